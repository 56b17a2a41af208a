"""Reads tool calls out of generated text, whole or as it streams.

The format (SmolLM2's; see tools.py):
`<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`.
A block may also hold a single call object instead of a list (the Hermes/Qwen form, one block per
call), the closing tag may be missing at the end of the text, "parameters" is read as "arguments",
and an empty list is no call. Text outside the blocks is the message's content.

ToolCallStreamParser turns text deltas into OpenAI chat-completion deltas: content as it comes
(holding back only what may be the start of `<tool_call>`, and whitespace until text follows it),
and per call a first delta with its index, id, type and name, then its arguments' JSON text in
fragments as the model writes it. parse_tool_calls runs the same parser over a whole text, so
both give the same calls with the same arguments text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
JSON_WHITESPACE = " \t\n\r"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it

    def to_openai(self) -> dict:
        """As a chat completion message's `tool_calls` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished generation: the content is the text outside the tool-call
    blocks (stripped, or None when empty, if there are calls). Text whose calls are malformed or
    cut off is all content, with no calls."""
    parser = ToolCallStreamParser()
    deltas = parser.feed(text) + parser.finish()
    if parser.broken_calls:
        return text, []
    content = "".join(d["content"] for d in deltas if "content" in d)
    if not parser.tool_calls:
        return content, []
    return content.strip() or None, parser.tool_calls


class _CallObject:
    """Scans one call object `{...}` as its text arrives: where its top-level values start and
    end, its name once complete, and the span of its arguments value."""

    def __init__(self):
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.phase = "key"  # key | colon | value | after_value (at depth 1)
        self.key_start = 0
        self.key: str | None = None
        self.value_start: int | None = None
        self.name: str | None = None
        self.args_key: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.complete = False
        self.malformed = False

    def feed(self, chunk: str) -> int:
        """Scan `chunk`; the number of its characters consumed (all, unless the object completed
        or turned out malformed within it)."""
        base = len(self.text)
        self.text += chunk
        for k, ch in enumerate(chunk):
            self._add(ch, base + k)
            if self.complete or self.malformed:
                self.text = self.text[: base + k + 1]
                return k + 1
        return len(chunk)

    def _add(self, ch: str, i: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.phase == "key":
                    self.key = _loads(self.text[self.key_start : i + 1])
                    self.phase = "colon"
                elif self.depth == 1 and self.phase == "value":
                    self._value_end(i + 1)
            return
        if ch in JSON_WHITESPACE:
            return
        if self.depth == 0:  # the object's opening brace
            self.depth = 1
            self.malformed = ch != "{"
            return
        if self.depth == 1:
            self._top_level(ch, i)
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.phase == "value":
                self._value_end(i + 1)
            elif self.depth == 0:
                self.complete = True

    def _top_level(self, ch: str, i: int) -> None:
        if self.phase == "key":
            if ch == '"':
                self.key_start = i
            elif ch != "}":
                self.malformed = True
        elif self.phase == "colon":
            self.phase = "value"
            self.value_start = None
            self.malformed = ch != ":"
        elif self.phase == "value":
            if self.value_start is None:
                self.value_start = i
                if self.key in ARGUMENT_KEYS and self.args_key is None:
                    self.args_key, self.args_start = self.key, i
            elif ch in ",}" and self.text[self.value_start] not in '"{[':  # the end of a scalar
                self._value_end(i)
                if ch == ",":
                    self.phase = "key"
        elif ch == ",":  # after_value
            self.phase = "key"
        elif ch != "}":
            self.malformed = True

    def _value_end(self, end: int) -> None:
        raw = self.text[self.value_start : end].rstrip(JSON_WHITESPACE)
        if self.key == "name" and self.name is None:
            name = _loads(raw)
            self.name = name if isinstance(name, str) and name else None
        if self.args_start == self.value_start:
            self.args_end = self.value_start + len(raw)
        self.phase = "after_value"

    @property
    def args_streamable(self) -> bool:
        """The arguments value is an object, whose text can be passed on as it grows."""
        return self.args_start is not None and self.text[self.args_start] == "{"

    def args_text_so_far(self) -> str:
        if self.args_start is None:
            return ""
        return self.text[
            self.args_start : self.args_end if self.args_end is not None else len(self.text)
        ]

    def final_arguments(self) -> str | None:
        """The arguments' JSON text once the object is complete and well-formed; None if it is
        not."""
        obj = _loads(self.text) if self.complete and not self.malformed else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        if self.args_key is None:
            return "{}"
        value = obj[self.args_key]
        if isinstance(value, str):  # arguments given as a JSON string
            return value
        return self.text[self.args_start : self.args_end]


class ToolCallStreamParser:
    """feed(delta) -> OpenAI-style deltas ({"content": ...} or {"tool_calls": [...]});
    finish() at the end of the generation flushes what was held back.

    tool_calls: the complete, well-formed calls so far (finish_reason "tool_calls" when any);
    broken_calls: how many calls were announced but turned out malformed or unfinished, or were
    followed by a malformed rest of their block."""

    def __init__(self):
        self.tool_calls: list[ToolCall] = []
        self.broken_calls = 0
        self._pending = ""  # text not yet consumed
        self._held_space = ""  # whitespace of the content, held until text follows it
        self._state = "text"  # text | block_start | block_items | call | block_next | block_close
        self._in_list = False
        self._block_calls = 0  # complete calls in the current block
        self._block_text = ""  # the current block's text since its last complete call
        self._call: _CallObject | None = None
        self._announced_calls = 0  # calls whose first delta went out
        self._ended_calls = 0  # of those, the ones complete or found broken
        self._call_id = ""
        self._args_sent = 0
        self._out: list[dict] = []

    def feed(self, delta: str) -> list[dict]:
        self._pending += delta
        self._run(final=False)
        if self._state == "call":
            self._stream_call()
        return self._take()

    def finish(self) -> list[dict]:
        self._run(final=True)
        self._end_unfinished_block()
        space, self._held_space = self._held_space, ""
        if not self.tool_calls:
            self._emit_content(space, hold_space=False)
        return self._take()

    @property
    def _call_index(self) -> int:
        """The OpenAI index of the call being read: one past the announced calls that ended."""
        return self._ended_calls

    # ---- output
    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _emit_content(self, text: str, hold_space: bool = True) -> None:
        text = self._held_space + text
        kept = text.rstrip() if hold_space else text
        self._held_space = text[len(kept) :]
        if kept:
            if self._out and "content" in self._out[-1]:
                self._out[-1]["content"] += kept
            else:
                self._out.append({"content": kept})

    def _emit_arguments(self, fragment: str) -> None:
        if not fragment:
            return
        last = (
            self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        )
        if last is not None and last["index"] == self._call_index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._out.append(
                {"tool_calls": [{"index": self._call_index, "function": {"arguments": fragment}}]}
            )

    # ---- the state machine
    def _run(self, final: bool) -> None:
        while self._pending:
            if self._state == "text":
                if not self._scan_text(final):
                    return
            elif self._state == "block_close":
                if not self._scan_close(final):
                    return
            elif self._state == "call":
                used = self._call.feed(self._pending)
                self._block_text += self._pending[:used]
                self._pending = self._pending[used:]
                if self._call.complete or self._call.malformed:
                    self._end_call()
            else:
                self._scan_block_start()

    def _scan_text(self, final: bool) -> bool:
        """Content up to the next opening tag. False when waiting for more text."""
        at = self._pending.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._emit_content(self._pending[:at])
            self._pending = self._pending[at + len(TOOL_CALL_OPEN) :]
            # The whitespace before the tag goes with the block: content again if it is no call.
            self._block_text, self._held_space = self._held_space + TOOL_CALL_OPEN, ""
            self._state, self._in_list, self._block_calls = "block_start", False, 0
            return True
        keep = 0 if final else _partial_tag_length(self._pending, TOOL_CALL_OPEN)
        self._emit_content(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    def _scan_close(self, final: bool) -> bool:
        """After a block's calls: whitespace, then the closing tag (anything else is content
        again; a closing tag cut off by the end of the text is dropped). False when waiting."""
        stripped = self._pending.lstrip()
        if stripped.startswith(TOOL_CALL_CLOSE):
            self._pending = stripped[len(TOOL_CALL_CLOSE) :]
            self._state = "text"
            return True
        if not stripped or TOOL_CALL_CLOSE.startswith(stripped):
            if final:
                self._pending = ""
            return False
        self._pending = stripped
        self._state = "text"
        return True

    def _scan_block_start(self) -> None:
        """Inside a block, around its calls: whitespace, then `[` or `{` at its start; `{` or `]`
        (an empty list) after `[`; `,` or `]` after a call of the list."""
        pending = self._pending
        i = len(pending) - len(pending.lstrip(JSON_WHITESPACE))
        if i == len(pending):
            self._block_text += pending
            self._pending = ""
            return
        ch = pending[i]
        self._block_text += pending[: i + 1]
        self._pending = pending[i + 1 :]
        state = self._state
        if state == "block_start" and ch == "[":
            self._in_list, self._state = True, "block_items"
        elif state in ("block_start", "block_items") and ch == "{":
            self._call = _CallObject()
            self._call.feed("{")
            self._state = "call"
        elif (state == "block_items" and ch == "]" and not self._block_calls) or (
            state == "block_next" and ch == "]"
        ):
            self._state = "block_close"
        elif state == "block_next" and ch == ",":
            self._state = "block_items"
        else:
            self._abandon_block()

    def _stream_call(self) -> None:
        """Announce the call once its name is known, then pass on its arguments text so far."""
        call = self._call
        if self._announced_calls == self._call_index and call.name is not None:
            self._announced_calls += 1
            self._call_id = new_tool_call_id()
            self._args_sent = 0
            self._out.append(
                {
                    "tool_calls": [
                        {
                            "index": self._call_index,
                            "id": self._call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }
                    ]
                }
            )
        if self._announced() and call.args_streamable:
            so_far = call.args_text_so_far()
            self._emit_arguments(so_far[self._args_sent :])
            self._args_sent = len(so_far)

    def _announced(self) -> bool:
        return self._announced_calls > self._call_index

    def _end_call(self) -> None:
        call = self._call
        arguments = call.final_arguments()
        if arguments is None:
            if self._announced():
                self.broken_calls += 1
                self._ended_calls += 1
                self._call, self._state, self._block_text = None, "text", ""  # the rest is content
            else:
                self._abandon_block()
            return
        self._stream_call()
        self._emit_arguments(arguments[self._args_sent :] if call.args_streamable else arguments)
        self.tool_calls.append(ToolCall(self._call_id, call.name, arguments))
        self._ended_calls += 1
        self._call, self._block_text = None, ""
        self._block_calls += 1
        self._state = "block_next" if self._in_list else "block_close"

    def _abandon_block(self) -> None:
        """The block is not tool calls (what was read of it is content), or is malformed after
        its first calls (which counts as a broken call)."""
        text, self._block_text, self._call = self._block_text, "", None
        self._state = "text"
        if self._block_calls:
            self.broken_calls += 1
        self._emit_content(text)

    def _end_unfinished_block(self) -> None:
        """The text ended inside a block: an announced call is broken; text that never became a
        call is content."""
        if self._state == "call" and self._announced():
            self.broken_calls += 1
            self._ended_calls += 1
        elif self._state in ("call", "block_start", "block_items") and not self._block_calls:
            self._emit_content(self._block_text, hold_space=False)
        self._state, self._call, self._block_text = "text", None, ""


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
