"""`kvserve bench throughput --repeat`: rounds of kvserve and its peers, each engine's median round,
and the ratio of every round. No model: the runs are stand-ins."""

import argparse
from types import SimpleNamespace

import pytest

from kvserve.bench import throughput


def run(engine, tok_s, wall):
    return {"engine": engine, "metrics": {"useful_output_tokens_per_s": tok_s, "elapsed_s": wall}}


ROUNDS = [
    [run("kvserve", 250.0, 1), run("llamacpp", 100.0, 1)],
    [run("kvserve", 300.0, 2), run("llamacpp", 120.0, 2)],
    [run("kvserve", 200.0, 3), run("llamacpp", 110.0, 3)],
]


def test_each_engine_keeps_its_median_round_and_every_rounds_metrics():
    runs = throughput.median_runs(ROUNDS)
    assert [r["engine"] for r in runs] == ["kvserve", "llamacpp"]
    assert runs[0]["metrics"]["useful_output_tokens_per_s"] == 250.0  # of 200, 250, 300
    assert runs[1]["metrics"]["useful_output_tokens_per_s"] == 110.0  # of 100, 110, 120
    assert [m["elapsed_s"] for m in runs[0]["rounds"]] == [1, 2, 3]  # in round order
    # an even count takes the lower of the two middle rounds; one round adds no "rounds"
    assert throughput.median_runs(ROUNDS[:2])[0]["metrics"]["useful_output_tokens_per_s"] == 250.0
    assert "rounds" not in throughput.median_runs(ROUNDS[:1])[0]


def test_round_ratios_pair_each_round_with_itself():
    ratios = throughput.round_ratios(ROUNDS)
    assert ratios == {"llamacpp": pytest.approx([2.5, 2.5, 200 / 110])}
    assert (
        throughput.round_ratios([[run("llamacpp", 100.0, 1)]]) == {}
    )  # --only-peers: nothing to pair


@pytest.mark.parametrize("repeat", [0, -1, throughput.MAX_REPEAT + 1, 2**64])
def test_repeat_out_of_range_is_refused_before_anything_runs(repeat, capsys):
    args = SimpleNamespace(dataset="w2", peer=[], only_peers=False, repeat=repeat)
    assert throughput.main(args, []) == 2
    assert "--repeat must be between 1 and" in capsys.readouterr().err


def test_multiturn_refuses_repeat(capsys):
    args = SimpleNamespace(dataset="multiturn", peer=[], only_peers=False, turns=2, repeat=3)
    assert throughput.main(args, []) == 2
    assert "--repeat" in capsys.readouterr().err


def test_repeat_is_a_flag_of_throughput():
    p = argparse.ArgumentParser()
    throughput.add_args(p)
    assert p.parse_args(["--repeat", "3"]).repeat == 3 and p.parse_args([]).repeat == 1
