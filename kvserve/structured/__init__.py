"""Structured output: constrained decoding on llguidance, and tool calling.

A GrammarCompiler (one per model) compiles each distinct StructuredOutputs constraint once and
hands out a GrammarMatcher per sequence; each step the matchers fill rows of a token bitmask
(bitmask.py: layout and how to apply it) that the sampler applies to the logits. tools.py turns
OpenAI `tools` / `tool_choice` into constraints and prompts; tool_parser.py reads the calls back.
"""
from kvserve.structured.bitmask import allocate_bitmask, apply_bitmask_numpy, bitmask_words
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import BatchMaskFiller, GrammarMatcher
from kvserve.structured.tokenizer_bridge import ll_tokenizer
from kvserve.structured.tool_parser import ToolCall, ToolCallStreamParser, parse_tool_calls
from kvserve.structured.tools import messages_for_template, render_tools_system_prompt, tool_choice_constraint

__all__ = ["GrammarCompiler", "GrammarMatcher", "BatchMaskFiller", "allocate_bitmask", "apply_bitmask_numpy",
           "bitmask_words", "ll_tokenizer", "ToolCall", "ToolCallStreamParser", "parse_tool_calls",
           "tool_choice_constraint", "render_tools_system_prompt", "messages_for_template"]
