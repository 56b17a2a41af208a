"""GrammarCompiler: compiles StructuredOutputs constraints for one model, once each (LRU cache).

Compiling a constraint translates it to llguidance grammar text, builds an LLMatcher from it (which
checks the grammar against the tokenizer) and computes its first mask on a copy (which builds the
lexer states the first step needs, and shows limits the grammar hits at once). The built matcher
is kept as a template: matcher() hands out deep copies of it, which are cheap and share the
template's lexer cache. A constraint that does not compile raises ParamError with llguidance's
message (never a native backtrace), and stays cached as a failure.

Where compiles run: always on the CompilePool's big-stack threads (compile_pool.py), whoever
asks; a caller waits at most COMPILE_TIMEOUT_S, then gets a ParamError (the compile finishes in
the background and is cached). Identical constraints asked for at once compile once. The cache
is bounded in entries and in the bytes its templates are estimated to hold.

Thread safety: compile(), compile_future() and matcher() may be called from any thread; the
cache is guarded by a lock, and compiling runs outside it (llguidance releases the GIL while it
builds a grammar), so one slow constraint does not hold up cache hits.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import ParamError, StructuredOutputs
from kvserve.structured.bitmask import allocate_bitmask, unpack_bitmask
from kvserve.structured.compile_pool import CompilePool
from kvserve.structured.constraints import grammar_text
from kvserve.structured.matcher import NON_VERBOSE_MARK, GrammarMatcher
from kvserve.structured.tokenizer_bridge import ll_tokenizer

DEFAULT_CACHE_SIZE = 512
DEFAULT_CACHE_BYTES = 512 << 20
# A template's memory per byte of its grammar text, an upper estimate: a choice list's template
# holds about 40 bytes per byte of text, a grammar that is mostly comments about 5.
TEMPLATE_BYTES_PER_TEXT_BYTE = 48
TEMPLATE_BYTES_MIN = 64 << 10
COMPILE_TIMEOUT_S = 30.0
MAX_ERROR_CHARS = 2000
_BACKTRACE = re.compile(
    r"\s*(<backtrace>|stack backtrace:|note: run with `RUST_BACKTRACE).*", re.DOTALL
)

_pool: CompilePool | None = None
_pool_lock = threading.Lock()


def compile_pool() -> CompilePool:
    """The process's compile threads (one pool: engines that restart share it)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = CompilePool()
        return _pool


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint's compile result: the grammar and its template matcher, or the error."""

    grammar: str | None
    template: llguidance.LLMatcher | None
    error: str | None

    @property
    def cost(self) -> int:
        """Bytes this entry is taken to hold in the cache."""
        if self.template is None:
            return len(self.error or "") + len(self.grammar or "")
        return max(TEMPLATE_BYTES_MIN, TEMPLATE_BYTES_PER_TEXT_BYTE * len(self.grammar))


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    size: int
    max_size: int
    bytes: int = 0
    max_bytes: int = 0


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; hands out GrammarMatchers.

    vocab_size is the model's (its logits' width; at least the tokenizer's): bitmasks for these
    matchers have allocate_bitmask(rows, vocab_size)'s shape."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = tokenizer.vocab_size
        self.ll_tokenizer = ll_tokenizer(tokenizer, vocab_size)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._bytes = 0
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = compile_pool()
        self._hits = 0
        self._misses = 0

    def compile(self, so: StructuredOutputs, param: str = "structured_outputs") -> str:
        """The llguidance grammar for `so`, checked. ParamError(param, llguidance's message) when it
        does not compile (param: the request field the constraint came from)."""
        return self._compiled(so, param).grammar

    def matcher(self, so: StructuredOutputs, param: str = "structured_outputs") -> GrammarMatcher:
        """A fresh matcher at the start of `so`'s grammar (one per sequence: n > 1 takes n)."""
        compiled = self._compiled(so, param)
        return GrammarMatcher(
            compiled.template.deep_copy(), self.vocab_size, self.tokenizer_vocab_size
        )

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                self._hits,
                self._misses,
                len(self._cache),
                self.cache_size,
                self._bytes,
                self.cache_bytes,
            )

    def compile_future(self, so: StructuredOutputs) -> concurrent.futures.Future:
        """The CompiledGrammar of `so` as a future: done at once on a cache hit, else the compile
        on the pool (shared with anyone compiling the same constraint now)."""
        key = so.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(compiled)
                return done
            self._misses += 1
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = self._pool.submit(self._build_and_cache, key, so)
            return pending

    def _compiled(self, so: StructuredOutputs, param: str) -> CompiledGrammar:
        future = self.compile_future(so)
        if not future.done() and self._pool.on_pool_thread():
            compiled = self._build_and_cache(so.key(), so)  # a pool thread never waits on the pool
        else:
            try:
                compiled = future.result(timeout=COMPILE_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                raise ParamError(param, timeout_message(so.kind)) from None
        return checked(compiled, param)

    def _build_and_cache(self, key: tuple, so: StructuredOutputs) -> CompiledGrammar:
        try:
            compiled = self._build(so)
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)
            raise
        with self._lock:
            self._pending.pop(key, None)
            old = self._cache.pop(key, None)
            self._bytes -= old.cost if old is not None else 0
            self._cache[key] = compiled
            self._bytes += compiled.cost
            while len(self._cache) > 1 and (
                len(self._cache) > self.cache_size  # the newest stays
                or self._bytes > self.cache_bytes
            ):
                _, dropped = self._cache.popitem(last=False)
                self._bytes -= dropped.cost
        return compiled

    def _build(self, so: StructuredOutputs) -> CompiledGrammar:
        kind = so.kind
        try:
            grammar = grammar_text(so)
        except ParamError as e:
            return CompiledGrammar(None, None, clean_message(str(e)))
        try:
            return self._build_template(kind, grammar)
        except BaseException as e:
            if not (isinstance(e, Exception) or type(e).__name__ == "PanicException"):
                raise
            # llguidance reports failures through is_error(); anything it raises instead (a Rust
            # panic pyo3 turned into an exception included) is still this constraint's failure.
            return CompiledGrammar(grammar, None, _failure(kind, str(e) or type(e).__name__))

    def _build_template(self, kind: str, grammar: str) -> CompiledGrammar:
        template = llguidance.LLMatcher(
            self.ll_tokenizer,
            grammar,
            log_level=0,
            limits=llguidance.LLParserLimits(verbose_errors=False),
        )
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
                return CompiledGrammar(
                    grammar, None, _failure(kind, f"no output satisfies it{reason}")
                )
        return CompiledGrammar(grammar, template, None)


def checked(compiled: CompiledGrammar, param: str) -> CompiledGrammar:
    """`compiled`, or its error as ParamError(param)."""
    if compiled.error is not None:
        raise ParamError(param, compiled.error)
    return compiled


def timeout_message(kind: str) -> str:
    return (
        f"the {kind} constraint did not compile within {COMPILE_TIMEOUT_S:g} s: make it "
        f"smaller or simpler"
    )


def clean_message(message: str) -> str:
    """llguidance's message as a client may see it: no Rust panic backtrace, at most
    MAX_ERROR_CHARS."""
    message = _BACKTRACE.sub("", message.replace(NON_VERBOSE_MARK, "")).strip()
    message = re.sub(
        r"\bpanic: ", "the grammar compiler cannot take it (make it smaller): ", message
    )
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return message


def _failure(kind: str, message: str) -> str:
    return f"the {kind} constraint does not compile: {clean_message(message)}"
