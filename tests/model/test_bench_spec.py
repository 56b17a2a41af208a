"""`kvserve bench spec` on the real model: both engines run every workload, their greedy tokens
agree (the command fails otherwise), and the copy-heavy prompt gets drafts accepted."""
import json

from kvserve.bench.cli import main


def test_bench_spec_runs_both_engines_and_reports_acceptance(default_gguf, tmp_path):
    out = tmp_path / "spec.json"
    rc = main(["spec", "--workloads", "copy-text,w1", "--repeat", "1", "--output-len", "32", "--threads", "1",
               "--kv-cache-memory", "64MiB", "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "spec"
    rows = {r["workload"]: r for r in res["runs"][0]["workloads"]}
    assert set(rows) == {"copy-text", "w1"}
    copy = rows["copy-text"]
    assert copy["num_accepted_tokens"] > 0 and 0 < copy["acceptance"] <= 1
    assert copy["plain_decode_tok_s"] > 0 and copy["spec_decode_tok_s"] > 0


def test_bench_spec_refuses_an_unknown_workload(default_gguf, capsys):
    assert main(["spec", "--workloads", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err
