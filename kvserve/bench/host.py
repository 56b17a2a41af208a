"""`kvserve bench host`: the engine's host time per decode step, with a forward that costs nothing.

The real engine (scheduler, KV block allocation, input preparation, sampling, output processing,
detokenizing, stop checks) runs B requests that all decode, while its step backend is replaced by
a null forward: it returns a precomputed logits buffer in which each row's largest logit is the
successor, in a fixed cycle of real text tokens, of the row's input token. Greedy decoding then
writes that text over and over, so the detokenizer has real work, and the step's time is the
host's alone. The model is a tiny random-weight Llama with the default model's tokenizer
(kvserve/bench/gguf_presets.py), unless --model names one: only its vocabulary and KV shape
matter, its forward never runs.

Each step's time is split by phase, timed around the engine's own methods (no hook in the
engine): schedule (Scheduler.schedule), prepare (ModelRunner.batch: the flat batch's tensors),
forward (the null one), sample (ModelRunner._sample), update (EngineCore._update less output),
output (OutputProcessor.append_token / finish_sample: detokenizing, stop strings, logprobs), emit
(EngineCore._emit: the RequestOutputs), other (the rest of EngineCore.step). Each round runs
fresh requests: prefill, --warmup steps, then --steps steps timed without the phase timers (the
step total: the median step, the median over rounds) and --steps steps with them (the phases:
the mean step, of the median round, so that they add up to its total). Times are the process's
CPU time unless --clock wall: on a loaded machine the wall clock counts other processes' turns.

--forward-ms X makes the null forward sleep X ms (the GIL released, as a device's forward or the
C kernels leave it), standing in for the device's time per step, and times by the wall clock.
--async-scheduling on (or both, for the two side by side) runs the engine with async scheduling:
the next step is scheduled and flattened while the forward sleeps, so a step takes about
max(host, X) plus the update and output work instead of host + X. Its phases overlap the
forward, so they no longer add up to the step ("other" goes negative).

--server also runs each batch size behind the HTTP server (kvserve/bench/host_served.py).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from kvserve.bench import common

PHASES = ("schedule", "prepare", "forward", "sample", "update", "output", "emit", "other")
# Real text whose tokens, each kept once, make the cycle greedy decoding follows.
CYCLE_TEXT = (
    "The quick brown fox jumps over a lazy dog near the riverbank, while seven curious "
    "children watch from their wooden bridge; one of them laughs, another counts ripples "
    "(twelve, maybe thirteen?) and the café owner waves: \u00abbonjour, mes amis!\u00bb "
    "Afterwards everybody walks home slowly under orange evening light."
)
NEVER_STOP = "\n\nUser:"  # a stop string the cycle never writes: every token is checked for it
# How a step's time is read: the process's CPU time (what the step costs, however many other
# processes share the cores) or the wall clock (what a caller waits, the machine's load included).
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
OUTLIER = 1.5  # an instrumented step slower than this x the median is left out of the phases
HOT = 30.0  # the chosen token's logit; the others are standard normal


def add_args(p) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--batch-sizes",
        default="1,16,64,256,1024",
        help="comma-separated numbers of requests decoding at once (default: %(default)s)",
    )
    g.add_argument(
        "--prompt-len", type=int, default=8, help="prompt tokens per request (default: %(default)s)"
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="untimed decode steps per round (default: %(default)s)",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=20,
        help="timed decode steps per round, per pass (default: %(default)s)",
    )
    g.add_argument(
        "--rounds", type=int, default=3, help="rounds; figures are medians (default: %(default)s)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default: %(default)s, greedy; above 0 the sampler's "
        "softmax and draw run, and the cycle still holds)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=None,
        help=f"a stop string every request carries (repeatable; default: {NEVER_STOP!r}, "
        "which never matches)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="a GGUF file whose vocabulary and KV shape to use (default: a tiny random-weight "
        "Llama with the default model's tokenizer)",
    )
    g.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default=None,
        help="time steps and phases by this process's CPU time or by the wall clock (default: "
        "cpu, wall with --forward-ms; the step's wall time is recorded too)",
    )
    g.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="the null forward sleeps this long per step, the GIL released: a device's forward "
        "time (default: %(default)s)",
    )
    g.add_argument(
        "--async-scheduling",
        choices=("off", "on", "both"),
        default="off",
        help="run the engine with async scheduling off, on, or both one after the other "
        "(default: %(default)s)",
    )
    g.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    g.add_argument(
        "--server",
        action="store_true",
        help="also run each batch size behind kvserve's HTTP server, streamed to a client "
        "process: the step period and CPU time per step with the server in the loop "
        "(kvserve/bench/host_served.py)",
    )
    g.add_argument(
        "--profile-batch",
        type=int,
        default=None,
        help="also run cProfile over one round's timed steps at this batch size and print the "
        "top functions by cumulative time",
    )
    g.add_argument(
        "--profile-top", type=int, default=25, help="functions to list (default: %(default)s)"
    )
    g.add_argument("--output", "-o", default=None, help="write the result JSON here")
    g.add_argument(
        "--save",
        action="store_true",
        help="write the result JSON to docs/bench-results/host-steps.json",
    )


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"batch sizes are integers separated by commas, not {text!r}")
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"batch sizes are positive integers, not {text!r}")
    return sizes


# ---- the null forward ---------------------------------------------------------------------------


def make_cycle(tokenizer, special: set[int]) -> list[int]:
    """CYCLE_TEXT's token ids, each kept once, in order, no special token: the tokens greedy
    decoding writes in turn."""
    ids = tokenizer.encode(CYCLE_TEXT, add_special_tokens=False)
    return [t for t in dict.fromkeys(ids) if t not in special]


class NullForward:
    """A step backend whose logits cost nothing: a preallocated [rows, vocab] buffer of standard
    normal logits in which, per row, the successor of the row's input token in `cycle` gets the
    largest logit (any other token: cycle[0]). Per step it moves the hot entries (a few tensor
    ops, no loop over the batch) and returns a view of the buffer. The real backend is kept
    (`real`) only to name it; `calls` counts the steps it served."""

    name = "null"

    def __init__(self, real, cycle: list[int], vocab: int, rows: int = 1, forward_ms: float = 0.0):
        import numpy as np
        import torch

        self.forward_s = forward_ms / 1000  # slept per step (time.sleep releases the GIL)
        self.real = real
        self.model, self.kv_caches = real.model, real.kv_caches
        self.declined = real.declined
        self.vocab = vocab
        self.next_of = np.full(vocab, cycle[0], dtype=np.int64)
        self.next_of[cycle] = cycle[1:] + cycle[:1]
        self._gen = torch.Generator().manual_seed(0)
        self.buf = torch.randn((max(rows, 1), vocab), generator=self._gen)
        self._np = self.buf.numpy()  # the same memory: numpy indexing costs less per call
        self._hot: tuple | None = None  # (rows, columns, their normal values) set last step
        self._view = None  # the buffer's first rows, as last returned
        self.calls = 0

    def describe(self) -> str:
        slept = f", sleeping {self.forward_s * 1000:g} ms" if self.forward_s else ""
        return f"null forward (precomputed logits{slept}) in place of {self.real.describe()}"

    def sync_copies(self, copies) -> None:
        pass

    def hidden(self, batch):
        raise RuntimeError("the null forward has no hidden states: it returns logits only")

    def logits(self, batch):
        import numpy as np
        import torch

        self.calls += 1
        if self.forward_s:
            time.sleep(self.forward_s)
        n = batch.rows.numel()
        if self._hot is not None:  # last step's hot entries back to their values
            rows, cols, saved = self._hot
            self._np[rows, cols] = saved
            self._hot = None
        if n > self.buf.shape[0]:
            more = torch.randn((n - self.buf.shape[0], self.vocab), generator=self._gen)
            self.buf = torch.cat([self.buf, more])
            self._np = self.buf.numpy()
            self._view = None
        rows = np.arange(n)
        cols = self.next_of[batch.input_ids.numpy()[batch.rows.numpy()]]
        self._hot = (rows, cols, self._np[rows, cols])
        self._np[rows, cols] = HOT
        if self._view is None or self._view.shape[0] != n:
            self._view = self.buf[:n]
        return self._view


def tiny_model(directory: str) -> str:
    """A tiny random-weight Llama GGUF with the default model's tokenizer, written once."""
    from kvserve.bench.gguf_presets import write_model

    path = os.path.join(directory, "kvserve-host-bench-tiny-q4_0.gguf")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        write_model(tmp, "tiny", "q4_0")
        os.replace(tmp, path)
    return path


def null_engine(
    model: str | None,
    max_batch: int,
    max_len: int,
    threads: int = 1,
    cache_dir: str | None = None,
    async_scheduling: bool = False,
    forward_ms: float = 0.0,
):
    """The real EngineCore over `model` (None: the tiny random one), room for `max_batch`
    sequences of `max_len` tokens, its step backend replaced by a NullForward (sleeping
    `forward_ms` per step)."""
    from kvserve import LLM
    from kvserve.config import make_engine_config

    path = model or tiny_model(cache_dir or tempfile.gettempdir())
    block = 16
    blocks = max_batch * -(-max_len // block) + 16
    config = make_engine_config(
        path,
        device="cpu",
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, max_batch),
        max_waiting=max(1024, max_batch),
        max_model_len=max(max_len, 256),
        num_blocks=blocks,
        num_threads=threads,
        async_scheduling=async_scheduling,
    )
    engine = LLM(config=config).engine  # the EngineCore the offline API drives
    special = set(engine.eos_token_ids) | set(getattr(engine.tokenizer, "all_special_ids", []))
    cycle = make_cycle(engine.tokenizer, special)
    engine.runner.backend = NullForward(
        engine.runner.backend, cycle, engine.arch.vocab_size, max_batch, forward_ms
    )
    engine.cycle = cycle
    return engine


# ---- phase timers -------------------------------------------------------------------------------


class PhaseTimers:
    """Seconds per phase, accumulated by wrappers that `with timers:` sets on the engine's objects
    as instance attributes and takes off at the end (the classes stay as they are, and a step
    outside the block runs no wrapper)."""

    def __init__(self, engine, clock=time.process_time):
        self.t: dict[str, float] = defaultdict(float)
        self.clock = clock
        runner, proc = engine.runner, engine.processor
        self._targets = [
            (engine.scheduler, "schedule", "schedule"),
            (runner, "batch", "prepare"),
            (runner.backend, "logits", "forward"),
            (runner, "_sample", "sample"),
            (engine, "_update", "update+output"),
            (proc, "append_token", "output"),
            (proc, "finish_sample", "output"),
            (engine, "_emit", "emit"),
        ]

    def __enter__(self):
        for obj, name, phase in self._targets:
            assert name not in vars(obj), f"{name} is already wrapped"
            setattr(obj, name, self._timed(getattr(obj, name), phase))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, _ in self._targets:
            delattr(obj, name)

    def _timed(self, fn, phase: str):
        acc, clock = self.t, self.clock

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[phase] += clock() - t0

        return timed

    def reset(self) -> None:
        self.t.clear()

    def phases(self, total: float) -> dict[str, float]:
        """Seconds per phase; `other` is what the named phases leave of `total`."""
        t = self.t
        out = {
            "schedule": t["schedule"],
            "prepare": t["prepare"],
            "forward": t["forward"],
            "sample": t["sample"],
            "update": t["update+output"] - t["output"],
            "output": t["output"],
            "emit": t["emit"],
        }
        out["other"] = total - sum(out.values())
        return out


# ---- one batch size -----------------------------------------------------------------------------


def _params(args, max_tokens: int):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        max_tokens=max_tokens,
        ignore_eos=True,
        stop=list(args.stop) if args.stop is not None else [NEVER_STOP],
    )


def random_prompts(engine, batch: int, length: int, rng: random.Random) -> list[list[int]]:
    """Random prompts of ordinary tokens, none in the cycle (the first token is cycle[0])."""
    avoid = set(engine.cycle) | set(engine.eos_token_ids)
    vocab = engine.arch.vocab_size
    pool = [t for t in range(vocab // 100, vocab) if t not in avoid]
    return [[rng.choice(pool) for _ in range(length)] for _ in range(batch)]


def run_round(engine, timers: PhaseTimers, args, batch: int, rng, profile=None) -> dict:
    """One round at `batch`: fresh requests, prefill, warm-up, a plain pass and a timed pass."""
    max_tokens = args.warmup + 2 * args.steps + 8
    params = _params(args, max_tokens)
    ids = [f"h{batch}-{rng.randrange(1 << 30)}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(engine, batch, args.prompt_len, rng)):
        engine.add_request(rid, prompt, params)
    produced = dict.fromkeys(ids, 0)
    waiting = set(ids)
    for _ in range(4 * batch + 16):  # prefill until every request has its first token
        for out in engine.step():
            for o in out.outputs:
                produced[out.request_id] += len(o.delta_token_ids)
            if produced.get(out.request_id):
                waiting.discard(out.request_id)
        if not waiting:
            break
    else:
        raise RuntimeError(f"batch {batch}: some requests never got their first token")
    for _ in range(args.warmup):
        engine.step()

    def timed_pass(instrumented: bool) -> list[tuple[float, dict[str, float], float]]:
        """Per step: its time, its seconds per phase (instrumented), its wall time. `profile`
        runs over the plain pass (no phase timers)."""
        steps = []
        with timers if instrumented else contextlib.nullcontext():
            if profile is not None and not instrumented:
                profile.enable()
            for _ in range(args.steps):
                timers.reset()
                w0, t0 = time.perf_counter(), clock()
                outs = engine.step()
                dt, wall = clock() - t0, time.perf_counter() - w0
                steps.append((dt, timers.phases(dt) if instrumented else {}, wall))
                if engine.last_step_tokens != batch or len(outs) != batch:
                    raise RuntimeError(
                        f"batch {batch}: a timed step ran {engine.last_step_tokens} tokens for "
                        f"{len(outs)} requests: not every request was decoding"
                    )
            if profile is not None and not instrumented:
                profile.disable()
        return steps

    clock = timers.clock
    plain_steps = timed_pass(False)
    plain = [dt for dt, _, _ in plain_steps]
    inst = timed_pass(True)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # hand out the aborts; every block is free again
    # Steps the OS took the core from (over OUTLIER x the median) would swamp a mean of phases.
    mid = statistics.median(dt for dt, _, _ in inst)
    kept = [ph for dt, ph, _ in inst if dt <= OUTLIER * mid]
    return {
        "step_us": statistics.median(plain) * 1e6,
        "step_wall_us": statistics.median(w for _, _, w in plain_steps) * 1e6,
        "step_us_mean": sum(plain) / len(plain) * 1e6,
        "instrumented_step_us": sum(sum(ph.values()) for ph in kept) / len(kept) * 1e6,
        "phases_us": {p: sum(ph[p] for ph in kept) / len(kept) * 1e6 for p in PHASES},
        "outlier_steps": len(inst) - len(kept),
    }


def measure(engine, args, batch: int, rng, profile=None) -> dict:
    timers = PhaseTimers(engine, CLOCKS[args.clock])
    rounds = [run_round(engine, timers, args, batch, rng) for _ in range(args.rounds)]
    if profile is not None:
        run_round(engine, timers, args, batch, rng, profile)
    step = statistics.median(r["step_us"] for r in rounds)
    wall = statistics.median(r["step_wall_us"] for r in rounds)
    # The phases of the median round (by its instrumented step), so that they add up to it.
    by_inst = sorted(rounds, key=lambda r: r["instrumented_step_us"])
    mid = by_inst[(len(by_inst) - 1) // 2]
    inst, phases = mid["instrumented_step_us"], mid["phases_us"]
    return {
        "outlier_steps": sum(r["outlier_steps"] for r in rounds),
        "batch": batch,
        "step_us": step,
        "tok_s": batch / step * 1e6,
        "step_wall_us": wall,
        "instrumented_step_us": inst,
        "phases_us": phases,
        "rounds": rounds,
    }


def profile_table(prof: cProfile.Profile, steps: int, step_us: float, top: int) -> list[dict]:
    """The top functions by cumulative time per step, with their share of the profiled step."""
    st = pstats.Stats(prof, stream=io.StringIO())
    total = (
        sum(v[3] for k, v in st.stats.items() if k[0].endswith("engine_core.py") and k[2] == "step")
        or 1.0
    )
    rows = []
    for (file, line, fn), (_, calls, tt, ct, _) in st.stats.items():
        rows.append(
            {
                "function": f"{_short(file)}:{line}({fn})",
                "calls_per_step": calls / steps,
                "cum_us": ct / steps * 1e6,
                "self_us": tt / steps * 1e6,
                "cum_share": ct / total,
            }
        )
    rows.sort(key=lambda r: -r["cum_us"])
    return rows[:top]


def _short(file: str) -> str:
    p = Path(file)
    for anchor in ("kvserve", "site-packages"):
        if anchor in p.parts:
            return "/".join(p.parts[p.parts.index(anchor) + (anchor == "site-packages") :])
    return file


# ---- the command --------------------------------------------------------------------------------


def print_table(results: list[dict]) -> None:
    rows = [
        [
            r["batch"],
            f"{r['step_us']:.0f}",
            f"{r['tok_s']:,.0f}",
            f"{r['step_wall_us']:.0f}",
            f"{r['instrumented_step_us']:.0f}",
        ]
        + [f"{r['phases_us'][p]:.0f}" for p in PHASES]
        for r in results
    ]
    head = ["batch", "step us", "tok/s", "wall us", "timed us"] + [f"{p} us" for p in PHASES]
    print(common.table(head, rows))


def run_served(engine, args, sizes: list[int], async_on: bool) -> dict:
    """Every batch size again with the engine behind the server (host_served.py); its run."""
    from kvserve.bench import host_served

    served = host_served.ServedEngine(engine)
    try:
        rng = random.Random(1)
        results = []
        for b in sizes:
            print(f"batch {b}, served: {args.rounds} rounds of {args.steps} steps", file=sys.stderr)
            results.append(host_served.measure(served, args, b, rng))
    finally:
        served.close()
    head = ["batch", "step period us", "tok/s", "process CPU us", "engine thread us"]
    head += ["in core.step us", "HTTP us"]
    keys = ("process_cpu_us", "engine_thread_cpu_us", "core_step_cpu_us", "http_cpu_us")
    rows = [
        [r["batch"], f"{r['step_wall_us']:.0f}", f"{r['tok_s']:,.0f}"]
        + [f"{r[k]:.0f}" for k in keys]
        for r in results
    ]
    print("\nwith the server in the loop (per step; HTTP: the event loop and other threads)")
    print(common.table(head, rows))
    return {
        "engine": "kvserve",
        "mode": "server, null forward" + (", async scheduling" if async_on else ""),
        "config": {"threads": args.threads, "async_scheduling": async_on},
        "batches": results,
    }


def main(args, argv: list[str]) -> int:
    import torch

    try:
        sizes = batch_sizes(args.batch_sizes)
        for name in ("prompt_len", "steps", "rounds", "threads"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if args.warmup < 0 or args.temperature < 0 or args.forward_ms < 0:
            raise ValueError("--warmup, --temperature and --forward-ms must not be negative")
    except ValueError as e:
        return common.die(str(e))
    if args.clock is None:
        args.clock = "wall" if args.forward_ms else "cpu"
    result = common.new_result("host", argv, args)
    max_len = args.prompt_len + args.warmup + 2 * args.steps + 16
    if args.server:
        from kvserve.bench.host_served import served_tokens

        max_len = max(max_len, args.prompt_len + served_tokens(args) + 16)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    result["workload"] = {
        "batch_sizes": sizes,
        "prompt_tokens": args.prompt_len,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "rounds": args.rounds,
        "temperature": args.temperature,
        "clock": args.clock,
        "forward_ms": args.forward_ms,
        "stop": list(args.stop) if args.stop is not None else [NEVER_STOP],
    }
    result["runs"] = []
    for async_on in modes:
        engine = null_engine(
            args.model,
            max(sizes),
            max_len,
            args.threads,
            async_scheduling=async_on,
            forward_ms=args.forward_ms,
        )
        torch.set_num_threads(args.threads)
        backend = engine.runner.backend
        label = f"async scheduling {'on' if async_on else 'off'}"
        print(f"{engine.describe()}; {label}", file=sys.stderr)
        rng = random.Random(0)
        results = []
        for b in sizes:
            print(
                f"batch {b}: {args.rounds} rounds of {args.steps} + {args.steps} steps",
                file=sys.stderr,
            )
            prof = cProfile.Profile(CLOCKS[args.clock]) if args.profile_batch == b else None
            r = measure(engine, args, b, rng, prof)
            if prof is not None:
                r["profile"] = profile_table(prof, args.steps, r["step_us"], args.profile_top)
            results.append(r)
        result["workload"]["cycle_tokens"] = len(engine.cycle)
        result["runs"].append(
            {
                "engine": "kvserve",
                "mode": "offline, null forward" + (", async scheduling" if async_on else ""),
                "config": {
                    "steps": engine.step_path,
                    "model": engine.model_path,
                    "threads": args.threads,
                    "async_scheduling": async_on,
                    "forward_ms": args.forward_ms,
                },
                "null_forward_calls": backend.calls,
                "batches": results,
            }
        )
        if len(modes) > 1:
            print(f"\n{label}, forward {args.forward_ms:g} ms")
        print_table(results)
        for r in results:
            if "profile" in r:
                print(f"\ncProfile, batch {r['batch']}: top functions by cumulative time per step")
                print(
                    common.table(
                        ["function", "calls/step", "cum us", "self us", "cum share"],
                        [
                            [p["function"], f"{p['calls_per_step']:.1f}", f"{p['cum_us']:.0f}"]
                            + [f"{p['self_us']:.0f}", f"{p['cum_share'] * 100:.1f}%"]
                            for p in r["profile"]
                        ],
                    )
                )
        if args.server:
            result["runs"].append(run_served(engine, args, sizes, async_on))
        engine.close()
    result["load_avg_after"] = os.getloadavg()[0]
    common.save_result(result, args.output, args.save, "host-steps")
    return 0
