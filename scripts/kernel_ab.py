"""A/B of two kernel source trees in one process: the engine's greedy requests run with the C
library built from a base tree and from this checkout, alternated run by run (the shared host's
drift hits both alike), prefix caching off. Prints each side's median seconds and whether the two
gave identical tokens. The base tree is any checkout's kvserve/ops/csrc, e.g.

    git archive 1bc4579 kvserve/ops/csrc | tar -x -C /tmp/base
    KVSERVE_ISA=avx2 python3 scripts/kernel_ab.py --base /tmp/base/kvserve/ops/csrc --workload w2 --rounds 4
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import standard_requests
from kvserve.ops import cpu_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the base tree's kvserve/ops/csrc directory")
    p.add_argument("--workload", choices=["w1", "w2"], default="w2")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    isa, cc = cpu_kernels.selected_isa(), cpu_kernels._compiler()
    own = cpu_kernels._CSRC
    libs = {}
    for name, src in (("base", Path(args.base)), ("new", own)):
        cpu_kernels._CSRC = src
        libs[name] = ctypes.CDLL(str(cpu_kernels.build(cc, isa)))
        cpu_kernels._signatures(libs[name])
    cpu_kernels._CSRC = own
    current = {"lib": libs["new"]}
    cpu_kernels.library = lambda isa=None: current["lib"]
    llm = LLM(enable_prefix_caching=False)
    reqs = standard_requests(args.workload, None, llm.engine.model_path)
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    times: dict[str, list[float]] = {"base": [], "new": []}
    tokens = {}
    for r in range(args.rounds):
        for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
            current["lib"] = libs[name]
            t0 = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = [list(o.outputs[0].token_ids) for o in out]
    for name, ts in times.items():
        print(f"{name} ({isa}, {args.workload}): median {statistics.median(ts):.3f} s;",
              " ".join(f"{t:.3f}" for t in ts))
    print("identical tokens:", tokens["base"] == tokens["new"])


if __name__ == "__main__":
    main()
