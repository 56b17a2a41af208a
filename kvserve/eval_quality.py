"""kvserve eval-quality: how much each weight format costs in quality against fp32 dequantized
weights.

A fixed offline text (docstrings of standard-library modules, in a fixed order: it ships with
Python) is cut into windows (512 tokens by default); each window is run through every format's
model from position 0 over a paged KV pool, and at every position we compare the format's
next-token distribution with the fp32 reference's:

    ppl       exp(mean negative log-likelihood of the text's next token)
    top-1     share of positions where the format's argmax equals the reference's
    KL        mean KL(p_ref || p_fmt) in nats

Bound for a format to be acceptable: ppl within 1% of fp32, top-1 agreement >= 97%.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODULES = (
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "mimetypes",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "shlex",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "zipfile",
)
DECODE_SUFFIX = ":decode"  # "gguf:decode": the format's model fed token by token (decode kernels)
KV_SEPARATOR = "@"  # "gguf:decode@int8": ... with an int8 KV cache
KV_DTYPES = ("float32", "float16", "int8")  # the KV caches eval-quality measures


@dataclass(frozen=True)
class FormatSpec:
    weights: str  # a weight format of kvserve.model.quant.FORMATS
    decode: bool  # fed token by token (decode steps) instead of window prefills
    kv_dtype: str  # float32 | float16 | int8


def parse_format(text: str) -> FormatSpec:
    """'gguf' | 'gguf:decode' | 'none@int8' | 'gguf:decode@float16' -> FormatSpec."""
    rest, _, kv = text.partition(KV_SEPARATOR)
    return FormatSpec(
        rest.removesuffix(DECODE_SUFFIX), rest.endswith(DECODE_SUFFIX), kv or "float32"
    )


PPL_BOUND = 0.01
TOP1_BOUND = 0.97


def corpus_text() -> str:
    """Docstrings of MODULES and of their public classes/functions (sorted by name), joined."""
    parts = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if mod.__doc__:
            parts.append(inspect.cleandoc(mod.__doc__))
        members = vars(mod)
        for attr in sorted(members):
            obj = members[attr]
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) != mod.__name__ or not obj.__doc__:
                continue
            parts.append(f"{attr}: {inspect.cleandoc(obj.__doc__)}")
    return "\n\n".join(parts)


class _Pool:
    """One window's paged KV pool: contiguous blocks 0..n-1 (a fresh context per window), float32,
    float16 or int8 rows (kvserve.ops.kv_int8)."""

    def __init__(self, arch, tokens: int, kv_dtype: str = "float32", block: int = 16):
        from kvserve.ops import kv_int8

        self.block = block
        n = -(-tokens // block)
        shape = (n, block, arch.num_kv_heads, arch.head_dim)
        dtype = torch.float32
        if kv_dtype == "int8":
            shape, dtype = kv_int8.pool_shape(*shape), torch.int8
        elif kv_dtype == "float16":
            dtype = torch.float16
        elif kv_dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype {kv_dtype!r}: eval-quality measures {', '.join(KV_DTYPES)}")
        self.kv = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(arch.num_layers)
        ]
        self.table = torch.arange(n)[None]


_STACKS: dict = {}


def forward(
    lm, ids: torch.Tensor, positions: torch.Tensor, meta, kv, prompt_len: int
) -> torch.Tensor:
    """Final hidden states of every row (one sequence whose first `prompt_len` tokens are its
    prompt), computed as the engine computes them: through the C layer stack when the runner
    would use it for these weights (runner/layer_stack.py), else through the model's PyTorch
    forward."""
    from kvserve.runner.layer_stack import CLayerStack

    key = id(lm.model)
    if key not in _STACKS:
        _STACKS[key] = CLayerStack.build(lm.model)
    stack = _STACKS[key]
    if stack is not None and stack.runs(kv):
        return stack(ids, positions, meta, kv, torch.arange(ids.shape[0]), [prompt_len])
    return lm.model(ids, positions, meta, kv)


@torch.inference_mode()
def window_logits(lm, ids: list[int], kv_dtype: str = "float32") -> torch.Tensor:
    """Logits [len(ids), V] (float32) of one window prefilled from position 0."""
    from kvserve.ops.attention import AttentionMetadata

    T = len(ids)
    pool = _Pool(lm.arch, T, kv_dtype)
    meta = AttentionMetadata(torch.arange(T), [0, T], [T], pool.table, pool.block)
    hidden = forward(lm, torch.tensor(ids), torch.arange(T), meta, pool.kv, prompt_len=T)
    return lm.model.compute_logits(hidden)


@torch.inference_mode()
def window_logits_decode(lm, ids: list[int], kv_dtype: str = "float32") -> torch.Tensor:
    """Logits [len(ids), V] of one window fed one token per step, as decode steps run (batch of
    one row: the kernels a single-stream decode uses, e.g. the C layer stack). Every position
    then attends over keys/values read back from the pool (with an int8 pool: quantized)."""
    from kvserve.ops.attention import AttentionMetadata

    T = len(ids)
    pool = _Pool(lm.arch, T, kv_dtype)
    hidden = []
    for p in range(T):
        meta = AttentionMetadata(torch.tensor([p]), [0, 1], [p + 1], pool.table, pool.block)
        hidden.append(
            forward(
                lm, torch.tensor(ids[p : p + 1]), torch.tensor([p]), meta, pool.kv, prompt_len=0
            )
        )
    return lm.model.compute_logits(torch.cat(hidden))


def evaluate(models: dict, ids: list[int], window: int, progress: bool = True) -> dict:
    """models: {format: LoadedModel}, "none" first (the reference). -> {format: metrics}."""
    from tqdm import tqdm

    stats = {f: {"nll": 0.0, "agree": 0, "kl": 0.0, "n": 0, "seconds": 0.0} for f in models}
    starts = list(range(0, len(ids) - 1, window))
    for s in tqdm(starts, desc="eval-quality", unit="window", disable=not progress):
        chunk = ids[s : s + window + 1]
        if len(chunk) < 2:
            continue
        inp, target = chunk[:-1], torch.tensor(chunk[1:])
        ref_logp = None
        for fmt, lm in models.items():
            t0 = time.perf_counter()
            spec = parse_format(fmt)
            run = window_logits_decode if spec.decode else window_logits
            logp = F.log_softmax(run(lm, inp, spec.kv_dtype), dim=-1)
            st = stats[fmt]
            st["seconds"] += time.perf_counter() - t0
            if ref_logp is None:
                ref_logp, ref_top = logp, logp.argmax(-1)
            st["nll"] += -logp.gather(1, target[:, None]).sum().item()
            st["agree"] += int((logp.argmax(-1) == ref_top).sum())
            st["kl"] += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            st["n"] += len(inp)
    out = {}
    for fmt, st in stats.items():
        n = max(st["n"], 1)
        out[fmt] = {
            "ppl": math.exp(st["nll"] / n),
            "top1": st["agree"] / n,
            "kl": st["kl"] / n,
            "tokens": st["n"],
            "seconds": st["seconds"],
        }
    ref = out[next(iter(out))]["ppl"]
    for m in out.values():
        m["ppl_delta"] = m["ppl"] / ref - 1
        m["ok"] = abs(m["ppl_delta"]) <= PPL_BOUND and m["top1"] >= TOP1_BOUND
    return out


def format_table(results: dict) -> str:
    lines = [
        f"{'format':<18} {'ppl':>9} {'Δppl':>8} {'top-1':>8} {'KL (nats)':>10} "
        f"{'tokens':>7} {'s':>7}  within bound",
        "-" * 86,
    ]
    for fmt, m in results.items():
        lines.append(
            f"{fmt:<18} {m['ppl']:>9.4f} {m['ppl_delta'] * 100:>7.2f}% {m['top1'] * 100:>7.2f}% "
            f"{m['kl']:>10.5f} {m['tokens']:>7} {m['seconds']:>7.1f}  {'yes' if m['ok'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvserve eval-quality", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: the default model)"
    )
    p.add_argument(
        "--formats",
        default="none,int8,int4,gguf,gguf:decode",
        help="comma-separated weight formats; the reference fp32 'none' is always included. "
        "FORMAT:decode feeds the text one token per step, through the decode kernels "
        "(the C layer stack for gguf), instead of whole-window prefills; "
        "FORMAT@int8 or FORMAT@float16 uses that KV cache dtype instead of float32 "
        "(e.g. none@int8, gguf:decode@float16, what the engine keeps by default)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=24576,
        help="tokens of the text to use (default: %(default)s)",
    )
    p.add_argument(
        "--window", type=int, default=512, help="tokens per window (default: %(default)s)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model
    from kvserve.model.quant import FORMATS

    formats = ["none"] + [f for f in args.formats.split(",") if f and f != "none"]
    specs = {f: parse_format(f) for f in formats}
    for f, spec in specs.items():
        if spec.weights not in FORMATS or spec.kv_dtype not in KV_DTYPES:
            p.error(
                f"unknown format {f!r}: "
                f"FORMAT[{DECODE_SUFFIX}][{KV_SEPARATOR}{'|'.join(KV_DTYPES)}], FORMAT one of "
                f"{', '.join(FORMATS)}"
            )
    loaded = {}
    for spec in specs.values():
        if spec.weights not in loaded:
            loaded[spec.weights] = load_model(
                ModelConfig(model=args.model, quantization=spec.weights)
            )
    models = {f: loaded[spec.weights] for f, spec in specs.items()}
    text = corpus_text()
    ids = models["none"].tokenizer.encode(text)[: args.max_tokens + 1]
    print(
        f"model: {models['none'].path}\ntext: stdlib docstrings, {len(text)} chars, "
        f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, {len(ids) - 1} tokens used, "
        f"{args.window}-token windows, reference: fp32 dequantized weights",
        flush=True,
    )
    results = evaluate(models, ids, args.window, progress=not args.no_progress)
    print(format_table(results))
    return 0 if all(m["ok"] for m in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
