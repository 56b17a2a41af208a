"""Request models of the OpenAI protocol (pydantic v2, strict types) and their mapping to
SamplingParams.

Strict: a number where a string belongs (or "0.5" where a number belongs) is a 400, not a silent
coercion. Every string must be valid Unicode (JSON's "\ud800" escapes are refused). Unknown
fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep working, except
the ones in UNSUPPORTED_FIELDS, which would change what the answer means. Value ranges are
checked once, by SamplingParams; `to_sampling_params` turns its ValueError into a 400 that names
the request field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from kvserve.sampling_params import ParamError, SamplingParams, StructuredOutputs
from kvserve.server.errors import BadRequest
from kvserve.server.tools import tool_choice_constraint, tool_functions

MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_CACHE_SALT_CHARS = 1024
MAX_TEMPERATURE = 2.0  # OpenAI's upper bound for temperature (the offline API takes any)

# Fields of OpenAI or vLLM requests that change what the answer means and that kvserve does not
# implement (yet): a 400 naming the field, never a silently different answer.
UNSUPPORTED_FIELDS = (
    "logit_bias",
    "functions",
    "function_call",
    "prompt_logprobs",
)  # a field of /v1/completions; chat has none
# vLLM's older names for the kinds of `structured_outputs`
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
GUIDED_OPTIONS = {"guided_whitespace_pattern": "whitespace_pattern"}  # apply to the one above


def _valid_unicode(v: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\ud800") that no tokenizer or encoder accepts."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"must be valid Unicode text: lone surrogate {v[e.start]!r} at character {e.start}"
        ) from None
    return v


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _valid_nested_unicode(v: Any, path: str = "") -> Any:
    """_valid_unicode for every key and string inside a JSON object (tools, schemas), naming
    where."""
    if isinstance(v, str):
        try:
            _valid_unicode(v)
        except ValueError as e:
            raise ValueError(f"{path or 'value'} {e}") from None
    elif isinstance(v, dict):
        for key, item in v.items():
            _valid_nested_unicode(key, f"{path}.{key!r}" if path else f"key {key!r}")
            _valid_nested_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(v, list):
        for i, item in enumerate(v):
            _valid_nested_unicode(item, f"{path}[{i}]" if path else f"[{i}]")
    return v


JSONObject = Annotated[
    dict, AfterValidator(_valid_nested_unicode)
]  # a dict whose strings are all Text


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(_Model):
    name: Text | None = None
    description: Text | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise BadRequest(
                "response_format of type json_schema needs json_schema.schema", "response_format"
            )
        return StructuredOutputs(json=self.json_schema.schema_)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Model):
    """Fields that completions and chat share. Unknown fields are kept (not used) so that
    `check` can refuse the ones in UNSUPPORTED_FIELDS."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: Text | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Text | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: JSONObject | None = (
        None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    )
    # Beam search (vLLM's extension): the n best of best_of (completions) or n beams.
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    def check(self) -> None:
        """Rules across fields and values kvserve does not support: BadRequest naming the field."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            if extra.get(name) not in (None, {}, []):
                raise BadRequest(f"{name} is not supported by this server", name)
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise BadRequest(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                "characters",
                "cache_salt",
            )
        self.constraint()

    def constraint(self) -> tuple[StructuredOutputs | None, str]:
        """The output constraint and the field it came from: response_format, structured_outputs
        or one of vLLM's guided_* fields (at most one of them)."""
        extra = self.model_extra or {}
        given = [(name, extra[name]) for name in GUIDED_FIELDS if extra.get(name) is not None]
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", self.response_format))
        stray = [
            o
            for o in GUIDED_OPTIONS
            if extra.get(o) is not None and not any(name in GUIDED_FIELDS for name, _ in given)
        ]
        if stray:
            raise BadRequest(
                f"{stray[0]} applies to a guided_json constraint in the same request", stray[0]
            )
        if not given:
            return None, "structured_outputs"
        built = [(self._one_constraint(name, value, extra), name) for name, value in given]
        if len({so.key() for so, _ in built}) > 1:  # the same one in two fields is fine (vLLM)
            raise BadRequest(
                f"give one output constraint, not {', '.join(n for n, _ in given)}", given[1][0]
            )
        return built[0]

    @staticmethod
    def _one_constraint(name: str, value, extra: dict) -> StructuredOutputs:
        try:
            if name == "response_format":
                return value.constraint()
            if name == "structured_outputs":
                known = set(StructuredOutputs.__dataclass_fields__)
                unknown = sorted(set(value) - known)
                if unknown:
                    raise BadRequest(
                        f"structured_outputs: unknown key {unknown[0]!r} (known: "
                        f"{', '.join(sorted(known))})",
                        name,
                    )
                return StructuredOutputs(**value)
            options = {
                field: extra[option]
                for option, field in GUIDED_OPTIONS.items()
                if extra.get(option) is not None
            }
            return StructuredOutputs(**{GUIDED_FIELDS[name]: value}, **options)
        except ParamError as e:
            raise BadRequest(str(e), name) from None

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        names: dict[str, str],
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "structured_outputs": self.constraint()[0],
            "use_beam_search": self.use_beam_search,
            "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping,
            "best_of": getattr(self, "best_of", None),
        }
        if self.temperature is not None and self.temperature > MAX_TEMPERATURE:
            raise BadRequest(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (OpenAI's range), "
                f"got {self.temperature:g}",
                "temperature",
            )
        kwargs = {k: v for k, v in given.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**kwargs)
        except ParamError as e:  # "<field> must be ...": name the request's field
            param = names.get(e.param, e.param)
            raise BadRequest(str(e).replace(e.param, param, 1), param) from None


# ---- /v1/completions ----


def _check_prompt(v: Any) -> Any:
    if isinstance(v, list) and len(v) > MAX_PROMPTS and not all(type(x) is int for x in v):
        raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(v)}")
    ok = isinstance(v, str) or (
        isinstance(v, list)
        and v
        and (
            all(isinstance(x, str) for x in v)
            or all(type(x) is int for x in v)
            or all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in v)
        )
    )
    if not ok:
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of lists of token ids, none of them empty"
        )
    return v


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: top-N logprobs of every prompt token

    @field_validator("prompt", mode="before")
    @classmethod
    def _valid_prompt(cls, v: Any) -> Any:
        return _check_prompt(v)

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise BadRequest(
                "max_tokens must be >= 1 (0 is for scoring a prompt: with echo or prompt_logprobs)",
                "max_tokens",
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (each a string or token ids)."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    def prompt_logprobs_wanted(self) -> int | None:
        """Top-N of the prompt's logprobs: asked for directly, or by echo with logprobs (the
        legacy API's prompt scoring, as lm-evaluation-harness sends it)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            return self.logprobs
        return 0 if self.echo and self.max_tokens == 0 else None

    def to_sampling_params(self) -> SamplingParams:
        return self._params(
            self.max_tokens, self.logprobs, {}, prompt_logprobs=self.prompt_logprobs_wanted()
        )


# ---- /v1/chat/completions ----


class TextPart(_Model):
    type: Literal["text"]
    text: Text


def _check_content(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part of type {kind!r} is not supported: only text parts")
        return v
    raise ValueError("content must be a string or a list of text parts")


class ToolCallFunction(_Model):
    name: Annotated[Text, Field(min_length=1)]
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Model):
    """One of an assistant's earlier calls, as OpenAI takes it back in `messages`."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _valid_content(cls, v: Any) -> Any:
        return _check_content(v)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


def check_tool_turns(messages: list[ChatMessage]) -> None:
    """Each `tool` message answers a call of the assistant message before it (only other tool
    messages between them) and names that call's id, as OpenAI requires: a 400 naming the
    message otherwise."""
    calls: set[str] | None = None  # the ids the latest assistant tool_calls made
    for i, m in enumerate(messages):
        if m.role != "tool":
            calls = {c.id for c in m.tool_calls} if m.role == "assistant" and m.tool_calls else None
            continue
        if calls is None:
            raise BadRequest(
                f"messages.{i}: a message with role 'tool' must answer a preceding "
                f"assistant message with 'tool_calls'",
                f"messages.{i}.role",
            )
        if m.tool_call_id is None:
            raise BadRequest(
                f"messages.{i}.tool_call_id: a message with role 'tool' must name the "
                f"call it answers in 'tool_call_id'",
                f"messages.{i}.tool_call_id",
            )
        if m.tool_call_id not in calls:
            raise BadRequest(
                f"messages.{i}.tool_call_id: {m.tool_call_id!r} is not the id of a "
                f"call in the preceding assistant message's 'tool_calls'",
                f"messages.{i}.tool_call_id",
            )


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as OpenAI gives them, with string content (developer -> system), earlier tool
    calls and the tool_call_id of tool results: serving_chat.render_chat shapes them for the
    model's template."""
    return [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
            **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
            **({"tool_call_id": m.tool_call_id} if m.role == "tool" else {}),
        }
        for m in messages
    ]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[JSONObject] | None = None
    tool_choice: Text | JSONObject | None = None
    parallel_tool_calls: bool = True

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        check_tool_turns(self.messages)

    @property
    def uses_tools(self) -> bool:
        """The model may call tools: its answer is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def constraint(self) -> tuple[StructuredOutputs | None, str]:
        """response_format / structured_outputs, or the grammar `tool_choice` imposes
        (`required`, a named function); not both."""
        so, name = super().constraint()
        try:
            tool_so = tool_choice_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ParamError as e:
            raise BadRequest(str(e), e.param) from None
        if tool_so is None:
            return so, name
        if so is not None:
            raise BadRequest(
                f"tool_choice {self.tool_choice!r} cannot be combined with {name}", "tool_choice"
            )
        return tool_so, "tool_choice"

    def chat_messages(self) -> list[dict]:
        return chat_messages(self.messages)

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tools the prompt lists (none with tool_choice "none")."""
        return self.tools if self.uses_tools else None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        max_name = (
            "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(
            max_tokens, logprobs, {"max_tokens": max_name, "logprobs": "top_logprobs"}
        )


# ---- /tokenize, /detokenize ----


class TokenizeRequest(_Model):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[JSONObject] | None = None  # with messages: rendered as a chat request renders them

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of prompt or messages", "prompt")
        if self.messages is not None and not self.messages:
            raise BadRequest("messages must not be empty", "messages")
        if self.tools is not None and self.messages is None:
            raise BadRequest("tools apply to messages, not to a prompt", "tools")
        if self.messages:
            check_tool_turns(self.messages)
        try:
            tool_functions(self.tools)
        except ParamError as e:
            raise BadRequest(str(e), e.param) from None


class DetokenizeRequest(_Model):
    model: Text | None = None
    tokens: list[int]


# ---- /v1/kv/prefill (disaggregated prefill) ----


class KVPrefillRequest(_Model):
    prompt_token_ids: list[int]
