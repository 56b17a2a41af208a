"""`kvserve serve` on a port already in use fails at once, before loading the model."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_a_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvserve",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--model",
                "/nonexistent/model.gguf",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr  # and no model error: the missing model was never read
