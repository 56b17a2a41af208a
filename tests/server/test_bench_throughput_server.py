"""`kvserve bench throughput --peer server`: the offline run and kvserve's own server started
with the same engine flags, on the same requests."""

import json

from kvserve.bench.cli import main as bench_main


def test_throughput_peer_server_runs_the_same_engine_behind_http(tmp_path):
    out = tmp_path / "tp.json"
    rc = bench_main(
        [
            "throughput",
            "--dataset",
            "random",
            "--num-prompts",
            "4",
            "--input-len",
            "8:24",
            "--output-len",
            "5",
            "--max-num-seqs",
            "4",
            "--peer",
            "server",
            "--no-progress",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    offline, server = res["runs"]
    assert (offline["engine"], server["engine"]) == ("kvserve", "server")
    flags = server["config"]["server_args"]
    assert flags[:2] == ["--max-num-seqs", "4"] and "--threads" in flags  # same engine, threads
    for run in (offline, server):
        assert run["metrics"]["total_output_tokens"] == 4 * 5  # exactly max_tokens each
