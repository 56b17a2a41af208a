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

Where they listen: the store (rank 0's TCPStore) and gloo's sockets bind to one address, never to
every interface: 127.0.0.1 when every rank runs on this machine, else --master-addr for the store
and, on each node, the interface that reaches it for gloo (GLOO_SOCKET_IFNAME when set). Anyone
who reaches those ports can read and write the store and the ranks' traffic: across machines the
network between them must be trusted (docs/scale-out.md).

Failures: before each step rank 0 checks that every worker process it started is alive and raises
RankLost naming the one that is not (at once, not after a timeout); a rank on another machine that
dies closes its sockets, so the next collective fails at once; one that stalls makes the step fail
after STEP_TIMEOUT_S. RankLost stops the engine: no step can run without every rank. A worker whose
rank 0 is gone stops too.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import time

import torch.distributed as dist

log = logging.getLogger("kvserve")

STEP_TIMEOUT_S = float(os.environ.get("KVSERVE_STEP_TIMEOUT_S", "30"))  # a collective inside a step
CONNECT_TIMEOUT = datetime.timedelta(minutes=10)  # ranks wait this long for each other at start
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waits this long for rank 0's next step

_control = None  # this process's control group (join)


class RankLost(RuntimeError):
    """A rank is gone: no step can run."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK = "127.0.0.1"


def meeting_host(d) -> str:
    """The address the ranks meet at and listen on: 127.0.0.1 when every rank runs on this machine
    (nothing else needs to reach them), else node 0's --master-addr."""
    return LOOPBACK if d.local_ranks == d.world and not d.torchrun else d.master_addr


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` only (port 0: a free one). torch's TCPStore server
    binds every interface whatever its host; handed this socket, it listens here alone."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ValueError(
            f"--master-addr {host}: cannot resolve it ({e}): give node 0's address"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--master-port {port}: {addr[0]}:{port} is in use; choose another "
                f"port (or stop what is using it)"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(
                f"--master-addr {host} ({addr[0]}) is not an address of this machine: "
                f"node 0 listens on it for the other ranks; give one of node 0's own "
                f"addresses"
            ) from None
        raise ValueError(
            f"cannot listen on {addr[0]}:{port} for the ranks: {e.strerror or e}"
        ) from None
    return sock


def _store(d, port: int, master: bool):
    """Rank 0's store (master: listening on meeting_host(d) only), or a client of it."""
    host = meeting_host(d)
    if not master:
        return dist.TCPStore(host, port, d.world, is_master=False, timeout=CONNECT_TIMEOUT)
    sock = _listen(host, port)
    if d.local_ranks < d.world and ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
        log.warning(
            "--master-addr %s is a loopback address: ranks on other machines cannot "
            "reach it (give node 0's network address)",
            host,
        )
    try:
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            d.world,
            is_master=True,
            timeout=CONNECT_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now and closes it when it goes
    return store


def _local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (host itself when it is this machine's):
    a UDP socket "connected" there sends nothing but learns its source address."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError as e:
        raise ValueError(f"--master-addr {host}: this machine has no route to it ({e})") from None


def gloo_interface(host: str) -> str:
    """The name of this machine's network interface that reaches `host`, where gloo's listening
    sockets go: left alone, gloo binds the address the machine's hostname resolves to, which on
    many hosts is its public one."""
    import psutil

    ip = _local_address_towards(host)
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    raise ValueError(
        f"no network interface of this machine holds {ip}, its address towards "
        f"{host}: set GLOO_SOCKET_IFNAME to the interface the ranks should use"
    )


@contextlib.contextmanager
def _gloo_bound(d):
    """gloo groups made inside listen on the interface towards meeting_host(d) only: the loopback
    one on one machine; across machines GLOO_SOCKET_IFNAME, when set, wins."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    host = meeting_host(d)
    one_machine = ipaddress.ip_address(_local_address_towards(host)).is_loopback
    if one_machine or not before:
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface(host)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before


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
            raise RankLost(
                f"not every rank reached {store.host}:{store.port} within {CONNECT_TIMEOUT}: "
                f"start every node's command (--nnodes, --node-rank)"
            )
        time.sleep(0.02)


def join(d, rank: int, store=None, workers: list[subprocess.Popen] = ()) -> None:
    """Join the ranks' groups as `rank` (store: rank 0's, already listening; torchrun: its own)."""
    global _control
    if store is not None:
        _arrive(store, rank, d.world, workers)
    timeout = datetime.timedelta(seconds=STEP_TIMEOUT_S)
    with _gloo_bound(d):
        how = {"init_method": "env://"} if d.torchrun else {"store": store}
        dist.init_process_group("gloo", rank=rank, world_size=d.world, timeout=timeout, **how)
        # A worker waits on the control group for as long as the engine stays idle; rank 0 only
        # sends on it, and a send that cannot complete within a step's timeout means a rank is
        # gone: rank 0 must fail the step then (RankLost), never wait on it for good.
        _control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else IDLE_TIMEOUT)


def spawn(d, port: int, threads: int) -> list[subprocess.Popen]:
    """Start this machine's other ranks (d.rank+1 .. d.rank+d.spawn) as worker processes."""
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.runner.worker",
                str(rank),
                str(d.world),
                meeting_host(d),
                str(port),
                str(threads),
            ]
        )
        for rank in range(d.rank + 1, d.rank + 1 + d.spawn)
    ]
    atexit.register(lambda: [w.kill() for w in workers if w.poll() is None])
    return workers


class Ranks:
    """Rank 0's side: the worker processes it started, and the step broadcast."""

    def __init__(self, world: int, workers: list[subprocess.Popen]) -> None:
        self.world = world
        self.workers = workers  # the ranks this process started: 1..len(workers)

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
        return RankLost(
            f"{what} failed ({err}): a rank is gone or stalled (a rank on another machine: see its "
            f"log); no step can run, restart the engine"
        )

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
        """Tell the workers to stop, wait for the ones started here, leave the group (at exit
        too)."""
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
        store = _store(
            d, d.master_port or 0, master=True
        )  # port 0: a free one, told to the workers
        workers = spawn(d, store.port, config.num_threads)
    try:
        join(d, 0, store, workers)
        ranks = cls(d.world, workers)
        ranks.broadcast(config)
        atexit.register(ranks.shutdown)  # a script that never closes its engine stops the ranks too
    except Exception:
        for w in workers:
            w.kill()
        _forget_groups()
        raise
    log.info(
        "ranks: %d, this machine runs %d of them (meeting at %s:%s)",
        d.world,
        d.local_ranks,
        meeting_host(d),
        store.port if store is not None else d.master_port,
    )
    return ranks


def join_as_worker(d, rank: int) -> None:
    """As rank `rank` > 0: meet the others at rank 0's store (d.master_port)."""
    store = None if d.torchrun else _store(d, d.master_port, master=False)
    join(d, rank, store)


class Stopped(Exception):
    """Rank 0 said stop: it is closing, or its start failed before the first step (a worker
    waiting for the configuration or the KV sizes then stops quietly, not on a bad object)."""


def receive():
    """A worker's next object from rank 0 (Ranks.broadcast); Stopped when rank 0 says stop."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_control)
    if isinstance(box[0], tuple) and box[0] == ("stop",):
        raise Stopped
    return box[0]


def steps(runner):
    """A worker's steps from rank 0 until it says stop: each step's copy-on-write copies are
    applied to `runner`'s pools here, then its work (when it has any) is yielded. A LoRA adapter
    that rank 0 loaded or unloaded (("lora", "load", name, path), ("lora", "unload", name)) is
    loaded or unloaded here too, in the same order, so every rank gives it the same slot."""
    while True:
        try:
            kind, *rest = receive()
        except Stopped:
            return
        if kind == "lora":
            manager = runner.model.lora_step.manager
            if rest[0] == "load":
                manager.load(*rest[1:])
            else:
                manager.unload(*rest[1:])
            continue
        copy_blocks, work = rest
        if copy_blocks:
            runner.copy_blocks(copy_blocks)
        if work is not None:
            yield work
