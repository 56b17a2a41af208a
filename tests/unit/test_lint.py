"""The style the tree keeps: `ruff check` and `ruff format --check` (configured in
pyproject.toml) pass on kvserve, tests and scripts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["kvserve", "tests", "scripts"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed (pip install -e '.[test]')",
)


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ruff_check():
    res = ruff("check", "--output-format", "concise")
    assert res.returncode == 0, f"ruff check found problems:\n{res.stdout}{res.stderr}"


def test_ruff_format():
    res = ruff("format", "--check")
    assert res.returncode == 0, f"ruff format would change files:\n{res.stdout}{res.stderr}"
