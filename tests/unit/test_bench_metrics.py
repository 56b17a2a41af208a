"""Benchmark arithmetic against hand-computed values."""

import math

import pytest

from kvserve.bench.metrics import (
    RequestTiming,
    goodput,
    itl,
    meets_slo,
    parse_duration,
    parse_slo,
    percentile,
    serve_report,
    summarize,
    throughput_report,
    tpot,
)


def test_percentile_interpolates_like_numpy():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # between 2 and 3
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)  # pos 8.1
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert percentile([7], 99) == 7
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert s["mean"] == 4.0
    assert s["median"] == 2.5
    assert s["p90"] == pytest.approx(3 + 0.7 * 7)  # pos 2.7
    assert s["p99"] == pytest.approx(3 + 0.97 * 7)  # pos 2.97
    assert (s["min"], s["max"], s["n"]) == (1.0, 10.0, 4)
    assert math.isnan(summarize([])["mean"])


def test_request_timing_ttft_tpot_itl():
    t = RequestTiming(start=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1], output_tokens=4)
    assert t.ttft == pytest.approx(0.5)
    assert t.e2e == pytest.approx(1.1)
    assert t.tpot == pytest.approx(0.6 / 3)
    assert t.itl == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_counts_tokens_not_chunks():
    # 2 chunks carrying 5 tokens: TPOT spreads the decode time over the 4 later tokens
    assert tpot(e2e=1.0, ttft=0.2, output_tokens=5) == pytest.approx(0.2)
    assert math.isnan(tpot(e2e=1.0, ttft=1.0, output_tokens=1))
    assert itl([1.0]) == [] and itl([]) == []


def test_parse_slo_and_durations():
    assert parse_slo("ttft=2s,tpot=100ms,e2e=10s") == {"ttft": 2.0, "tpot": 0.1, "e2e": 10.0}
    assert parse_slo(" itl = 50ms ") == {"itl": 0.05}
    assert parse_duration("0.25") == 0.25
    for bad in ("ttft", "latency=1s", "ttft=fast"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_goodput_requires_every_bound():
    slo = parse_slo("ttft=1s,tpot=100ms")
    good = RequestTiming(0.0, [0.5, 0.55, 0.6], output_tokens=3)  # ttft .5, tpot .05
    slow_first = RequestTiming(0.0, [1.5, 1.55], output_tokens=2)  # ttft 1.5
    slow_decode = RequestTiming(0.0, [0.5, 0.7, 0.9], output_tokens=3)  # tpot .2
    failed = RequestTiming(0.0, [], ok=False, error="boom")
    one_token = RequestTiming(0.0, [0.9], output_tokens=1)  # no TPOT to break
    assert meets_slo(good, slo) and meets_slo(one_token, slo)
    assert not meets_slo(slow_first, slo) and not meets_slo(slow_decode, slo)
    assert not meets_slo(failed, slo)
    g = goodput([good, slow_first, slow_decode, failed, one_token], slo, duration=2.0)
    assert g == {"good_requests": 2, "share": 0.4, "rate": 1.0}


def test_itl_slo_bounds_the_worst_gap():
    t = RequestTiming(0.0, [0.1, 0.2, 0.9, 1.0], output_tokens=4)
    assert not meets_slo(t, {"itl": 0.5})  # one 0.7 s stall
    assert meets_slo(t, {"tpot": 0.5})  # though the mean gap is 0.3 s


def test_serve_report_totals():
    a = RequestTiming(0.0, [1.0, 2.0], output_tokens=2, prompt_tokens=10, max_tokens=2)
    b = RequestTiming(1.0, [1.5, 2.0, 2.5, 4.0], output_tokens=4, prompt_tokens=20, max_tokens=4)
    c = RequestTiming(2.0, [], ok=False, error="HTTP 500")
    r = serve_report([a, b, c], duration=4.0, slo={"e2e": 2.5})
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["request_throughput"] == 0.5
    assert r["output_token_throughput"] == 1.5 and r["input_token_throughput"] == 7.5
    assert r["ttft_s"]["mean"] == pytest.approx(0.75)  # 1.0 and 0.5
    assert r["e2e_s"]["median"] == pytest.approx(2.5)  # 2.0 and 3.0
    assert r["tpot_s"]["mean"] == pytest.approx((1.0 + 2.5 / 3) / 2)
    assert r["itl_s"]["n"] == 4  # 1 gap + 3 gaps
    assert r["goodput"]["good_requests"] == 1 and r["errors"] == ["HTTP 500"]


def test_throughput_report():
    r = throughput_report(
        num_requests=4, input_tokens=100, output_tokens=60, useful_tokens=50, elapsed=2.0
    )
    assert r["requests_per_s"] == 2.0
    assert r["output_tokens_per_s"] == 30.0 and r["useful_output_tokens_per_s"] == 25.0
    assert r["total_tokens_per_s"] == 80.0


# ---- workloads and the report page (pure parts of kvserve/bench) ----


def test_parse_range_and_random_workload_is_seeded():
    from kvserve.bench.datasets import parse_range, random_requests

    assert (
        parse_range("128") == (128, 128)
        and parse_range("16:256") == (16, 256)
        and parse_range(7) == (7, 7)
    )
    for bad in ("0", "9:3", "a"):
        with pytest.raises(ValueError):
            parse_range(bad)
    a = random_requests(20, "4:8", "2:3", seed=5, vocab_size=1000)
    assert a == random_requests(20, "4:8", "2:3", seed=5, vocab_size=1000)
    assert a != random_requests(20, "4:8", "2:3", seed=6, vocab_size=1000)
    assert all(4 <= len(r.prompt_ids) <= 8 and 2 <= r.max_tokens <= 3 for r in a)
    assert all(10 <= t < 1000 for r in a for t in r.prompt_ids)


def test_prefix_workload_shares_one_prompt_per_group():
    from kvserve.bench.datasets import prefix_requests

    reqs = prefix_requests(8, groups=2, prefix_len=100, question_len=10, output_len=5, seed=0)
    assert [len(r.prompt_ids) for r in reqs] == [110] * 8 and {r.max_tokens for r in reqs} == {5}
    assert reqs[0].prompt_ids[:100] == reqs[2].prompt_ids[:100] != reqs[1].prompt_ids[:100]
    assert len({tuple(r.prompt_ids[100:]) for r in reqs}) == 8


def test_report_page_shows_ratios(tmp_path):
    from kvserve.bench.report import build_page

    machine = {
        "cpu": "test cpu",
        "cores": 2,
        "simd": ["avx2"],
        "memory_gib": 8,
        "os": "linux",
        "python": "3.11",
    }

    def run(engine, tps):
        return {
            "engine": engine,
            "config": {},
            "metrics": throughput_report(4, 100, 80, 80, 80 / tps),
        }

    res = {
        "kind": "throughput",
        "command": "kvserve bench throughput --peer hf",
        "date": "2026-01-01",
        "machine": machine,
        "versions": {"kvserve": "0.1.0"},
        "load_avg_before": 0.1,
        "workload": {
            "dataset": "w2",
            "num_requests": 4,
            "prompt_tokens": 100,
            "max_tokens_total": 80,
        },
        "runs": [run("kvserve", 40.0), run("hf", 20.0)],
    }
    page = build_page([(tmp_path / "throughput-w2.json", res)], tmp_path)
    assert "## CPU: test cpu, 2 cores, avx2 build" in page
    assert "- `throughput-w2`: `kvserve bench throughput --peer hf`" in page
    assert "| 40.0 | transformers fp32 | 20.0 | 2.00x |" in page
    assert "[throughput-w2](bench-results/throughput-w2.json), 2026-01-01 |" in page


def test_report_page_keeps_the_newest_result_per_row(tmp_path):
    """Per machine class, kind, model, workload and peer only the newest result is shown; another
    machine class keeps its own table."""
    from kvserve.bench.report import build_page

    def res(date, tps, simd=("avx2",), cpu="test cpu"):
        return {
            "kind": "latency",
            "command": "kvserve bench latency --workload w1 --peer llamacpp --llamacpp-bin "
            "/opt/llama/build-avx2/bin/llama-server --repeat 3 --output x.json",
            "date": date,
            "machine": {"cpu": cpu, "cores": 2, "simd": list(simd)},
            "versions": {"kvserve_commit": "not-a-commit"},
            "workload": {"name": "w1", "prompt_tokens": 34, "output_tokens": 128},
            "runs": [
                {
                    "engine": engine,
                    "config": {},
                    "samples": [{}] * 3,
                    "summary": {"decode_tok_s": {"median": v}},
                }
                for engine, v in (("kvserve", tps), ("llamacpp", 50.0))
            ],
        }

    page = build_page(
        [
            (tmp_path / "old.json", res("2026-01-01T00:00:00", 100.0)),
            (tmp_path / "new.json", res("2026-01-02T00:00:00", 150.0)),
            (tmp_path / "vnni.json", res("2026-01-01T00:00:00", 80.0, ("avx512_vnni",))),
        ],
        tmp_path,
    )
    assert "old.json" not in page and "| 150.0 | llama.cpp (build-avx2) | 50.0 | 3.00x |" in page
    assert "## CPU: test cpu, 2 cores, avx512vnni build" in page and "| 1.60x |" in page
    assert "--llamacpp-bin LLAMA_SERVER --repeat 3`" in page and "x.json" not in page


def test_report_page_shows_prefill_beside_decode(tmp_path):
    """A latency result with prefill times gives a prefill row per peer, whose ratio is how many
    times faster kvserve's prefill is (lower time is better); one without them gives none."""
    from kvserve.bench.report import build_page

    def run(engine, tps, prefill):
        summary = {"decode_tok_s": {"median": tps}}
        if prefill is not None:
            summary["prefill_s"] = {"median": prefill}
        return {"engine": engine, "config": {}, "samples": [{}] * 3, "summary": summary}

    def res(name, prefills):
        return {
            "kind": "latency",
            "command": f"kvserve bench latency --workload w1 --peer llamacpp -o {name}.json",
            "date": "2026-01-01T00:00:00",
            "machine": {"cpu": f"cpu {name}", "cores": 2, "simd": ["avx2"]},
            "versions": {"kvserve_commit": "not-a-commit"},
            "workload": {"name": "w1", "prompt_tokens": 34, "output_tokens": 128},
            "runs": [run("kvserve", 30.0, prefills[0]), run("llamacpp", 15.0, prefills[1])],
        }

    page = build_page(
        [
            (tmp_path / "a.json", res("a", (0.2, 0.5))),
            (tmp_path / "b.json", res("b", (None, None))),
        ],
        tmp_path,
    )
    rows = [line for line in page.splitlines() if "prefill s" in line]
    assert len(rows) == 1 and "| 0.200 | llama.cpp" in rows[0] and "| 0.500 | 2.50x |" in rows[0]
    assert "| 30.0 | llama.cpp" in page and "| 15.0 | 2.00x |" in page


def test_the_standard_workloads_ship_in_the_package():
    """A fresh clone (or a wheel) runs `kvserve bench` on W1/W2 with no other checkout."""
    import json

    from kvserve.bench import common

    path = common.workloads_path()
    assert common.REPO_ROOT / "kvserve" in path.parents or "site-packages" in str(path)
    data = json.loads(path.read_text())
    assert {"w1", "w2"} <= set(data)


def test_standard_workloads_keep_the_default_models_ids():
    """W1/W2 for the default model are the file's ids; retokenizing them through the same
    vocabulary changes nothing."""
    from kvserve.bench.datasets import standard_requests
    from kvserve.model.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package is not installed")
    assert standard_requests("w2", None, path) == standard_requests("w2")


def test_llamacpp_peer_is_labelled_by_its_build(tmp_path):
    from kvserve.bench.report import peer_label
    from kvserve.bench.servers import llamacpp_build

    def build(flags: dict) -> str:
        root = tmp_path / "_".join(f"{k}{v}" for k, v in flags.items())
        (root / "bin").mkdir(parents=True)
        binary = root / "bin" / "llama-server"
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
        lines = [f"GGML_{k}:BOOL={v}" for k, v in flags.items()]
        (root / "CMakeCache.txt").write_text("\n".join(["CMAKE_BUILD_TYPE:STRING=Release", *lines]))
        return str(binary)

    assert llamacpp_build(build({"NATIVE": "ON", "AVX2": "OFF"})) == "native"
    assert llamacpp_build(build({"NATIVE": "OFF", "AVX2": "ON", "AVX512": "OFF"})) == "AVX2"
    assert llamacpp_build(build({"NATIVE": "OFF", "AVX512": "ON", "AVX2": "ON"})) == "AVX512"
    assert llamacpp_build(str(tmp_path / "missing")) is None
    run = {"engine": "llamacpp", "config": {"build": "AVX2"}}
    assert peer_label({"command": "kvserve bench latency"}, run) == "llama.cpp (AVX2 build)"
