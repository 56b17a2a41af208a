"""Structured output: constrained decoding on llguidance.

A GrammarCompiler (one per model) compiles each distinct StructuredOutputs constraint once and
hands out a GrammarMatcher per sequence; each step the matchers fill rows of a token bitmask
(bitmask.py: layout and how to apply it) that the sampler applies to the logits. OpenAI tool
calling, which builds such constraints from `tools` / `tool_choice`, is protocol and lives in
kvserve/server/tools.py.
"""

from kvserve.structured.bitmask import allocate_bitmask, apply_bitmask_numpy, bitmask_words
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import BatchMaskFiller, GrammarMatcher
from kvserve.structured.tokenizer_bridge import ll_tokenizer

__all__ = [
    "GrammarCompiler",
    "GrammarMatcher",
    "BatchMaskFiller",
    "allocate_bitmask",
    "apply_bitmask_numpy",
    "bitmask_words",
    "ll_tokenizer",
]
