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
    lora_of,
    merge,
    off_loop,
    open_streams,
    reserve_capacity,
    sse_stream,
    usage,
)
from kvserve.server.tools import (
    ToolCallStreamParser,
    messages_for_template,
    parse_tool_calls,
    template_has_tool_role,
)


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools=None
) -> list[int]:
    """Chat template + tokenize, as the offline LLM.chat does (the template carries the special
    tokens). With tools, or tool calls and results in the history: the tools prompt and the calls
    in the default model's format (kvserve.server.tools), the results in the template's own
    `tool` role where it has one."""
    if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        tool_role = template_has_tool_role(getattr(tokenizer, "chat_template", None))
        messages = messages_for_template(messages, tools, tool_role)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raise_exception: e.g. roles out of the order the template wants
        raise BadRequest(
            f"cannot apply the chat template to these messages: {e}", "messages"
        ) from None
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(req: ChatCompletionRequest, state: ServerState):
    """Validate the request, render its messages through the chat template and submit them
    (n choices), then answer with one JSON body or, with `stream`, server-sent chunks."""
    check_request(state, req.model)
    req.check()
    params = req.to_sampling_params()
    constraint_field = req.constraint()[1]
    engine = state.engine
    with reserve_capacity(state, params.n, "n") as held:
        await compile_constraint(state, req, params)
        prompt_ids = await off_loop(
            render_chat, engine.tokenizer, req.chat_messages(), True, req.prompt_tools
        )
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
            lora_name=lora_of(state, req.model),
        )
    run = _ChatRun(req, state, params.n, constraint_field, request_id, len(prompt_ids))
    if not req.stream:
        return await run.full_response(streams)
    return StreamingResponse(
        sse_stream(run.stream_chunks(streams)), media_type="text/event-stream", headers=SSE_HEADERS
    )


class _ChatRun:
    """One submitted chat request: its choices, the cached prompt tokens the engine reported,
    and the two ways to answer it: `full_response` and the `stream_chunks` generator (which,
    when the request offered tools, reads tool calls out of the text as it comes)."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        state: ServerState,
        n: int,
        constraint_field: str,
        request_id: str,
        prompt_tokens: int,
    ) -> None:
        self.req = req
        self.constraint_field = constraint_field
        self.prompt_tokens = prompt_tokens
        self.choices = [Choice(i) for i in range(n)]
        self.cached = 0
        self.num_top = req.top_logprobs or 0
        model = lora_of(state, req.model) or state.model_name  # an adapter's own name
        self.head = {"id": request_id, "created": int(time.time()), "model": model}
        self.parsers = [ToolCallStreamParser() for _ in self.choices] if req.uses_tools else None
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def total_usage(self) -> dict:
        return usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices), self.cached)

    def answer(self, c: Choice) -> dict:
        """The message and finish reason of a finished choice: tool calls read out of the text
        when the request offered tools."""
        message = {"role": "assistant", "content": c.text}
        if self.req.uses_tools and c.finish_reason != "length":
            content, calls = parse_tool_calls(c.text)
            if calls:
                message = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [call.to_openai() for call in calls],
                }
                return {"message": message, "finish_reason": "tool_calls"}
        return {"message": message, "finish_reason": c.finish_reason}

    async def full_response(self, streams) -> JSONResponse:
        """Every choice to its end, then one JSON body."""
        req = self.req
        async for _, out in merge(streams):
            check_output(out, self.constraint_field)
            self.cached = out.num_cached_tokens
            for o in out.outputs:
                self.choices[o.index].add(o)
        body = [
            {
                "index": c.index,
                **self.answer(c),
                "logprobs": chat_logprobs(c.logprobs, self.num_top) if req.logprobs else None,
                "stop_reason": c.stop_reason,
            }
            for c in self.choices
        ]
        return JSONResponse(
            {**self.head, "object": "chat.completion", "choices": body, "usage": self.total_usage()}
        )

    def chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None) -> dict:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        extra = {"usage": None} if self.include_usage else {}
        return {**self.head, "object": "chat.completion.chunk", "choices": [choice], **extra}

    def deltas(self, index: int, text: str, finished: bool) -> list[dict]:
        """The delta(s) for new text: content as it comes, or, with tools, content and tool-call
        deltas from the stream parser (it holds back text that may open a call)."""
        if self.parsers is None:
            return [{"content": text}] if text else []
        parser = self.parsers[index]
        return parser.feed(text) + (parser.finish() if finished else [])

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        parsers = self.parsers
        if (
            reason
            and parsers is not None
            and parsers[index].tool_calls
            and not parsers[index].broken_calls
            and reason != "length"
        ):
            return "tool_calls"
        return reason

    async def stream_chunks(self, streams) -> AsyncIterator[dict]:
        """The role first, once per choice; then the deltas of each step (the finish reason and
        logprobs ride on the step's last one); then, with stream_options.include_usage, the
        usage."""
        req = self.req
        for c in self.choices:
            yield self.chunk(c.index, {"role": "assistant", "content": ""})
        async for _, out in merge(streams):
            check_output(out, self.constraint_field)
            self.cached = out.num_cached_tokens
            for o in out.outputs:
                self.choices[o.index].add(o)
                if not o.delta_text and not o.finish_reason and not o.delta_logprobs:
                    continue
                lp = chat_logprobs(o.delta_logprobs or [], self.num_top) if req.logprobs else None
                parts = self.deltas(o.index, o.delta_text, bool(o.finish_reason))
                for part in parts[:-1]:
                    yield self.chunk(o.index, part)
                yield self.chunk(
                    o.index,
                    parts[-1] if parts else {},
                    lp,
                    self.finish_reason(o.index, o.finish_reason),
                )
        if self.include_usage:
            yield {
                **self.head,
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": self.total_usage(),
            }
