"""The Hugging Face transformers peer: the same GGUF dequantized to fp32, static batches with
left padding, greedy, exactly max_tokens per request (only each request's own max_tokens count)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from tqdm import tqdm

from kvserve.bench.datasets import BenchRequest

HF_INSTALL = (
    "the hf peer needs transformers: pip install 'kvserve[peers]' (or pip install transformers)"
)


def hf_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def peer_device(args) -> tuple[str, str]:
    """The device and compute dtype the peer runs with: those kvserve resolves from the same flags
    (EngineConfig.on_device), so both engines compute alike."""
    import torch

    from kvserve.config import engine_config_from_args

    cfg = engine_config_from_args(args)
    cfg = cfg.on_device(cfg.device != "cpu" and torch.cuda.is_available())
    return cfg.device, cfg.model.dtype


def load_hf(gguf: str, threads: int, device: str = "cpu", dtype: str = "float32"):
    """AutoModelForCausalLM from the GGUF (dequantized to `dtype`) on `device`, eval mode,
    `threads` torch threads."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    p = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=getattr(torch, dtype)
    )
    return model.to(device).eval()


def _pad_id(model) -> int:
    cfg = model.generation_config
    for v in (cfg.pad_token_id, model.config.pad_token_id, cfg.eos_token_id):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def generate_batch(model, batch: list[BenchRequest], max_new: int | None = None) -> list[int]:
    """One static batch, left-padded; every row runs max(max_tokens) steps (EOS ignored via
    min_new_tokens). Returns the tokens generated per row."""
    import torch

    steps = max_new or max(r.max_tokens for r in batch)
    width = max(len(r.prompt_ids) for r in batch)
    pad = _pad_id(model)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=pad,
        )
    if out.is_cuda:
        torch.cuda.synchronize()
    return [out.shape[1] - width] * len(batch)


def run_static(model, requests: list[BenchRequest], batch_size: int, progress: bool = True) -> dict:
    """All requests in dataset order, `batch_size` at a time; wall time and token counts."""
    bar = tqdm(
        total=len(requests), desc=f"hf static batch {batch_size}", unit="req", disable=not progress
    )
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        generated += sum(generate_batch(model, batch))
        bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    return {"elapsed": elapsed, "generated_tokens": generated}


def time_single(model, req: BenchRequest, max_new: int) -> float:
    start = time.perf_counter()
    generate_batch(model, [req], max_new)
    return time.perf_counter() - start
