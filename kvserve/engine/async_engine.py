"""AsyncEngine: the EngineCore step loop on one background thread, async output streams for the
server.

EngineCore is not thread-safe, so exactly one thread (the engine thread) ever touches it after
construction. `generate()` queues an "add", cancelling or closing the generator an "abort"; the
engine thread applies queued commands between steps, runs `core.step()` while there is work,
and hands each step's outputs to the event loop in one `loop.call_soon_threadsafe`, into
per-request OutputStreams (a reader that fell behind takes the outputs of several steps merged
into one, as vLLM's output collector does: one chunk instead of a backlog). So a client that
goes away frees its KV blocks within one step, and a long prefill never blocks the event loop
(torch releases the GIL inside its kernels).

The engine loop is supervised: if anything raises out of a step (EngineCore already fails a
request that breaks a step alone, so this is a bug, not bad input), the requests in flight fail
with the cause, the core drops every request and its blocks (the model and KV tensors stay),
the loop starts again and `kvserve:engine_restarts` counts it. More than MAX_RESTARTS within
RESTART_WINDOW seconds, or a tensor/pipeline-parallel rank lost (RankLost), and the engine is
declared dead: /health answers 503.

Text off the engine thread: the engine's OutputProcessor defers the text of samples without
stop strings (`defer_text`); each step's deferred snapshots travel with its outputs in the
same `call_soon_threadsafe`, and the event loop detokenizes them before routing anything, in
step order. The engine thread is left the work that decides what runs next (a stop string
ends its sequence at once, so requests with stop strings detokenize on the engine thread).
An unfinished output's `token_ids` and `logprobs` hold the step's tokens only (the processor's
`delta_snapshots`: no copy of a long completion's lists each step); the final output is whole.

Admission fast path: when the waiting queue is known to be full, `generate` raises
QueueFullError on the event loop at once instead of waiting for the engine thread to get
to the request between two steps (a 429 in milliseconds under a burst).

Why a thread and not a separate process: see docs/server.md ("Engine thread or process").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator

from kvserve.engine.errors import QueueFullError
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.output_processor import fill_deferred_text
from kvserve.outputs import RequestOutput
from kvserve.runner.ranks import RankLost
from kvserve.sampling_params import ParamError, SamplingParams

log = logging.getLogger("kvserve")

MAX_RESTARTS = 5
RESTART_WINDOW = 60.0


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crash or shutdown): no request can be served."""


class EngineClosedError(RuntimeError):
    """The engine is draining for shutdown and admits no new request."""


class QueueReservation:
    """Places of the waiting queue held for a request being prepared (AsyncEngine.reserve)."""

    def __init__(self, num_sequences: int):
        self.left = num_sequences


class OutputStream:
    """One request's outputs on the event loop: the next one, or, when its reader fell behind,
    everything that came since it last took one merged into one (RequestOutput.merge), so a slow
    reader sends one chunk for several steps instead of a backlog of chunks. An error is kept
    apart and handed over after the outputs that came before it; none that come after it."""

    __slots__ = ("output", "error", "ready")

    def __init__(self) -> None:
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = self.error or item
        elif self.error is None:  # after an error the request is over: nothing follows it
            self.output = item if self.output is None else self.output.merge(item)
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The pending output (merged), else the error; waits while there is neither."""
        while self.output is None and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        out, self.output = self.output, None
        return out if out is not None else self.error


class AsyncEngine:
    def __init__(self, core, metrics: EngineMetrics | None = None):
        self.core = core  # touched only by the engine thread from now on
        self.tokenizer = core.tokenizer  # read-only use from the event loop is safe
        self.model_name: str = core.model_name
        self.max_model_len: int = core.max_model_len
        self.metrics = metrics or EngineMetrics(core.model_name)
        self.metrics.record_stats(core.stats())
        self._processor = getattr(core, "processor", None)
        if self._processor is not None:
            self._processor.defer_text = True  # detokenized on the event loop: _dispatch
            self._processor.delta_snapshots = True  # whole lists in final outputs only
        self.max_waiting: int = core.config.scheduler.max_waiting
        self.accepting = True
        self.restarts = 0
        self._cv = threading.Condition()
        self._commands: list[tuple] = []  # guarded by _cv
        self._closing = False  # guarded by _cv
        self._queued_sequences = 0  # guarded by _cv: sequences in "add" commands
        self._reserved_sequences = 0  # guarded by _cv: held by requests being prepared
        self._core_waiting = 0  # written by the engine thread after each step
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}  # event-loop thread only
        self._live: set[str] = set()  # engine thread only: ids the core holds
        self._last_token_at: dict[str, float] = {}  # engine thread only: for inter-token latency
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config) -> "AsyncEngine":
        from kvserve.engine.engine_core import EngineCore

        return cls(EngineCore(config))

    # ---- the asyncio side ----
    @property
    def num_in_flight(self) -> int:
        """Requests whose output stream is still open."""
        return len(self._streams)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        reservation: QueueReservation | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until the one with finished=True (`lora_name`: the loaded
        LoRA adapter it runs with, None: the base model).

        The first `__anext__` raises what admission raised (ValueError: can never fit;
        QueueFullError: the waiting queue is full). Closing the generator early, or cancelling
        the task that iterates it, aborts the request in the engine.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        if not self.accepting:
            raise EngineClosedError("server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if reservation is None:
            self.check_queue(params.n)
        self._loop = asyncio.get_running_loop()
        stream = self._streams[request_id] = OutputStream()
        with self._cv:
            if reservation is not None:  # its places become queued ones
                taken = min(params.n, reservation.left)
                reservation.left -= taken
                self._reserved_sequences -= taken
            self._queued_sequences += params.n
            self._commands.append(
                (
                    "add",
                    request_id,
                    list(prompt_token_ids),
                    params,
                    priority,
                    cache_salt,
                    time.monotonic(),
                    lora_name,
                )
            )
            self._cv.notify()
        done = False
        try:
            while not done:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self._send(("abort", request_id))

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile the params' output constraint now (cached for admission); ParamError with the
        grammar engine's message when it does not compile, or when it takes longer than the
        compiler's COMPILE_TIMEOUT_S. It runs on the compile pool's own threads: no thread of
        the loop's default pool (tokenizing) waits on it, and the steps never do."""
        from kvserve.structured.compiler import COMPILE_TIMEOUT_S, timeout_message

        if params.structured_outputs is None:
            return
        future = asyncio.wrap_future(self.core.grammar.check_future(params))
        try:
            await asyncio.wait_for(asyncio.shield(future), COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ParamError(
                "structured_outputs", timeout_message(params.structured_outputs.kind)
            ) from None

    async def call(self, fn):
        """fn(core) on the engine thread, between two steps; its result (or exception) here."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        self._loop = asyncio.get_running_loop()
        future = self._loop.create_future()
        self._send(("call", fn, future))
        return await future

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def check_queue(self, num_sequences: int, ahead: int = 0) -> None:
        """QueueFullError now when `num_sequences` more would overflow the waiting queue as last
        seen (the core's own check stays the authority), counting `ahead` sequences the caller
        knows are on their way; ValueError if they never could."""
        with self._cv:
            self.check_queue_locked(num_sequences, ahead)

    def check_queue_locked(self, num_sequences: int, ahead: int = 0) -> None:
        """check_queue with _cv held."""
        if num_sequences > self.max_waiting:
            raise ValueError(
                f"{num_sequences} sequences can never fit the waiting queue "
                f"(max_waiting={self.max_waiting}, --max-waiting)"
            )
        waiting = self._core_waiting + self._queued_sequences + self._reserved_sequences + ahead
        if waiting + num_sequences > self.max_waiting:
            raise QueueFullError(
                f"{waiting} requests are waiting (max_waiting={self.max_waiting}): retry later"
            )

    @contextlib.contextmanager
    def reserve(self, num_sequences: int):
        """check_queue, then hold `num_sequences` places of the waiting queue until the block ends
        (the server tokenizes the request inside it, then passes the QueueReservation to
        `generate`, which takes its places without counting them twice)."""
        with self._cv:
            self.check_queue_locked(num_sequences)
            self._reserved_sequences += num_sequences
        reservation = QueueReservation(num_sequences)
        try:
            yield reservation
        finally:
            with self._cv:
                self._reserved_sequences -= reservation.left
                reservation.left = 0

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine thread is not running."""
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine is not running: {self._dead or 'thread stopped'}")

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let open requests finish for up to `timeout` seconds, abort the rest,
        stop the engine thread."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        if self._streams:
            log.warning("shutdown: aborting %d unfinished request(s)", len(self._streams))
        with self._cv:
            self._closing = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join, 10.0)
        await asyncio.sleep(0)  # let the last call_soon_threadsafe deliveries run
        self._fail_all(EngineDeadError("server is shutting down"))

    def _send(self, command: tuple) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def _dispatch(self, items: list[tuple[str, object]], deferred=None) -> None:
        """Event-loop thread: give the step's deferred snapshots their text, then route
        (request_id, output or exception) to its stream."""
        failed = fill_deferred_text(deferred) if deferred else None
        for request_id, item in items:
            if failed and request_id in failed and not isinstance(item, BaseException):
                item = RuntimeError(f"detokenizing failed: {failed[request_id]!r}")
                self.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(item)

    def _fail_all(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(err)

    # ---- the engine thread ----
    def _run(self) -> None:
        """Supervise the step loop: restart it after a crash, up to MAX_RESTARTS per window."""
        crashes: list[float] = []
        while True:
            try:
                self._step_loop()
                return  # closing
            except BaseException as e:
                log.exception("engine loop crashed")
                now = time.monotonic()
                crashes = [t for t in crashes if now - t < RESTART_WINDOW] + [now]
                if (
                    len(crashes) > MAX_RESTARTS
                    or not isinstance(e, Exception)
                    or isinstance(e, RankLost)
                    or not self._recover(e)
                ):  # a lost rank: no restart can bring it back
                    self._die(e)
                    return
                self.restarts += 1
                self.metrics.engine_restarts.inc()
                log.warning("engine loop restarted (%d restart(s) so far)", self.restarts)

    def _step_loop(self) -> None:
        core = self.core
        busy = core.has_unfinished_requests()
        while True:
            with self._cv:
                while not self._commands and not busy and not self._closing:
                    self._cv.wait()
                commands, self._commands = self._commands, []
                closing = self._closing
            for command in commands:
                self._apply(command)
            if closing:
                self._drain()
                return
            if core.has_unfinished_requests():
                self._deliver(core.step())
                if core.last_step_tokens:
                    self.metrics.iteration_tokens.observe(core.last_step_tokens)
            busy = core.has_unfinished_requests()
            self._record_stats()

    def _record_stats(self) -> None:
        stats = self.core.stats()
        self._core_waiting = stats["num_waiting"]
        self.metrics.record_stats(stats)

    def _recover(self, err: Exception) -> bool:
        """After a crash: fail every request in flight with the cause, and have the core drop
        them all and check its blocks. False when the core cannot get back to a clean state."""
        failed = [
            (
                rid,
                RuntimeError(
                    f"the engine failed while serving this request and restarted: {err!r}"
                ),
            )
            for rid in self._live
        ]
        self._live.clear()
        self._last_token_at.clear()
        self._to_loop(failed)
        try:
            self.core.reset()
            self._record_stats()
        except Exception:
            log.exception("engine could not reset after a crash")
            return False
        return True

    def _die(self, err: BaseException) -> None:
        self._dead = err
        log.error("engine stopped for good: %r", err)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(
                self._fail_all, EngineDeadError(f"engine died: {err!r}")
            )

    def _apply(self, command: tuple) -> None:
        if command[0] == "call":
            _, fn, future = command
            try:
                result, error = fn(self.core), None
            except Exception as e:  # the caller's to handle
                result, error = None, e

            def settle():
                if not future.done():
                    future.set_exception(error) if error is not None else future.set_result(result)

            self._loop.call_soon_threadsafe(settle)
            return
        if command[0] == "abort":
            if command[1] in self._live:
                self.core.abort_request(command[1])
            return
        _, request_id, prompt_token_ids, params, priority, cache_salt, arrival, lora = command
        with self._cv:
            self._queued_sequences -= params.n
        try:
            self.core.add_request(
                request_id,
                prompt_token_ids,
                params,
                priority=priority,
                cache_salt=cache_salt,
                arrival_time=arrival,
                lora_request=lora,
            )
            self._live.add(request_id)
        except Exception as e:  # ValueError, QueueFullError, ...: this request fails alone
            self._to_loop([(request_id, e)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            if any(o.delta_token_ids for o in out.outputs):
                last = self._last_token_at.get(rid)
                if last is not None:
                    self.metrics.itl.observe(now - last)
                    self.metrics.tpot_token.observe(now - last)
                self._last_token_at[rid] = now
            if out.finished:
                self._live.discard(rid)
                self._last_token_at.pop(rid, None)
                if out.error:
                    self.metrics.failed_requests.inc()
                reason = (
                    "abort"
                    if out.error
                    else next((o.finish_reason for o in out.outputs if o.finish_reason), "stop")
                )
                self.metrics.record_finished(out.metrics, reason, len(out.prompt_token_ids))
        deferred = self._processor.take_deferred() if self._processor is not None else None
        if outputs:
            self._to_loop([(out.request_id, out) for out in outputs], deferred)

    def _to_loop(self, items: list[tuple[str, object]], deferred=None) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, items, deferred)

    def _drain(self) -> None:
        """Shutdown: abort everything the core still holds and deliver the final outputs."""
        for rid in list(self._live):
            self.core.abort_request(rid)
        for _ in range(3):
            if not self.core.has_unfinished_requests():
                break
            self._deliver(self.core.step())
        self.metrics.record_stats(self.core.stats())
