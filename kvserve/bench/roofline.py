"""`kvserve bench roofline`: this machine's limits, and how close a model gets to them.

Machine (torch, --threads threads, about --seconds per figure): peak matmul FLOP/s in fp32, bf16 and
int8 (fbgemm's dynamically quantized linear, and torch._int_mm), and memory bandwidth (sum over
and copy of a 256 MiB tensor, far larger than the caches).
Model (kvserve.LLM): decode MBU = (weight bytes + KV bytes read per step) / step time / read
bandwidth at batch 1 (median over 5 requests, each against the read bandwidth measured right
before and after it, the higher of the two); MFU = achieved matmul FLOP/s / the compute dtype's
peak for a long prefill and for a batch of concurrent decodes. FLOPs count the linear layers
(2 x in x out per token), the LM head at sampled positions only, and causal attention.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import statistics
import sys
import time
import warnings

from kvserve.bench import common
from kvserve.bench.throughput import add_output_args

DECODE_REPEATS = 5
BANDWIDTH_PROBE_S = 0.4  # each read-bandwidth measurement beside a batch-1 decode request
MATMUL_SHAPES = [(1024, 1024, 1024), (256, 576, 1536), (512, 2048, 2048)]  # (M, K, N)


def timeit(fn, seconds: float) -> float:
    """Seconds per call: one warm-up call, then as many calls as fit in `seconds` (at least 3)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def matmul_kernels(m: int, k: int, n: int) -> dict:
    """name -> a call computing one [m, k] x [k, n] product with that kernel."""
    import torch

    a, w = torch.randn(m, k), torch.randn(n, k)
    ab, wb = a.bfloat16(), w.bfloat16()
    ai = torch.randint(-127, 127, (m, k), dtype=torch.int8)
    wi = torch.randint(-127, 127, (k, n), dtype=torch.int8)
    kernels = {
        "fp32": lambda: torch.nn.functional.linear(a, w),
        "bf16": lambda: torch.nn.functional.linear(ab, wb),
        "int8_int_mm": lambda: torch._int_mm(ai, wi),
    }
    if (
        torch.backends.mkldnn.is_available()
    ):  # oneDNN's fp32 GEMM; F.linear's goes to MKL / OpenBLAS
        am, wm = a.to_mkldnn(), w.to_mkldnn()
        kernels["fp32_onednn"] = lambda: torch._C._nn.mkldnn_linear(am, wm)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wq = torch.quantize_per_channel(
                w, w.abs().amax(1) / 127, torch.zeros(n, dtype=torch.long), 0, torch.qint8
            )
        packed = torch.ops.quantized.linear_prepack(wq, None)
        kernels["int8_dynamic_linear"] = lambda: torch.ops.quantized.linear_dynamic(a, packed)
    except (RuntimeError, AttributeError):
        pass
    return kernels


def matmul_peaks(seconds: float, rounds: int = 2) -> dict:
    """Best GFLOP/s over MATMUL_SHAPES for each kernel; kernels interleaved over `rounds` rounds so
    that a burst of load from elsewhere does not land on one kernel only."""
    out: dict[str, dict] = {}
    shapes = {s: matmul_kernels(*s) for s in MATMUL_SHAPES}
    per = seconds / rounds / sum(len(k) for k in shapes.values())
    for _ in range(rounds):
        for (m, k, n), kernels in shapes.items():
            for name, fn in kernels.items():
                try:
                    g = 2 * m * k * n / timeit(fn, per) / 1e9
                except RuntimeError:
                    continue
                if g > out.get(name, {}).get("gflops", 0):
                    out[name] = {"gflops": g, "shape_mkn": [m, k, n]}
    return out


def _tensor(mib: int):
    import torch

    return torch.ones(mib * 2**20 // 4)


def read_gbs(x, seconds: float) -> float:
    """Read bandwidth (GB/s) of a sum over x, for about `seconds`."""
    return x.numel() * x.element_size() / timeit(lambda: x.sum(), seconds) / 1e9


def read_bandwidth_probe(mib: int = 256):
    """read_gbs over one tensor of `mib` MiB (far larger than the caches), allocated once: a call
    taking seconds."""
    return functools.partial(read_gbs, _tensor(mib))


def memory_bandwidth(seconds: float, mib: int = 256) -> dict:
    import torch

    x = _tensor(mib)
    read = read_gbs(x, seconds / 2)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 4 / timeit(lambda: y.copy_(x), seconds / 2) / 1e9
    return {"read_gbs": read, "copy_gbs": copy, "tensor_mib": mib}


def _read_tensors(model):
    """(name, tensor) of what a forward pass reads: every module's own parameters and buffers, less
    rotary tables, and where a module keeps a packed copy of its weight (packed*, kernels read
    that and its scales; gguf_packed: the GGUF blocks of the C kernel), only that copy. (Layers
    with a batch fp16 copy read only the packed copy at batch 1; fp16-only layers are counted by
    model_facts from fp16_nbytes.)"""
    for mod_name, mod in model.named_modules():
        own = list(
            itertools.chain(mod.named_parameters(recurse=False), mod.named_buffers(recurse=False))
        )
        if any(n.startswith(("packed", "gguf_packed")) for n, _ in own):
            own = [(n, t) for n, t in own if n.startswith(("packed", "scale", "gguf_packed"))]
        for n, t in own:
            if t is not None and not any(s in n for s in ("cos", "sin", "inv_freq")):
                yield f"{mod_name}.{n}", t


def model_facts(llm) -> dict:
    """Weight bytes a decode step reads, and matmul parameters per token, from the loaded module."""
    model, arch = llm.engine.runner.model, llm.engine.arch
    seen, weight_bytes, embed_bytes = set(), 0, 0
    for name, mod in model.named_modules():
        if (
            not hasattr(mod, "packed4")
            and getattr(mod, "gguf_packed", None) is None
            and hasattr(mod, "fp16_nbytes")
        ):
            weight_bytes += (
                mod.fp16_nbytes
            )  # fbgemm's packed fp16 weight: an opaque object, not a tensor
    for name, t in _read_tensors(model):
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        weight_bytes += nbytes
        if "embed" in name:
            embed_bytes += nbytes
    if getattr(model, "lm_head", None) is not None:
        weight_bytes -= embed_bytes  # the embedding is only gathered, a few rows a step
    linear_params = sum(
        m.in_features * m.out_features
        for name, m in model.named_modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features") and not name.endswith("lm_head")
    )
    return {
        "weight_bytes_per_step": weight_bytes,
        "linear_params": linear_params,
        "lm_head_params": arch.vocab_size * arch.hidden_size,
        "num_layers": arch.num_layers,
        "num_heads": arch.num_heads,
        "head_dim": arch.head_dim,
        "kv_bytes_per_token": llm.engine.kv_shape.bytes_per_token,
    }


def prefill_flops(f: dict, t: int) -> float:
    attn = 2 * f["head_dim"] * f["num_heads"] * t * (t + 1) * f["num_layers"]
    return 2 * f["linear_params"] * t + 2 * f["lm_head_params"] + attn


def decode_flops(f: dict, context: int) -> float:
    return (
        2 * (f["linear_params"] + f["lm_head_params"])
        + 4 * f["head_dim"] * f["num_heads"] * context * f["num_layers"]
    )


def measure_model(args, peaks: dict, bw: dict) -> dict:
    probe = read_bandwidth_probe(bw["tensor_mib"])
    from kvserve import LLM, SamplingParams
    from kvserve.config import engine_config_from_args

    args.no_prefix_caching = True
    llm = LLM(config=engine_config_from_args(args))
    print(llm.engine.describe(), file=sys.stderr)
    f = model_facts(llm)
    vocab = llm.engine.arch.vocab_size

    def prompt(n: int, salt: int) -> dict:
        return {
            "prompt_token_ids": [
                (salt * 7919 + i * 104729) % (vocab - 1000) + 500 for i in range(n)
            ]
        }

    def gen(prompts, out_len):
        t0 = time.perf_counter()
        outs = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True),
            use_tqdm=False,
        )
        return outs, time.perf_counter() - t0

    gen([prompt(16, 0)], 4)  # warm-up
    prefix = (
        "bf16" if llm.engine.config.model.dtype == "bfloat16" else "fp32"
    )  # the compute dtype's best kernel
    peak_kernel = max((k for k in peaks if k.startswith(prefix)), key=lambda k: peaks[k]["gflops"])
    peak = peaks[peak_kernel]["gflops"]
    res: dict = {"facts": f, "mfu_peak": {"kernel": peak_kernel, "gflops": peak}}
    res["decode_batch1"] = _decode_batch1(args, gen, prompt, probe, f, bw, peak)
    res["prefill"] = _prefill(args, gen, prompt, f, peak)
    res["batch_decode"] = _batch_decode(args, gen, prompt, f, bw, peak)
    res["model"] = llm.engine.model_path
    res["dtype"] = llm.engine.config.model.dtype
    res["quantization"] = llm.engine.quantization
    llm = None  # free the model before the peer runs
    gc.collect()
    return res


def _decode_batch1(args, gen, prompt, probe, f: dict, bw: dict, peak: float) -> dict:
    """Decode, batch 1: prompt P, O tokens; step time from the first to the last token, the median
    of DECODE_REPEATS requests (one request is short, and a single one moves on a shared VM).
    The read bandwidth is measured again right before and right after each request: a shared
    VM's bandwidth moves from one minute to the next, so each request's MBU is taken against
    the higher of its two neighbours, and the MBU is the median of those."""
    p, o = args.decode_prompt_len, args.decode_len
    mean_ctx = p + o / 2
    bytes_step = f["weight_bytes_per_step"] + f["kv_bytes_per_token"] * mean_ctx
    steps, reads, mbus = [], [], []
    for r in range(DECODE_REPEATS):
        before = probe(BANDWIDTH_PROBE_S)
        (out,), _ = gen([prompt(p, 1 + r)], o)
        after = probe(BANDWIDTH_PROBE_S)
        steps.append((out.metrics.last_token_time - out.metrics.first_token_time) / (o - 1))
        reads.append([before, after])
        mbus.append(bytes_step / steps[-1] / 1e9 / max(before, after))
    step = statistics.median(steps)
    return {
        "prompt_len": p,
        "output_len": o,
        "step_s": step,
        "step_s_samples": steps,
        "tokens_per_s": 1 / step,
        "bytes_per_step": bytes_step,
        "achieved_gbs": bytes_step / step / 1e9,
        "mbu": statistics.median(mbus),
        "mbu_samples": mbus,
        "read_gbs_samples": reads,
        "mbu_vs_start_bandwidth": bytes_step / step / 1e9 / bw["read_gbs"],
        "mfu": decode_flops(f, int(mean_ctx)) / step / 1e9 / peak,
    }


def _prefill(args, gen, prompt, f: dict, peak: float) -> dict:
    """Prefill: one prompt of T tokens, one output token."""
    t = args.prefill_len
    (out,), _ = gen([prompt(t, 2)], 1)
    pt = out.metrics.first_token_time - (
        out.metrics.first_scheduled_time or out.metrics.arrival_time
    )
    return {
        "tokens": t,
        "seconds": pt,
        "tokens_per_s": t / pt,
        "gflops": prefill_flops(f, t) / pt / 1e9,
        "mfu": prefill_flops(f, t) / pt / 1e9 / peak,
    }


def _batch_decode(args, gen, prompt, f: dict, bw: dict, peak: float) -> dict:
    """Large batch: B concurrent requests, short prompts, O tokens each; FLOPs over the whole
    run."""
    b, bp, bo = args.batch, 16, args.decode_len
    outs, wall = gen([prompt(bp, 100 + i) for i in range(b)], bo)
    total = b * (prefill_flops(f, bp) + sum(decode_flops(f, bp + j) for j in range(1, bo)))
    return {
        "batch": b,
        "prompt_len": bp,
        "output_len": bo,
        "seconds": wall,
        "output_tokens_per_s": b * bo / wall,
        "gflops": total / wall / 1e9,
        "mfu": total / wall / 1e9 / peak,
        "mbu_weights_only": f["weight_bytes_per_step"] * (bo - 1) / wall / 1e9 / bw["read_gbs"],
    }


def bandwidth_beside_decode(d: dict) -> str:
    """One line: the read bandwidth measured beside the batch-1 decode requests, and their MBUs."""
    reads = [g for pair in d["read_gbs_samples"] for g in pair]
    mbus = ", ".join(f"{m * 100:.0f}%" for m in d["mbu_samples"])
    return (
        f"batch-1 MBU per request {mbus} against the read bandwidth measured beside each "
        f"({min(reads):.1f}-{max(reads):.1f} GB/s); against the machine "
        f"figure above: {d['mbu_vs_start_bandwidth'] * 100:.0f}%"
    )


def add_args(p) -> None:
    from kvserve.config import add_engine_args

    g = p.add_argument_group("roofline")
    g.add_argument(
        "--seconds",
        type=float,
        default=3.0,
        help="time for each machine measurement (default: %(default)s)",
    )
    g.add_argument("--no-model", action="store_true", help="measure only the machine")
    g.add_argument(
        "--decode-prompt-len",
        type=int,
        default=128,
        help="batch-1 decode prompt (default: %(default)s)",
    )
    g.add_argument(
        "--decode-len", type=int, default=64, help="decode tokens measured (default: %(default)s)"
    )
    g.add_argument(
        "--prefill-len", type=int, default=512, help="prefill prompt tokens (default: %(default)s)"
    )
    g.add_argument(
        "--batch",
        type=int,
        default=32,
        help="concurrent requests for batch MFU (default: %(default)s)",
    )
    add_engine_args(p)
    add_output_args(p)


def main(args, argv: list[str]) -> int:
    import torch

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    result = common.new_result("roofline", argv, args)
    print(f"measuring this machine with {threads} threads ...", file=sys.stderr)
    peaks = matmul_peaks(args.seconds)
    bw = memory_bandwidth(args.seconds)
    result["machine_peaks"] = {"threads": threads, "matmul": peaks, "memory": bw}
    print(
        common.table(
            ["kernel", "GFLOP/s", "at M,K,N"],
            [[k, v["gflops"], ",".join(map(str, v["shape_mkn"]))] for k, v in peaks.items()],
        )
    )
    print(
        f"memory: read {bw['read_gbs']:.1f} GB/s, copy {bw['copy_gbs']:.1f} GB/s "
        f"(read+write, {bw['tensor_mib']} MiB)"
    )
    if not args.no_model:
        m = measure_model(args, peaks, bw)
        result["model"] = m
        d, pf, bd = m["decode_batch1"], m["prefill"], m["batch_decode"]
        print(
            f"\nmodel {m['model']} ({m['dtype']}, weights {m['quantization']}): "
            f"{m['facts']['weight_bytes_per_step'] / 2**20:.0f} MiB of weights "
            f"read per decode step, {m['facts']['linear_params'] / 1e6:.1f}M matmul params + "
            f"{m['facts']['lm_head_params'] / 1e6:.1f}M LM head"
        )
        print(
            common.table(
                [
                    "regime",
                    "tokens/s",
                    "GB/s or GFLOP/s",
                    "MBU",
                    f"MFU (vs {m['mfu_peak']['kernel']})",
                ],
                [
                    [
                        f"decode batch 1 (P{d['prompt_len']})",
                        d["tokens_per_s"],
                        f"{d['achieved_gbs']:.1f} GB/s",
                        f"{d['mbu'] * 100:.0f}%",
                        f"{d['mfu'] * 100:.1f}%",
                    ],
                    [
                        f"prefill {pf['tokens']} tokens",
                        pf["tokens_per_s"],
                        f"{pf['gflops']:.1f} GFLOP/s",
                        "-",
                        f"{pf['mfu'] * 100:.0f}%",
                    ],
                    [
                        f"decode batch {bd['batch']}",
                        bd["output_tokens_per_s"],
                        f"{bd['gflops']:.1f} GFLOP/s",
                        f"{bd['mbu_weights_only'] * 100:.0f}% (weights)",
                        f"{bd['mfu'] * 100:.0f}%",
                    ],
                ],
            )
        )
        print(bandwidth_beside_decode(d))
    common.save_result(result, args.output, args.save, "roofline")
    return 0
