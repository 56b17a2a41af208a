"""Where a batch-1 decode step's time goes in the engine: the C layer stack (every layer), the LM
head, and the rest of `EngineCore.step` (scheduler, input tensors, sampling, detokenizing: the
Python around the kernels). One greedy request of --output-len tokens after a short prompt,
--rounds times; prints ms per step.

    KVSERVE_ISA=avx2 python3 scripts/decode_step_anatomy.py --quantization gguf
"""

from __future__ import annotations

import argparse
import time

from kvserve import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quantization", default=None)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    llm = LLM(
        enable_prefix_caching=False,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    runner, engine = llm.engine.runner, llm.engine
    if runner.layer_stack is None:
        raise SystemExit("this build runs no C layer stack")
    spent = {"stack": 0.0, "head": 0.0, "step": 0.0, "steps": 0}

    def timed(fn, key):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
                spent["steps"] += key == "step"

        return call

    stack_type = type(runner.layer_stack)
    stack_call = stack_type.__call__
    stack_type.__call__ = timed(stack_call, "stack")
    runner.model.compute_logits = timed(runner.model.compute_logits, "head")
    engine.step = timed(engine.step, "step")
    try:
        prompt = {"prompt_token_ids": [(i * 104729) % 48000 + 500 for i in range(args.prompt_len)]}
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        spent.update(stack=0.0, head=0.0, step=0.0, steps=0)
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        stack_type.__call__ = stack_call
    n = spent["steps"]
    rest = spent["step"] - spent["stack"] - spent["head"]
    print(
        f"{n} steps: {wall / n * 1e3:.3f} ms a step; layer stack {spent['stack'] / n * 1e3:.3f}, "
        f"LM head {spent['head'] / n * 1e3:.3f}, the rest of the step {rest / n * 1e3:.3f}, "
        f"outside steps {(wall - spent['step']) / n * 1e3:.3f}"
    )


if __name__ == "__main__":
    main()
