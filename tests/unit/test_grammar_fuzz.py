"""A fuzz ring for the grammar compiler: random Lark and GBNF grammars, regexes and JSON schemas,
deep and wide, some past the limits. Each either compiles or raises ParamError whose message has
no Rust panic or backtrace; the process never dies (the ring runs in a subprocess, whose exit
status tells a crash from a failed assertion)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FUZZ = textwrap.dedent("""
    import json
    import string

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvserve.sampling_params import ParamError, StructuredOutputs
    from kvserve.structured.compiler import GrammarCompiler
    from tests.unit.test_structured_compiler import tiny_tokenizer

    tok = tiny_tokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size + 7)
    names = st.text(string.ascii_lowercase, min_size=1, max_size=6)
    literal = st.text(string.ascii_letters + string.digits + " {}[]\\\\\\"'|*+?()", max_size=8)
    scalar = st.sampled_from(
        [{"type": t} for t in ("string", "integer", "number", "boolean", "null")]
    )


    def schema(depth):
        leaf = scalar | st.builds(lambda v: {"enum": v}, st.lists(literal, min_size=1, max_size=5))
        if depth == 0:
            return leaf
        inner = schema(depth - 1)
        return leaf | st.builds(lambda p, r: {"type": "object", "properties": p, "required": r},
                                st.dictionaries(names, inner, max_size=4),
                                st.lists(names, max_size=2)) \\
            | st.builds(lambda i: {"type": "array", "items": i}, inner) \\
            | st.builds(lambda a: {"anyOf": a}, st.lists(inner, min_size=1, max_size=3)) \\
            | st.builds(lambda d: {"$defs": {"x": d}, "$ref": "#/$defs/x"}, inner)


    def nested_schema(levels):
        s = {"type": "string"}
        for _ in range(levels):
            s = {"type": "object", "properties": {"a": s}}
        return s


    def chain(n, gbnf):
        arrow = "::=" if gbnf else ":"
        rules = [f'r{i} {arrow} "a" r{i + 1}' for i in range(n - 1)] + [f'r{n - 1} {arrow} "a"']
        return "\\n".join([f"{'root' if gbnf else 'start'} {arrow} r0", *rules])


    def lark(rules):
        body = [f"start: {' '.join(n for n, _ in rules[:3]) or json.dumps('x')}"]
        body += [f"{n}: {json.dumps(v)} | {n} {json.dumps(v)}" for n, v in rules]
        return "\\n".join(body)


    constraint = st.one_of(
        st.builds(lambda s: StructuredOutputs(json=s), schema(4)),
        st.builds(lambda n: StructuredOutputs(json=nested_schema(n)), st.integers(1, 400)),
        st.builds(lambda n, g: StructuredOutputs(grammar=chain(n, g)),
                  st.integers(1, 3000), st.booleans()),
        st.builds(lambda r: StructuredOutputs(grammar=lark(r)),
                  st.lists(st.tuples(names, literal), max_size=8, unique_by=lambda t: t[0])),
        st.builds(lambda t: StructuredOutputs(grammar=t), st.text(min_size=1, max_size=200)),
        st.builds(lambda t: StructuredOutputs(regex=t), st.text(min_size=1, max_size=60)),
        st.builds(lambda c: StructuredOutputs(choice=c),
                  st.lists(literal, min_size=1, max_size=300)),
    )


    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        try:
            so = data.draw(constraint)
        except ParamError as e:
            assert "panic" not in str(e) and "backtrace" not in str(e), str(e)
            return
        try:
            compiler.matcher(so)
        except ParamError as e:
            assert "panic" not in str(e) and "backtrace" not in str(e), str(e)


    fuzz()
    print("survived")
""")


def test_grammar_fuzz_ring_never_crashes_the_process():
    proc = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.stdout.strip().endswith("survived")
