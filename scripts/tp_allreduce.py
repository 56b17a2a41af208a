"""All-reduce latency of tensor parallelism here: gloo over 127.0.0.1, 2 processes, float32
tensors of [rows, hidden] as the row-parallel layers reduce them (hidden 576: the default model).
A decode step of the default model runs 2 all-reduces per layer x 30 layers, a broadcast of the
step and an all-gather of the logits.

    python3 scripts/tp_allreduce.py [--hidden 576] [--rows 1,8,64,512] [--iters 200]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def worker(rank: int, world: int, port: int, hidden: int, rows: list[int], iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    for n in rows:
        x = torch.randn(n, hidden)
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            med = statistics.median(times)
            print(
                f"| {n} | {n * hidden * 4 / 1024:.1f} | {med * 1e6:.0f} | {60 * med * 1e3:.2f} |",
                flush=True,
            )
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--rows", default="1,8,64,512")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = [int(x) for x in args.rows.split(",")]
    if args.rank is not None:
        worker(args.rank, 2, args.port, args.hidden, rows, args.iters)
        return 0
    from kvserve.runner.ranks import free_port

    port = free_port()
    print("| rows | KiB | all-reduce median us | x 60 per step (30 layers x 2), ms |")
    print("|---|---|---|---|")
    other = subprocess.Popen([sys.executable, __file__, *argv, "--rank", "1", "--port", str(port)])
    worker(0, 2, port, args.hidden, rows, args.iters)
    other.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
