"""engine_flags (the engine's part of a command line, for a server a benchmark starts) and the
server's default thread count."""

import pytest

from kvserve.config import engine_flags
from kvserve.server import launcher


def test_engine_flags_keeps_engine_flags_with_their_values_in_order():
    argv = [
        "throughput",
        "--dataset",
        "w2",
        "--threads",
        "2",
        "--no-prefix-caching",
        "--repeat",
        "3",
        "--quantization=none",
        "--peer",
        "server",
        "--max-num-seqs",
        "16",
    ]
    assert engine_flags(argv) == [
        "--threads",
        "2",
        "--no-prefix-caching",
        "--quantization=none",
        "--max-num-seqs",
        "16",
    ]


def test_engine_flags_ignores_a_flag_inside_another_flags_value():
    argv = ["--llamacpp-args", "--threads 4", "--output", "x.json"]
    assert engine_flags(argv) == []


@pytest.mark.parametrize(
    ("cores", "ranks", "threads"), [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 7), (16, 2, 7)]
)
def test_serving_threads_keeps_a_core_only_on_big_machines(monkeypatch, cores, ranks, threads):
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert launcher.serving_threads(ranks) == threads
