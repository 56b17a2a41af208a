"""The dashboard's maths: histogram quantiles from bucket counts, rates and ratios over a
trailing window of snapshots, the ring of points. No model, no server."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.engine.metrics import EngineMetrics
from kvserve.server.dashboard import (
    SERIES,
    DashboardHistory,
    DashboardRecorder,
    Histogram,
    Snapshot,
    derive_point,
    histogram_quantile,
    take_snapshot,
)

INF = math.inf


# ---- histogram_quantile ---------------------------------------------------------------------


def test_quantile_interpolates_inside_the_bucket():
    # 10 observations in (0, 1], 10 in (1, 2]: the median is the top of the first bucket,
    # p75 halfway through the second, p10 a tenth... of 20 -> rank 2 of 10 in (0, 1] -> 0.2
    bounds, counts = [1.0, 2.0, INF], [10, 20, 20]
    assert histogram_quantile(0.5, bounds, counts) == pytest.approx(1.0)
    assert histogram_quantile(0.75, bounds, counts) == pytest.approx(1.5)
    assert histogram_quantile(0.1, bounds, counts) == pytest.approx(0.2)
    assert histogram_quantile(1.0, bounds, counts) == pytest.approx(2.0)


def test_quantile_skips_empty_buckets_and_starts_at_the_previous_bound():
    # 4 observations, all in (0.5, 1.0]: p50 = 0.5 + 0.5 * 2/4
    bounds, counts = [0.1, 0.5, 1.0, INF], [0, 0, 4, 4]
    assert histogram_quantile(0.5, bounds, counts) == pytest.approx(0.75)
    assert histogram_quantile(0.0, bounds, counts) == pytest.approx(
        0.5
    )  # the first non-empty bucket's start


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    bounds, counts = [1.0, 2.0, INF], [1, 1, 100]
    assert histogram_quantile(0.99, bounds, counts) == 2.0


def test_quantile_of_nothing_is_none():
    assert histogram_quantile(0.5, [1.0, INF], [0, 0]) is None


@pytest.mark.parametrize("q", [-0.1, 1.5])
def test_quantile_outside_0_1_is_a_value_error(q):
    with pytest.raises(ValueError, match="between 0 and 1"):
        histogram_quantile(q, [1.0, INF], [1, 1])


def test_quantile_needs_an_inf_bucket_and_matching_counts():
    with pytest.raises(ValueError, match=r"\+Inf"):
        histogram_quantile(0.5, [1.0, 2.0], [1, 2])
    with pytest.raises(ValueError, match="one count per bound"):
        histogram_quantile(0.5, [1.0, INF], [1])


@given(
    st.lists(st.floats(0.0, 30.0, allow_nan=False), min_size=1, max_size=200), st.floats(0.0, 1.0)
)
def test_quantile_lands_in_the_bucket_of_the_true_quantile(values, q):
    """Whatever the data, the estimate lies within the bucket holding the rank-th observation."""
    bounds = [0.5, 1.0, 2.0, 5.0, 10.0, INF]
    counts = [sum(v <= b for v in values) for b in bounds]
    est = histogram_quantile(q, bounds, counts)
    rank = q * len(values)
    b = next(
        i for i, c in enumerate(counts) if c >= rank and c > 0
    )  # rank 0: the lowest observation's bucket
    lo = 0.0 if b == 0 else bounds[b - 1]
    hi = bounds[b] if b < len(bounds) - 1 else bounds[-2]
    assert lo - 1e-9 <= est <= hi + 1e-9


def test_histogram_since_subtracts_and_sees_resets():
    before = Histogram((1.0, INF), (3, 5))
    after = Histogram((1.0, INF), (4, 9))
    assert after.since(before) == Histogram((1.0, INF), (1, 4))
    assert before.since(after) is None
    with pytest.raises(ValueError, match="different buckets"):
        after.since(Histogram((2.0, INF), (0, 0)))


# ---- derive_point ---------------------------------------------------------------------------


def snap(
    t,
    *,
    running=0,
    waiting=0,
    kv=0.0,
    gen=0,
    prompt=0,
    finished=0,
    preempt=0,
    queries=0,
    hits=0,
    drafts=0,
    draft_tokens=0,
    accepted=0,
    ttft=(0, 0, 0),
    tpot=(0, 0, 0),
) -> Snapshot:
    bounds = (0.1, 1.0, INF)
    return Snapshot(
        t=t,
        wall=1000.0 + t,
        gauges={"running": running, "waiting": waiting, "kv_usage": kv, "kv_blocks_total": 64},
        counters={
            "generation_tokens": gen,
            "prompt_tokens": prompt,
            "finished_requests": finished,
            "preemptions": preempt,
            "prefix_queries": queries,
            "prefix_hits": hits,
            "spec_drafts": drafts,
            "spec_draft_tokens": draft_tokens,
            "spec_accepted_tokens": accepted,
        },
        histograms={"ttft": Histogram(bounds, ttft), "tpot": Histogram(bounds, tpot)},
    )


def test_point_rates_ratios_and_percentiles_over_the_window():
    old = snap(
        10.0,
        gen=100,
        prompt=50,
        finished=1,
        preempt=1,
        queries=100,
        hits=10,
        drafts=5,
        draft_tokens=20,
        accepted=10,
        ttft=(2, 2, 2),
        tpot=(1, 1, 1),
    )
    new = snap(
        20.0,
        running=3,
        waiting=2,
        kv=0.25,
        gen=600,
        prompt=250,
        finished=5,
        preempt=2,
        queries=300,
        hits=60,
        drafts=15,
        draft_tokens=60,
        accepted=40,
        ttft=(2, 6, 6),
        tpot=(5, 9, 9),
    )
    p = derive_point(new, old)
    assert (p["time"], p["running"], p["waiting"], p["kv_usage_pct"]) == (1020.0, 3, 2, 25.0)
    assert p["output_tokens_per_s"] == pytest.approx(50.0)  # 500 tokens in 10 s
    assert p["prompt_tokens_per_s"] == pytest.approx(20.0)
    assert p["finished_requests_per_s"] == pytest.approx(0.4)
    assert p["preemptions_per_min"] == pytest.approx(6.0)  # 1 in 10 s
    assert p["prefix_hit_rate_pct"] == pytest.approx(25.0)  # 50 of 200 looked-up tokens
    assert p["spec_acceptance_pct"] == pytest.approx(75.0)  # 30 of 40 drafts
    assert p["spec_accepted_per_draft"] == pytest.approx(3.0)  # 30 accepted in 10 verifications
    # the window saw 4 TTFTs, all in (0.1, 1.0]: p50 = 0.1 + 0.9 * 2/4
    assert p["ttft_p50_s"] == pytest.approx(0.55)
    assert p["ttft_p99_s"] == pytest.approx(0.1 + 0.9 * 3.96 / 4)
    # 4 TPOTs in (0, 0.1], 4 in (0.1, 1.0]: p50 = 0.1, p99 = 0.1 + 0.9 * (7.92 - 4) / 4
    assert p["tpot_p50_s"] == pytest.approx(0.1)
    assert p["tpot_p99_s"] == pytest.approx(0.1 + 0.9 * 3.92 / 4)
    assert set(p) == set(SERIES)


def test_point_without_activity_has_gaps_not_zeros_where_nothing_is_defined():
    old, new = snap(0.0, gen=7), snap(1.0, gen=7)
    p = derive_point(new, old)
    assert p["output_tokens_per_s"] == 0.0
    for key in (
        "prefix_hit_rate_pct",
        "spec_acceptance_pct",
        "spec_accepted_per_draft",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
    ):
        assert p[key] is None, key


def test_first_point_has_only_gauges():
    p = derive_point(snap(0.0, running=1, gen=5), None)
    assert p["running"] == 1
    assert p["output_tokens_per_s"] is None and p["ttft_p50_s"] is None


def test_counter_going_down_is_a_gap_and_snapshots_out_of_order_are_refused():
    assert derive_point(snap(1.0, gen=5), snap(0.0, gen=9))["output_tokens_per_s"] is None
    with pytest.raises(ValueError, match="out of order"):
        derive_point(snap(0.0), snap(1.0))


# ---- DashboardHistory -----------------------------------------------------------------------


def test_history_measures_over_the_trailing_window_only():
    h = DashboardHistory(interval_s=1.0, window_s=3.0, history_s=5.0)
    # 10 tokens a second for 4 s, then 100 a second
    gen = 0
    for t in range(10):
        gen += 10 if t <= 4 else 100
        p = h.add(snap(float(t), gen=gen))
    # the last point compares t=9 with t=6: 300 tokens in 3 s
    assert p["output_tokens_per_s"] == pytest.approx(100.0)
    cols = h.columns()
    assert len(cols["time"]) == 5  # history_s / interval_s points kept
    assert cols["time"] == [1005.0, 1006.0, 1007.0, 1008.0, 1009.0]
    # t=5 against t=2: 10 + 10 + 100 = 120 tokens in 3 s -> 40/s
    assert cols["output_tokens_per_s"][0] == pytest.approx(40.0)


def test_history_after_a_stall_uses_what_remains_in_the_window():
    h = DashboardHistory(interval_s=1.0, window_s=3.0, history_s=10.0)
    h.add(snap(0.0, gen=0))
    assert h.add(snap(10.0, gen=100))["output_tokens_per_s"] is None  # nothing within 3 s before
    assert h.add(snap(11.0, gen=150))["output_tokens_per_s"] == pytest.approx(50.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"interval_s": 0}, "interval_s"),
        ({"history_s": -1}, "history_s"),
        ({"interval_s": 2.0, "window_s": 1.0}, "at least interval_s"),
    ],
)
def test_history_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DashboardHistory(**kwargs)


# ---- reading the engine's real metrics ------------------------------------------------------


def test_snapshot_reads_the_engine_metrics():
    m = EngineMetrics("tiny")
    m.record_stats(
        {
            "num_running": 2,
            "num_waiting": 1,
            "kv_cache_usage": 0.5,
            "kv_blocks_total": 64,
            "generation_tokens_total": 40,
            "prompt_tokens_total": 12,
            "num_preemptions": 1,
            "prefix_cache_queries": 12,
            "prefix_cache_hits": 4,
        }
    )
    m.ttft.observe(0.03)
    m.success["stop"].inc()
    m.success["length"].inc(2)
    s = take_snapshot(m, t=5.0, wall=6.0)
    assert s.gauges == {"running": 2, "waiting": 1, "kv_usage": 0.5, "kv_blocks_total": 64}
    assert s.counters["generation_tokens"] == 40 and s.counters["prefix_hits"] == 4
    assert s.counters["finished_requests"] == 3 and s.counters["preemptions"] == 1
    ttft = s.histograms["ttft"]
    assert ttft.upper_bounds[-1] == INF and ttft.cumulative[-1] == 1
    assert ttft.quantile(0.5) == pytest.approx(0.03)  # alone in (0.02, 0.04]: its middle


def test_recorder_runs_on_the_loop_and_serves_columns():
    m = EngineMetrics("tiny")
    rec = DashboardRecorder(m, DashboardHistory(interval_s=0.02, window_s=0.1, history_s=1.0))

    async def main():
        task = asyncio.create_task(rec.run())
        await asyncio.sleep(0.05)
        m.record_stats({"generation_tokens_total": 500})
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    data = rec.data("tiny", speculative=False)
    assert data["model"] == "tiny" and data["speculative"] is False
    tps = [v for v in data["series"]["output_tokens_per_s"] if v is not None]
    assert (
        len(data["series"]["time"]) >= 4
        and max(tps) > 0
        and data["totals"]["generation_tokens"] == 500
    )
