"""A real `kvserve serve` subprocess on 127.0.0.1 (a random free port), once per test session,
driven by the official `openai` client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.launcher import wait_ready

API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 64 * 1024
# Small and explicit: the tests stay light on a 2-core machine and their limits are known.
SERVER_ARGS = [
    "--api-key",
    API_KEY,
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-body-bytes",
    "64KiB",
    "--kv-cache-memory",
    "192MiB",
    "--max-num-seqs",
    "64",
    "--max-waiting",
    "256",
    "--no-access-log",
    "--enable-tokenizer-info-endpoint",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, extra_args: list[str], env: dict | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(
            prefix="kvserve-test-server-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "kvserve",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra_args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> None:
        try:
            wait_ready(self.base_url, self.proc, time.monotonic() + timeout)
        except RuntimeError as e:
            if self.proc.poll() is None:  # not ready in time: stop it
                self.stop()
            raise RuntimeError(f"kvserve serve: {e}:\n{self.log_text()[-4000:]}") from None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server_factory():
    """server_factory(args) -> a started ServerProcess of its own (the test stops it)."""
    from tests.conftest import default_model_or_skip

    default_model_or_skip()
    return ServerProcess


@pytest.fixture(scope="session")
def server_process():
    from tests.conftest import default_model_or_skip

    default_model_or_skip()
    srv = ServerProcess(SERVER_ARGS)
    srv.wait_ready()
    yield srv
    srv.stop()
    os.unlink(srv.log.name)


@pytest.fixture(scope="session")
def server(server_process) -> str:
    """Base URL of the session's server (http://127.0.0.1:PORT)."""
    return server_process.base_url


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(
        base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300
    )


@pytest.fixture(scope="session")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def metrics(server):
    """metrics() -> the server's /metrics as {'name{label=value}': value}."""
    return lambda: read_metrics(server)


@pytest.fixture(scope="session")
def idle(server):
    """idle(kv) -> /metrics once nothing runs or waits and kv_cache_usage_perc <= kv (else
    AssertionError)."""
    return lambda idle_kv, timeout=30.0: wait_idle(server, idle_kv, timeout)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def read_metrics(base_url: str) -> dict[str, float]:
    """/metrics as {'name{label=value,...}': value}, labels sorted, model_name left out."""
    text = httpx.get(
        f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
    ).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(base_url: str, idle_kv: float, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the KV cache is back to `idle_kv`."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(base_url)
        if (
            m["kvserve:num_requests_running"] == 0
            and m["kvserve:num_requests_waiting"] == 0
            and m["kvserve:kv_cache_usage_perc"] <= idle_kv
        ):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                f"server not idle after {timeout}s: running={m['kvserve:num_requests_running']} "
                f"waiting={m['kvserve:num_requests_waiting']} "
                f"kv={m['kvserve:kv_cache_usage_perc']} (idle {idle_kv})"
            )
        time.sleep(0.1)
