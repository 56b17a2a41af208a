"""`kvserve serve --tensor-parallel-size 2`: a lost rank kills the engine for good, so requests fail
fast naming the rank and /health answers 503 (a router takes the replica out), rather than the
engine loop restarting on a step that can never run."""
from __future__ import annotations

import os
import signal
import time

import httpx

from tests.server.conftest import API_KEY, SERVER_ARGS


def test_a_server_whose_rank_dies_turns_unhealthy_at_once(server_factory):
    server = server_factory(SERVER_ARGS + ["--tensor-parallel-size", "2", "--threads", "1"])
    try:
        server.wait_ready()
        children = [int(d) for d in os.listdir("/proc") if d.isdigit() and _parent(int(d)) == server.proc.pid]
        workers = [pid for pid in children if b"kvserve.runner.worker" in _cmdline(pid)]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code >= 500 and "rank 1" in r.text
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 503
        assert time.monotonic() - t0 < 30
    finally:
        server.stop()


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
