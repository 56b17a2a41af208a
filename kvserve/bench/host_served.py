"""`kvserve bench host --server`: the host time per decode step with the server in the loop.

The null-forward engine of kvserve/bench/host.py runs behind kvserve's own HTTP server (the
AsyncEngine and the app of `kvserve serve`, uvicorn on a free 127.0.0.1 port, in this process),
and a client process streams B completions at once (the load generator of `bench serve`, greedy,
the cycle's text over SSE, a stop string checked on every token). Once every request decodes,
--steps consecutive steps of B tokens (after --warmup such steps) are timed from the engine
thread: the step period (wall clock from one step's start to the next one's, the engine thread
waiting for the GIL and the event loop included), this process's CPU time per step (engine
thread, event loop: HTTP, SSE and detokenizing), the engine thread's own CPU time per step, and
the part of it inside EngineCore.step (the rest: the AsyncEngine loop's commands, output
delivery and metrics). The client's work is in its own process and not counted. Compared with
the offline figure of the same batch (no server), the difference is what serving costs per step.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from kvserve.bench.host import NEVER_STOP, random_prompts


class StepLog:
    """(wall, process CPU, engine-thread CPU, engine-thread CPU inside EngineCore.step so far,
    tokens) at the start of each engine step, recorded by a wrapper set on the core as an
    instance attribute (the engine thread calls it)."""

    def __init__(self, core):
        self.core, self.rows, self.inside = core, [], 0.0
        step = core.step

        def timed():
            t = time.thread_time()
            row = (time.perf_counter(), time.process_time(), t, self.inside, core.last_step_tokens)
            self.rows.append(row)
            try:
                return step()
            finally:
                self.inside += time.thread_time() - t

        core.step = timed

    def remove(self) -> None:
        del self.core.step


class ServedEngine:
    """The null engine behind kvserve's app and uvicorn, on 127.0.0.1 (a free port), with the
    GIL switch interval `kvserve serve` sets and its startup objects frozen out of the cyclic
    collector's reach, as it does."""

    def __init__(self, core):
        import uvicorn

        from kvserve.engine.async_engine import AsyncEngine
        from kvserve.server.app import build_app
        from kvserve.server.launcher import SWITCH_INTERVAL_S, freeze_startup_objects

        self.switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # as `kvserve serve` runs
        self.log = StepLog(core)
        self.engine = AsyncEngine(core)
        app = build_app(self.engine)
        freeze_startup_objects()  # as `kvserve serve` does
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the bench's kvserve server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        asyncio.run(self.engine.shutdown(timeout=5))
        self.log.remove()
        self.sock.close()
        sys.setswitchinterval(self.switch_interval)
        gc.unfreeze()


def served_tokens(args) -> int:
    """max_tokens of each streamed request: room for the steps timed once every request decodes,
    however spread out their arrivals are (the client is stopped once they are timed)."""
    return 4 * (args.warmup + args.steps) + 64


def measure_round(served: ServedEngine, args, batch: int, rng) -> dict:
    """B streamed requests from a client process; the first --steps steps of B tokens after
    --warmup such steps: step period, process and engine-thread CPU per step. The client is then
    stopped (the server aborts what it left) and the engine left idle."""
    core = served.log.core
    prompts = random_prompts(core, batch, args.prompt_len, rng)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"url": served.url, "prompts": prompts, "max_tokens": served_tokens(args)}, f)
    start = len(served.log.rows)
    client = subprocess.Popen([sys.executable, "-m", "kvserve.bench.host_served", f.name])
    try:
        rows = _wait_for_steps(served.log, start, batch, args.warmup, args.steps, client)
    finally:
        client.kill()
        client.wait()
        os.unlink(f.name)
    deadline = time.monotonic() + 120
    while served.engine.num_in_flight or core.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch}: the server kept requests of a gone client")
        time.sleep(0.05)
    (w0, p0, e0, s0, _), (w1, p1, e1, s1, _) = rows[0], rows[-1]
    n = len(rows) - 1
    return {
        "step_wall_us": (w1 - w0) / n * 1e6,
        "process_cpu_us": (p1 - p0) / n * 1e6,
        "engine_thread_cpu_us": (e1 - e0) / n * 1e6,
        "core_step_cpu_us": (s1 - s0) / n * 1e6,
    }


def _wait_for_steps(log: StepLog, start: int, batch: int, warmup: int, steps: int, client):
    """The step rows of the first steps + 1 consecutive steps of `batch` tokens that follow
    `warmup` such steps (a row records the tokens of the step before it)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        rows = log.rows[start:]
        run = 0
        for i in range(1, len(rows)):
            run = run + 1 if rows[i][4] == batch else 0
            if run == warmup + steps + 1:  # rows i - steps .. i start steps of batch tokens
                return rows[i - steps : i + 1]
        if client.poll() is not None:
            raise RuntimeError(
                f"batch {batch}: the client finished before {warmup + steps} steps of {batch} "
                "tokens ran: not every request was decoding at once"
            )
        time.sleep(0.05)
    raise RuntimeError(f"batch {batch}: no {steps} steps of {batch} tokens within 600 s")


def measure(served: ServedEngine, args, batch: int, rng) -> dict:
    rounds = [measure_round(served, args, batch, rng) for _ in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {
        "batch": batch,
        **med,
        "http_cpu_us": med["process_cpu_us"] - med["engine_thread_cpu_us"],
        "tok_s": batch / med["step_wall_us"] * 1e6,
        "rounds": rounds,
    }


def client_main(path: str) -> int:
    """The client process: stream every prompt of the JSON file at once, until stopped."""
    from kvserve.bench.datasets import BenchRequest
    from kvserve.bench.loadgen import run_load, served_model

    spec = json.loads(open(path).read())
    reqs = [BenchRequest(p, spec["max_tokens"]) for p in spec["prompts"]]
    model = served_model(spec["url"])
    asyncio.run(run_load(spec["url"], reqs, model, extra={"stop": [NEVER_STOP]}, progress=False))
    return 0


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1]))
