"""Offline throughput of vLLM on token-id requests; run by `kvserve bench throughput --peer vllm`
with the Python that has vLLM installed (--vllm-python), so it imports vLLM and the standard
library only, never kvserve.

    python vllm_runner.py IN.json OUT.json

IN: {"model": HF dir, "dtype", "max_num_seqs", "max_model_len", "seed", "requests": [{"prompt_ids",
"max_tokens"}, ...]}. OUT: {"load_s", "elapsed_s", "output_tokens": [per request], "version"}.
Every request is submitted at once, greedy, ignore_eos, exactly its max_tokens, as kvserve's run.
"""

import json
import sys
import time


def main(src: str, dst: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    job = json.load(open(src))
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_model_len=job["max_model_len"],
        seed=job["seed"],
    )
    load_s = time.perf_counter() - t0
    reqs = job["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
    ]
    llm.generate(
        prompts[:1], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False
    )
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    json.dump(
        {
            "load_s": load_s,
            "elapsed_s": elapsed,
            "version": vllm.__version__,
            "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
        },
        open(dst, "w"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
