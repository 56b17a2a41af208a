"""Start and stop the servers a benchmark talks to: `kvserve serve` and the llama.cpp peer.

Each runs as a subprocess on a free 127.0.0.1 port, its output in a log file, and is
terminated (then killed) on exit.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

from kvserve.bench.common import free_port
from kvserve.bench.loadgen import wait_ready

LLAMACPP_INSTALL = (
    "the llama.cpp peer needs llama-cpp-python's server: pip install 'kvserve[peers]' "
    "(or pip install 'llama-cpp-python[server]'; it compiles llama.cpp, minutes on 2 cores), "
    "or pass --llamacpp-bin PATH/llama-server"
)


class ServerProcess:
    """`with ServerProcess(name, cmd, port) as base_url:` — started, ready, stopped."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        ready_timeout: float = 300,
        api_key: str | None = None,
    ):
        self.name, self.cmd, self.port, self.ready_timeout = name, cmd, port, ready_timeout
        self.api_key = api_key
        self.poll_s = 0.5  # how often __enter__ asks whether the server is ready
        self.stop_timeout = 15.0  # seconds from SIGTERM to SIGKILL
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"kvserve-bench-{name}-", suffix=".log", delete=False
        )

    def __enter__(self) -> str:
        print(
            f"starting {self.name}: {shlex.join(self.cmd)}  (log: {self.log.name})", file=sys.stderr
        )
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            wait_ready(self.base_url, self.ready_timeout, self.proc, self.api_key, self.poll_s)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(
                f"{self.name}: {e}\n--- last lines of {self.log.name} ---\n{self.tail()}"
            ) from e
        return self.base_url

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, n: int = 20) -> str:
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def kvserve_server(
    model: str | None, extra_args: list[str], api_key: str | None = None
) -> ServerProcess:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvserve",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
    ]
    if model:
        cmd += ["--model", model]
    if api_key:
        cmd += ["--api-key", api_key]
    return ServerProcess("kvserve", cmd + extra_args, port, api_key=api_key)


def llamacpp_available(binary: str | None) -> bool:
    if binary:
        return shutil.which(binary) is not None or os.access(binary, os.X_OK)
    return (
        importlib.util.find_spec("llama_cpp") is not None
        and importlib.util.find_spec("uvicorn") is not None
    )


_LLAMACPP_ISAS = ("AVX512_VNNI", "AVX512", "AVX_VNNI", "AVX2", "AVX")


def llamacpp_build(binary: str | None) -> str | None:
    """What a llama.cpp build from source targets, from its CMakeCache.txt beside bin/: "native"
    (GGML_NATIVE, the build machine's ISA) or the widest x86 ISA it was configured with, so
    reports tell a native peer from an AVX2-only one. None when no cache is found."""
    path = shutil.which(binary) if binary else None
    if not path:
        return None
    cache = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(path))), "CMakeCache.txt")
    try:
        with open(cache, errors="replace") as f:
            flags = dict(
                line.split(":BOOL=", 1) for line in f.read().splitlines() if ":BOOL=" in line
            )
    except OSError:
        return None
    on = {k for k, v in flags.items() if v.strip().upper() in ("ON", "1", "TRUE")}
    if "GGML_NATIVE" in on:
        return "native"
    return next((isa for isa in _LLAMACPP_ISAS if f"GGML_{isa}" in on), "generic")


def llamacpp_server(
    gguf: str,
    threads: int,
    slots: int,
    ctx_per_slot: int,
    binary: str | None = None,
    extra_args: list[str] = (),
) -> ServerProcess:
    """llama.cpp's own `llama-server` (parallel slots, continuous batching) when a binary is given,
    else llama-cpp-python's server (one request at a time: it serializes on one llama context)."""
    port = free_port()
    if binary:
        cmd = [
            binary,
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(ctx_per_slot * slots),
            "-cb",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--n_ctx",
            str(ctx_per_slot),
            "--interrupt_requests",
            "false",
        ]
    return ServerProcess("llamacpp", cmd + list(extra_args), port)


def llamacpp_request_kwargs(gguf: str, binary: str | None, requests) -> dict:
    """How run_load must talk to the llama.cpp peer. llama-server takes token ids and ignore_eos;
    llama-cpp-python's server takes only text (decoded here; it re-tokenizes) and min_tokens."""
    if binary:
        return {}
    from kvserve.bench.tokenize import decoder

    decode = decoder(gguf)
    return {"prompt_texts": [decode(r.prompt_ids) for r in requests], "min_tokens": True}
