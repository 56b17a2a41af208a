"""The processes of a model spread over ranks (tensor or pipeline parallelism) on this machine.

Rank 0 is the engine process. Ranks 1..N-1 are `python -m <module> RANK WORLD PORT` processes,
which read the engine configuration (pickled) from stdin; a module's worker does not re-import the
caller's script, so `LLM(tensor_parallel_size=2)` works in a script without a main guard. All join
one torch.distributed group (gloo over 127.0.0.1) with a 30 s timeout.

Failures: before each step rank 0 checks that every worker process is alive and raises RankLost
naming the one that is not (at once, not after a timeout); a collective that stalls raises after
the timeout. RankLost stops the engine: no step can run without every rank.
"""
from __future__ import annotations

import atexit
import datetime
import pickle
import socket
import subprocess
import sys

import torch.distributed as dist

TIMEOUT_S = 30


class RankLost(RuntimeError):
    """A rank is gone: no step can run."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


class Ranks:
    """Rank 0's side: the worker processes and the step broadcast."""

    def __init__(self, world: int, workers: list[subprocess.Popen], group=None) -> None:
        self.world = world
        self.workers = workers        # rank 1..world-1
        self.group = group

    def check_workers(self) -> None:
        for rank, p in enumerate(self.workers, 1):
            if p.poll() is not None:
                raise RankLost(f"rank {rank} (pid {p.pid}) exited with code {p.returncode}: no step can run; "
                               f"restart the engine")

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
        return RankLost(f"{what} failed ({err}): a rank is gone or stalled")

    def broadcast(self, payload) -> None:
        """Send `payload` (any picklable object) to every rank."""
        self.check_workers()
        try:
            dist.broadcast_object_list([payload], src=0, group=self.group)
        except RuntimeError as e:
            raise self.lost("broadcast to the ranks", e) from e

    def kill(self) -> None:
        """Stop the workers at once (start-up failed on rank 0)."""
        for p in self.workers:
            if p.poll() is None:
                p.kill()
            p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them, leave the group."""
        try:
            if all(p.poll() is None for p in self.workers):
                dist.broadcast_object_list([("stop",)], src=0, group=self.group)
        except RuntimeError:
            pass
        for p in self.workers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(cls, module: str, config, world: int):
    """Start `python -m module RANK WORLD PORT` for ranks 1..world-1 and join them as rank 0;
    returns cls(world, workers)."""
    port = free_port()
    workers = []
    for rank in range(1, world):
        p = subprocess.Popen([sys.executable, "-m", module, str(rank), str(world), str(port)], stdin=subprocess.PIPE)
        p.stdin.write(pickle.dumps(config))
        p.stdin.close()
        workers.append(p)
    atexit.register(lambda: [w.kill() for w in workers if w.poll() is None])
    try:
        init_group(0, world, port)
    except Exception:
        for w in workers:
            w.kill()
        raise
    return cls(world, workers)


def receive():
    """A worker's next object from rank 0 (Ranks.broadcast)."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
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


def worker_args() -> tuple[int, int, int, object]:
    """A worker's (rank, world, port, config) from its command line and stdin."""
    return int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), pickle.loads(sys.stdin.buffer.read())
