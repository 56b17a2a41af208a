"""The live dashboard: GET /dashboard (a static page and its canvas chart script, shipped in
kvserve/server/static/) and GET /dashboard/data (the JSON the page polls).

The figures come from the engine's Prometheus metrics (kvserve/engine/metrics.py), nothing else:
a recorder task on the event loop copies the ones the page shows into a `Snapshot` every
`interval_s` seconds, and turns each new snapshot, against the oldest one still inside the trailing
`window_s`, into one `point`: gauges as they are, counters as rates, histograms as p50/p99 of the
observations made inside the window (their bucket counts' increase, read as Prometheus'
histogram_quantile reads it). The last `history_s` seconds of points are kept in a ring; the data
endpoint hands them over as columns. Requests pay nothing for any of it: the engine records its
metrics as it always does, and a snapshot is a few dozen reads once a second.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import time
from collections import deque
from dataclasses import dataclass
from importlib.resources import files

from fastapi import FastAPI, Response

from kvserve.engine.metrics import EngineMetrics

PAGE_PATH = "/dashboard"
SCRIPT_PATH = "/dashboard/dashboard.js"
DATA_PATH = "/dashboard/data"

INTERVAL_S = 1.0  # one snapshot a second
WINDOW_S = 15.0  # rates and percentiles over the trailing 15 s
HISTORY_S = 300.0  # five minutes of points on the page

# the latency histograms shown, by the series-name prefix they get
LATENCY_HISTOGRAMS = {"ttft": "ttft", "tpot": "tpot"}  # EngineMetrics attribute -> series prefix
QUANTILES = {"p50": 0.5, "p99": 0.99}
# counters read into a snapshot: EngineMetrics attribute (a labelled child) -> snapshot key
COUNTERS = {
    "generation_tokens": "generation_tokens",
    "prompt_tokens": "prompt_tokens",
    "num_preemptions": "preemptions",
    "prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
    "spec_decode_num_drafts": "spec_drafts",
    "spec_decode_num_draft_tokens": "spec_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_accepted_tokens",
}
GAUGES = {
    "running": "running",
    "waiting": "waiting",
    "kv_usage": "kv_usage",
    "kv_blocks_total": "kv_blocks_total",
}


def histogram_quantile(
    q: float, upper_bounds: list[float], cumulative: list[float]
) -> float | None:
    """The q-quantile (0 <= q <= 1) of observations counted in a cumulative histogram, as
    Prometheus' histogram_quantile estimates it: find the bucket holding rank q * total and
    interpolate linearly inside it (the first bucket starts at 0). A rank in the +Inf bucket
    gives the highest finite bound. None when nothing was observed.

    `upper_bounds` ascend and end with +Inf; `cumulative[i]` counts observations
    <= upper_bounds[i]."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be between 0 and 1, got {q}")
    if len(upper_bounds) != len(cumulative):
        raise ValueError(
            f"{len(upper_bounds)} bucket bounds but {len(cumulative)} counts: "
            "give one count per bound"
        )
    if len(upper_bounds) < 2 or upper_bounds[-1] != math.inf:
        raise ValueError(
            "the buckets must end with a +Inf bucket and have at least one finite bound before it"
        )
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    # the first bucket whose cumulative count reaches the rank (for rank 0: the first non-empty one)
    b = bisect.bisect_left(cumulative, rank) if rank > 0 else bisect.bisect_right(cumulative, 0)
    if b == len(upper_bounds) - 1:
        return upper_bounds[-2]
    start = 0.0 if b == 0 else upper_bounds[b - 1]
    if b == 0 and upper_bounds[0] <= 0:
        return upper_bounds[0]
    below = 0.0 if b == 0 else cumulative[b - 1]
    return start + (upper_bounds[b] - start) * (rank - below) / (cumulative[b] - below)


@dataclass(frozen=True)
class Histogram:
    """One histogram's state: upper bounds (ending with +Inf) and cumulative counts."""

    upper_bounds: tuple[float, ...]
    cumulative: tuple[float, ...]

    def since(self, earlier: "Histogram") -> "Histogram | None":
        """The observations made after `earlier` (None when the counts went down: a reset)."""
        if earlier.upper_bounds != self.upper_bounds:
            raise ValueError("histograms with different buckets cannot be subtracted")
        delta = tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative))
        return None if any(d < 0 for d in delta) else Histogram(self.upper_bounds, delta)

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, list(self.upper_bounds), list(self.cumulative))


@dataclass(frozen=True)
class Snapshot:
    """The metrics the dashboard shows, at one moment (`t`: time.monotonic(), `wall`:
    time.time())."""

    t: float
    wall: float
    gauges: dict[str, float]
    counters: dict[str, float]
    histograms: dict[str, Histogram]


def read_histogram(child) -> Histogram:
    """A prometheus_client histogram child's buckets, from its public collect()."""
    bounds, counts = [], []
    for family in child.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                bounds.append(float(s.labels["le"]))
                counts.append(s.value)
    return Histogram(tuple(bounds), tuple(counts))


def read_value(child) -> float:
    """A counter's or gauge's current value, from its public collect()."""
    for family in child.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                return s.value
    raise ValueError(f"metric {child!r} has no sample")


def take_snapshot(
    metrics: EngineMetrics, t: float | None = None, wall: float | None = None
) -> Snapshot:
    finished = sum(read_value(c) for c in metrics.success.values())
    return Snapshot(
        t=time.monotonic() if t is None else t,
        wall=time.time() if wall is None else wall,
        gauges={key: read_value(getattr(metrics, attr)) for attr, key in GAUGES.items()},
        counters={
            **{key: read_value(getattr(metrics, attr)) for attr, key in COUNTERS.items()},
            "finished_requests": finished,
        },
        histograms={
            key: read_histogram(getattr(metrics, attr)) for attr, key in LATENCY_HISTOGRAMS.items()
        },
    )


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den or den <= 0 else num / den


def derive_point(new: Snapshot, old: Snapshot | None) -> dict[str, float | None]:
    """One point of the page's series: `new`'s gauges, and rates / percentiles / ratios of what
    happened between `old` and `new` (None where `old` is missing, nothing happened, or a counter
    went down)."""
    g = new.gauges
    point: dict[str, float | None] = {
        "time": new.wall,
        "running": g["running"],
        "waiting": g["waiting"],
        "kv_usage_pct": 100.0 * g["kv_usage"],
    }
    dt = None if old is None else new.t - old.t
    if dt is not None and dt <= 0:
        raise ValueError(
            f"snapshots out of order: the newer one is {-dt:.3f}s before the older one"
        )

    def delta(key: str) -> float | None:
        if old is None:
            return None
        d = new.counters[key] - old.counters[key]
        return None if d < 0 else d

    def per_s(key: str, scale: float = 1.0) -> float | None:
        d = delta(key)
        return None if d is None else scale * d / dt

    point["output_tokens_per_s"] = per_s("generation_tokens")
    point["prompt_tokens_per_s"] = per_s("prompt_tokens")
    point["finished_requests_per_s"] = per_s("finished_requests")
    point["preemptions_per_min"] = per_s("preemptions", 60.0)
    hits = _ratio(delta("prefix_hits"), delta("prefix_queries"))
    point["prefix_hit_rate_pct"] = None if hits is None else 100.0 * hits
    accepted = _ratio(delta("spec_accepted_tokens"), delta("spec_draft_tokens"))
    point["spec_acceptance_pct"] = None if accepted is None else 100.0 * accepted
    point["spec_accepted_per_draft"] = _ratio(delta("spec_accepted_tokens"), delta("spec_drafts"))
    for key, hist in new.histograms.items():
        recent = None if old is None else hist.since(old.histograms[key])
        for name, q in QUANTILES.items():
            point[f"{key}_{name}_s"] = None if recent is None else recent.quantile(q)
    return point


SERIES = (
    "time",
    "running",
    "waiting",
    "kv_usage_pct",
    "output_tokens_per_s",
    "prompt_tokens_per_s",
    "finished_requests_per_s",
    "preemptions_per_min",
    "prefix_hit_rate_pct",
    "spec_acceptance_pct",
    "spec_accepted_per_draft",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
)


class DashboardHistory:
    """The trailing window of snapshots and the ring of points derived from them."""

    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        window_s: float = WINDOW_S,
        history_s: float = HISTORY_S,
    ):
        for name, value in (
            ("interval_s", interval_s),
            ("window_s", window_s),
            ("history_s", history_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if window_s < interval_s:
            raise ValueError(
                f"window_s ({window_s}) must be at least interval_s ({interval_s}): "
                "a window needs two snapshots"
            )
        self.interval_s, self.window_s, self.history_s = interval_s, window_s, history_s
        self._window: deque[Snapshot] = deque()
        self.points: deque[dict] = deque(maxlen=max(1, math.ceil(history_s / interval_s)))
        self.latest: Snapshot | None = None

    def add(self, snap: Snapshot) -> dict:
        """Record a snapshot; returns the point derived from it."""
        while self._window and snap.t - self._window[0].t > self.window_s + 1e-9:
            self._window.popleft()
        point = derive_point(snap, self._window[0] if self._window else None)
        self._window.append(snap)
        self.points.append(point)
        self.latest = snap
        return point

    def columns(self) -> dict[str, list]:
        """The points as {series name: values, oldest first}."""
        return {name: [p[name] for p in self.points] for name in SERIES}


class DashboardRecorder:
    """Takes a snapshot of `metrics` every `history.interval_s` seconds while `run()` runs."""

    def __init__(self, metrics: EngineMetrics, history: DashboardHistory | None = None):
        self.metrics = metrics
        self.history = history or DashboardHistory()
        self.started = time.monotonic()

    def record(self) -> dict:
        return self.history.add(take_snapshot(self.metrics))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            self.record()
            next_at += self.history.interval_s
            now = loop.time()
            if next_at < now:  # the loop was held up: skip the missed ticks, do not burst
                next_at = now + self.history.interval_s
            await asyncio.sleep(next_at - now)

    def data(self, model_name: str, speculative: bool) -> dict:
        h = self.history
        latest = h.latest
        totals = (
            {}
            if latest is None
            else {
                "finished_requests": latest.counters["finished_requests"],
                "generation_tokens": latest.counters["generation_tokens"],
                "prompt_tokens": latest.counters["prompt_tokens"],
                "preemptions": latest.counters["preemptions"],
                "kv_blocks_total": latest.gauges["kv_blocks_total"],
            }
        )
        return {
            "model": model_name,
            "speculative": speculative,
            "interval_s": h.interval_s,
            "window_s": h.window_s,
            "history_s": h.history_s,
            "uptime_s": time.monotonic() - self.started,
            "totals": totals,
            "series": h.columns(),
        }


def static_file(name: str) -> bytes:
    return (files("kvserve.server") / "static" / name).read_bytes()


def install_dashboard(
    app: FastAPI,
    metrics: EngineMetrics,
    model_name: str,
    speculative: bool,
    history: DashboardHistory | None = None,
) -> DashboardRecorder:
    """Add the dashboard's routes to `app`, and its recorder to the app's lifespan (it runs while
    the server does)."""
    recorder = DashboardRecorder(metrics, history)
    page, script = static_file("dashboard.html"), static_file("dashboard.js")
    no_cache = {"Cache-Control": "no-cache"}

    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard_page():
        return Response(page, media_type="text/html; charset=utf-8", headers=no_cache)

    @app.get(SCRIPT_PATH, include_in_schema=False)
    async def dashboard_script():
        return Response(script, media_type="text/javascript; charset=utf-8", headers=no_cache)

    @app.get(DATA_PATH)
    async def dashboard_data():
        """The dashboard's time series (the last few minutes of the engine's metrics)."""
        # json.dumps directly: FastAPI's encoder is much slower over the few thousand numbers, on
        # the event loop
        return Response(
            json.dumps(recorder.data(model_name, speculative)), media_type="application/json"
        )

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        task = asyncio.create_task(recorder.run(), name="kvserve-dashboard-recorder")
        try:
            async with inner(a) as state:
                yield state
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.router.lifespan_context = lifespan
    return recorder
