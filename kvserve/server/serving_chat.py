"""POST /v1/chat/completions: messages through the model's chat template, assistant messages out."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.server.errors import BadRequest
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving import (SSE_HEADERS, Choice, ServerState, chat_logprobs, check_capacity,
                                    check_context, check_output, check_request, merge, off_loop,
                                    open_streams, sse_stream, usage)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Chat template + tokenize, as the offline LLM.chat does (the template carries the special tokens)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raise_exception: e.g. roles out of the order the template wants
        raise BadRequest(f"cannot apply the chat template to these messages: {e}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(req: ChatCompletionRequest, state: ServerState):
    check_request(state, req.model)
    req.check()
    params = req.to_sampling_params()
    engine = state.engine
    check_capacity(state, params.n, "n")
    prompt_ids = await off_loop(render_chat, engine.tokenizer, req.chat_messages())
    check_context(len(prompt_ids), params.max_tokens, engine.max_model_len, "messages")

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await open_streams(engine, [prompt_ids], params, request_id, req.priority, req.cache_salt,
                                 names={"prompt": "messages"})
    choices = [Choice(i) for i in range(params.n)]
    cached = [0]
    num_top = req.top_logprobs or 0
    head = {"id": request_id, "created": int(time.time()), "model": state.model_name}

    def total_usage() -> dict:
        return usage(len(prompt_ids), sum(c.num_tokens for c in choices), cached[0])

    if not req.stream:
        async for _, out in merge(streams):
            check_output(out)
            cached[0] = out.num_cached_tokens
            for o in out.outputs:
                choices[o.index].add(o)
        body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": chat_logprobs(c.logprobs, num_top) if req.logprobs else None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices]
        return JSONResponse({**head, "object": "chat.completion", "choices": body, "usage": total_usage()})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunk_head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
        return {**chunk_head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": finish_reason}], **extra}

    async def chunks() -> AsyncIterator[dict]:
        for c in choices:  # the role first, once per choice
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for _, out in merge(streams):
            check_output(out)
            cached[0] = out.num_cached_tokens
            for o in out.outputs:
                choices[o.index].add(o)
                if not o.delta_text and not o.finish_reason and not o.delta_logprobs:
                    continue
                lp = chat_logprobs(o.delta_logprobs or [], num_top) if req.logprobs else None
                yield chunk(o.index, {"content": o.delta_text} if o.delta_text else {}, lp, o.finish_reason)
        if include_usage:
            yield {**chunk_head, "choices": [], "usage": total_usage()}

    return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream", headers=SSE_HEADERS)
