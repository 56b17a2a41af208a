"""`kvserve serve --tensor-parallel-size 2`: every port the server and its rank open listens on
127.0.0.1 only (the store and gloo's sockets too); a lost rank kills the engine for good, so
requests fail fast naming the rank and /health answers 503 (a router takes the replica out), rather
than the engine loop restarting on a step that can never run."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.server.conftest import API_KEY, SERVER_ARGS


def _other_interface() -> str | None:
    """A network interface with a non-loopback IPv4 address, if this machine has one."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family.name == "AF_INET" and not a.address.startswith("127.") for a in addrs):
            return name
    return None


@pytest.fixture(scope="module")
def tp_server(server_factory):
    # Pointing gloo at a network interface shows that one machine's ranks bind loopback anyway
    # (left alone, gloo binds what the hostname resolves to, often the machine's public address).
    iface = _other_interface()
    server = server_factory(
        SERVER_ARGS + ["--tensor-parallel-size", "2", "--threads", "1"],
        env={"GLOO_SOCKET_IFNAME": iface} if iface else None,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _workers(server) -> list[int]:
    children = [
        int(d) for d in os.listdir("/proc") if d.isdigit() and _parent(int(d)) == server.proc.pid
    ]
    return [pid for pid in children if b"kvserve.runner.worker" in _cmdline(pid)]


def _listeners(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]


def test_every_port_of_the_server_and_its_ranks_listens_on_loopback(tp_server):
    workers = _workers(tp_server)
    assert len(workers) == 1
    server = _listeners(tp_server.proc.pid)
    worker = _listeners(workers[0])
    # The API port, the ranks' store and gloo's sockets: all there, and none on another address.
    assert ("127.0.0.1", tp_server.port) in server and len(server) >= 3 and worker, (server, worker)
    assert {ip for ip, _ in server + worker} == {"127.0.0.1"}, (server, worker)


def test_a_server_whose_rank_dies_turns_unhealthy_at_once(tp_server):
    workers = _workers(tp_server)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    t0 = time.monotonic()
    r = httpx.post(
        f"{tp_server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code >= 500 and "rank 1" in r.text
    assert httpx.get(f"{tp_server.base_url}/health", timeout=10).status_code == 503
    assert time.monotonic() - t0 < 30


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
