"""GPU kernel figures (issue 17): the device's copy bandwidth, the Triton paged-attention
kernels' achieved bandwidth against it, and where a decode step's GPU time goes.

    python3 scripts/gpu_kernels.py --output docs/bench-results/gpu-kernels-h200.json
    python3 scripts/gpu_kernels.py --step-breakdown --output ...   (needs the default model)

Times are CUDA-event medians of repeated launches after a warm-up. Attention bytes are what the
kernel must read at least: every K and V row of every context once, plus q and out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.ops import triton_attention  # noqa: E402


def timed(fn, repeat: int = 50, warmup: int = 5, graph: bool = False) -> float:
    """Median seconds of fn() over `repeat` timings between two CUDA events. graph=True captures
    10 calls in a CUDA graph and times its replays (per call): the GPU's time without the host's
    launch cost, which bounds a single eager call of a small kernel (as the engine's captured
    decode steps run them)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    calls = 1
    if graph:
        calls, g = 10, torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        fn = g.replay
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), repeat=20)


def paged_pools(num_seqs: int, ctx: int, hkv: int, d: int, bs: int, dtype, gen):
    """KV pools holding num_seqs contexts of ctx tokens in shuffled blocks, and their tables."""
    per_seq = -(-ctx // bs)
    nblocks = num_seqs * per_seq + 1
    k = torch.randn(nblocks, bs, hkv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(nblocks, bs, hkv, d, device="cuda", generator=gen).to(dtype)
    perm = torch.randperm(nblocks - 1, device="cuda", generator=gen)[: num_seqs * per_seq]
    tables = perm.view(num_seqs, per_seq).to(torch.int32)
    return k, v, tables


def decode_attention(
    num_seqs: int, ctx: int, hq: int, hkv: int, d: int, dtype, sm_count: int, gen
) -> dict:
    from kvserve.ops.attention import decode_splits

    bs = 16
    k, v, tables = paged_pools(num_seqs, ctx, hkv, d, bs, dtype, gen)
    q = torch.randn(num_seqs, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    rows = torch.arange(num_seqs, dtype=torch.int32, device="cuda")
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    splits = decode_splits(num_seqs, hkv, sm_count)

    def call():
        triton_attention.paged_decode_attention(
            q, k, v, out, rows, lens, tables, d**-0.5, None, splits
        )

    t_eager, t = timed(call), timed(call, graph=True)
    nbytes = 2 * num_seqs * ctx * hkv * d * k.element_size() + 2 * q.numel() * q.element_size()
    return {
        "kernel": "decode",
        "seqs": num_seqs,
        "context": ctx,
        "heads": f"{hq}/{hkv}x{d}",
        "kv_dtype": str(dtype).removeprefix("torch."),
        "splits": splits,
        "us": round(t * 1e6, 1),
        "eager_call_us": round(t_eager * 1e6, 1),
        "bytes": nbytes,
        "gb_per_s": round(nbytes / t / 1e9, 1),
    }


def prefill_attention(num_seqs: int, ctx: int, hq: int, hkv: int, d: int, gen) -> dict:
    bs = 16
    k, v, tables = paged_pools(num_seqs, ctx, hkv, d, bs, torch.bfloat16, gen)
    q = torch.randn(num_seqs * ctx, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(0, (num_seqs + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    seqs = torch.arange(num_seqs, dtype=torch.int32, device="cuda")
    t = timed(
        lambda: triton_attention.paged_prefill_attention(
            q, k, v, out, seqs, qsl, lens, tables, ctx, d**-0.5, None
        ),
        repeat=20,
        graph=True,
    )
    flops = 4 * num_seqs * hq * d * ctx * ctx / 2  # causal: half of QK^T and PV
    ref = torch.nn.functional.scaled_dot_product_attention
    qb = q.view(num_seqs, ctx, hq, d).transpose(1, 2)
    kb = torch.randn(num_seqs, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    t_sdpa = timed(lambda: ref(qb, kb, kb, is_causal=True, enable_gqa=True), repeat=20, graph=True)
    return {
        "kernel": "prefill",
        "seqs": num_seqs,
        "context": ctx,
        "heads": f"{hq}/{hkv}x{d}",
        "us": round(t * 1e6, 1),
        "tflop_per_s": round(flops / t / 1e12, 1),
        "torch_sdpa_contiguous_us": round(t_sdpa * 1e6, 1),
    }


def step_breakdown(batch: int, ctx: int) -> dict:
    """One engine's decode steps at `batch` requests: wall time per step with CUDA graphs and
    eagerly, and the eager step's GPU time by kernel family (torch.profiler)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from kvserve import LLM, SamplingParams

    llm = LLM(
        device="cuda",
        kv_cache_memory="4GiB",
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=8192,
    )
    engine = llm.engine
    prompt = list(range(1000, 1000 + ctx))
    params = SamplingParams(temperature=0.0, max_tokens=2048, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [7 + i] + prompt, params)
    while (
        any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    figures = {}
    graphs = engine.runner.backend.graphs
    for mode in ("graphs", "eager"):
        engine.runner.backend.graphs = graphs if mode == "graphs" else None
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        figures[f"step_ms_{mode}"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    engine.runner.backend.graphs = None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    engine.runner.backend.graphs = graphs
    families = {
        "attention": ("_decode_split_kernel", "_decode_merge_kernel", "_prefill_kernel"),
        "kv_write": ("index_copy", "indexcopy"),
        "gemm": ("gemm", "cutlass", "nvjet", "sm90", "cublas", "gemv"),
        "norm": ("_rms_norm_kernel",),
        "rope": ("_rope_kernel",),
        "sampling": ("argmax", "softmax", "topk", "sort"),
    }
    by_family: dict[str, float] = {}
    for ev in prof.key_averages():
        if (
            not str(ev.device_type).endswith("CUDA")
            or getattr(ev, "self_device_time_total", 0) <= 0
        ):
            continue
        name = ev.key.lower()
        fam = next((f for f, keys in families.items() if any(k in name for k in keys)), "other")
        by_family[fam] = (
            by_family.get(fam, 0.0) + ev.self_device_time_total / 10 / 1e3
        )  # ms per step
    figures["gpu_ms_per_step_by_kernel_family"] = {
        k: round(v, 3) for k, v in sorted(by_family.items())
    }
    figures["gpu_ms_per_step"] = round(sum(by_family.values()), 3)
    for i in range(batch):
        engine.abort_request(f"r{i}")
    return {"batch": batch, "context": ctx, **figures}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", default=None, help="write the JSON here too")
    p.add_argument(
        "--step-breakdown",
        action="store_true",
        help="also the engine's decode step (default model)",
    )
    p.add_argument(
        "--steps-only", action="store_true", help="skip the kernel and copy measurements"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import datetime
    import shlex

    from kvserve.bench import common

    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    result = {
        "kind": "gpu-kernels",
        "command": "python3 scripts/gpu_kernels.py " + shlex.join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": common.machine_info(),
        "versions": common.versions(),
        "device": props.name,
        "sm_count": props.multi_processor_count,
    }
    if not args.steps_only:
        copy = copy_bandwidth()
        result["copy_gb_per_s"] = round(copy / 1e9, 1)
        rows = []
        for hq, hkv, d in ((9, 3, 64), (32, 8, 128)):  # SmolLM2-135M; a Llama-3-8B layer
            for seqs, ctx in ((1, 4096), (1, 32768), (64, 1024), (64, 4096), (256, 2048)):
                for dtype in (torch.bfloat16, torch.float8_e4m3fn):
                    r = decode_attention(
                        seqs, ctx, hq, hkv, d, dtype, props.multi_processor_count, gen
                    )
                    r["of_copy_bandwidth"] = round(r["gb_per_s"] * 1e9 / copy, 3)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        for hq, hkv, d in ((9, 3, 64), (32, 8, 128)):
            for seqs, ctx in ((1, 4096), (8, 2048)):
                r = prefill_attention(seqs, ctx, hq, hkv, d, gen)
                rows.append(r)
                print(json.dumps(r), flush=True)
        result["attention"] = rows
    if args.step_breakdown:
        result["decode_steps"] = []
        for batch, ctx in ((1, 512), (64, 512), (256, 512)):
            try:
                r = step_breakdown(batch, ctx)
            except Exception as e:  # keep the figures measured so far
                r = {"batch": batch, "context": ctx, "error": repr(e)}
            result["decode_steps"].append(r)
            print(json.dumps(r), flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
