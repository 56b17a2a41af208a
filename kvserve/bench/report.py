"""`kvserve bench report`: regenerate docs/benchmarks.md from the saved results.

Reads every docs/bench-results/*.json that `kvserve bench ... --save` wrote and writes one page: a
short intro, then one table per machine class (CPU model and kernel build, or GPU). A row is one
figure (kind of benchmark, model, workload, peer) from the newest result that measured it, with
its command and JSON file. Older results stay in docs/bench-results/ as the record.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import textwrap
from datetime import datetime
from pathlib import Path

from kvserve.bench import common


def add_args(p) -> None:
    p.add_argument(
        "--results-dir",
        default=str(common.RESULTS_DIR),
        help="result JSON files (default: %(default)s)",
    )
    p.add_argument(
        "--output",
        "-o",
        default=str(common.REPO_ROOT / "docs" / "benchmarks.md"),
        help="page to write (default: %(default)s)",
    )


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += [
        "| " + " | ".join(common.fmt(c, 1) if isinstance(c, float) else str(c) for c in r) + " |"
        for r in rows
    ]
    return "\n".join(lines)


def x(r: float) -> str:
    return "-" if r is None or math.isnan(r) else f"{r:.2f}x"


def pct(rate) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def secs(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


# ---- machine classes ----------------------------------------------------------------------------

# CPUs whose /proc/cpuinfo name hides the core: (vendor word, family, model) -> the core's name.
CORES = {
    ("AMD", 25, 1): "Zen 3",
    ("AMD", 25, 17): "Zen 4",
    ("Intel", 6, 106): "Ice Lake",
    ("Intel", 6, 207): "Emerald Rapids",
}
ISA_ALIASES = {"avx512": "avx512vnni", "avx512_vnni": "avx512vnni"}  # KVSERVE_ISA spellings


def cpu_name(cpu: str) -> str:
    m = re.search(r"family (\d+), model (\d+)", cpu)
    vendor = "AMD" if "AMD" in cpu else "Intel" if "Intel" in cpu else ""
    core = CORES.get((vendor, int(m[1]), int(m[2]))) if m else None
    return f"{cpu} ({core})" if core else cpu


def steps_of(res: dict) -> str:
    """How kvserve ran its steps ("C layer stack, avx2 kernels", "PyTorch forward on cuda, ...")."""
    for run in res.get("runs", []):
        if run.get("engine") == "kvserve":
            steps = run.get("steps") or (run.get("config") or {}).get("steps")
            if steps:
                return steps
    return ""


def on_gpu(res: dict) -> bool:
    if res["kind"] == "gpu-kernels":
        return True
    args = res.get("args") or {}
    cfgs = [r.get("config") or {} for r in res.get("runs", [])]
    return (
        args.get("device") == "cuda"
        or "--device cuda" in (args.get("server_args") or "")
        or any(c.get("device", "cpu") not in ("cpu", None) for c in cfgs)
    )


def isa_of(res: dict) -> str:
    """The kernel build kvserve ran: the step path it recorded, else KVSERVE_ISA, else the best
    build the CPU's flags allow."""
    m = re.search(r"(\w+) kernels", steps_of(res))
    if m:
        return m[1]
    env = res.get("kvserve_isa_env")
    if env:
        return ISA_ALIASES.get(env, env)
    simd = set((res.get("machine") or {}).get("simd", []))
    if "avx512_vnni" in simd:
        return "avx512vnni"
    if "avx_vnni" in simd:
        return "avxvnni"
    return "avx2" if "avx2" in simd else "portable"


def machine_class(res: dict) -> str:
    m = res.get("machine") or {}
    if m.get("gpu") and on_gpu(res):
        return f"GPU: {m['gpu']}"
    cores = f", {m['cores']} cores" if m.get("cores") else ""
    return f"CPU: {cpu_name(m.get('cpu', '?'))}{cores}, {isa_of(res)} build"


# ---- what a result measured ---------------------------------------------------------------------


def model_name(res: dict) -> str:
    path = (res.get("args") or {}).get("model")
    if res.get("kind") == "host" and not path:
        return "tiny random, SmolLM2 vocabulary (null forward)"
    return Path(path).name.removesuffix(".gguf") if path else "default (SmolLM2-135M)"


def peer_label(res: dict, run: dict) -> str:
    engine = run["engine"]
    cfg = run.get("config") or {}
    if engine == "llamacpp":
        if cfg.get("build"):
            return f"llama.cpp ({cfg['build']} build)"
        m = re.search(r"--llamacpp-bin\s+(\S+)", res.get("command", ""))
        binary = (res.get("args") or {}).get("llamacpp_bin") or (m[1] if m else None)
        build = Path(binary).parent.parent.name if binary else cfg.get("server", "?")
        return f"llama.cpp ({build})"
    if engine == "hf":
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
            cfg.get("dtype"), "fp32"
        )
        on = f" on {cfg['device']}" if cfg.get("device", "cpu") != "cpu" else ""
        return f"transformers {dtype}{on}"
    if engine == "vllm":
        return f"vLLM {cfg.get('version', '?')} CPU"
    if engine == "server":
        return "kvserve serve, same flags, streamed"
    return engine


def shown_command(res: dict) -> str:
    """The command as a user would run it: no output file, no progress flags; llama-server's path
    (machine-specific) as LLAMA_SERVER."""
    cmd = re.sub(r"\s(--output|-o)\s+\S+", "", res.get("command", "?"))
    cmd = re.sub(r"\s--(save|no-progress)\b", "", cmd)
    cmd = re.sub(r"(--llamacpp-bin)\s+\S+", r"\1 LLAMA_SERVER", cmd)
    isa = res.get("kvserve_isa_env")
    return f"{'KVSERVE_ISA=' + isa + ' ' if isa else ''}{cmd}"


def engine_default(dest: str):
    """The default of the engine flag whose argparse attribute is `dest`."""
    from kvserve.config import engine_knobs

    return next(k.entry for k in engine_knobs() if k.dest == dest)


def settings(res: dict) -> str:
    """Settings that change what a workload measures (part of a row's identity)."""
    args = res.get("args") or {}
    out = []
    if args.get("no_prefix_caching"):
        out.append("no prefix caching")
    if args.get("kv_cache_dtype") not in (None, "auto"):
        out.append(f"{args['kv_cache_dtype']} KV")
    if args.get("quantization") == "none":  # float weights: another format, not a GGUF one
        out.append("float weights")
    seqs = args.get("max_num_seqs")
    if seqs is not None and seqs != engine_default("max_num_seqs"):
        out.append(f"{seqs} running at most")
    return "".join(f", {s}" for s in out)


def fmt_rate(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.1f}"


def rows_latency(res: dict) -> list[dict]:
    w = res["workload"]
    name = w.get("name")
    load = name.upper() if name else f"prompt {w['prompt_tokens']}, {w['output_tokens']} out"
    base = next((r for r in res["runs"] if r["engine"] == "kvserve"), None)
    if base is None:
        return []
    ours = base["summary"]["decode_tok_s"]["median"]
    what = f"decode tok/s, median of {len(base['samples'])}"
    if res.get("read_gbs") and (base.get("config") or {}).get("bytes_per_step"):
        what += f" (MBU against {res['read_gbs']:.1f} GB/s read)"
    rows = [dict(what=what, metric="decode", load=load, ours=fmt_rate(ours) + mbu(res, base))]
    for r in res["runs"]:
        if r is not base:
            theirs = r["summary"]["decode_tok_s"]["median"]
            row = _peer_row(res, r, what, "decode", load, ours, theirs)
            row["ours"] = rows[0]["ours"]
            row["theirs"] += mbu(res, r)
            rows.append(row)
    return (rows if len(rows) == 1 else rows[1:]) + prefill_rows(res, base, load)


def prefill_rows(res: dict, base: dict, load: str) -> list[dict]:
    """One row per peer: the prompt's prefill time (a max_tokens=1 request), kvserve's against
    the peer's; the ratio is how many times faster kvserve is."""
    ours = base["summary"].get("prefill_s")
    if not ours:
        return []
    what = f"prefill s (one-token request), median of {len(base['samples'])}"
    rows = []
    for r in res["runs"]:
        theirs = r["summary"].get("prefill_s")
        if r is not base and theirs:
            row = _peer_row(res, r, what, "prefill", load, None, None)
            row.update(
                ours=f"{ours['median']:.3f}",
                theirs=f"{theirs['median']:.3f}",
                ratio=x(common.ratio(theirs["median"], ours["median"])),
            )
            rows.append(row)
    return rows


def mbu(res: dict, run: dict) -> str:
    """ " (NN% MBU)" for a latency run that recorded its bytes per step beside a result that
    recorded the read bandwidth; "" otherwise."""
    step, gbs = (run.get("config") or {}).get("bytes_per_step"), res.get("read_gbs")
    if not step or not gbs:
        return ""
    return f" ({run['summary']['decode_tok_s']['median'] * step / gbs / 1e9 * 100:.0f}% MBU)"


def _peer_row(res: dict, run: dict, what: str, metric: str, load: str, ours, theirs) -> dict:
    """One table row: kvserve against one peer's run of the same result."""
    return dict(
        what=what,
        metric=metric,
        load=load,
        ours=fmt_rate(ours),
        peer=peer_label(res, run),
        peer_key=run["engine"],
        theirs=fmt_rate(theirs),
        ratio=x(common.ratio(ours, theirs)),
    )


def rows_throughput(res: dict) -> list[dict]:
    w = res["workload"]
    load = f"{w['dataset'].upper() if w['dataset'] in ('w1', 'w2') else w['dataset']}, "
    n = w["num_requests"]
    load += f"{n} request{'s' if n != 1 else ''}"
    base = next((r for r in res["runs"] if r["engine"] == "kvserve"), None)
    if base is None:
        return []
    n = len(base.get("rounds", [])) or 1
    what = "useful out tok/s" + (f", median of {n} rounds" if n > 1 else ", one run")
    ours = base["metrics"]["useful_output_tokens_per_s"]
    peers = [r for r in res["runs"] if r is not base]
    if not peers:
        cell = fmt_rate(ours)
        if w["dataset"] in ("prefix", "multiturn") and "hit_rate" in base:
            # What these workloads are for: the prefix cache's hits and the first token's wait.
            cell += (
                f" (TTFT p50 {secs(base.get('ttft_median_s'))} s, "
                f"prefix cache hit rate {pct(base['hit_rate'])})"
            )
        return [dict(what=what, metric="useful", load=load, ours=cell)]
    out = []
    for r in peers:
        theirs = r["metrics"]["useful_output_tokens_per_s"]
        out.append(_peer_row(res, r, what, "useful", load, ours, theirs))
    return out


def rows_serve(res: dict) -> list[dict]:
    w = res["workload"]
    base = next((r for r in res["runs"] if r["engine"] == "kvserve"), None)
    if base is None:
        return []
    peer = next((r for r in res["runs"] if r is not base), None)
    out = []
    for i, p in enumerate(base["points"]):
        conc = p.get("max_concurrency")
        rate = p["request_rate"]
        point = (
            f"concurrency {conc}"
            if conc
            else "all at once"
            if math.isinf(rate)
            else f"{rate:g} requests/s"
        )
        m = p["metrics"]
        row = dict(
            what="server out tok/s (TTFT p50)",
            load=f"{w['dataset'].upper()}, {w['num_requests']} requests, {point}",
            ours=f"{fmt_rate(m['output_token_throughput'])} ({m['ttft_s']['median']:.2f} s)",
        )
        if peer is not None and i < len(peer["points"]):
            pm = peer["points"][i]["metrics"]
            row.update(
                peer=peer_label(res, peer),
                peer_key=peer["engine"],
                theirs=f"{fmt_rate(pm['output_token_throughput'])} "
                f"({pm['ttft_s']['median']:.2f} s)",
                ratio=x(common.ratio(m["output_token_throughput"], pm["output_token_throughput"])),
            )
        out.append(row)
    return out


def rows_spec(res: dict) -> list[dict]:
    run = res["runs"][0]
    method = run["config"]["speculative_config"]["method"]
    peer = next((r for r in res["runs"][1:] if r["engine"] == "llamacpp"), None)
    theirs = {w["workload"]: w for w in peer["workloads"]} if peer else {}
    out = []
    for w in run["workloads"]:
        n = len(w.get("spec_samples", [])) or "?"
        acc = "" if w["acceptance"] is None else f", {100 * w['acceptance']:.0f}% accepted"
        what = f"{method} decode tok/s, median of {n}"
        metric = f"spec {method}"
        load = w["workload"]
        ours = f"{fmt_rate(w['spec_decode_tok_s'])}{acc}"
        out.append(
            dict(
                what=what,
                metric=metric,
                load=load,
                ours=ours,
                peer="kvserve, no speculation",
                peer_key="plain",
                theirs=fmt_rate(w["plain_decode_tok_s"]),
                ratio=x(w["speedup"]),
            )
        )
        t = theirs.get(w["workload"])
        if t:
            out.append(
                dict(
                    what=what,
                    metric=metric,
                    load=load,
                    ours=ours,
                    peer=f"{peer_label(res, peer)}, speculative",
                    peer_key="llamacpp",
                    theirs=fmt_rate(t["spec_decode_tok_s"]),
                    ratio=x(common.ratio(w["spec_decode_tok_s"], t["spec_decode_tok_s"])),
                )
            )
    return out


def rows_roofline(res: dict) -> list[dict]:
    mem = res["machine_peaks"]["memory"]
    out = [
        dict(
            what="memory read GB/s",
            load=f"{mem['tensor_mib']} MiB tensor",
            ours=f"{mem['read_gbs']:.1f}",
        )
    ]
    d = (res.get("model") or {}).get("decode_batch1")
    if d:
        out.append(
            dict(
                what="batch-1 decode tok/s (MBU)",
                load=f"prompt {d['prompt_len']}",
                ours=f"{fmt_rate(d['tokens_per_s'])} ({d['mbu'] * 100:.0f}%)",
            )
        )
    return out


def rows_soak(res: dict) -> list[dict]:
    w = res["workload"]
    out = []
    for run in res["runs"]:
        failed = [c["check"] for c in run["invariants"] if c["ok"] is False]
        out.append(
            dict(
                what="invariants (leaks, restarts, RSS drift, answers)",
                load=f"{run['num_requests']} requests, {w['concurrency']} at a time, "
                f"{w['disconnect_fraction']:.0%} dropped, {w['bad_fraction']:.0%} bad",
                ours="all hold" if not failed else "failed: " + ", ".join(failed),
            )
        )
    return out


def rows_structured(res: dict) -> list[dict]:
    out = []
    sch = res.get("schemas")
    if sch:
        out.append(
            dict(
                what="JSON schemas compiled; valid of finished",
                load=f"{sch['schemas']} schemas",
                ours=f"{pct(sch['compile_rate'])}; {pct(sch['validity_rate'])}",
            )
        )
    cost = res.get("cost")
    if cost:
        from kvserve.bench.structured import cost_table

        rows, _ = cost_table(cost["runs"])
        for batch, free, cons, extra in rows:
            out.append(
                dict(
                    what="TPOT ms with a JSON-schema constraint",
                    load=f"chat prompts, batch {batch}",
                    ours=f"{cons} ({extra})",
                    peer="kvserve, unconstrained",
                    peer_key="unconstrained",
                    theirs=free,
                )
            )
    return out


def rows_gpu_kernels(res: dict) -> list[dict]:
    out = []
    for kv in sorted({r["kv_dtype"] for r in res.get("attention", []) if r["kernel"] == "decode"}):
        best = max(
            (r for r in res["attention"] if r["kernel"] == "decode" and r["kv_dtype"] == kv),
            key=lambda r: r["of_copy_bandwidth"],
        )
        out.append(
            dict(
                what="paged decode attention, share of copy bandwidth",
                load=f"{kv} KV, {best['seqs']} x {best['context']}, heads {best['heads']}",
                ours=pct(best["of_copy_bandwidth"]),
            )
        )
    for r in res.get("decode_steps", []):
        out.append(
            dict(
                what="decode step ms, CUDA graphs (eager)",
                load=f"batch {r['batch']}, context {r.get('context', '?')}",
                ours=f"{r.get('step_ms_graphs', '-')} ({r.get('step_ms_eager', '-')})",
            )
        )
    return out


def rows_host(res: dict) -> list[dict]:
    """`bench host`: the host's time per decode step with a null forward, per batch size."""
    w = res["workload"]
    out = []
    for b in res["runs"][0]["batches"]:
        ph = b["phases_us"]
        top = sorted((p for p in ph if p != "other"), key=lambda p: -ph[p])[:2]
        out.append(
            dict(
                what=f"host {w.get('clock', 'cpu')} us per decode step (tok/s), "
                f"median of {w['rounds']} rounds",
                metric="host",
                load=f"batch {b['batch']}, prompt {w['prompt_tokens']}",
                ours=f"{b['step_us']:,.0f} ({fmt_rate(b['tok_s'])}); "
                + ", ".join(f"{p} {ph[p]:,.0f}" for p in top),
            )
        )
    for run in res["runs"]:
        if not run["mode"].startswith("server"):
            continue
        for b in run["batches"]:
            out.append(
                dict(
                    what="host us per decode step with the server in the loop: step period "
                    f"(tok/s), CPU per step, median of {w['rounds']} rounds",
                    metric="host",
                    load=f"batch {b['batch']}, prompt {w['prompt_tokens']}, streamed",
                    ours=f"{b['step_wall_us']:,.0f} ({fmt_rate(b['tok_s'])}); CPU "
                    f"{b['process_cpu_us']:,.0f} = engine thread {b['engine_thread_cpu_us']:,.0f}"
                    f" + HTTP {b['http_cpu_us']:,.0f}",
                )
            )
    return out


def rows_start(res: dict) -> list[dict]:
    """`bench start`: seconds from exec to ready (and to a first reply), peak RSS against the
    file, each against a peer where one ran (ratio: the peer's figure over kvserve's, so above 1
    is kvserve starting sooner or holding less)."""
    size = res["workload"]["model_bytes"]
    base = next((r for r in res["runs"] if r["engine"] == "kvserve"), None)
    if base is None:
        return []
    n = len(base["samples"])

    def cells(run):
        s = run["summary"]
        ready, first = s["ready_s"]["median"], s["first_reply_s"]["median"]
        peak = s["peak_rss_bytes"]["median"]
        once = run.get("first_start")  # the untimed start before the rounds (packed cache)
        note = f"; the start before, {once['ready_s']:.2f}" if once else ""
        return (
            (ready, f"{ready:.2f} (first reply {first:.2f}{note})"),
            (peak, f"{peak / 1e9:.2f} (+{(peak - size) / 1e9:.2f} over the file)"),
        )

    what = (
        f"seconds from exec to ready, median of {n} (warm page cache)",
        f"peak RSS GB after one request, median of {n}",
    )
    load = f"start, {size / 1e9:.2f} GB file"
    ours = cells(base)
    peers = [r for r in res["runs"] if r is not base]
    if not peers:
        return [dict(what=w, metric=f"start{i}", load=load, ours=o[1]) for i, (w, o) in
                enumerate(zip(what, ours))]  # fmt: skip
    out = []
    for r in peers:
        for i, (w, o, th) in enumerate(zip(what, ours, cells(r))):
            out.append(
                dict(
                    what=w,
                    metric=f"start{i}",
                    load=load,
                    ours=o[1],
                    peer=peer_label(res, r),
                    peer_key=r["engine"],
                    theirs=th[1],
                    ratio=x(common.ratio(th[0], o[0])),
                )
            )
    return out


KINDS = {
    "latency": ("latency", rows_latency),
    "throughput": ("throughput", rows_throughput),
    "serve": ("serve", rows_serve),
    "spec": ("speculative", rows_spec),
    "structured": ("structured", rows_structured),
    "soak": ("soak", rows_soak),
    "roofline": ("roofline", rows_roofline),
    "gpu-kernels": ("GPU kernels", rows_gpu_kernels),
    "host": ("host", rows_host),
    "start": ("start", rows_start),
}


# ---- which result is current --------------------------------------------------------------------


def commit_time(commit: str | None, cache: dict) -> float | None:
    """When kvserve's commit was made (git), None outside a clone or for an unknown commit."""
    if not commit:
        return None
    if commit not in cache:
        try:
            out = subprocess.run(
                ["git", "show", "-s", "--format=%ct", commit],
                cwd=common.REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=5,
            )
            cache[commit] = float(out.stdout.split()[0]) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            cache[commit] = None
    return cache[commit]


def run_time(date: str) -> float:
    try:
        return datetime.fromisoformat(date[:19]).timestamp()
    except (TypeError, ValueError):
        return 0.0


def current_rows(results: list[tuple[Path, dict]]) -> dict[str, list[dict]]:
    """Machine class -> its rows: per (kind, model, workload, peer) the row of the newest result:
    the newest kvserve commit (when git knows it), then the newest run."""
    cache: dict = {}
    best: dict[tuple, dict] = {}
    for path, res in results:
        kind = res.get("kind")
        if kind not in KINDS:
            continue
        try:
            rows = KINDS[kind][1](res)
        except (KeyError, TypeError, IndexError, ZeroDivisionError) as e:
            print(f"skipping {path.name}: {type(e).__name__} {e}")
            continue
        date = res.get("date", "")
        when = commit_time(res.get("versions", {}).get("kvserve_commit"), cache)
        age = (when if when is not None else run_time(date), date)
        cls, model, extra = machine_class(res), model_name(res), settings(res)
        for row in rows:
            row.update(
                kind=kind,
                model=model,
                load=row["load"] + extra,
                command=shown_command(res),
                file=path.name,
                date=date[:10],
                age=age,
            )
            metric = row.get("metric", row["what"])
            key = (cls, kind, model, metric, row["load"], row.get("peer_key", "-"))
            if key not in best or best[key]["age"] <= age:
                best[key] = row
    classes: dict[str, list[dict]] = {}
    order = list(KINDS)
    # Stable sort: within a kind, model and metric, rows keep the order their results gave them.
    for (cls, *_), row in sorted(
        best.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]), *kv[0][2:4])
    ):
        classes.setdefault(cls, []).append(row)
    return classes


# ---- the page -----------------------------------------------------------------------------------

INTRO = """\
# kvserve benchmarks

Generated by `python3 -m kvserve bench report` from `docs/bench-results/*.json`; do not edit by
hand. One table per machine class: a CPU model with the kvserve kernel build that ran (the best
the CPU has, or one forced with `KVSERVE_ISA`), or a GPU. For each kind of benchmark, model,
workload and peer the table shows the newest result only (the newest kvserve commit, then the
newest run); every result saved stays in `docs/bench-results/` as the record.

To reproduce a row, run its command from a clone of the repository (`--save` writes the JSON,
then `python3 -m kvserve bench report` rebuilds this page):

```bash
[KVSERVE_ISA=avx2] python3 -m kvserve bench KIND [--workload w1 | --dataset w2] \\
    --peer llamacpp --llamacpp-bin LLAMA_SERVER --repeat 3 --save
```

Peers run in the same command, on the same token ids, after the same warm-up. The ratio is
kvserve's figure over the peer's; with `--repeat 3` or more each figure is the median of that many
rounds, kvserve and its peers alternating, and the "what" column says how many. `LLAMA_SERVER` is
the llama-server binary whose build the "against" column names. What the workloads, peers and
columns are, and the caveats: [methodology.md](methodology.md); every flag:
[bench.md](bench.md).
"""

HEADERS = ["kind", "what", "model", "workload", "kvserve", "against", "its figure", "ratio"]


def build_page(results: list[tuple[Path, dict]], page_dir: Path) -> str:
    lines = [INTRO]
    classes = current_rows(results)
    newest: dict[str, dict] = {}
    for _, res in results:
        if res.get("kind") in KINDS:
            cls = machine_class(res)
            if cls not in newest or newest[cls].get("date", "") < res.get("date", ""):
                newest[cls] = res
    # CPUs first, then GPUs; by name within each.
    for cls in sorted(classes, key=lambda c: (c.startswith("GPU"), c)):
        res = newest[cls]
        m, v = res["machine"], res.get("versions", {})
        about = (
            f"{m.get('memory_gib', '?')} GiB, {m.get('os', '?')}, Python {m.get('python', '?')}, "
            + ", ".join(f"{k} {val}" for k, val in v.items() if val and k != "kvserve_commit")
            + f" (newest result). SIMD: {', '.join(m.get('simd', [])) or '-'}."
        )
        lines += [f"## {cls}", "", *textwrap.wrap(about, 100), ""]
        rows = classes[cls]
        lines.append(
            md_table(
                HEADERS + ["result"],
                [
                    [KINDS[r["kind"]][0], r["what"], r["model"], r["load"], r["ours"]]
                    + [r.get("peer", "-"), r.get("theirs", "-"), r.get("ratio", "-")]
                    + [f"[{Path(r['file']).stem}](bench-results/{r['file']}), {r['date']}"]
                    for r in rows
                ],
            )
        )
        commands = {}
        for r in rows:
            commands.setdefault(r["file"], r["command"])
        lines += ["", "Commands:", ""]
        lines += [f"- `{Path(f).stem}`: `{c}`" for f, c in commands.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


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
