"""kvserve eval-quality: how much each weight format costs in quality against fp32 dequantized
weights.

A fixed offline text (docstrings of standard-library modules, in a fixed order: it ships with
Python) is cut into windows (512 tokens by default); each window is run through every format's
model from position 0 over a paged KV pool, and at every position we compare the format's
next-token distribution with the fp32 reference's:

    ppl       exp(mean negative log-likelihood of the text's next token)
    top-1     share of positions where the format's argmax equals the reference's
    KL        mean KL(p_ref || p_fmt) in nats

    |dlogp|   mean and max |log p_fmt(next token) - log p_ref(next token)|

Bound for a format to be acceptable: ppl within 1% of fp32, top-1 agreement >= 97% (over the
whole text; a single kind of the varied text below may agree less often).

`--text varied` measures instead a text of several kinds, each reported on its own: Python source
(standard-library modules), English prose (the docstrings above), multi-turn chats rendered with
the model's chat template, and passages in German, French, Spanish, Russian, Chinese, Japanese,
Italian and Portuguese (kvserve/bench/data/quality-text.json). Windows never cross two kinds.

`--reference MODEL` takes the fp32 reference from another checkpoint of the same vocabulary (a
GPTQ / AWQ model against the float model it was quantized from): the formats then run --model.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import os
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


VARIED_DATA = os.path.join(os.path.dirname(__file__), "bench", "data", "quality-text.json")
# Tokens of each open-ended kind of the varied text (the written kinds are used whole).
VARIED_CAPS = {"code": 7168, "prose": 7168}


def varied_texts(tokenizer, data_path: str = VARIED_DATA) -> dict[str, str]:
    """{kind: text} of the varied text: code (the source of the data file's standard-library
    modules), prose (corpus_text), chat (every conversation through the model's chat template,
    plain role-prefixed turns when it has none) and one kind per language."""
    with open(data_path, encoding="utf-8") as f:
        data = json.load(f)
    code = []
    for name in data["code_modules"]:
        try:
            code.append(inspect.getsource(importlib.import_module(name)))
        except (ImportError, OSError, TypeError):
            continue
    chats = []
    for conv in data["chat"]:
        try:
            chats.append(tokenizer.apply_chat_template(conv, add_generation_prompt=False))
        except Exception:  # no usable template: the turns as plain text
            chats.append("\n".join(f"{m['role']}: {m['content']}" for m in conv))
    texts = {"code": "\n\n".join(code), "prose": corpus_text(), "chat": "\n".join(chats)}
    for lang, passages in data["languages"].items():
        texts[lang] = "\n\n".join(passages)
    return texts


def tokenize_kinds(tokenizer, texts: dict[str, str], max_tokens: int | None = None) -> dict:
    """{kind: ids}, each kind cut to VARIED_CAPS (and to max_tokens when given)."""
    out = {}
    for kind, text in texts.items():
        cap = min(VARIED_CAPS.get(kind, 1 << 30), max_tokens or 1 << 30)
        out[kind] = tokenizer.encode(text)[: cap + 1]
    return out


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


def evaluate(
    models: dict, ids: list[int] | dict[str, list[int]], window: int, progress: bool = True
) -> dict:
    """models: {format: LoadedModel}, "none" first (the reference). ids: one text's token ids, or
    {kind: ids} (windows never cross kinds). -> {format: metrics} over everything; with kinds,
    each format's metrics also hold "kinds": {kind: metrics}."""
    from tqdm import tqdm

    kinds = ids if isinstance(ids, dict) else {"text": ids}

    def fresh():
        return {"nll": 0.0, "agree": 0, "kl": 0.0, "n": 0, "seconds": 0.0, "dsum": 0.0, "dmax": 0.0}

    stats = {(k, f): fresh() for k in kinds for f in models}
    work = [(k, s) for k, kid in kinds.items() for s in range(0, len(kid) - 1, window)]
    for kind, s in tqdm(work, desc="eval-quality", unit="window", disable=not progress):
        chunk = kinds[kind][s : s + window + 1]
        if len(chunk) < 2:
            continue
        inp, target = chunk[:-1], torch.tensor(chunk[1:])
        ref_logp = None
        for fmt, lm in models.items():
            t0 = time.perf_counter()
            spec = parse_format(fmt)
            run = window_logits_decode if spec.decode else window_logits
            logp = F.log_softmax(run(lm, inp, spec.kv_dtype), dim=-1)
            st = stats[kind, fmt]
            st["seconds"] += time.perf_counter() - t0
            tok = logp.gather(1, target[:, None])[:, 0]
            if ref_logp is None:
                ref_logp, ref_top, ref_tok = logp, logp.argmax(-1), tok
            delta = (tok - ref_tok).abs()
            st["nll"] += -tok.sum().item()
            st["agree"] += int((logp.argmax(-1) == ref_top).sum())
            st["kl"] += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            st["dsum"] += delta.sum().item()
            st["dmax"] = max(st["dmax"], delta.max().item())
            st["n"] += len(inp)

    def metrics(sts: list[dict]) -> dict:
        tot = {key: sum(st[key] for st in sts) for key in ("nll", "agree", "kl", "n", "seconds")}
        n = max(tot["n"], 1)
        return {
            "ppl": math.exp(tot["nll"] / n),
            "top1": tot["agree"] / n,
            "kl": tot["kl"] / n,
            "dlogp_mean": sum(st["dsum"] for st in sts) / n,
            "dlogp_max": max(st["dmax"] for st in sts),
            "tokens": tot["n"],
            "seconds": tot["seconds"],
        }

    def judge(by_fmt: dict) -> dict:
        ref = by_fmt[next(iter(by_fmt))]["ppl"]
        for m in by_fmt.values():
            m["ppl_ratio"] = m["ppl"] / ref
            m["ppl_delta"] = m["ppl_ratio"] - 1
            m["ok"] = abs(m["ppl_delta"]) <= PPL_BOUND and m["top1"] >= TOP1_BOUND
        return by_fmt

    out = judge({f: metrics([stats[k, f] for k in kinds]) for f in models})
    if isinstance(ids, dict):
        per_kind = {k: judge({f: metrics([stats[k, f]]) for f in models}) for k in kinds}
        for f in models:
            out[f]["kinds"] = {k: per_kind[k][f] for k in kinds}
    return out


def format_table(results: dict) -> str:
    lines = [
        f"{'format':<18} {'ppl':>9} {'Δppl':>8} {'top-1':>8} {'KL (nats)':>10} "
        f"{'|Δlogp|':>8} {'max':>6} {'tokens':>7} {'s':>7}  within bound",
        "-" * 103,
    ]
    for fmt, m in results.items():
        lines.append(
            f"{fmt:<18} {m['ppl']:>9.4f} {m['ppl_delta'] * 100:>7.2f}% {m['top1'] * 100:>7.2f}% "
            f"{m['kl']:>10.5f} {m['dlogp_mean']:>8.4f} {m['dlogp_max']:>6.2f} {m['tokens']:>7} "
            f"{m['seconds']:>7.1f}  {'yes' if m['ok'] else 'NO'}"
        )
    return "\n".join(lines)


def format_kinds(results: dict) -> str:
    """Per text kind: each format's perplexity ratio to float32, top-1 agreement and mean
    |Δlogp| (empty without kinds)."""
    fmts = [f for f in results if f != "none" and "kinds" in results[f]]
    if not fmts:
        return ""
    kinds = list(results[fmts[0]]["kinds"])
    head = f"{'kind':<7} {'tokens':>6} {'ppl fp32':>9}" + "".join(f" {f:>22}" for f in fmts)
    lines = [head, f"{'':<24}" + "".join(f" {'ppl×  top-1  |Δlogp|':>22}" for _ in fmts)]
    for k in kinds:
        ref = results["none"]["kinds"][k]
        row = f"{k:<7} {ref['tokens']:>6} {ref['ppl']:>9.3f}"
        for f in fmts:
            m = results[f]["kinds"][k]
            row += f" {m['ppl_ratio']:>7.4f} {m['top1'] * 100:>6.2f}% {m['dlogp_mean']:>6.4f}"
        lines.append(row)
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
    p.add_argument(
        "--text",
        choices=("stdlib", "varied"),
        default="stdlib",
        help="stdlib: standard-library docstrings; varied: code, prose, chat and eight languages, "
        "each kind reported on its own, --max-tokens per kind (default: %(default)s)",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="the fp32 reference from this GGUF file or HF directory instead of --model (same "
        "vocabulary), e.g. the float model a GPTQ / AWQ checkpoint was quantized from",
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
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
    reference = "fp32 dequantized weights"
    if args.reference:
        ref = load_model(ModelConfig(model=args.reference, quantization="none"))
        if ref.arch.vocab_size != models["none"].arch.vocab_size:
            p.error(
                f"--reference has a vocabulary of {ref.arch.vocab_size}, --model "
                f"{models['none'].arch.vocab_size}: pass a checkpoint of the same model"
            )
        models["none"], reference = ref, f"fp32 weights of {ref.path}"
    tokenizer = models["none"].tokenizer
    if args.text == "varied":
        texts = varied_texts(tokenizer)
        ids = tokenize_kinds(tokenizer, texts, args.max_tokens)
        text = "".join(texts.values())
        n_tokens = sum(len(x) - 1 for x in ids.values())
        what = "varied (" + ", ".join(f"{k} {len(x) - 1}" for k, x in ids.items()) + ")"
    else:
        text = corpus_text()
        ids = tokenizer.encode(text)[: args.max_tokens + 1]
        n_tokens, what = len(ids) - 1, "stdlib docstrings"
    print(
        f"model: {loaded['none'].path}\ntext: {what}, {len(text)} chars, "
        f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, {n_tokens} tokens used, "
        f"{args.window}-token windows, reference: {reference}",
        flush=True,
    )
    results = evaluate(models, ids, args.window, progress=not args.no_progress)
    print(format_table(results))
    if args.text == "varied":
        print(format_kinds(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": loaded["none"].path,
                    "reference": reference,
                    "text": what,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0 if all(m["ok"] for m in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
