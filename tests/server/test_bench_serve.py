"""`kvserve bench serve` end to end against the session's live server: a handful of requests."""

import json

from kvserve.bench.cli import main as bench_main


def _bench(server, auth, tmp_path, *extra):
    out = tmp_path / "serve.json"
    key = auth["Authorization"].split()[-1]
    rc = bench_main(
        [
            "serve",
            "--base-url",
            server,
            "--api-key",
            key,
            "--dataset",
            "random",
            "--num-prompts",
            "4",
            "--input-len",
            "8:24",
            "--output-len",
            "5",
            "--slo",
            "ttft=60s,tpot=10s",
            "--no-progress",
            "-o",
            str(out),
            *extra,
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_serve_measures_every_request(server, auth, tmp_path):
    res = _bench(server, auth, tmp_path, "--request-rate", "8", "--seed", "1")
    (run,) = res["runs"]
    (point,) = run["points"]
    m = point["metrics"]
    assert (m["completed"], m["failed"]) == (4, 0)
    assert m["total_output_tokens"] == 4 * 5  # ignore_eos: exactly max_tokens each
    assert m["total_input_tokens"] == res["workload"]["prompt_tokens"]
    assert 0 < m["ttft_s"]["median"] <= m["e2e_s"]["median"]
    assert m["tpot_s"]["n"] == 4 and m["tpot_s"]["mean"] > 0
    assert m["itl_s"]["n"] >= 4  # at least one gap per request
    assert m["goodput"]["good_requests"] == 4  # a generous SLO
    assert res["command"].startswith("kvserve bench serve")


def test_bench_serve_concurrency_sweep_plots(server, auth, tmp_path):
    plot = tmp_path / "sweep.png"
    res = _bench(server, auth, tmp_path, "--sweep-concurrency", "1,4", "--plot", str(plot))
    points = res["runs"][0]["points"]
    assert [p["max_concurrency"] for p in points] == [1, 4]
    assert all(p["metrics"]["completed"] == 4 for p in points)
    assert plot.stat().st_size > 1000 and res["sweep"] == "max_concurrency"
