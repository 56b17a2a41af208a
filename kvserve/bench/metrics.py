"""Latency and throughput arithmetic for the benchmarks. Pure Python, no torch.

Conventions follow vLLM's benchmark_serving:
  TTFT  = first token time - request start
  e2e   = last token time - request start
  TPOT  = (e2e - TTFT) / (output_tokens - 1)    (undefined for one-token outputs)
  ITL   = gaps between successive streamed chunks
Percentiles interpolate linearly between order statistics, like numpy's default.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), numpy's 'linear' method. NaN for an empty list."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    """mean / median / p90 / p99 / min / max / n of a list (NaN when empty)."""
    n = len(values)
    return {
        "mean": sum(values) / n if n else math.nan,
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values) if n else math.nan,
        "max": max(values) if n else math.nan,
        "n": n,
    }


@dataclass
class RequestTiming:
    """One request as a client saw it. Times are seconds on one monotonic clock."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    output_tokens: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0  # what was asked for: the useful-token count
    ok: bool = True
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else math.nan

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start if self.chunk_times else math.nan

    @property
    def tpot(self) -> float:
        return tpot(self.e2e, self.ttft, self.output_tokens)

    @property
    def itl(self) -> list[float]:
        return itl(self.chunk_times)


def tpot(e2e: float, ttft: float, output_tokens: int) -> float:
    """Time per output token after the first; NaN when there is no second token."""
    if output_tokens < 2:
        return math.nan
    return (e2e - ttft) / (output_tokens - 1)


def itl(chunk_times: list[float]) -> list[float]:
    """Inter-token latencies: gaps between successive chunk arrivals."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")
SLO_KEYS = ("ttft", "tpot", "e2e", "itl")


def parse_duration(text: str) -> float:
    """'2s' -> 2.0, '100ms' -> 0.1, '0.5' -> 0.5 (seconds)."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"cannot read duration {text!r}: write it like 2s, 100ms or 0.5")
    value = float(m.group(1))
    return value / 1000 if m.group(2) == "ms" else value


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=2s,tpot=100ms,e2e=10s' -> {'ttft': 2.0, 'tpot': 0.1, 'e2e': 10.0}.

    'itl' bounds every inter-token gap of a request (its worst gap).
    """
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"bad SLO term {part!r}: expected one of {', '.join(SLO_KEYS)} as key=duration"
            )
        slo[key] = parse_duration(value)
    return slo


def meets_slo(t: RequestTiming, slo: dict[str, float]) -> bool:
    """A failed request never meets it; a one-token request has no TPOT/ITL to violate."""
    if not t.ok:
        return False
    checks = {
        "ttft": t.ttft,
        "e2e": t.e2e,
        "tpot": t.tpot if t.output_tokens >= 2 else 0.0,
        "itl": max(t.itl, default=0.0),
    }
    return all(checks[k] <= bound for k, bound in slo.items())


def goodput(
    timings: list[RequestTiming], slo: dict[str, float], duration: float
) -> dict[str, float]:
    """Share of requests meeting every SLO bound, and those requests per second."""
    good = sum(meets_slo(t, slo) for t in timings)
    return {
        "good_requests": good,
        "share": good / len(timings) if timings else math.nan,
        "rate": good / duration if duration > 0 else math.nan,
    }


def serve_report(
    timings: list[RequestTiming], duration: float, slo: dict[str, float] | None = None
) -> dict:
    """Everything `bench serve` prints for one run."""
    done = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in done)
    in_tokens = sum(t.prompt_tokens for t in done)
    report = {
        "num_requests": len(timings),
        "completed": len(done),
        "failed": len(timings) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else math.nan,
        "input_token_throughput": in_tokens / duration if duration > 0 else math.nan,
        "output_token_throughput": out_tokens / duration if duration > 0 else math.nan,
        "useful_output_token_throughput": sum(min(t.output_tokens, t.max_tokens) for t in done)
        / duration
        if duration > 0
        else math.nan,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_s": summarize([t.ttft for t in done]),
        "tpot_s": summarize([t.tpot for t in done if t.output_tokens >= 2]),
        "itl_s": summarize([gap for t in done for gap in t.itl]),
        "e2e_s": summarize([t.e2e for t in done]),
    }
    if slo:
        report["slo"] = slo
        report["goodput"] = goodput(timings, slo, duration)
    errors = sorted({t.error for t in timings if not t.ok})
    if errors:
        report["errors"] = errors[:5]
    return report


def throughput_report(
    num_requests: int, input_tokens: int, output_tokens: int, useful_tokens: int, elapsed: float
) -> dict:
    """Offline figures: requests/s, token rates, useful output tokens/s (sum of max_tokens /
    wall)."""
    return {
        "num_requests": num_requests,
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "input_tokens_per_s": input_tokens / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "useful_output_tokens_per_s": useful_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "useful_output_tokens": useful_tokens,
    }
