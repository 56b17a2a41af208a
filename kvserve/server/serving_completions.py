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
    merge,
    off_loop,
    open_streams,
    prompt_logprobs_json,
    reserve_capacity,
    sse_stream,
    usage,
)


async def create_completion(req: CompletionRequest, state: ServerState):
    check_request(state, req.model)
    req.check()
    params = req.to_sampling_params()
    constraint_field = req.constraint()[1]
    engine = state.engine
    tok = engine.tokenizer
    prompts = req.prompts()
    with reserve_capacity(
        state, len(prompts) * params.n, "n" if len(prompts) == 1 else "prompt"
    ) as held:
        await compile_constraint(state, req, params)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(
            await off_loop(lambda: [tok.encode(t, add_special_tokens=True) for t in texts])
        )
        prompt_ids: list[list[int]] = []
        echo_texts: list[str] = []
        for p in prompts:
            ids = next(encoded) if isinstance(p, str) else list(p)
            if not ids:
                raise BadRequest("the prompt is empty after tokenization", "prompt")
            check_context(len(ids), params.max_tokens, engine.max_model_len, "prompt")
            prompt_ids.append(ids)
            if req.echo:
                echo_texts.append(
                    p if isinstance(p, str) else tok.decode(ids, skip_special_tokens=False)
                )
            else:
                echo_texts.append("")

        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await open_streams(
            engine, prompt_ids, params, request_id, req.priority, req.cache_salt, reservation=held
        )
    n = params.n
    choices = [Choice(i) for i in range(len(prompt_ids) * n)]
    cached = [0] * len(prompt_ids)
    prompt_lps: list = [None] * len(prompt_ids)  # per prompt, once the engine has computed them
    echo_lps = req.echo and req.logprobs is not None

    def record(i: int, out) -> None:
        cached[i] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            prompt_lps[i] = out.prompt_logprobs

    def prompt_part(i: int) -> tuple[dict, int]:
        """The echoed prompt's logprobs (legacy shape) and the text offset after it."""
        first = tok.decode(prompt_ids[i][:1], skip_special_tokens=False)
        return echo_logprobs(prompt_lps[i] or [], first, req.logprobs)

    def extra_fields(i: int) -> dict:
        return (
            {"prompt_logprobs": prompt_logprobs_json(prompt_lps[i])}
            if req.prompt_logprobs is not None and prompt_lps[i] is not None
            else {}
        )

    head = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
    }

    def total_usage() -> dict:
        return usage(
            sum(len(ids) for ids in prompt_ids), sum(c.num_tokens for c in choices), sum(cached)
        )

    if not req.stream:
        async for i, out in merge(streams):
            check_output(out, constraint_field)
            record(i, out)
            for o in out.outputs:
                choices[i * n + o.index].add(o)
        body = []
        for c in choices:
            i = c.index // n
            echo = echo_texts[i]
            lp = None
            if echo_lps:
                prompt_lp, offset = prompt_part(i)
                lp = join_logprobs(
                    prompt_lp, completion_logprobs(c.logprobs, req.logprobs, offset)[0]
                )
            elif req.logprobs is not None:
                lp = completion_logprobs(c.logprobs, req.logprobs, len(echo))[0]
            body.append(
                {
                    "index": c.index,
                    "text": echo + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **extra_fields(i),
                }
            )
        return JSONResponse({**head, "choices": body, "usage": total_usage()})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    async def chunks() -> AsyncIterator[dict]:
        async for i, out in merge(streams):
            check_output(out, constraint_field)
            record(i, out)
            for o in out.outputs:
                c = choices[i * n + o.index]
                c.add(o)
                text = o.delta_text
                first = not c.started
                if first:
                    c.started = True
                    text = echo_texts[i] + text
                    c.text_offset = len(echo_texts[i])
                if not text and not o.finish_reason and not o.delta_logprobs:
                    continue
                lp, head_lp = None, None
                if first and echo_lps:
                    head_lp, c.text_offset = prompt_part(i)
                if req.logprobs is not None:
                    lp, c.text_offset = completion_logprobs(
                        o.delta_logprobs or [], req.logprobs, c.text_offset
                    )
                    lp = join_logprobs(head_lp, lp) if head_lp is not None else lp
                yield {
                    **head,
                    "choices": [
                        {
                            "index": c.index,
                            "text": text,
                            "logprobs": lp,
                            "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason,
                            **(extra_fields(i) if first else {}),
                        }
                    ],
                    **extra,
                }
        if include_usage:
            yield {**head, "choices": [], "usage": total_usage()}

    return StreamingResponse(
        sse_stream(chunks()), media_type="text/event-stream", headers=SSE_HEADERS
    )
