"""Structured-output constraints past the limits are refused when made (ParamError naming the
field and the limit); within them the native compiler runs on its own big-stack threads, so a
chain of rules that would overflow an ordinary thread's stack compiles, and never kills the
process; Rust panic text never reaches a message; many choices stay one lexer terminal."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvserve import sampling_params as sp
from kvserve.bench.soak import chain_grammar, defs_chain  # the soak's attacks, shared
from kvserve.sampling_params import ParamError, StructuredOutputs
from kvserve.server.tools import tool_choice_constraint
from kvserve.structured.compiler import GrammarCompiler, clean_message
from tests.unit.test_structured_compiler import tiny_tokenizer


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def refused(match: str, **kw) -> ParamError:
    with pytest.raises(ParamError, match=match) as e:
        StructuredOutputs(**kw)
    assert e.value.param == "structured_outputs"
    return e.value


@pytest.mark.parametrize("links", [sp.MAX_GRAMMAR_RULES, 4000])
def test_chain_grammars_past_the_rule_limit_are_refused(links):
    refused(
        f"grammar has {links + 1} rules; the limit is {sp.MAX_GRAMMAR_RULES}",
        grammar=chain_grammar(links),
    )  # start and `links` rules


def test_schema_limits_are_refused_with_the_limit():
    refused(f"json has 4000 \\$ref; the limit is {sp.MAX_SCHEMA_REFS}", json=defs_chain(4000))
    refused("json has 4000 \\$ref", json=json.dumps(defs_chain(4000)))
    refused(f"nests more than {sp.MAX_SCHEMA_DEPTH} levels", json=nested(300))
    deep_text = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    refused(
        f"json nests 10001 levels of objects and arrays; the limit is {sp.MAX_SCHEMA_DEPTH}",
        json=deep_text,
    )  # before json.loads could recurse
    big = {"type": "object", "description": "x" * (sp.MAX_CONSTRAINT_BYTES + 1)}
    refused(f"the limit is {sp.MAX_CONSTRAINT_BYTES}", json=big)


def test_grammar_regex_and_choice_limits():
    refused(
        f"grammar is .* bytes; the limit is {sp.MAX_CONSTRAINT_BYTES}",
        grammar='start: "a"\n// ' + "c" * sp.MAX_CONSTRAINT_BYTES,
    )
    refused(
        f"regex is .* bytes; the limit is {sp.MAX_REGEX_BYTES}",
        regex="a" * (sp.MAX_REGEX_BYTES + 1),
    )
    refused(
        f"choice has {sp.MAX_CHOICES + 1} strings; the limit is {sp.MAX_CHOICES}",
        choice=[str(i) for i in range(sp.MAX_CHOICES + 1)],
    )
    refused(
        "choice's strings are .* bytes together",
        choice=["y" * (sp.MAX_CONSTRAINT_BYTES // 2 + 1)] * 2,
    )
    refused("grammar nests", grammar="start: %json " + '{"items": ' * 200 + "{}" + "}" * 200)


def test_escaped_refs_count_as_refs():
    """A %json block of a grammar is JSON text: "\\u0024ref" is a "$ref" the limit counts."""
    escaped = json.dumps(defs_chain(4000)).replace('"$ref"', '"\\u0024r\\u0065f"')
    refused(
        f"grammar has 4000 \\$ref; the limit is {sp.MAX_SCHEMA_REFS}",
        grammar="start: %json " + escaped,
    )


def test_a_panic_raised_by_the_native_compiler_is_the_constraints_failure(monkeypatch):
    class PanicException(BaseException):  # the type pyo3 turns a Rust panic into
        pass

    def panics(*args, **kwargs):
        raise PanicException("assertion failed: x < y\nstack backtrace:\n   0: rust_begin_unwind")

    tok = tiny_tokenizer()
    gc = GrammarCompiler(tok, tok.vocab_size + 7)
    monkeypatch.setattr("kvserve.structured.compiler.llguidance.LLMatcher", panics)
    with pytest.raises(ParamError, match="does not compile: assertion failed: x < y$") as e:
        gc.compile(StructuredOutputs(grammar='start: "a"'), "response_format")
    assert e.value.param == "response_format" and "backtrace" not in str(e.value)


def test_limits_leave_ordinary_constraints_alone():
    StructuredOutputs(json=nested(40))
    StructuredOutputs(json=defs_chain(100))
    StructuredOutputs(grammar=chain_grammar(500))
    StructuredOutputs(choice=[str(i) for i in range(5000)])


def test_tool_parameters_past_the_limits_name_tools():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": defs_chain(4000)}},
            },
        }
    ]
    with pytest.raises(ParamError, match=r"tools\[0\].function.parameters has 4000 \$ref") as e:
        tool_choice_constraint(tools, "required")
    assert e.value.param == "tools"
    deep = [{"type": "function", "function": {"name": "f", "parameters": nested(300)}}]
    with pytest.raises(ParamError, match="nests more than") as e:
        tool_choice_constraint(deep, "auto")
    assert e.value.param == "tools"


def test_panic_backtraces_never_reach_a_message():
    raw = (
        "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
        "   0: <unknown>\n  16: type_call\n             at Objects/typeobject.c:1091:11\n"
    )
    message = clean_message(raw)
    assert "backtrace" not in message and "unknown" not in message and "typeobject" not in message
    assert message.startswith(
        "the grammar compiler cannot take it (make it smaller): assertion failed"
    )
    assert "panic" not in clean_message("stack backtrace:\n 0: x")


def test_a_deep_chain_compiles_on_the_pool_from_a_small_stack():
    """A caller on a 1 MiB stack compiles the longest chain the limits allow: the build runs on
    the compile pool's threads (in a subprocess: without them the process would die)."""
    code = textwrap.dedent(f"""
        import threading
        from kvserve.sampling_params import StructuredOutputs
        from kvserve.structured.compiler import GrammarCompiler
        from tests.unit.test_grammar_limits import chain_grammar, defs_chain
        from tests.unit.test_structured_compiler import tiny_tokenizer
        tok = tiny_tokenizer()
        gc = GrammarCompiler(tok, tok.vocab_size + 7)
        out = []
        def run():
            gc.compile(StructuredOutputs(grammar=chain_grammar({sp.MAX_GRAMMAR_RULES - 1})))
            gc.compile(StructuredOutputs(json=defs_chain({sp.MAX_SCHEMA_REFS})))
            out.append("compiled")
        threading.stack_size(1 << 20)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        print(*out)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "compiled"


def test_many_choices_are_one_terminal_and_match_to_the_end():
    tok = tiny_tokenizer()
    gc = GrammarCompiler(tok, tok.vocab_size + 7)
    choices = [f"option {i}" for i in range(5000)]
    matcher = gc.matcher(StructuredOutputs(choice=choices))
    for t in tok.encode("option 4321"):
        assert matcher.accept_token(t), matcher.error
    assert matcher.error is None and matcher.is_terminated()


def test_identical_compiles_at_once_compile_once_and_the_cache_is_bounded_in_bytes():
    tok = tiny_tokenizer()
    gc = GrammarCompiler(tok, tok.vocab_size + 7, cache_bytes=1 << 20)
    so = StructuredOutputs(grammar=chain_grammar(300))
    futures = [gc.compile_future(so) for _ in range(8)]
    assert len({id(f) for f in futures}) == 1
    futures[0].result(timeout=120)
    for i in range(40):  # each ~10 KB of text: far more than 1 MiB of estimated templates
        gc.compile(StructuredOutputs(grammar=f'start: "{i}"\n// ' + "c" * 10_000))
    info = gc.cache_info()
    assert 0 < info.bytes <= info.max_bytes == 1 << 20
    assert info.size < 40
