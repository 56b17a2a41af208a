"""The processes of a model spread over ranks (tensor or pipeline parallelism), on one machine or
several (config.DistributedConfig says which).

Rank 0 is the engine process; the others execute the steps it broadcasts (runner/worker.py). How
they start:
  - one machine: rank 0 starts ranks 1..N-1 as `python -m kvserve.runner.worker` processes;
  - several machines with flags: each node's first rank (`kvserve serve --node-rank R`) starts the
    other ranks of its node alike; node 0 hosts the store where they meet (--master-addr/port);
  - torchrun: it starts every rank and hosts the store; RANK 0 runs the engine.
Every rank then receives the engine's configuration from rank 0, so only rank 0's flags matter
beyond the distributed ones and --threads.

Two gloo groups: the default group, used inside a step (all-reduce, all-gather, sends between
stages), whose collectives fail after STEP_TIMEOUT_S; and the control group, over which rank 0
sends each step, where a worker may wait as long as the engine stays idle (rank 0's own side of
it fails after STEP_TIMEOUT_S too: no wait of rank 0 is unbounded).

Start: every rank first checks in at the store and waits there (up to CONNECT_TIMEOUT) for the
others, so a slow start never counts against the groups' STEP_TIMEOUT_S rendezvous; a worker that
exits before then fails rank 0's start at once. (Under torchrun its own rendezvous does this.)

Failures: before each step rank 0 checks that every worker process it started is alive and raises
RankLost naming the one that is not (at once, not after a timeout); a rank on another machine that
dies closes its sockets, so the next collective fails at once; one that stalls makes the step fail
after STEP_TIMEOUT_S. RankLost stops the engine: no step can run without every rank. A worker whose
rank 0 is gone stops too.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import subprocess
import sys
import time

import torch.distributed as dist

log = logging.getLogger("kvserve")

STEP_TIMEOUT_S = float(os.environ.get("KVSERVE_STEP_TIMEOUT_S", "30"))   # a collective inside a step
CONNECT_TIMEOUT = datetime.timedelta(minutes=10)     # ranks wait this long for each other at start
IDLE_TIMEOUT = datetime.timedelta(days=365)          # a worker waits this long for rank 0's next step

_control = None       # this process's control group (join)


class RankLost(RuntimeError):
    """A rank is gone: no step can run."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(d, port: int, master: bool):
    return dist.TCPStore(d.master_addr, port, d.world, is_master=master, timeout=CONNECT_TIMEOUT,
                         wait_for_workers=False)


def _exited(workers: list[subprocess.Popen], first_rank: int) -> str | None:
    """'rank R (pid P) exited with code C' for the first of `workers` (ranks first_rank, ...) that
    has exited, else None."""
    for r, p in enumerate(workers, first_rank):
        if p.poll() is not None:
            return f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
    return None


def _arrive(store, rank: int, world: int, workers: list[subprocess.Popen] = ()) -> None:
    """Wait until every rank has reached the store. A rank still starting (its imports alone take
    seconds on a slow machine) must not eat into the groups' rendezvous, which fails after
    STEP_TIMEOUT_S; a worker started here that exits meanwhile fails the start at once."""
    store.set(f"kvserve/arrived/{rank}", "1")
    keys = [f"kvserve/arrived/{r}" for r in range(world)]
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while not store.check(keys):
        if (gone := _exited(workers, rank + 1)) is not None:
            raise RankLost(f"{gone} while starting; see its log above")
        if time.monotonic() > deadline:
            raise RankLost(f"not every rank reached {store.host}:{store.port} within {CONNECT_TIMEOUT}: "
                           f"start every node's command (--nnodes, --node-rank)")
        time.sleep(0.02)


def join(d, rank: int, store=None, workers: list[subprocess.Popen] = ()) -> None:
    """Join the ranks' groups as `rank` (store: rank 0's, already listening; torchrun: its own)."""
    global _control
    if store is not None:
        _arrive(store, rank, d.world, workers)
    timeout = datetime.timedelta(seconds=STEP_TIMEOUT_S)
    if d.torchrun:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=d.world, timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=d.world, timeout=timeout)
    # A worker waits on the control group for as long as the engine stays idle; rank 0 only sends on
    # it, and a send that cannot complete within a step's timeout means a rank is gone: rank 0
    # must fail the step then (RankLost), never wait on it for good.
    _control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else IDLE_TIMEOUT)


def spawn(d, port: int, threads: int) -> list[subprocess.Popen]:
    """Start this machine's other ranks (d.rank+1 .. d.rank+d.spawn) as worker processes."""
    workers = [subprocess.Popen([sys.executable, "-m", "kvserve.runner.worker", str(rank), str(d.world),
                                 d.master_addr, str(port), str(threads)])
               for rank in range(d.rank + 1, d.rank + 1 + d.spawn)]
    atexit.register(lambda: [w.kill() for w in workers if w.poll() is None])
    return workers


class Ranks:
    """Rank 0's side: the worker processes it started, and the step broadcast."""

    def __init__(self, world: int, workers: list[subprocess.Popen]) -> None:
        self.world = world
        self.workers = workers        # the ranks this process started: 1..len(workers)

    def check_workers(self) -> None:
        if (gone := _exited(self.workers, 1)) is not None:
            raise RankLost(f"{gone}: no step can run; restart the engine")

    def lost(self, what: str, err: Exception) -> RankLost:
        """The error for a collective that failed: the rank that exited when one did (a killed
        process may still be dying when its peers see the socket close), else the failure."""
        for p in self.workers:
            try:
                p.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        try:
            self.check_workers()
        except RankLost as named:
            return named
        return RankLost(f"{what} failed ({err}): a rank is gone or stalled (a rank on another machine: see its "
                        f"log); no step can run, restart the engine")

    def broadcast(self, payload) -> None:
        """Send `payload` (any picklable object) to every rank."""
        self.check_workers()
        try:
            dist.broadcast_object_list([payload], src=0, group=_control)
        except RuntimeError as e:
            raise self.lost("broadcast to the ranks", e) from e

    def kill(self) -> None:
        """Stop the workers at once (start-up failed on rank 0); ranks elsewhere see rank 0 go."""
        for p in self.workers:
            if p.poll() is None:
                p.kill()
            p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for the ones started here, leave the group (at exit too)."""
        if not dist.is_initialized():
            return
        try:
            if all(p.poll() is None for p in self.workers):
                dist.broadcast_object_list([("stop",)], src=0, group=_control)
        except RuntimeError:
            pass
        for p in self.workers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _forget_groups() -> None:
    """Leave every group after a failed start, so that a later engine in this process can start
    ranks: torch names groups by a per-process count that only destroying the default group resets,
    and an init_process_group that timed out advanced it without forming the group; the next
    engine's group names would then never match its fresh workers' (their rendezvous times out)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        from torch.distributed import distributed_c10d
        distributed_c10d._world.group_count = 0


def start_ranks(cls, config):
    """As rank 0: start this machine's other ranks, meet every rank, send them the configuration;
    returns cls(world, workers)."""
    d = config.distributed
    store, workers = None, []
    if not d.torchrun:
        store = _store(d, d.master_port or 0, master=True)     # port 0: a free one, told to the workers
        workers = spawn(d, store.port, config.num_threads)
    try:
        join(d, 0, store, workers)
        ranks = cls(d.world, workers)
        ranks.broadcast(config)
        atexit.register(ranks.shutdown)       # a script that never closes its engine stops the ranks too
    except Exception:
        for w in workers:
            w.kill()
        _forget_groups()
        raise
    log.info("ranks: %d, this machine runs %d of them (meeting at %s:%s)", d.world, d.local_ranks,
             d.master_addr, store.port if store is not None else d.master_port)
    return ranks


def join_as_worker(d, rank: int) -> None:
    """As rank `rank` > 0: meet the others at rank 0's store (d.master_port)."""
    store = None if d.torchrun else _store(d, d.master_port, master=False)
    join(d, rank, store)


def receive():
    """A worker's next object from rank 0 (Ranks.broadcast)."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def steps(runner):
    """A worker's steps from rank 0 until it says stop: each step's copy-on-write copies are
    applied to `runner`'s pools here, then its work (when it has any) is yielded."""
    while True:
        msg = receive()
        if msg[0] == "stop":
            return
        _, copy_blocks, work = msg
        if copy_blocks:
            runner._copy_blocks(copy_blocks)
        if work is not None:
            yield work
