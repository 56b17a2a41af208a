"""Clients that cannot share the server's environment run in their own: scripts/install.sh
--test makes a virtual environment per such library under .venv-clients/ (instructor caps
jiter<0.15 where the openai the other clients need requires jiter>=0.16; guidance pins
llguidance==1.5.0 where the server needs >=1.7). A test runs the library's code there as a
subprocess against the ring's server; the script prints one JSON line the test checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VENVS = Path(os.environ.get("KVSERVE_CLIENT_VENVS", Path(__file__).parents[2] / ".venv-clients"))


def venv_python(name: str) -> str:
    """The python of the client's environment; the test skips, naming how to make it, if absent."""
    python = VENVS / name / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    if not python.exists():
        pytest.skip(f"{name} runs in its own environment {VENVS / name}: scripts/install.sh --test")
    return str(python)


def run_client(name: str, script: str, *args: str, timeout: float = 300) -> dict:
    """Run `script` with the environment's python (args as sys.argv[1:]); its last stdout line
    parsed as JSON. A failing script fails the test with its stderr."""
    res = subprocess.run(
        [venv_python(name), "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, f"{name} client failed:\n{res.stderr[-4000:]}"
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert lines, f"{name} client printed nothing:\n{res.stderr[-4000:]}"
    return json.loads(lines[-1])
