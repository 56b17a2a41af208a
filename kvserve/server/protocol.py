"""Request models of the OpenAI protocol (pydantic v2, strict types) and their mapping to SamplingParams.

Strict: a number where a string belongs (or "0.5" where a number belongs) is a 400, not a silent
coercion. Every string must be valid Unicode (JSON's "\ud800" escapes are refused). Unknown
fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep working, except
the ones in UNSUPPORTED_FIELDS, which would change what the answer means. Value ranges are checked once, by SamplingParams; `to_sampling_params` turns its
ValueError into a 400 that names the request field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from kvserve.sampling_params import ParamError, SamplingParams
from kvserve.server.errors import BadRequest

MAX_PROMPTS = 256             # prompts in one /v1/completions request
MAX_CACHE_SALT_CHARS = 1024

# Fields of OpenAI or vLLM requests that change what the answer means and that kvserve does not
# implement (yet): a 400 naming the field, never a silently different answer.
UNSUPPORTED_FIELDS = ("logit_bias", "functions", "function_call", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar", "structured_outputs",
                      "prompt_logprobs")   # a field of /v1/completions; chat has none


def _valid_unicode(v: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\ud800") that no tokenizer or encoder accepts."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"must be valid Unicode text: lone surrogate {v[e.start]!r} "
                         f"at character {e.start}") from None
    return v


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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

    def check(self) -> None:
        """Rules across fields and values kvserve does not support: BadRequest naming the field."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            if extra.get(name) not in (None, {}, []):
                raise BadRequest(f"{name} is not supported by this server", name)
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise BadRequest(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                             "characters", "cache_salt")

    def _params(self, max_tokens: int | None, logprobs: int | None, names: dict[str, str],
                prompt_logprobs: int | None = None) -> SamplingParams:
        given = {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                 "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                 "stop_token_ids": self.stop_token_ids, "presence_penalty": self.presence_penalty,
                 "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                 "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                 "skip_special_tokens": self.skip_special_tokens,
                 "include_stop_str_in_output": self.include_stop_str_in_output,
                 "max_tokens": max_tokens, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
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
    ok = (isinstance(v, str)
          or (isinstance(v, list) and v and (
              all(isinstance(x, str) for x in v)
              or all(type(x) is int for x in v)
              or all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in v))))
    if not ok:
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of lists of token ids, none of them empty")
    return v


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None     # vLLM's extension: top-N logprobs of every prompt token

    @field_validator("prompt", mode="before")
    @classmethod
    def _valid_prompt(cls, v: Any) -> Any:
        return _check_prompt(v)

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of is not supported (other than best_of == n)", "best_of")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise BadRequest("max_tokens must be >= 1 (0 is for scoring a prompt: with echo or "
                             "prompt_logprobs)", "max_tokens")

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
        return self._params(self.max_tokens, self.logprobs, {}, prompt_logprobs=self.prompt_logprobs_wanted())


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


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

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


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them (string content; developer -> system)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class ResponseFormat(_Model):
    type: Text


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Text | dict | None = None
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tools:
            raise BadRequest("tools are not supported", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice is not supported", "tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest(f"response_format type {self.response_format.type!r} is not supported "
                             "(only 'text')", "response_format")

    def chat_messages(self) -> list[dict]:
        return chat_messages(self.messages)

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, {"max_tokens": max_name, "logprobs": "top_logprobs"})


# ---- /tokenize, /detokenize ----

class TokenizeRequest(_Model):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of prompt or messages", "prompt")
        if self.messages is not None and not self.messages:
            raise BadRequest("messages must not be empty", "messages")


class DetokenizeRequest(_Model):
    model: Text | None = None
    tokens: list[int]
