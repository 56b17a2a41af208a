"""A rank other than 0: meet the others, take the engine's configuration from rank 0, and execute
its steps (tensor or pipeline parallelism) until it says stop or is gone.

Started three ways (runner/ranks.py): by rank 0 or a node's first rank, as
`python -m kvserve.runner.worker RANK WORLD MASTER_ADDR MASTER_PORT THREADS`; as a node's first
rank, in-process, by `kvserve serve --node-rank R` (R > 0); or by torchrun, in-process, by any
kvserve command whose RANK is not 0.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

from kvserve.config import DistributedConfig
from kvserve.runner import pipeline_parallel, ranks, tensor_parallel

log = logging.getLogger("kvserve")


def execute(d: DistributedConfig, rank: int, threads: int) -> int:
    """Run rank `rank` until rank 0 says stop (0) or is gone (1)."""
    import torch

    torch.set_num_threads(max(1, threads))
    ranks.join_as_worker(d, rank)
    try:
        config = replace(ranks.receive(), num_threads=max(1, threads))
        main = (
            pipeline_parallel.worker_main
            if config.pipeline_parallel_size > 1
            else tensor_parallel.worker_main
        )
        main(rank, d.world, config)
    except ranks.Stopped:  # rank 0 stopped before the first step: its start failed
        log.info("rank %d/%d stops: rank 0 stopped before the first step", rank, d.world)
    except RuntimeError as e:  # a collective failed: rank 0 (or another rank) is gone
        log.error("rank %d/%d stops: %s", rank, d.world, e)
        return 1
    return 0


def serve_rank(config) -> int:
    """This process's rank (not 0) of config.distributed: start the other ranks of this machine
    (flags: a node's first rank starts them), execute, wait for them."""
    d = config.distributed
    if d.rank == 0:
        raise ValueError("rank 0 runs the engine, not a worker")
    log.info(
        "rank %d of %d: executing the steps of the engine at %s:%s (this machine runs ranks %d-%d)",
        d.rank,
        d.world,
        d.master_addr,
        d.master_port,
        d.rank,
        d.rank + d.spawn,
    )
    workers = ranks.spawn(d, d.master_port, config.num_threads) if d.spawn else []
    code = execute(d, d.rank, config.num_threads)
    codes = [w.wait() for w in workers]
    return code or next((c for c in codes if c), 0)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s kvserve-rank{sys.argv[1]} %(levelname)s %(message)s",
    )
    rank, world, addr, port, threads = sys.argv[1:6]
    sys.exit(
        execute(
            DistributedConfig(world=int(world), master_addr=addr, master_port=int(port)),
            int(rank),
            int(threads),
        )
    )
