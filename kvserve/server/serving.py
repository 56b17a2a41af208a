"""What the completions and chat endpoints share: admission checks, opening engine streams,
merging the streams of a multi-prompt request, per-choice accumulation, usage, logprobs, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request, Response

from kvserve.engine.async_engine import AsyncEngine, EngineClosedError, EngineDeadError
from kvserve.engine.errors import CONSTRAINT_FAILED, QueueFullError
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.connections import CURRENT_ADMISSION
from kvserve.server.errors import (
    APIError,
    BadRequest,
    InternalError,
    NotFound,
    TooManyRequests,
    Unavailable,
)

log = logging.getLogger("kvserve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = 2 * 2**20
    created: int = field(default_factory=lambda: int(time.time()))
    # The loaded LoRA adapters, {name: path}: a request's model field may name one
    # (kvserve/server/lora_routes.py keeps it in step with the engine's).
    lora_adapters: dict[str, str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


# ---- admission ----


def lora_of(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's model field names, None for the base model."""
    return model if model in state.lora_adapters else None


def check_request(state: ServerState, model: str | None) -> None:
    if not state.engine.accepting:
        raise Unavailable("the server is shutting down and admits no new request")
    if (
        model is not None
        and model not in state.served_model_names
        and model not in state.lora_adapters
    ):
        served = [*state.served_model_names, *state.lora_adapters]
        raise NotFound(
            f"The model `{model}` does not exist. Served: {', '.join(served)}",
            param="model",
            code="model_not_found",
        )


def check_context(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str
) -> None:
    """OpenAI's wording, with the numbers, for requests that can never fit the context."""
    total = num_prompt_tokens + (max_tokens or 0)
    if num_prompt_tokens >= max_model_len or total > max_model_len:
        what = "messages" if param == "messages" else "prompt"
        detail = (
            f"{total} tokens ({num_prompt_tokens} in the {what}, {max_tokens} in the completion)"
            if max_tokens
            else f"{num_prompt_tokens} tokens in the {what}, leaving no room for a completion"
        )
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {detail}. "
            f"Please reduce the length of the {what} or completion.",
            param=param,
            code="context_length_exceeded",
        )


def admission_error(state: ServerState, pending: int = 0) -> APIError | None:
    """The error any generation request gets right now, whatever it holds (503 draining or engine
    dead, 429 queue full counting `pending` admitted requests not yet in the queue as one place
    each), or None. The guard asks it before parsing a body."""
    if not state.engine.accepting:
        return Unavailable("the server is shutting down and admits no new request")
    try:
        state.engine.check_health()
        state.engine.check_queue(1, ahead=pending)
    except (QueueFullError, EngineDeadError) as e:
        return api_error(e)
    return None


@contextlib.contextmanager
def reserve_capacity(state: ServerState, num_sequences: int, param: str):
    """Before any tokenization: 400 when the request's sequences (prompts x n) can never fit the
    waiting queue, 429 at once when the queue is full now; else hold their places in the queue
    while the request is tokenized and submitted, so that a burst is refused from its first
    request past the limit (not after all of them have been tokenized)."""
    reservation = state.engine.reserve(num_sequences)
    admission = CURRENT_ADMISSION.get()
    try:
        held = reservation.__enter__()
    except ValueError as e:
        raise BadRequest(f"{e}: send fewer prompts or a smaller n", param) from None
    except QueueFullError as e:
        raise api_error(e) from None
    finally:  # counted by the engine now, or refused: no longer pending at the protocol
        if admission is not None:
            admission.release()
    try:
        yield held
    finally:
        reservation.__exit__(None, None, None)


async def compile_constraint(state: ServerState, req, params: SamplingParams) -> None:
    """Compile the request's output constraint on the compile threads (cached for the engine); a
    400 naming the field it came from when it does not compile."""
    if params.structured_outputs is None:
        return
    try:
        await state.engine.compile_constraint(params)
    except ValueError as e:
        raise BadRequest(str(e), req.constraint()[1]) from None


def api_error(err: BaseException, names: dict[str, str] | None = None) -> APIError:
    """What an engine-side exception means to the client. `names` renames the engine's
    parameter names to the endpoint's (chat: prompt -> messages)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, QueueFullError):
        return TooManyRequests(f"server is at capacity: {err}")
    if isinstance(err, EngineClosedError):
        return Unavailable(str(err))
    if isinstance(err, EngineDeadError):
        return Unavailable(f"engine unavailable: {err}")
    if isinstance(err, ValueError):
        param = getattr(err, "param", None)
        return BadRequest(str(err), (names or {}).get(param, param))
    log.error("request failed: %r", err)
    return InternalError(f"request failed: {type(err).__name__}: {err}")


def check_output(out: RequestOutput, constraint_field: str = "structured_outputs") -> None:
    """A request that failed inside the engine (it fails alone) or was aborted under it. Its own
    output constraint failing while generating is the client's 400, naming `constraint_field`."""
    if out.error and out.error.startswith(CONSTRAINT_FAILED):
        raise BadRequest(
            f"the output constraint failed while generating: "
            f"{out.error.removeprefix(CONSTRAINT_FAILED)}",
            constraint_field,
        )
    if out.error:
        raise InternalError(f"request failed in the engine: {out.error}")
    if any(o.finish_reason == "abort" for o in out.outputs):
        raise Unavailable("request aborted: the server is shutting down")


Stream = tuple[RequestOutput, AsyncIterator[RequestOutput]]


async def open_streams(
    engine: AsyncEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    priority: int,
    cache_salt: str | None,
    names: dict[str, str] | None = None,
    reservation=None,
    lora_name: str | None = None,
) -> list[Stream]:
    """Submit every prompt and wait for each one's first output, so that admission errors
    (400 can-never-fit, 429 queue full, 503 shutting down) come back as the HTTP status.
    `lora_name`: the LoRA adapter every prompt runs with (None: the base model)."""
    gens = [
        engine.generate(
            ids,
            params,
            request_id if len(prompts) == 1 else f"{request_id}-{i}",
            priority=priority,
            cache_salt=cache_salt,
            reservation=reservation,
            lora_name=lora_name,
        )
        for i, ids in enumerate(prompts)
    ]
    try:
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
    except BaseException:
        await _close(gens)
        raise
    err = next((f for f in firsts if isinstance(f, BaseException)), None)
    if err is not None:
        await _close(gens)
        raise api_error(err, names)
    return list(zip(firsts, gens))


async def _close(gens) -> None:
    for g in gens:
        try:
            await g.aclose()
        except RuntimeError:  # still running (cancelled mid-await): its own finally aborts it
            pass


async def merge(streams: list[Stream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come. Closing this closes them all."""
    if len(streams) == 1:
        first, gen = streams[0]
        try:
            yield 0, first
            async for out in gen:
                yield 0, out
        finally:
            await _close([gen])
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, first: RequestOutput, gen) -> None:
        try:
            queue.put_nowait((i, first))
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, first, gen)) for i, (first, gen) in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise api_error(item)
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close([gen for _, gen in streams])


# ---- accumulating one choice ----


@dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False  # streaming: the first chunk of this choice went out
    text_offset: int = 0  # completions logprobs: offset of the next token in the text

    def add(self, o: CompletionOutput) -> None:
        self.text += o.delta_text
        self.num_tokens += len(o.delta_token_ids)
        if o.delta_logprobs:
            self.logprobs.extend(o.delta_logprobs)
        if o.finish_reason:
            self.finish_reason = o.finish_reason
            self.stop_reason = o.stop_reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# ---- logprobs in the two OpenAI formats ----


def _lp(value: float) -> float:
    """JSON has neither -inf nor NaN."""
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


def completion_logprobs(lps: list[Logprob], num_top: int, text_offset: int) -> tuple[dict, int]:
    """Legacy completions format; returns it and the text offset after these tokens."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for lp in lps:
        out["tokens"].append(lp.token)
        out["token_logprobs"].append(_lp(lp.logprob))
        top = {text: _lp(v) for _, text, v in lp.top[:num_top]}
        top.setdefault(lp.token, _lp(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(lp.token)
    return out, text_offset


def echo_logprobs(
    prompt_lps: list[Logprob | None], first_token: str, num_top: int
) -> tuple[dict, int]:
    """The prompt's part of the legacy logprobs when echo is on: the first token has no logprob
    (null, as OpenAI answers), then each prompt token with its top-N. Returns it and the text
    offset after the prompt."""
    out: dict[str, list] = {
        "tokens": [first_token],
        "token_logprobs": [None],
        "top_logprobs": [None],
        "text_offset": [0],
    }
    rest, offset = completion_logprobs(
        [lp for lp in prompt_lps[1:] if lp is not None], num_top, len(first_token)
    )
    for key in out:
        out[key].extend(rest[key])
    return out, offset


def join_logprobs(head: dict, tail: dict) -> dict:
    return {key: head[key] + tail[key] for key in head}


def prompt_logprobs_json(prompt_lps: list[Logprob | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt position, {token id: {logprob, rank,
    decoded_token}} for the prompt token and its top-N (None for the first position)."""
    out: list[dict | None] = []
    for lp in prompt_lps:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(tid): {"logprob": _lp(v), "rank": rank, "decoded_token": text}
            for rank, (tid, text, v) in enumerate(lp.top, 1)
        }
        entry[str(lp.token_id)] = {
            "logprob": _lp(lp.logprob),
            "rank": lp.rank,
            "decoded_token": lp.token,
        }
        out.append(entry)
    return out


def chat_logprobs(lps: list[Logprob], num_top: int) -> dict:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": _lp(lp.logprob),
                "bytes": list(lp.token.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": _lp(v), "bytes": list(text.encode())}
                    for _, text, v in lp.top[:num_top]
                ],
            }
            for lp in lps
        ]
    }


# ---- server-sent events ----


def sse(obj: dict) -> str:
    """One server-sent event; strict JSON (a NaN raises here rather than reach a client)."""
    return (
        f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"
    )


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """SSE lines of the chunks, then [DONE]. A failure mid-stream becomes an error event."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as e:
        yield sse(e.body())
    except Exception as e:
        log.exception("stream failed")
        yield sse(InternalError(f"stream failed: {type(e).__name__}").body())
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


# ---- work off the event loop ----


async def off_loop(fn, *args, **kwargs):
    """Run CPU work (tokenizing, chat templates) in a worker thread, so a 2 MB prompt does not
    stall /health and everyone else's streams."""
    return await asyncio.to_thread(fn, *args, **kwargs)


# ---- client disconnects ----


def with_cancellation(handler):
    """Run the endpoint while watching the connection: a client that goes away cancels the
    handler (which closes its engine streams, which aborts the requests and frees their blocks).
    Streaming responses are covered past this point by Starlette's own disconnect watch."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        raw: Request = kwargs["raw_request"]
        task = asyncio.create_task(handler(*args, **kwargs))
        watcher = asyncio.create_task(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()
        await asyncio.wait({task})  # let the handler's cleanup (aborts) run
        if not task.cancelled() and task.exception() is not None:
            log.debug("handler of a disconnected client failed: %r", task.exception())
        return Response(status_code=499)  # nobody is listening

    return wrapper


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
