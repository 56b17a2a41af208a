"""Checks of what a request carries, before any of it reaches the scheduler: each failure is a
ParamError naming the field (the server answers 400 with it), so that nothing in a request can
make a step raise. SamplingParams.check() owns the sampling fields; these add what needs the
model (vocabulary, context) and the engine's limits."""

from __future__ import annotations

import operator

from kvserve.sampling_params import ParamError, SamplingParams, is_text


def check_prompt(prompt_token_ids, vocab_size: int) -> list[int]:
    """The prompt as a list of Python ints inside the vocabulary, or ParamError("prompt")."""
    try:
        ids = [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        raise ParamError("prompt", "prompt token ids must be integers") from None
    if not ids:
        raise ParamError("prompt", "prompt is empty: give at least one token")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParamError(
            "prompt", f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    return ids


def check_request(
    params: SamplingParams, priority: int, cache_salt: str | None, max_waiting: int
) -> None:
    """What a request carries besides its prompt, checked again here: the offline API hands
    SamplingParams objects that may have been changed after they were built."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.check()
    if params.n > max_waiting:
        raise ParamError(
            "n",
            f"n={params.n} sequences can never fit the waiting queue "
            f"(max_waiting={max_waiting}, --max-waiting)",
        )
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not -(2**63) <= priority < 2**63
    ):
        raise ParamError("priority", "priority must be an integer in [-2**63, 2**63)")
    if cache_salt is not None:
        if not isinstance(cache_salt, str) or not cache_salt:
            raise ParamError("cache_salt", "cache_salt must be a non-empty string")
        if not is_text(cache_salt):
            raise ParamError(
                "cache_salt", "cache_salt must be valid Unicode text (no lone surrogates)"
            )


def check_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """The request's output cap: max_tokens, or the room its prompt leaves in the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ParamError(
            "prompt",
            f"prompt has {prompt_len} tokens; this model's context is "
            f"{max_model_len} tokens, which leaves no room to generate",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if params.min_tokens > max_tokens:
        raise ParamError(
            "min_tokens",
            f"min_tokens ({params.min_tokens}) is more than the "
            f"{max_tokens} tokens this request can generate",
        )
    return max_tokens
