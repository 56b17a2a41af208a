"""`kvserve tune`: the engine configuration with the highest goodput for a workload and an SLO.

Each trial starts a real `kvserve serve` with one configuration, sends it the workload (the same
requests, the same seeded Poisson arrivals at --request-rate, --max-concurrency in flight) and
scores it by goodput: requests per second that met every SLO target (`--slo ttft=1s,tpot=100ms`),
ties broken by output tokens/s. The search is coordinate descent from the defaults: knob by knob,
in a fixed order, every value of the knob is tried with the others at their best so far, and the
best value stays; `--passes 2` goes round twice. A configuration is never run twice. The order,
the values and the workload are fixed by the flags and --seed; the figures are measured, so two
runs agree as far as the machine's timing does.

Prints the table of trials and the winner, writes the winner as a YAML file of `kvserve serve`
flags (`kvserve serve --config tuned.yaml` loads it) and plots goodput per trial.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.bench import common
from kvserve.bench.datasets import BenchRequest, add_dataset_args, load_requests
from kvserve.bench.metrics import parse_slo, serve_report
from kvserve.config import SchedulerConfig

NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)


def _threads_values() -> list[str]:
    n = len(os.sched_getaffinity(0))
    vals = sorted({1, n} | {2**i for i in range(1, 8) if 2**i < n})
    return [str(v) for v in vals]


def _default_first(default: int, values: list[int]) -> list[str]:
    return [str(default)] + [str(v) for v in values if v != default]


# knob (a `kvserve serve` flag) -> the values tried, the engine's default first where it is one.
def knob_values() -> dict[str, list[str]]:
    return {
        "max-num-seqs": _default_first(SchedulerConfig.max_num_seqs, [4, 8, 16, 32, 64]),
        "max-num-batched-tokens": _default_first(
            SchedulerConfig.max_num_batched_tokens, [128, 256, 512, 1024, 2048]
        ),
        "threads": _threads_values(),
        "kv-cache-dtype": ["auto", "int8"],
        "speculative-config": ["none", NGRAM],
    }


@dataclass
class Trial:
    config: dict[str, str]
    goodput: float = math.nan  # requests/s meeting the SLO
    good_share: float = math.nan
    tokens_per_s: float = math.nan
    ttft_p99: float = math.nan
    tpot_p99: float = math.nan
    failed: int = 0
    error: str | None = None
    metrics: dict = field(default_factory=dict, repr=False)

    def key(self) -> tuple:
        """Higher is better: goodput, then output tokens/s; a failed trial is last."""
        if self.error is not None:
            return (-math.inf, -math.inf)
        return (_num(self.goodput), _num(self.tokens_per_s))


def _num(x: float) -> float:
    return -math.inf if x is None or math.isnan(x) else x


def server_flags(config: dict[str, str]) -> list[str]:
    out = []
    for k, v in config.items():
        if k == "speculative-config" and v == "none":
            continue
        out += [f"--{k}", v]
    return out


def coordinate_descent(
    knobs: dict[str, list[str]],
    run,
    passes: int = 1,
    max_trials: int | None = None,
    start: dict[str, str] | None = None,
) -> tuple[Trial, list[Trial]]:
    """Search `knobs` by coordinate descent; `run(config) -> Trial`. Returns (best, every trial
    in order)."""
    best_config = dict(start or {k: vals[0] for k, vals in knobs.items()})
    seen: dict[tuple, Trial] = {}
    trials: list[Trial] = []

    def trial(config: dict[str, str]) -> Trial | None:
        key = tuple(sorted(config.items()))
        if key not in seen:
            if max_trials is not None and len(trials) >= max_trials:
                return None
            seen[key] = run(dict(config))
            trials.append(seen[key])
        return seen[key]

    best = trial(best_config)
    for _ in range(passes):
        for knob, vals in knobs.items():
            for v in vals:
                t = trial({**best_config, knob: v})
                if t is None:
                    return best, trials
                if t.key() > best.key():
                    best, best_config = t, dict(t.config)
    return best, trials


def add_args(p: argparse.ArgumentParser) -> None:
    add_dataset_args(p, default_num=32)
    g = p.add_argument_group("tuning")
    g.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)"
    )
    g.add_argument(
        "--slo",
        default="ttft=2s,tpot=100ms",
        help="targets every good request meets: ttft, tpot, e2e (default: %(default)s)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate, requests/s; inf sends all at once (default: %(default)s)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: no cap)",
    )
    g.add_argument(
        "--knobs",
        default=",".join(knob_values()),
        help="comma list of knobs to search, in order (default: %(default)s)",
    )
    g.add_argument(
        "--passes", type=int, default=1, help="rounds over the knobs (default: %(default)s)"
    )
    g.add_argument(
        "--max-trials",
        type=int,
        default=None,
        help="stop after this many server runs (default: no cap)",
    )
    g.add_argument(
        "--server-args", default="", help="fixed extra `kvserve serve` flags for every trial"
    )
    g.add_argument(
        "--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)"
    )
    g.add_argument(
        "--output", default="tuned.yaml", help="the winning flags, YAML (default: %(default)s)"
    )
    g.add_argument("--results", default=None, help="every trial's figures, JSON (default: none)")
    g.add_argument("--plot", default=None, help="goodput per trial, PNG (default: beside --output)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def _measure(url: str, reqs: list[BenchRequest], args, slo: dict) -> dict:
    from kvserve.bench.loadgen import run_load, served_model

    model = served_model(url)
    warm = [BenchRequest(r.prompt_ids[:8], 4) for r in reqs[:1]]
    asyncio.run(run_load(url, warm, model, progress=False))
    timings, duration = asyncio.run(
        run_load(
            url,
            reqs,
            model,
            rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            progress=not args.no_progress,
        )
    )
    return serve_report(timings, duration, slo)


def run_trial(config: dict[str, str], reqs: list[BenchRequest], args, slo: dict) -> Trial:
    from kvserve.bench.servers import kvserve_server

    flags = shlex.split(args.server_args) + server_flags(config)
    print(f"trial: {' '.join(flags) or '(defaults)'}", file=sys.stderr)
    t = Trial(config)
    try:
        with kvserve_server(args.model, flags) as url:
            m = _measure(url, reqs, args, slo)
    except (RuntimeError, OSError) as e:  # the server did not start with these flags
        t.error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        print(f"  failed: {t.error}", file=sys.stderr)
        return t
    g = m.get("goodput", {})
    t.metrics, t.failed = m, m["failed"]
    t.goodput, t.good_share = g.get("rate", math.nan), g.get("share", math.nan)
    t.tokens_per_s = m["output_token_throughput"]
    t.ttft_p99, t.tpot_p99 = m["ttft_s"]["p99"], m["tpot_s"]["p99"]
    print(
        f"  goodput {t.goodput:.3f} req/s ({t.good_share * 100:.0f}% good), "
        f"{t.tokens_per_s:.1f} out tok/s, "
        f"TTFT p99 {t.ttft_p99:.2f}s, TPOT p99 {t.tpot_p99 * 1e3:.0f}ms",
        file=sys.stderr,
    )
    return t


def trial_table(trials: list[Trial], best: Trial, knobs: list[str]) -> str:
    rows = []
    for i, t in enumerate(trials, 1):
        cells = [
            ("ngram" if t.config[k] != "none" else "off")
            if k == "speculative-config"
            else t.config[k]
            for k in knobs
        ]
        rows.append(
            [
                f"{i}{' *' if t is best else ''}",
                *cells,
                t.error or f"{t.goodput:.3f}",
                f"{t.good_share * 100:.0f}%" if t.error is None else "-",
                t.tokens_per_s,
                t.ttft_p99,
                t.tpot_p99 * 1e3,
            ]
        )
    return common.table(
        ["trial", *knobs, "goodput req/s", "good", "out tok/s", "TTFT p99 s", "TPOT p99 ms"], rows
    )


def write_yaml(path: Path, best: Trial, header: str) -> None:
    lines = [f"# {line}" for line in header.splitlines()]
    for k, v in best.config.items():
        if k == "speculative-config" and v == "none":
            continue
        lines.append(f"{k}: {json.dumps(v) if k == 'speculative-config' else v}")
    path.write_text("\n".join(lines) + "\n")


def plot_trials(trials: list[Trial], best: Trial, path: Path, title: str) -> None:
    plt = common.pyplot()

    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(trials) + 2), 4.5))
    xs = list(range(1, len(trials) + 1))
    ys = [0.0 if t.error or math.isnan(t.goodput) else t.goodput for t in trials]
    ax.bar(xs, ys, color=["tab:orange" if t is best else "tab:blue" for t in trials])
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("trial (see the table; orange: the chosen configuration)")
    ax.set_ylabel("goodput (requests/s meeting the SLO)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="kvserve tune",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_args(p)
    args = p.parse_args(argv)
    all_knobs = knob_values()
    chosen = [k.strip() for k in args.knobs.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in all_knobs]
    if unknown or not chosen:
        return common.die(f"--knobs: unknown knob(s) {unknown}; choose from {list(all_knobs)}")
    if args.passes < 1 or (args.max_trials is not None and args.max_trials < 1):
        return common.die("--passes and --max-trials must be at least 1")
    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        return common.die(str(e))
    if not slo:
        return common.die("--slo needs at least one target, e.g. ttft=1s,tpot=100ms")
    if not common.have_matplotlib():  # checked before the trials, not after
        return common.die(common.PLOTS_NEED_MATPLOTLIB)
    gguf = common.model_path(args.model)
    encode = None
    if args.dataset == "sharegpt":
        from kvserve.bench.tokenize import encoder

        encode = encoder(gguf)
    reqs = load_requests(args, gguf, encode, default_num=32)
    knobs = {k: all_knobs[k] for k in chosen}
    best, trials = coordinate_descent(
        knobs, lambda c: run_trial(c, reqs, args, slo), args.passes, args.max_trials
    )

    print(trial_table(trials, best, chosen))
    rate = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    header = (
        f"kvserve tune: {args.dataset}, {len(reqs)} requests, {rate}, max concurrency "
        f"{args.max_concurrency or '-'}, SLO {args.slo}, seed {args.seed}\n"
        f"best of {len(trials)} trials: goodput {best.goodput:.3f} req/s, "
        f"{best.tokens_per_s:.1f} out tok/s"
    )
    if best.error is not None:
        return common.die("every trial failed: " + best.error)
    print("\n" + header)
    out = Path(args.output)
    write_yaml(out, best, header + "\nfixed flags: " + (args.server_args or "(none)"))
    print(
        f"flags written to {out}: kvserve serve --config {out}"
        + (f" {args.server_args}" if args.server_args else "")
    )
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot_trials(trials, best, plot, header.splitlines()[0])
    print(f"plot written to {plot}")
    if args.results:
        Path(args.results).write_text(
            json.dumps(
                {
                    "argv": argv,
                    "knobs": knobs,
                    "best": best.config,
                    "trials": [
                        {"config": t.config, "error": t.error, "metrics": t.metrics} for t in trials
                    ],
                },
                indent=1,
            )
        )
    return 0
