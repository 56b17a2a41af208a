"""Prometheus metrics of the serving engine, named like vLLM's (`kvserve:` instead of `vllm:`),
so dashboards built for vLLM port over by renaming the prefix.

Everything lives in one registry owned by an `EngineMetrics` object (no global state: tests and
several engines in one process do not collide). The engine thread records; /metrics renders.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from kvserve.outputs import RequestMetrics

disable_created_metrics()  # no `*_created` series: dashboards do not read them (as vLLM)

# Bucket edges follow vLLM's, so percentiles line up with its dashboards.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TOKEN_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]

FINISH_REASONS = ("stop", "length", "abort")
# vLLM's buckets for token counts (per request, per step): 1, 2, 5, 10, 20, 50, ... up to 1M
COUNT_BUCKETS = [m * 10**e for e in range(7) for m in (1, 2, 5)][:-2]

# core.stats() counter key -> our counter attribute (the core counts; we publish the increase)
_COUNTER_STATS = {
    "prompt_tokens_total": "prompt_tokens",
    "generation_tokens_total": "generation_tokens",
    "num_preemptions": "num_preemptions",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "structured_mask_seconds": "structured_mask_seconds",
    "structured_masks": "structured_masks",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_decode_draft_seconds": "spec_decode_draft_seconds",
    "spec_decode_verify_seconds": "spec_decode_verify_seconds",
}
# core.stats() key of the accepted drafts by draft position (a list: [j] counts position j)
_PER_POSITION_STAT = "spec_decode_num_accepted_tokens_per_pos"


class EngineMetrics:
    """Every metric kvserve exports. Thread-safe (prometheus-client locks internally)."""

    def __init__(self, model_name: str):
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self._model_name = model_name
        ProcessCollector(registry=reg)  # process_cpu_seconds_total, process_resident_memory_bytes
        PlatformCollector(registry=reg)
        # Registration order is the order of /metrics.
        self._init_latency_histograms()
        self._init_token_counters()
        self._init_spec_decode_counters()
        self._init_request_states()
        self._last_stats: dict[str, float] = {}

    def _hist(self, name: str, doc: str, buckets: list[float]):
        return Histogram(
            f"kvserve:{name}", doc, ["model_name"], registry=self.registry, buckets=buckets
        ).labels(self._model_name)

    def _counter(self, name: str, doc: str):
        return Counter(f"kvserve:{name}", doc, ["model_name"], registry=self.registry).labels(
            self._model_name
        )

    def _gauge(self, name: str, doc: str):
        return Gauge(f"kvserve:{name}", doc, ["model_name"], registry=self.registry).labels(
            self._model_name
        )

    def _init_latency_histograms(self) -> None:
        hist = self._hist
        self.ttft = hist(
            "time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS
        )
        self.tpot_token = hist(
            "time_per_output_token_seconds",
            "Time between consecutive token deliveries of a request (vLLM's older name "
            "of inter_token_latency_seconds; dashboards read it).",
            TOKEN_BUCKETS,
        )
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt tokens, per finished request.", COUNT_BUCKETS
        )
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Generated tokens, per finished request.", COUNT_BUCKETS
        )
        self.iteration_tokens = hist(
            "iteration_tokens_total", "Tokens scheduled in one engine step.", COUNT_BUCKETS
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between consecutive token deliveries of a request.",
            TOKEN_BUCKETS,
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TOKEN_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "Arrival to finish, per request.", REQUEST_BUCKETS
        )
        self.queue = hist(
            "request_queue_time_seconds",
            "Arrival to first scheduled, per request.",
            REQUEST_BUCKETS,
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "First scheduled to first token, per request.",
            REQUEST_BUCKETS,
        )
        self.decode = hist(
            "request_decode_time_seconds",
            "First token to last token, per request.",
            REQUEST_BUCKETS,
        )

    def _init_token_counters(self) -> None:
        counter = self._counter
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (by recompute).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens served by the prefix cache."
        )
        self.structured_mask_seconds = counter(
            "structured_mask_seconds",
            "Time spent filling grammar token masks (on a worker thread).",
        )
        self.structured_masks = counter(
            "structured_masks", "Grammar token masks filled (one per constrained token)."
        )

    def _init_spec_decode_counters(self) -> None:
        counter = self._counter
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts",
            "Speculative verifications (steps of a request with draft tokens).",
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_decode_draft_seconds = counter(
            "spec_decode_draft_seconds", "Time spent proposing draft tokens."
        )
        self.spec_decode_verify_seconds = counter(
            "spec_decode_verify_seconds", "Time of the model steps that verified draft tokens."
        )
        self._accepted_per_pos = Counter(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            ["model_name", "position"],
            registry=self.registry,
        )

    def _init_request_states(self) -> None:
        """Finished requests by reason, the scheduler's and KV pool's gauges, engine failures."""
        success = Counter(
            "kvserve:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.success = {r: success.labels(self._model_name, r) for r in FINISH_REASONS}
        gauge = self._gauge
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.kv_blocks_used = gauge(
            "kv_cache_blocks_used",
            "KV cache blocks referenced by requests (cached free blocks not counted).",
        )
        self.kv_blocks_total = gauge("kv_cache_blocks_total", "KV cache blocks in the pool.")
        self.engine_restarts = self._counter(
            "engine_restarts", "Times the engine loop died and was restarted."
        )
        self.failed_requests = self._counter(
            "request_failures",
            "Requests failed alone by the engine (a step raised because of them).",
        )

    def record_finished(
        self, m: RequestMetrics | None, finish_reason: str | None, prompt_tokens: int | None = None
    ) -> None:
        """One finished request (all its samples done)."""
        reason = finish_reason if finish_reason in self.success else "abort"
        self.success[reason].inc()
        if m is None or reason == "abort":
            return
        if prompt_tokens is not None:
            self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(m.num_generation_tokens)
        for hist, value in (
            (self.ttft, m.ttft),
            (self.tpot, m.tpot),
            (self.e2e, m.e2e),
            (self.queue, m.queue_time),
            (self.prefill, m.prefill_time),
            (self.decode, m.decode_time),
        ):
            if value is not None:
                hist.observe(max(0.0, value))

    def record_stats(self, stats: dict) -> None:
        """A fresh core.stats(): set the gauges, add the counters' increase since the last call."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        self.kv_blocks_used.set(stats.get("kv_blocks_used", 0))
        self.kv_blocks_total.set(stats.get("kv_blocks_total", 0))
        for key, attr in _COUNTER_STATS.items():
            if key not in stats:
                continue
            delta = stats[key] - self._last_stats.get(key, 0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_stats[key] = stats[key]
        for pos, count in enumerate(stats.get(_PER_POSITION_STAT, ())):
            key = f"{_PER_POSITION_STAT}[{pos}]"
            series = self._accepted_per_pos.labels(
                self._model_name, str(pos)
            )  # exists (at 0) from now on
            delta = count - self._last_stats.get(key, 0)
            if delta > 0:
                series.inc(delta)
            self._last_stats[key] = count

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
