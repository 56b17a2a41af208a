"""GrammarCompiler: compiles StructuredOutputs constraints for one model, once each (LRU cache).

Compiling a constraint translates it to llguidance grammar text, builds an LLMatcher from it (which
checks the grammar against the tokenizer) and computes its first mask on a copy (which builds the
lexer states the first step needs, and shows limits the grammar hits at once). The built matcher
is kept as a template: matcher() hands out deep copies of it, which are cheap and share the
template's lexer cache. A constraint that does not compile raises ParamError with llguidance's
message, and stays cached as a failure.

Thread safety: compile() and matcher() may be called from any thread; the cache is guarded by a
lock, and compiling runs outside it (llguidance releases the GIL while it builds a grammar), so
one slow constraint does not hold up cache hits. Two threads missing on the same key both compile
it; the last one's result is kept.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import ParamError, StructuredOutputs
from kvserve.structured.bitmask import allocate_bitmask, unpack_bitmask
from kvserve.structured.constraints import grammar_text
from kvserve.structured.matcher import NON_VERBOSE_MARK, GrammarMatcher
from kvserve.structured.tokenizer_bridge import ll_tokenizer

DEFAULT_CACHE_SIZE = 512
MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint's compile result: the grammar and its template matcher, or the error."""
    grammar: str | None
    template: llguidance.LLMatcher | None
    error: str | None


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    size: int
    max_size: int


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; hands out GrammarMatchers.

    vocab_size is the model's (its logits' width; at least the tokenizer's): bitmasks for these
    matchers have allocate_bitmask(rows, vocab_size)'s shape."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE):
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = tokenizer.vocab_size
        self.ll_tokenizer = ll_tokenizer(tokenizer, vocab_size)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def compile(self, so: StructuredOutputs, param: str = "structured_outputs") -> str:
        """The llguidance grammar for `so`, checked. ParamError(param, llguidance's message) when it
        does not compile (param: the request field the constraint came from)."""
        return self._compiled(so, param).grammar

    def matcher(self, so: StructuredOutputs, param: str = "structured_outputs") -> GrammarMatcher:
        """A fresh matcher at the start of `so`'s grammar (one per sequence: n > 1 takes n)."""
        compiled = self._compiled(so, param)
        return GrammarMatcher(compiled.template.deep_copy(), self.vocab_size, self.tokenizer_vocab_size)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self.cache_size)

    def _compiled(self, so: StructuredOutputs, param: str) -> CompiledGrammar:
        key = so.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
            else:
                self._misses += 1
        if compiled is None:
            compiled = self._build(so)
            with self._lock:
                self._cache[key] = compiled
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if compiled.error is not None:
            raise ParamError(param, compiled.error)
        return compiled

    def _build(self, so: StructuredOutputs) -> CompiledGrammar:
        kind = so.kind
        try:
            grammar = grammar_text(so)
        except ParamError as e:
            return CompiledGrammar(None, None, str(e))
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0,
                                        limits=llguidance.LLParserLimits(verbose_errors=False))
        if template.is_error():
            return CompiledGrammar(grammar, None, _failure(kind, template.get_error()))
        # Two probes: copies of a template share its lexer, whose expression budget a huge
        # repetition (a{99999999}) can spend on the first sequence's mask alone; the second
        # sequence's would then fail at its first step instead of here, as a 400.
        for _ in range(2):
            probe = GrammarMatcher(template.deep_copy(), self.vocab_size, self.tokenizer_vocab_size)
            first_mask = allocate_bitmask(1, self.vocab_size)
            probe.fill_bitmask(first_mask, 0)
            if probe.error is not None or not unpack_bitmask(first_mask, self.vocab_size).any():
                reason = f" ({probe.error})" if probe.error else ""
                return CompiledGrammar(grammar, None, _failure(kind, f"no output satisfies it{reason}"))
        return CompiledGrammar(grammar, template, None)


def _failure(kind: str, message: str) -> str:
    message = message.replace(NON_VERBOSE_MARK, "").strip()
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return f"the {kind} constraint does not compile: {message}"
