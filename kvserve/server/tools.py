"""OpenAI tool calling (`tools`, `tool_choice`) in the tool-call format of SmolLM2, the default
model.

SmolLM2's GGUF chat template has no tools section. Its instruct models were tuned for function
calling with the tools listed as JSON inside `<tools>...</tools>` in the system prompt, and the
calls written as a JSON list inside `<tool_call>...</tool_call>`:

    <tool_call>[
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]</tool_call>

with tool results handed back after the call. A chat template that names a `tool` role renders
each result itself (as a `tool` message with its tool_call_id and function name); for one that
does not (SmolLM2, Gemma 3), the results of one round of calls become one user turn that says, in
words, what each function returned. This module:

- tool_choice_constraint: `required` and a named function as a grammar: the tag, a JSON list of
  calls whose arguments follow each function's `parameters` schema, the closing tag, then EOS;
- render_tools_system_prompt / messages_for_template: the tools, earlier calls and tool results
  as text for a chat template without tool support;
- parse_tool_calls / ToolCallStreamParser (tool_parser.py): the calls read back out of the text.
"""

from __future__ import annotations

import json
import re

from kvserve.sampling_params import (
    MAX_SCHEMA_DEPTH,
    ParamError,
    StructuredOutputs,
    check_schema_text,
    closed_objects,
    json_value_depth,
)
from kvserve.server.tool_parser import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    ToolCallStreamParser,
    parse_tool_calls,
)

__all__ = [
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
    "ToolCall",
    "ToolCallStreamParser",
    "parse_tool_calls",
    "tool_choice_constraint",
    "tool_functions",
    "render_tools_system_prompt",
    "messages_for_template",
]

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

TOOLS_SYSTEM_PROMPT = (
    "You can call functions to answer the user's question. These are the functions you have:\n"
    "<tools>{tools}</tools>\n"
    "\n"
    "To call functions, answer with only a JSON list of calls inside <tool_call> tags,\n"
    "giving each argument a value of its parameter's type:\n"
    "<tool_call>[\n"
    '{{"name": "function_name", "arguments": {{"argument_name": "value"}}}}\n'
    "]</tool_call>\n"
    "If no function fits the question, say so. "
    "If the question lacks arguments a function needs, ask for them."
)


def tool_functions(tools: list | None) -> list[dict]:
    """The `function` objects of OpenAI `tools`, checked: ParamError("tools") when malformed."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ParamError("tools", 'tools must be a list of {"type": "function", "function": {...}}')
    functions, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise ParamError(
                "tools", f'tools[{i}] must be {{"type": "function", "function": {{...}}}}'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ParamError("tools", f"tools[{i}].function.name must be a non-empty string")
        if name in names:
            raise ParamError("tools", f"tools[{i}]: function {name!r} is defined twice")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ParamError(
                "tools", f"tools[{i}].function.parameters must be a JSON schema object"
            )
        if fn.get("parameters") is not None:
            _check_parameters(fn["parameters"], f"tools[{i}].function.parameters")
        names.add(name)
        functions.append(fn)
    return functions


def _check_parameters(schema: dict, where: str) -> None:
    """A tool's parameters schema within the structured-output limits (ParamError("tools"))."""

    def bad(message: str):
        raise ParamError("tools", message)

    if json_value_depth(schema) > MAX_SCHEMA_DEPTH:
        bad(f"{where} nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays")
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        bad(f"{where} is not serializable as JSON: {e}")
    check_schema_text(text, where, bad)


def tool_choice_constraint(
    tools: list | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool = True,
    disable_any_whitespace: bool = False,
) -> StructuredOutputs | None:
    """The grammar that `tool_choice` imposes, or None when the model may answer freely
    (`none`, `auto`; no tool_choice means `auto` with tools, `none` without). `required`: one or
    more calls of any of the tools (one only without parallel_tool_calls); a named function
    ({"type": "function", "function": {"name": ...}}): one call of it."""
    functions = tool_functions(tools)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        if not functions:
            raise ParamError(
                "tool_choice", 'tool_choice "required" needs at least one tool in tools'
            )
        chosen, max_calls = functions, None if parallel_tool_calls else 1
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        chosen = [f for f in functions if f["name"] == name]
        if tool_choice.get("type", "function") != "function" or not chosen:
            raise ParamError(
                "tool_choice", f"tool_choice names function {name!r}, which is not in tools"
            )
        max_calls = 1
    else:
        raise ParamError(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    return StructuredOutputs(grammar=tool_calls_lark(chosen, max_calls, disable_any_whitespace))


def tool_calls_lark(
    functions: list[dict], max_calls: int | None, disable_any_whitespace: bool
) -> str:
    """A Lark grammar for one tool-call block: a JSON list of 1..max_calls calls of `functions`."""
    calls = {
        "type": "array",
        "minItems": 1,
        "x-guidance": {"whitespace_flexible": not disable_any_whitespace},
    }
    if max_calls is not None:
        calls["maxItems"] = max_calls
    definitions = {}
    call_schemas = []
    for i, fn in enumerate(functions):
        parameters = closed_objects(fn.get("parameters") or NO_PARAMETERS)
        if _has_ref(parameters):
            # Its refs ("#/$defs/X") point into the parameters schema: move it under the root's
            # $defs and point them there.
            definitions[f"tool_parameters_{i}"] = _rebase_refs(
                parameters, f"#/$defs/tool_parameters_{i}"
            )
            parameters = {"$ref": f"#/$defs/tool_parameters_{i}"}
        call_schemas.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    calls["items"] = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    if definitions:
        calls["$defs"] = definitions
    return (
        f"start: {json.dumps(TOOL_CALL_OPEN)} calls {json.dumps(TOOL_CALL_CLOSE)}\n"
        f"calls: %json {json.dumps(calls, ensure_ascii=False)}\n"
    )


def _has_ref(schema) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("$ref"), str) or any(_has_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_ref(v) for v in schema)
    return False


def _rebase_refs(schema, base: str):
    """A copy of `schema` whose document-local refs ("#", "#/...") are prefixed by `base`."""
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebase_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def render_tools_system_prompt(tools: list | None) -> str:
    """The system prompt that lists the tools and the call format (for chat templates without
    tool support)."""
    listed = [
        {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
        for fn in tool_functions(tools)
    ]
    return TOOLS_SYSTEM_PROMPT.format(tools=json.dumps(listed, ensure_ascii=False))


def format_tool_calls(tool_calls: list[dict]) -> str:
    """OpenAI `tool_calls` of an assistant message as the model writes them."""
    calls = []
    for call in tool_calls:
        fn = call.get("function") or {}
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass
        calls.append(
            json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
        )
    return TOOL_CALL_OPEN + "[\n" + ",\n".join(calls) + "\n]" + TOOL_CALL_CLOSE


def template_has_tool_role(template: str | None) -> bool:
    """Whether a chat template renders `tool` messages itself: it names the role."""
    return bool(template) and re.search(r"""['"]tool['"]""", template) is not None


def tool_result_text(name: str | None, content: str) -> str:
    """A tool result as a user turn says it, for templates without a tool role."""
    return (
        f"The function {name} returned:\n{content}" if name else f"A function returned:\n{content}"
    )


def messages_for_template(messages: list[dict], tools: list | None, tool_role: bool = False):
    """`messages` rewritten for the chat template: the tools prompt leads the system message (one
    is added if there is none), an assistant's tool_calls become text in the model's format, and
    a missing content is empty text. `tool` messages stay `tool` messages (with the function's
    name) when the template has that role (`tool_role`), else consecutive ones become one user
    turn in words (tool_result_text), so that user and assistant turns still alternate."""
    out, names = [], {}  # names: tool call id -> function name
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "assistant" and message.get("tool_calls"):
            for call in message["tool_calls"]:
                names[call.get("id")] = (call.get("function") or {}).get("name")
            calls = format_tool_calls(message["tool_calls"])
            out.append(
                {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
            )
        elif role == "tool" and tool_role:
            call_id = message.get("tool_call_id")
            out.append(
                {
                    "role": "tool",
                    "content": content or "",
                    "tool_call_id": call_id,
                    "name": names.get(call_id),
                }
            )
        elif role == "tool":
            text = tool_result_text(names.get(message.get("tool_call_id")), content or "")
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        else:
            out.append(
                {
                    **{k: v for k, v in message.items() if k != "tool_calls"},
                    "content": content or "",
                }
            )
    for message in out:
        message.pop("tool_results", None)
    if tools:
        prompt = render_tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            system = out[0].get("content")
            out[0] = {**out[0], "content": f"{prompt}\n\n{system}" if system else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
