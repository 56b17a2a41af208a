"""`kvserve bench spec` on the real model: both engines run every workload, their greedy tokens
agree (the command fails otherwise), and the copy-heavy prompt gets drafts accepted. A copy-heavy
answer runs to its end of sequence; w1 is the standard request, exactly its 128 tokens."""

import json

from kvserve.bench.cli import main


def test_bench_spec_runs_both_engines_and_reports_acceptance(default_gguf, tmp_path):
    out = tmp_path / "spec.json"
    rc = main(
        [
            "spec",
            "--workloads",
            "copy-text,w1",
            "--repeat",
            "1",
            "--output-len",
            "400",
            "--threads",
            "1",
            "--kv-cache-memory",
            "64MiB",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "spec"
    rows = {r["workload"]: r for r in res["runs"][0]["workloads"]}
    assert set(rows) == {"copy-text", "w1"}
    copy = rows["copy-text"]
    assert copy["num_accepted_tokens"] > 0 and 0 < copy["acceptance"] <= 1
    assert copy["plain_decode_tok_s"] > 0 and copy["spec_decode_tok_s"] > 0
    assert 32 < copy["output_tokens"] < 400  # the notice, repeated, then end of sequence
    assert rows["w1"]["output_tokens"] == 128


def test_bench_spec_refuses_an_unknown_workload(default_gguf, capsys):
    assert main(["spec", "--workloads", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_bench_spec_needs_llama_servers_binary_for_the_peer(default_gguf, capsys):
    assert main(["spec", "--peer", "llamacpp"]) == 2
    assert "--llamacpp-bin" in capsys.readouterr().err
    assert main(["spec", "--peer", "hf"]) == 2
    assert "llama.cpp only" in capsys.readouterr().err


def test_the_peer_table_sets_both_engines_side_by_side():
    from kvserve.bench.spec import PEER_HEADERS, peer_table

    ours = {"workloads": [{"workload": "w1", "spec_decode_tok_s": 300.0, "speedup": 1.5}]}
    peer = {"workloads": [{"workload": "w1", "spec_decode_tok_s": 100.0, "speedup": 1.25}]}
    assert peer_table([ours, peer]) == [["w1", "300.0", "x1.50", "100.0", "x1.25", "x3.00"]]
    assert len(PEER_HEADERS) == 6


def test_only_the_speculative_engine_speculates_whatever_the_flags():
    """--speculative-config names the speculative engine's method: the plain engine never drafts."""
    import argparse

    from kvserve.bench.spec import add_args, engine_configs

    p = argparse.ArgumentParser()
    add_args(p)
    spec_json = '{"method": "self_speculative", "draft_layers": 24}'
    plain, spec = engine_configs(p.parse_args(["--speculative-config", spec_json]), spec_json)
    assert plain.speculative is None and spec.speculative.method == "self_speculative"
    assert not plain.cache.enable_prefix_caching and not spec.cache.enable_prefix_caching
