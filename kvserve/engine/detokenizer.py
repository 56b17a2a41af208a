"""Incremental detokenization with stop strings, safe for streaming.

Two offsets into the token list (vLLM's technique) keep the cost per token O(1):
``prefix_offset`` starts a short window of already-emitted tokens that gives the decoder
its context (leading spaces, merged bytes), ``read_offset`` is where unemitted tokens
begin. Each step decodes ``ids[prefix_offset:]`` and emits what it adds to the text of
``ids[prefix_offset:read_offset]``. That prefix text is kept from the step that set the
offsets, and the text of a one-token window (the usual case) comes from a cache shared by
every request of the tokenizer, so a token costs one decode of a short window. When the new
text ends in U+FFFD the last token stopped inside a multi-byte UTF-8 character: nothing is
emitted and the offsets stay, so the next token completes it. The whole output is never
re-decoded.

Stop strings are matched on the decoded text. Text that could still be the start of a
stop string is held back (never streamed) until the next token settles it; ``flush``
releases it when the request ends for another reason.
"""

from __future__ import annotations

import weakref

from kvserve.sampling_params import SamplingParams

# Tokens of the prompt decoded together with the first output token for context.
_PROMPT_CONTEXT = 5
# Entries of a window-text cache before it starts again empty (a vocabulary's single tokens fit).
_CACHE_LIMIT = 1 << 18

# Per tokenizer, the texts of short token windows: (skip_special_tokens=False, =True) caches.
_window_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _window_cache(tokenizer, skip_special_tokens: bool) -> dict:
    """The window-text cache shared by every detokenizer of `tokenizer` (decode is a pure
    function of the ids); a private one when the tokenizer cannot be weakly referenced."""
    try:
        caches = _window_caches.get(tokenizer)
        if caches is None:
            caches = _window_caches[tokenizer] = ({}, {})
    except TypeError:
        return {}
    return caches[bool(skip_special_tokens)]


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamed text deltas.

    ``tokenizer`` needs ``decode(ids, skip_special_tokens=bool) -> str``. After a stop
    string matched, ``stopped`` is True and ``stop_reason`` holds that string.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._stop_firsts = {s[0] for s in self.stop if s}  # where a held-back tail can begin
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # the text of ids[prefix_offset:read_offset]
        self._cache = _window_cache(tokenizer, self.skip_special_tokens)
        self._chunks: list[str] = []  # emitted text
        self._pending = ""  # decoded but held back: might begin a stop string
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add_tokens(self, new_token_ids: list[int]) -> tuple[str, bool]:
        """Feed newly generated tokens; return (text safe to emit now, stop string matched).

        After a stop string matched, further tokens are ignored and return ("", True).
        """
        if self.stopped:
            return "", True
        self._ids.extend(new_token_ids)
        if not self.stop:  # nothing to match or hold back
            return self._emit(self._decode_new()), False
        buf = self._pending + self._decode_new()
        self._pending = ""

        cut = self._find_stop(buf)
        if cut is not None:
            self.stopped = True
            return self._emit(buf[:cut]), True

        hold = self._stop_prefix_len(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return self._emit(buf[: len(buf) - hold]), False

    def flush(self) -> str:
        """At finish (length/eos): release held-back text. Incomplete UTF-8 bytes stay dropped."""
        if self.stopped:
            return ""
        text, self._pending = self._pending, ""
        return self._emit(text)

    # ---------------------------------------------------------------- internals

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text

    def _decode_new(self) -> str:
        """Text of the tokens after read_offset, or "" while it ends mid-character."""
        ids = self._ids
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._window_text(ids[self._prefix_offset : self._read_offset])
        new_text = self.tokenizer.decode(
            ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens
        )
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            self._prefix_text = prefix_text
            return ""
        # Drop tokens before the new window so the list does not grow with the output.
        del ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(ids)
        self._prefix_text = self._window_text(ids)
        return new_text[len(prefix_text) :]

    def _window_text(self, window: list[int]) -> str:
        """decode(window), from the shared cache for windows of up to a few tokens."""
        if len(window) > 4:
            return self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)
        key = window[0] if len(window) == 1 else tuple(window)
        text = self._cache.get(key)
        if text is None:
            text = self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = text
        return text

    def _find_stop(self, buf: str) -> int | None:
        """Where to cut `buf` for the stop string that completes first, or None.

        Ties (several ending at the same character) go to the longest one.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, self.stop_reason = best
        return end if self.params.include_stop_str_in_output else start

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf`, shorter than the longest stop string, that a
        stop string begins with. Only suffixes starting with some stop string's first character
        are compared."""
        n = len(buf)
        k = min(self._max_stop_len - 1, n)
        if k <= 0 or self._stop_firsts.isdisjoint(buf[n - k :]):  # the usual case, in one call
            return 0
        for i in range(n - k, n):  # the longest suffix first
            if buf[i] in self._stop_firsts:
                tail = buf[i:]
                if any(s.startswith(tail) for s in self.stop):
                    return n - i
        return 0
