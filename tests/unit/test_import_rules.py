"""The rooms of docs/architecture.md, checked on the source: every module under
kvserve/ is parsed with `ast` (nothing is imported) and each of its kvserve imports (absolute,
relative, function-local, importlib.import_module("kvserve...")) must be allowed by RULES.

Dependencies point one way: server -> engine -> (core, runner) -> model -> ops. Nothing below
imports anything above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KVSERVE = Path(__file__).resolve().parents[2] / "kvserve"

# Top-level modules every room may share: plain data, no torch, nothing of kvserve.
SHARED = {"config", "sampling_params", "outputs"}

# room -> what it may import (a room, or a dotted module of one: "model.tokenizer" allows that
# module only). A room always may import itself. A module of a room not listed here fails the test.
RULES: dict[str, set[str]] = {
    "config": set(),  # every knob; nothing of kvserve
    "sampling_params": set(),
    "outputs": set(),
    "core": {"config", "sampling_params"},  # pure Python: no torch (NO_TORCH)
    "ops": set(),  # kernels: torch only
    "model": {"ops", "config"},
    # lora.manager: a pipeline stage's worker holds its layers' part of the LoRA adapters
    "runner": {
        "core",
        "model",
        "ops",
        "config",
        "sampling_params",
        "runner.backends",
        "lora.manager",
    },
    # The step backends (runner/backends/) run the model for the runner, below it: the rank-side
    # code of tensor/pipeline parallelism, the C layer stack, the CUDA graphs; never the runner
    # itself (model_runner), its sampler, nor anything above it.
    "runner.backends": {
        "config",
        "core.scheduler",
        "ops",
        "runner.layer_stack",
        "runner.cuda_graphs",
        "runner.tensor_parallel",
        "runner.pipeline_parallel",
    },
    "spec": {"runner", "core", "model", "ops", "config", "sampling_params"},
    # LoRA adapters: read from PEFT directories, applied inside the model's Linears (duck-typed)
    "lora": {"config"},
    "structured": {"model.tokenizer", "config", "sampling_params"},
    "engine": {
        "core",
        "runner",
        "model",
        "ops",
        "spec",
        "structured",
        "lora",
        "config",
        "sampling_params",
        "outputs",
    },
    # The HTTP server sees the engine only (errors it handles: kvserve.engine.errors), plus the
    # package itself for __version__.
    "server": {"engine", "config", "config_file", "sampling_params", "outputs", "kvserve"},
    # The router sees replicas over HTTP only: no engine, no torch; the OpenAI error body of
    # server.errors.
    "router": {"server.errors"},
    # The benchmarks drive kvserve as a user does: the HTTP server as a client, `kvserve.LLM` (the
    # package) offline, the engine flags of config. bench.tokenize counts tokens on the client side
    # with the served model's tokenizer (model.tokenizer only: no torch, no weights).
    "bench": {"kvserve", "config", "sampling_params", "model.tokenizer", "bench.host_served"},
    # `bench host --server` measures the engine's step behind the server's own app, in-process
    # around a null forward: the one bench module that sees the async engine and the app.
    "bench.host_served": {
        "bench",
        "kvserve",
        "config",
        "sampling_params",
        "model.tokenizer",
        "engine.async_engine",
        "server.app",
        "server.launcher",
    },
    # Top-level tools and entry points.
    "kvserve": {"sampling_params", "engine.llm"},  # the package: SamplingParams, LLM (lazily)
    "__main__": {"cli"},
    "cli": {"*"},  # `kvserve serve | generate | ...`: everything
    "kv_calc": {"config"},
    "config_file": set(),  # --config YAML -> argparse defaults
    # eval-quality measures weight formats and KV dtypes on the model and its kernels directly (no
    # engine, no scheduler), running each step as the runner would (runner.layer_stack).
    "eval_quality": {"config", "model", "ops", "runner.layer_stack"},
}
NO_TORCH = {"core", "config", "sampling_params", "outputs", "router"}
# Rooms inside a room, with rules of their own -> the rooms that may enter them. The engine learns
# how steps run from ModelRunner.step_path, never from a backend.
SUBROOMS: dict[str, set[str]] = {"runner.backends": {"runner"}, "bench.host_served": {"bench"}}


def module_name(path: Path, root: Path = KVSERVE) -> str:
    parts = ["kvserve", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """kvserve.core.scheduler -> core; kvserve.config -> config; kvserve -> kvserve;
    kvserve.runner.backends.cuda -> runner.backends (SUBROOMS)."""
    rel = module.removeprefix("kvserve.")
    for sub in SUBROOMS:
        if rel == sub or rel.startswith(sub + "."):
            return sub
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvserve"


def imports_of(
    source: str, module: str, is_package: bool = False, known: frozenset[str] = frozenset()
) -> set[str]:
    """Every kvserve module `module` imports (anywhere in its source), plus "torch" when it imports
    torch. `from a import b` counts as a.b when a.b is a module of `known`, else as a."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        if name == "torch" or name.startswith("torch."):
            found.add("torch")
        elif name == "kvserve" or name.startswith("kvserve."):
            found.add(name)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in known else target)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("import_module", "__import__")
                )
            )
        ):
            add(node.args[0].value)
    return found


def allowed(importer: str, imported: str) -> bool:
    src, dst = room(importer), room(imported)
    rule = RULES[src]
    if src == dst or "*" in rule:
        return True
    if dst in SUBROOMS and src not in SUBROOMS[dst]:
        return False
    rel = imported.removeprefix("kvserve.") if imported != "kvserve" else "kvserve"
    return any(rel == a or rel.startswith(a + ".") for a in rule)


def violations(
    module: str, source: str, is_package: bool = False, known: frozenset[str] = frozenset()
) -> list[str]:
    """The imports of `module` (given its source) that RULES / NO_TORCH forbid, as messages."""
    src = room(module)
    if src not in RULES:
        return [f"{module}: room {src!r} has no entry in RULES (add one: docs/architecture.md)"]
    bad = []
    for imported in sorted(imports_of(source, module, is_package, known)):
        if imported == "torch":
            if src in NO_TORCH:
                bad.append(f"{module} imports torch ({src} must stay pure Python)")
        elif not allowed(module, imported):
            dst = room(imported)
            if dst in SUBROOMS and src not in SUBROOMS[dst]:
                why = f"only {sorted(SUBROOMS[dst])} may enter {dst}"
            else:
                why = f"{src} may import {sorted(RULES[src]) or 'nothing of kvserve'}"
            bad.append(f"{module} imports {imported} ({why})")
    return bad


def _sources():
    return sorted(KVSERVE.rglob("*.py"))


def _known() -> frozenset[str]:
    return frozenset(module_name(p) for p in _sources())


def test_every_module_follows_the_rooms():
    known = _known()
    assert len(known) > 40, "kvserve sources not found"
    bad = []
    for path in _sources():
        bad += violations(module_name(path), path.read_text(), path.name == "__init__.py", known)
    assert not bad, "imports across rooms (docs/architecture.md):\n" + "\n".join(bad)


def test_shared_modules_are_top_level_and_exist():
    for name in SHARED:
        assert (KVSERVE / f"{name}.py").is_file(), name


# ---- the checker itself must flag what it is meant to flag

KNOWN = frozenset(
    {
        "kvserve.runner",
        "kvserve.runner.model_runner",
        "kvserve.runner.backends",
        "kvserve.runner.layer_stack",
        "kvserve.runner.sampler",
        "kvserve.spec",
        "kvserve.spec.rejection",
        "kvserve.core",
        "kvserve.core.scheduler",
        "kvserve.engine",
        "kvserve.engine.llm",
        "kvserve.ops",
        "kvserve.ops.cpu_kernels",
        "kvserve.model",
        "kvserve.model.quant",
        "kvserve.server",
    }
)


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("kvserve.core.fake", "import torch\n", "imports torch"),
        (
            "kvserve.core.fake",
            "from kvserve.runner import model_runner\n",
            "imports kvserve.runner.model_runner",
        ),
        (
            "kvserve.core.fake",
            "from ..runner.model_runner import ModelRunner\n",
            "imports kvserve.runner.model_runner",
        ),
        (
            "kvserve.ops.fake",
            "def f():\n    from kvserve.model import quant\n",
            "imports kvserve.model.quant",
        ),
        ("kvserve.ops.fake", "import kvserve.config\n", "imports kvserve.config"),
        (
            "kvserve.model.fake",
            "from kvserve.engine.llm import LLM\n",
            "imports kvserve.engine.llm",
        ),
        (
            "kvserve.engine.fake",
            "import importlib\nimportlib.import_module('kvserve.server.app')\n",
            "imports kvserve.server.app",
        ),
        (
            "kvserve.server.fake",
            "from kvserve.core.scheduler import QueueFullError\n",
            "imports kvserve.core.scheduler",
        ),
        (
            "kvserve.server.fake",
            "from kvserve.runner.model_runner import ModelRunner\n",
            "imports kvserve.runner",
        ),
        ("kvserve.newroom.fake", "x = 1\n", "has no entry in RULES"),
        (
            "kvserve.runner.fake",
            "from kvserve.spec.rejection import RejectionSampler\n",
            "imports kvserve.spec.rejection",
        ),
        (
            "kvserve.runner.backends.fake",
            "from kvserve.runner.model_runner import ModelRunner\n",
            "imports kvserve.runner.model_runner",
        ),
        (
            "kvserve.runner.backends.fake",
            "from ..sampler import Sampler\n",
            "imports kvserve.runner.sampler",
        ),
        (
            "kvserve.engine.fake",
            "from kvserve.runner.backends import TorchForward\n",
            "only ['runner'] may enter runner.backends",
        ),
    ],
)
def test_checker_flags_violations(module, source, expected):
    bad = violations(module, source, known=KNOWN)
    assert len(bad) == 1 and expected in bad[0], bad


@pytest.mark.parametrize(
    "module, source, is_package",
    [
        (
            "kvserve.core.fake",
            "from kvserve.config import SchedulerConfig\nfrom . import request\n",
            False,
        ),
        ("kvserve.ops", "from .cpu_kernels import gguf_gemv\nimport torch\n", True),
        ("kvserve.runner.model_runner", "from kvserve.runner.backends import StepBatch\n", False),
        (
            "kvserve.runner.backends.fake",
            "from kvserve.runner.layer_stack import CLayerStack\nfrom . import base\n",
            False,
        ),
        (
            "kvserve.model.fake",
            "from kvserve.ops import cpu_kernels\nfrom kvserve.model.quant import GROUP\n",
            False,
        ),
        (
            "kvserve.server.fake",
            "from kvserve.engine.errors import QueueFullError\nfrom kvserve import __version__\n",
            False,
        ),
    ],
)
def test_checker_allows_what_the_rooms_allow(module, source, is_package):
    assert violations(module, source, is_package, known=KNOWN) == []
