"""The engine's side of structured output: which sequences are constrained, their matchers, the
batch's token bitmask each step, and advancing the matchers with the sampled tokens.

The bitmask of a step is filled on a worker thread while the model runs the forward pass (the C
layer stack and llguidance both release the GIL), so the mask costs the step only what is left
of it when the logits are ready, when the forward pass leaves a core free (`overlap`: the server
runs the model on one core less than it has). When the model's threads take every core, a
worker would fight them for it (OpenMP teams slow down badly when a core is taken from them), so
the mask is filled on the engine thread once the logits are ready. The runner applies it just
before sampling.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvserve.sampling_params import SamplingParams, StructuredOutputs


@dataclass
class GrammarBitmask:
    """A step's grammar mask: rows[seq_id] is the seq's row (known at once); `wait()` returns the
    bitmask (int32 words, bit j of word j // 32 set: token j allowed) once it is filled."""

    rows: dict[str, int]
    wait: Callable[[], np.ndarray]


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, overlap: bool = True):
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.vocab_size = vocab_size
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict = {}  # seq_id -> GrammarMatcher
        self._filler = None
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvserve-grammar"
        )
        self.mask_seconds = 0.0  # time spent filling masks (for kvserve bench)
        self.masks_filled = 0

    @property
    def compiler(self):
        """Built once, by the first constrained request (the tokenizer bridge reads the whole
        vocabulary: most of a second, and about 60 MB resident), never at start: an engine that
        serves no constrained request does not hold it."""
        with self._compiler_lock:
            if self._compiler is None:
                from kvserve.structured import BatchMaskFiller, GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
                self._filler = BatchMaskFiller(num_threads=1)
            return self._compiler

    def check(self, params: SamplingParams) -> None:
        """Compile the request's constraint (cached): ParamError with the matcher's message when it
        does not compile. Thread-safe: the server calls it before admission, off the event loop."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def check_future(self, params: SamplingParams) -> concurrent.futures.Future:
        """check(params) as a future (None, or the ParamError), for a caller that must not hold a
        thread while a constraint compiles: at once on a cache hit, else on the compile pool."""
        so = params.structured_outputs
        if so is None or self._compiler is None:
            from kvserve.structured.compiler import compile_pool

            return compile_pool().submit(self.check, params)
        from kvserve.structured.compiler import checked

        compiled = self._compiler.compile_future(so)
        out: concurrent.futures.Future = concurrent.futures.Future()

        def settle(done: concurrent.futures.Future) -> None:
            try:
                checked(done.result(), "structured_outputs")
                out.set_result(None)
            except BaseException as e:
                out.set_exception(e)

        compiled.add_done_callback(settle)
        return out

    def add(self, seq_id: str, so: StructuredOutputs) -> None:
        self._matchers[seq_id] = self.compiler.matcher(so)

    def remove(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def clear(self) -> None:
        self._matchers.clear()

    def constrained(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def start_bitmask(self, seq_ids: list[str]) -> GrammarBitmask | None:
        """Begin filling the bitmask rows of these sequences (those with a matcher): on the worker
        thread when overlapping, else when waited for. None when none is constrained."""
        if not self._matchers:  # the common case: nothing constrained at all
            return None
        rows = {sid: i for i, sid in enumerate(s for s in seq_ids if s in self._matchers)}
        if not rows:
            return None
        from kvserve.structured import allocate_bitmask

        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        pairs = [(self._matchers[sid], row) for sid, row in rows.items()]

        def fill() -> np.ndarray:
            t0 = time.perf_counter()
            if self.overlap:
                self._filler.fill(pairs, bitmask)
            else:
                for matcher, row in pairs:
                    matcher.fill_bitmask(bitmask, row)
            self.mask_seconds += time.perf_counter() - t0
            self.masks_filled += len(pairs)
            return bitmask

        return GrammarBitmask(rows, self._worker.submit(fill).result if self.overlap else fill)

    def accept(self, seq_id: str, token_id: int) -> tuple[bool, str | None]:
        """Advance a sequence's matcher by its sampled token: (terminated, error). `terminated`:
        the grammar is complete (only EOS could follow), so the sequence should stop."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False, None
        if not matcher.accept_token(token_id):
            return True, matcher.error or f"token {token_id} is not allowed by the grammar"
        return matcher.is_terminated(), None
