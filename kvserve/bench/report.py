"""`kvserve bench report`: regenerate docs/benchmarks.md from the saved results.

Reads every docs/bench-results/*.json that `kvserve bench ... --save` wrote and writes one page:
the machines and versions, then per result its exact command, kvserve and each peer side by side
with ratios, and the sweep plots.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from kvserve.bench import common


NOTES_FILE = "benchmarks-notes.md"   # beside the page; included verbatim at its top when present


def add_args(p) -> None:
    p.add_argument("--results-dir", default=str(common.RESULTS_DIR), help="result JSON files (default: %(default)s)")
    p.add_argument("--output", "-o", default=str(common.REPO_ROOT / "docs" / "benchmarks.md"),
                   help="page to write (default: %(default)s)")


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(common.fmt(c, 1) if isinstance(c, float) else str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def x(r: float) -> str:
    return "-" if r is None or math.isnan(r) else f"{r:.2f}x"


def engine_label(run: dict) -> str:
    cfg = run.get("config") or {}
    if run["engine"] == "hf":
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(cfg.get("dtype"), "fp32")
        on = f" on {cfg['device']}" if cfg.get("device", "cpu") != "cpu" else ""
        return f"hf transformers, {dtype}{on}" + (f", static batch {cfg['batch_size']}" if cfg.get("batch_size") else "")
    if run["engine"] == "llamacpp":
        return f"llama.cpp ({cfg.get('server', '?')}, {cfg.get('slots', '?')} slot(s))"
    if run["engine"] == "vllm":
        return f"vLLM {cfg.get('version', '?')} CPU, float32 copy, max_num_seqs {cfg.get('max_num_seqs', '?')}"
    parts = [cfg[k] for k in ("quantization", "dtype") if cfg.get(k)]
    if cfg.get("device", "cpu") != "cpu":
        parts.append(f"on {cfg['device']}")
    if cfg.get("prefix_caching") is False:
        parts.append("no prefix caching")
    return "kvserve" + (f" ({', '.join(parts)})" if parts else "")


def pct(rate) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def secs(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def section_throughput(res: dict) -> list[str]:
    w = res["workload"]
    how = (f"in {w['turns']} rounds of {w['conversations']} conversations (round t sends system + q1 + a1 + ... + "
           f"q_t, a_i being kvserve's own answers)" if w.get("turns") else "all submitted at once")
    out = [f"Workload `{w['dataset']}`: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens, "
           f"{w['max_tokens_total']} output tokens asked, {how}.", ""]
    base = next((r for r in res["runs"] if r["engine"] == "kvserve"), None)
    # TTFT and the prefix cache hit rate only where some run measured them (kvserve since they were added).
    cache_cols = any("ttft_median_s" in r or "hit_rate" in r for r in res["runs"])
    rows = []
    for r in res["runs"]:
        m = r["metrics"]
        row = [engine_label(r), m["useful_output_tokens_per_s"], m["output_tokens_per_s"], m["requests_per_s"],
               m["input_tokens_per_s"], m["elapsed_s"],
               x(common.ratio(base["metrics"]["useful_output_tokens_per_s"], m["useful_output_tokens_per_s"]))
               if base else "-"]
        if cache_cols:
            row += [secs(r.get("ttft_median_s")), pct(r.get("hit_rate"))]
        rows.append(row)
    out.append(md_table(["engine", "useful out tok/s", "out tok/s", "req/s", "in tok/s", "wall s", "kvserve vs it"]
                        + (["TTFT p50 s", "prefix cache hit rate"] if cache_cols else []), rows))
    n = max((len(r.get("rounds", [])) for r in res["runs"]), default=0)
    if n:
        ratios = "; ".join(f"{peer} " + ", ".join(x(v) for v in rs) for peer, rs in res.get("round_ratios", {}).items())
        out += ["", f"Each engine's median of {n} rounds (kvserve, then each peer, {n} times)."
                + (f" kvserve over the peer, round by round: {ratios}." if ratios else "")]
    for r in res["runs"]:
        if r.get("per_turn"):
            out += ["", f"Per turn, {engine_label(r)}:", "",
                    md_table(["turn", "prompt tokens", "cached", "hit rate", "TTFT p50 s", "TTFT mean s", "wall s"],
                             [[t["turn"], t["prompt_tokens"], t["cached_prompt_tokens"], pct(t.get("hit_rate")),
                               secs(t.get("ttft_median_s")), secs(t.get("ttft_mean_s")), t["elapsed_s"]]
                              for t in r["per_turn"]])]
    return out


def section_latency(res: dict) -> list[str]:
    w = res["workload"]
    out = [f"One request: prompt {w['prompt_tokens']} tokens, {w['output_tokens']} output tokens; "
           f"median of {len(res['runs'][0]['samples'])} runs (min-max).", ""]
    base = next((r for r in res["runs"] if r["engine"] == "kvserve"), None)
    rows = []
    for r in res["runs"]:
        s = r["summary"]
        rng = lambda k, d=3: f"{s[k]['median']:.{d}f} ({s[k]['min']:.{d}f}-{s[k]['max']:.{d}f})"  # noqa: E731
        rows.append([engine_label(r) + (f" [{r['mode']}]" if r.get("mode") else ""), rng("decode_tok_s", 1),
                     rng("e2e_tok_s", 1), rng("prefill_s"), rng("ttft_s"),
                     x(common.ratio(base["summary"]["decode_tok_s"]["median"], s["decode_tok_s"]["median"]))
                     if base else "-"])
    out.append(md_table(["engine", "decode tok/s", "e2e tok/s", "prefill s", "TTFT s", "kvserve decode vs it"], rows))
    return out


def section_serve(res: dict, page_dir: Path) -> list[str]:
    w = res["workload"]
    args = res["args"]
    out = [f"Workload `{w['dataset']}`: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens, "
           f"{w['max_tokens_total']} output tokens; SLO `{args.get('slo')}`.", ""]
    rows = []
    for r in res["runs"]:
        for p in r["points"]:
            m = p["metrics"]
            rows.append([engine_label(r), f"{p['request_rate']:g}", p["max_concurrency"] or "-",
                         f"{m['completed']}/{m['num_requests']}", m["output_token_throughput"],
                         f"{m['ttft_s']['median']:.2f} / {m['ttft_s']['p99']:.2f}",
                         f"{m['tpot_s']['median'] * 1e3:.0f} / {m['tpot_s']['p99'] * 1e3:.0f}",
                         f"{m['itl_s']['p99'] * 1e3:.0f}", f"{m['e2e_s']['median']:.2f}",
                         f"{m.get('goodput', {}).get('rate', math.nan):.2f} "
                         f"({m.get('goodput', {}).get('share', math.nan) * 100:.0f}%)"])
    out.append(md_table(["engine", "rate", "conc", "ok", "out tok/s", "TTFT p50 / p99 s", "TPOT p50 / p99 ms",
                         "ITL p99 ms", "e2e p50 s", "goodput req/s"], rows))
    base = next((r for r in res["runs"] if r["engine"] == "kvserve"), None)
    for peer in (r for r in res["runs"] if r["engine"] != "kvserve"):
        if base is None:
            break
        ratios = [f"{a['request_rate']:g}/{a['max_concurrency'] or '-'}: "
                  f"{x(common.ratio(a['metrics']['output_token_throughput'], b['metrics']['output_token_throughput']))}"
                  for a, b in zip(base["points"], peer["points"])]
        out += ["", f"kvserve / {engine_label(peer)} output tokens/s (rate/conc): " + ", ".join(ratios)]
    if res.get("plot") and Path(res["plot"]).exists():
        out += ["", f"![{res['kind']} sweep]({os.path.relpath(res['plot'], page_dir)})"]
    return out


def section_roofline(res: dict) -> list[str]:
    mp = res["machine_peaks"]
    out = [md_table(["kernel", "GFLOP/s", "at M,K,N"],
                    [[k, v["gflops"], ",".join(map(str, v["shape_mkn"]))] for k, v in mp["matmul"].items()]),
           "", f"Memory bandwidth ({mp['memory']['tensor_mib']} MiB tensor, {mp['threads']} threads): "
           f"read {mp['memory']['read_gbs']:.1f} GB/s, copy {mp['memory']['copy_gbs']:.1f} GB/s (read + write)."]
    m = res.get("model")
    if m:
        d, pf, bd = m["decode_batch1"], m["prefill"], m["batch_decode"]
        out += ["", f"Model `{Path(m['model']).name}` ({m['dtype']}, weights {m.get('quantization')}): "
                f"{m['facts']['weight_bytes_per_step'] / 2**20:.0f} MiB of weights read per decode step.", "",
                md_table(["regime", "tokens/s", "achieved", "MBU",
                          f"MFU (vs {m.get('mfu_peak', {}).get('kernel', 'fp32')} peak)"], [
                    [f"decode, batch 1, prompt {d['prompt_len']}", d["tokens_per_s"], f"{d['achieved_gbs']:.1f} GB/s",
                     f"{d['mbu'] * 100:.0f}%", f"{d['mfu'] * 100:.1f}%"],
                    [f"prefill {pf['tokens']} tokens", pf["tokens_per_s"], f"{pf['gflops']:.1f} GFLOP/s", "-",
                     f"{pf['mfu'] * 100:.0f}%"],
                    [f"decode, batch {bd['batch']}", bd["output_tokens_per_s"], f"{bd['gflops']:.1f} GFLOP/s",
                     f"{bd['mbu_weights_only'] * 100:.0f}% (weights)", f"{bd['mfu'] * 100:.0f}%"]])]
        if "mbu_samples" in d:
            from kvserve.bench.roofline import bandwidth_beside_decode
            out += ["", bandwidth_beside_decode(d) + "."]
    return out


def soak_run_lines(run: dict, workload: dict) -> list[str]:
    from kvserve.bench.soak import CLASSES, FAILURES, VERDICTS, mib, statuses_text, verdict_label
    server, classes = run["server"], run["classes"]
    failed = [c["check"] for c in run["invariants"] if c["ok"] is False]
    out = [f"{run['num_requests']} requests, {workload['concurrency']} at a time, in {run['duration_s']:.0f} s "
           f"({run['requests_per_s']:.1f} req/s): {workload['disconnect_fraction']:.0%} dropped by the client, "
           f"{workload['bad_fraction']:.0%} bad inputs (attacks: {workload['attacks']}), seed {workload['seed']}. "
           f"Server RSS after the first {run['warmup']} requests {mib(server['rss_start'])} MiB, at the end "
           f"{mib(server['rss_end'])} MiB, peak {mib(server['rss_peak'])} MiB.", "",
           md_table(["class", "sent", *VERDICTS], [[k, classes[k]["sent"], *(classes[k][v] for v in VERDICTS)]
                                                   for k in CLASSES]), "",
           md_table(["invariant", "value", "result"], [[c["check"], common.fmt(c["value"]), verdict_label(c["ok"])]
                                                       for c in run["invariants"]]), "",
           "Verdict: " + ("all invariants hold" if not failed else "invariants failed: " + ", ".join(failed))
           + ". Bad inputs: " + run["bad_inputs"] + "."]
    if run["misanswered"]:
        out += ["", md_table(["class", "request", "sent", "failed", "statuses", "example"],
                             [[r["kind"], r["name"], r["sent"], sum(r["verdicts"].get(v, 0) for v in FAILURES),
                               statuses_text(r), r["example"][:100].replace("|", "\\|")]
                              for r in run["misanswered"]])]
    return out


def section_soak(res: dict) -> list[str]:
    return [line for run in res["runs"] for line in soak_run_lines(run, res["workload"])]


def section_structured(res: dict) -> list[str]:
    out = []
    sch = res.get("schemas")
    if sch:
        mask = sch.get("mask_ms_per_token")
        out += [md_table(["schemas", "compiled", "finished (stop)", "valid of finished", "truncated (length)",
                          "mask ms / constrained token"],
                         [[sch["schemas"], f"{sch['compiled']} ({pct(sch['compile_rate'])})", sch["finished"],
                           f"{sch['valid']} ({pct(sch['validity_rate'])})",
                           f"{sch['truncated']} ({pct(sch['truncation_rate'])})", secs(mask)]]), ""]
        fails = [f"{r['schema']}: {r.get('error') or r.get('valid')}" for r in sch.get("failures", [])]
        if fails:
            out += ["Not compiled or not valid:", ""] + [f"- {f.splitlines()[0]}" for f in fails] + [""]
    cost = res.get("cost")
    if cost:
        from kvserve.bench.structured import cost_table
        rows, _ = cost_table(cost["runs"])
        out += ["Cost of a constraint (offline, the same chat prompts, greedy; runs interleaved):", "",
                md_table(["batch", "TPOT ms, unconstrained", "TPOT ms, JSON schema", "cost"], rows)]
    return out


def section_spec(res: dict) -> list[str]:
    from kvserve.bench.spec import TABLE_HEADERS, table_rows
    run = res["runs"][0]
    out = [f"`{json.dumps(run['config']['speculative_config'])}`, {run['config']['steps']}; a token row costs "
           f"{run['config']['row_share_at_batch_1']:.2f} of a one-row step here (fitted over the run)", "",
           md_table(TABLE_HEADERS, table_rows(run["workloads"]))]
    peer = next((r for r in res["runs"][1:] if r["engine"] == "llamacpp"), None)
    if peer is not None:
        from kvserve.bench.spec import PEER_HEADERS, peer_table
        out += ["", f"llama.cpp's llama-server in the same command, plain and with `{peer['config']['spec_args']}`:", "",
                md_table(TABLE_HEADERS[:6], [row[:6] for row in table_rows(peer["workloads"])]), "",
                md_table(PEER_HEADERS, peer_table([run, peer]))]
    return out


def section_gpu_kernels(res: dict) -> list[str]:
    """The Triton attention kernels against the device's copy bandwidth, and decode steps
    (scripts/gpu_kernels.py)."""
    out = []
    if res.get("attention"):
        out += [f"{res['device']}, device-to-device copy {res['copy_gb_per_s']} GB/s (read + write). Kernel times "
                f"are per call in a replayed CUDA graph (as captured decode steps run them); the eager column is "
                f"one call from Python, launch included.", ""]
        dec = [r for r in res["attention"] if r["kernel"] == "decode"]
        out.append(md_table(["decode: seqs x context", "heads q/kv x dim", "KV", "splits", "us", "eager us",
                             "GB/s", "of copy"],
                            [[f"{r['seqs']} x {r['context']}", r["heads"], r["kv_dtype"], r["splits"], r["us"],
                              r.get("eager_call_us", "-"), r["gb_per_s"], pct(r["of_copy_bandwidth"])] for r in dec]))
        pre = [r for r in res["attention"] if r["kernel"] == "prefill"]
        out += ["", md_table(["prefill (causal): seqs x tokens", "heads q/kv x dim", "us", "TFLOP/s",
                              "torch SDPA on contiguous K/V, us"],
                             [[f"{r['seqs']} x {r['context']}", r["heads"], r["us"], r["tflop_per_s"],
                               r["torch_sdpa_contiguous_us"]] for r in pre])]
    if res.get("note"):
        out += ["", f"Note: {res['note']}."]
    if res.get("decode_steps"):
        fams = sorted({f for r in res["decode_steps"] for f in r.get("gpu_ms_per_step_by_kernel_family", {})})
        out += ["", "Decode steps of the engine (default model, 512-token prompts): wall time per step with CUDA "
                "graphs and eagerly, and the eager step's GPU time by kernel family (torch.profiler).", "",
                md_table(["batch", "step ms (graphs)", "step ms (eager)", "GPU ms"] + [f"{f} ms" for f in fams],
                         [[r["batch"], r.get("step_ms_graphs", "-"), r.get("step_ms_eager", "-"),
                           r.get("gpu_ms_per_step", "-")]
                          + [r.get("gpu_ms_per_step_by_kernel_family", {}).get(f, "-") for f in fams]
                          for r in res["decode_steps"]])]
    return out


SECTIONS = {"roofline": "Hardware limits (roofline)", "latency": "Latency", "throughput": "Offline throughput",
            "serve": "Serving load", "soak": "Soak: fault isolation under load",
            "structured": "Structured output", "spec": "Speculative decoding",
            "gpu-kernels": "GPU kernels and decode steps"}


def build_page(results: list[tuple[Path, dict]], page_dir: Path) -> str:
    lines = ["# kvserve benchmarks", "",
             "Generated by `kvserve bench report` from `docs/bench-results/*.json`; every figure below was measured "
             "by the command shown with it. Peers run in the same command on the same token ids "
             "(see docs/bench.md for how each peer is run).", ""]
    notes = page_dir / NOTES_FILE
    if notes.exists():   # the hand-written reading of the results below (targets, startup, quality)
        lines += [notes.read_text().rstrip(), ""]
    machines = {json.dumps(r["machine"], sort_keys=True): r["machine"] for _, r in results}
    lines += ["## Machines and versions", ""]
    for m in machines.values():
        lines.append(f"- {m['cpu']}, {m['cores']} cores, {m.get('memory_gib')} GiB, SIMD {', '.join(m.get('simd', []))}"
                     + (f"; GPU {m['gpu']}" if m.get("gpu") else "") + f"; {m.get('os')}; Python {m.get('python')}")
    vers = {json.dumps(r["versions"], sort_keys=True): r["versions"] for _, r in results}
    for v in vers.values():
        lines.append("- " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    for kind, title in SECTIONS.items():
        of_kind = [(p, r) for p, r in results if r["kind"] == kind]
        if not of_kind:
            continue
        lines += ["", f"## {title}"]
        for path, r in of_kind:
            load = r.get("load_avg_before")
            isa = f"KVSERVE_ISA={r['kvserve_isa_env']} " if r.get("kvserve_isa_env") else ""
            lines += ["", f"### {path.stem}", "", f"`{isa}{r['command']}`  ",
                      f"{r['date']}, kvserve {r['versions'].get('kvserve_commit')}"
                      + (f", load average {load:.1f} on {r['machine']['cores']} cores before the run" if load else ""), ""]
            if kind == "throughput":
                lines += section_throughput(r)
            elif kind == "latency":
                lines += section_latency(r)
            elif kind == "serve":
                lines += section_serve(r, page_dir)
            elif kind == "soak":
                lines += section_soak(r)
            elif kind == "structured":
                lines += section_structured(r)
            elif kind == "spec":
                lines += section_spec(r)
            elif kind == "gpu-kernels":
                lines += section_gpu_kernels(r)
            else:
                lines += section_roofline(r)
    return "\n".join(lines) + "\n"


def main(args, argv: list[str]) -> int:
    files = sorted(Path(args.results_dir).glob("*.json"))
    if not files:
        return common.die(f"no results in {args.results_dir}: run a benchmark with --save first")
    results = []
    for f in files:
        try:
            results.append((f, json.loads(f.read_text())))
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping {f}: {e}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_page(results, out.parent))
    print(f"wrote {out} from {len(results)} result files")
    return 0
