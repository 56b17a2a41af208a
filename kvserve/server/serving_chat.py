"""POST /v1/chat/completions: messages through the model's chat template, assistant messages out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.server.errors import BadRequest
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving import (
    SSE_HEADERS,
    Choice,
    ServerState,
    chat_logprobs,
    check_context,
    check_output,
    check_request,
    compile_constraint,
    merge,
    off_loop,
    open_streams,
    reserve_capacity,
    sse_stream,
    usage,
)
from kvserve.server.tools import ToolCallStreamParser, parse_tool_calls


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Chat template + tokenize, as the offline LLM.chat does (the template carries the special
    tokens)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raise_exception: e.g. roles out of the order the template wants
        raise BadRequest(
            f"cannot apply the chat template to these messages: {e}", "messages"
        ) from None
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(req: ChatCompletionRequest, state: ServerState):
    check_request(state, req.model)
    req.check()
    params = req.to_sampling_params()
    constraint_field = req.constraint()[1]
    engine = state.engine
    with reserve_capacity(state, params.n, "n") as held:
        await compile_constraint(state, req, params)
        prompt_ids = await off_loop(render_chat, engine.tokenizer, req.chat_messages())
        check_context(len(prompt_ids), params.max_tokens, engine.max_model_len, "messages")

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await open_streams(
            engine,
            [prompt_ids],
            params,
            request_id,
            req.priority,
            req.cache_salt,
            names={"prompt": "messages"},
            reservation=held,
        )
    choices = [Choice(i) for i in range(params.n)]
    cached = [0]
    num_top = req.top_logprobs or 0
    head = {"id": request_id, "created": int(time.time()), "model": state.model_name}

    def total_usage() -> dict:
        return usage(len(prompt_ids), sum(c.num_tokens for c in choices), cached[0])

    def answer(c: Choice) -> dict:
        """The message and finish reason of a finished choice: tool calls read out of the text
        when the request offered tools."""
        message = {"role": "assistant", "content": c.text}
        if req.uses_tools and c.finish_reason != "length":
            content, calls = parse_tool_calls(c.text)
            if calls:
                message = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [call.to_openai() for call in calls],
                }
                return {"message": message, "finish_reason": "tool_calls"}
        return {"message": message, "finish_reason": c.finish_reason}

    if not req.stream:
        async for _, out in merge(streams):
            check_output(out, constraint_field)
            cached[0] = out.num_cached_tokens
            for o in out.outputs:
                choices[o.index].add(o)
        body = [
            {
                "index": c.index,
                **answer(c),
                "logprobs": chat_logprobs(c.logprobs, num_top) if req.logprobs else None,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ]
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": body, "usage": total_usage()}
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunk_head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
        return {
            **chunk_head,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ],
            **extra,
        }

    parsers = [ToolCallStreamParser() for _ in choices] if req.uses_tools else None

    def deltas(index: int, text: str, finished: bool) -> list[dict]:
        """The delta(s) for new text: content as it comes, or, with tools, content and tool-call
        deltas from the stream parser (it holds back text that may open a call)."""
        if parsers is None:
            return [{"content": text}] if text else []
        parser = parsers[index]
        return parser.feed(text) + (parser.finish() if finished else [])

    def finish_reason(index: int, reason: str | None) -> str | None:
        if (
            reason
            and parsers is not None
            and parsers[index].tool_calls
            and not parsers[index].broken_calls
            and reason != "length"
        ):
            return "tool_calls"
        return reason

    async def chunks() -> AsyncIterator[dict]:
        for c in choices:  # the role first, once per choice
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for _, out in merge(streams):
            check_output(out, constraint_field)
            cached[0] = out.num_cached_tokens
            for o in out.outputs:
                choices[o.index].add(o)
                if not o.delta_text and not o.finish_reason and not o.delta_logprobs:
                    continue
                lp = chat_logprobs(o.delta_logprobs or [], num_top) if req.logprobs else None
                parts = deltas(o.index, o.delta_text, bool(o.finish_reason))
                for part in parts[:-1]:
                    yield chunk(o.index, part)
                yield chunk(
                    o.index, parts[-1] if parts else {}, lp, finish_reason(o.index, o.finish_reason)
                )
        if include_usage:
            yield {**chunk_head, "choices": [], "usage": total_usage()}

    return StreamingResponse(
        sse_stream(chunks()), media_type="text/event-stream", headers=SSE_HEADERS
    )
