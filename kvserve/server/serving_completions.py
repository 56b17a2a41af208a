"""POST /v1/completions: prompts (text, token ids, or lists of them) in, text completions out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.server.errors import BadRequest
from kvserve.server.protocol import CompletionRequest
from kvserve.server.serving import (
    SSE_HEADERS,
    Choice,
    ServerState,
    check_context,
    check_output,
    check_request,
    compile_constraint,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    lora_of,
    merge,
    off_loop,
    open_streams,
    prompt_logprobs_json,
    reserve_capacity,
    sse_stream,
    usage,
)


async def create_completion(req: CompletionRequest, state: ServerState):
    """Validate, tokenize and submit the request's prompts (n choices each), then answer with
    one JSON body or, with `stream`, server-sent chunks as the tokens come."""
    check_request(state, req.model)
    req.check()
    params = req.to_sampling_params()
    constraint_field = req.constraint()[1]
    engine = state.engine
    prompts = req.prompts()
    with reserve_capacity(
        state, len(prompts) * params.n, "n" if len(prompts) == 1 else "prompt"
    ) as held:
        await compile_constraint(state, req, params)
        prompt_ids, echo_texts = await _tokenize_prompts(req, engine, prompts, params.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await open_streams(
            engine,
            prompt_ids,
            params,
            request_id,
            req.priority,
            req.cache_salt,
            reservation=held,
            lora_name=lora_of(state, req.model),
        )
    run = _CompletionRun(req, state, params.n, constraint_field, request_id, prompt_ids, echo_texts)
    if not req.stream:
        return await run.full_response(streams)
    return StreamingResponse(
        sse_stream(run.stream_chunks(streams)), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _tokenize_prompts(
    req: CompletionRequest, engine, prompts: list, max_tokens: int | None
) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids (texts encoded off the event loop, in one go) and the text echoed
    before its completions ("" without `echo`). BadRequest: an empty prompt, or one that leaves
    no room in the context."""
    tok = engine.tokenizer
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await off_loop(lambda: [tok.encode(t, add_special_tokens=True) for t in texts]))
    prompt_ids: list[list[int]] = []
    echo_texts: list[str] = []
    for p in prompts:
        ids = next(encoded) if isinstance(p, str) else list(p)
        if not ids:
            raise BadRequest("the prompt is empty after tokenization", "prompt")
        check_context(len(ids), max_tokens, engine.max_model_len, "prompt")
        prompt_ids.append(ids)
        if req.echo:
            echo_texts.append(
                p if isinstance(p, str) else tok.decode(ids, skip_special_tokens=False)
            )
        else:
            echo_texts.append("")
    return prompt_ids, echo_texts


class _CompletionRun:
    """One submitted completion request: its choices (prompt i's come at i * n .. i * n + n - 1),
    what the engine reported per prompt (cached tokens, prompt logprobs), and the two ways to
    answer it: `full_response` and the `stream_chunks` generator."""

    def __init__(
        self,
        req: CompletionRequest,
        state: ServerState,
        n: int,
        constraint_field: str,
        request_id: str,
        prompt_ids: list[list[int]],
        echo_texts: list[str],
    ) -> None:
        self.req = req
        self.tok = state.engine.tokenizer
        self.n = n
        self.constraint_field = constraint_field
        self.prompt_ids = prompt_ids
        self.echo_texts = echo_texts
        self.choices = [Choice(i) for i in range(len(prompt_ids) * n)]
        self.cached = [0] * len(prompt_ids)
        self.prompt_lps: list = [None] * len(prompt_ids)  # per prompt, once the engine has them
        self.echo_lps = req.echo and req.logprobs is not None
        self.head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": lora_of(state, req.model) or state.model_name,  # an adapter's own name
        }

    def record(self, i: int, out) -> None:
        self.cached[i] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_lps[i] = out.prompt_logprobs

    def prompt_part(self, i: int) -> tuple[dict, int]:
        """The echoed prompt's logprobs (legacy shape) and the text offset after it."""
        first = self.tok.decode(self.prompt_ids[i][:1], skip_special_tokens=False)
        return echo_logprobs(self.prompt_lps[i] or [], first, self.req.logprobs)

    def extra_fields(self, i: int) -> dict:
        return (
            {"prompt_logprobs": prompt_logprobs_json(self.prompt_lps[i])}
            if self.req.prompt_logprobs is not None and self.prompt_lps[i] is not None
            else {}
        )

    def total_usage(self) -> dict:
        return usage(
            sum(len(ids) for ids in self.prompt_ids),
            sum(c.num_tokens for c in self.choices),
            sum(self.cached),
        )

    async def full_response(self, streams) -> JSONResponse:
        """Every choice to its end, then one JSON body."""
        async for i, out in merge(streams):
            check_output(out, self.constraint_field)
            self.record(i, out)
            for o in out.outputs:
                self.choices[i * self.n + o.index].add(o)
        body = [self.full_choice(c) for c in self.choices]
        return JSONResponse({**self.head, "choices": body, "usage": self.total_usage()})

    def full_choice(self, c: Choice) -> dict:
        """A finished choice as the non-streaming body lists it: echo, text and logprobs."""
        req = self.req
        i = c.index // self.n
        echo = self.echo_texts[i]
        lp = None
        if self.echo_lps:
            prompt_lp, offset = self.prompt_part(i)
            lp = join_logprobs(prompt_lp, completion_logprobs(c.logprobs, req.logprobs, offset)[0])
        elif req.logprobs is not None:
            lp = completion_logprobs(c.logprobs, req.logprobs, len(echo))[0]
        return {
            "index": c.index,
            "text": echo + c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            **self.extra_fields(i),
        }

    async def stream_chunks(self, streams) -> AsyncIterator[dict]:
        """A chunk per choice per step that brings text, logprobs or the end (the echo leads
        the choice's first), then, with stream_options.include_usage, the usage."""
        req = self.req
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        async for i, out in merge(streams):
            check_output(out, self.constraint_field)
            self.record(i, out)
            for o in out.outputs:
                c = self.choices[i * self.n + o.index]
                c.add(o)
                text = o.delta_text
                first = not c.started
                if first:
                    c.started = True
                    text = self.echo_texts[i] + text
                    c.text_offset = len(self.echo_texts[i])
                if not text and not o.finish_reason and not o.delta_logprobs:
                    continue
                lp, head_lp = None, None
                if first and self.echo_lps:
                    head_lp, c.text_offset = self.prompt_part(i)
                if req.logprobs is not None:
                    lp, c.text_offset = completion_logprobs(
                        o.delta_logprobs or [], req.logprobs, c.text_offset
                    )
                    lp = join_logprobs(head_lp, lp) if head_lp is not None else lp
                choice = {
                    "index": c.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                    **(self.extra_fields(i) if first else {}),
                }
                yield {**self.head, "choices": [choice], **extra}
        if include_usage:
            yield {**self.head, "choices": [], "usage": self.total_usage()}
