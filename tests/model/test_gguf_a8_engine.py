"""The gguf-a8 and gguf-mixed formats on the default model: the GGUF blocks with activations as one
8-bit part per block (llama.cpp's precision), or one except where a block's second part carries
enough (mixed), prompt tokens through the integer GEMV too. Their tokens at temperature 0 depend on
the prompt only (not on the batch, the chunking or the thread count) and are the same on every ISA
build; they stay close to the float32 reference (mixed closer than one part) and differ from
gguf."""

import pytest
import torch

from kvserve.ops import cpu_kernels
from tests.model.test_determinism import (
    FAST_ISAS,
    GREEDY,
    OTHERS,
    STEPS,
    _greedy_tokens,
    _llm,
    isa_env,  # noqa: F401 (a fixture)
)

FORMATS = {"gguf-a8": "one", "gguf-mixed": "mixed"}  # format -> the layer stack's activation parts


def _a8(default_gguf, threads, fmt="gguf-a8", **kw):
    llm = _llm(default_gguf, threads, quantization=fmt, **kw)
    stack = llm.engine.runner.layer_stack
    if stack is None:
        pytest.skip("no C layer stack here (no compiler)")
    assert stack.parts == FORMATS[fmt]
    return llm


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("isa", FAST_ISAS[:1])
def test_a8_greedy_tokens_do_not_depend_on_batch_or_threads(default_gguf, isa_env, isa, fmt):  # noqa: F811 (the fixture)
    from kvserve import SamplingParams

    isa_env(isa)
    llm = _a8(default_gguf, threads=1, fmt=fmt)
    alone = [_greedy_tokens(llm, [p], STEPS)[0] for p in GREEDY]
    del llm
    llm = _a8(
        default_gguf, threads=2, fmt=fmt, max_num_batched_tokens=48
    )  # prompts chunked, mixed steps
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    sampled = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=8 + 5 * i, ignore_eos=True)
        for i in range(4)
    ]
    prompts = [p for pair in zip(OTHERS[:4], GREEDY[:4]) for p in pair] + GREEDY[4:]
    params = [q for pair in zip(sampled, [greedy] * 4) for q in pair] + [greedy] * 4
    outs = llm.generate(prompts, params, use_tqdm=False)
    batched = [o.outputs[0].token_ids for o in outs[1:8:2]] + [
        o.outputs[0].token_ids for o in outs[8:]
    ]
    for prompt, a, b in zip(GREEDY, alone, batched):
        assert a == b, f"{isa}: {prompt!r} alone {a} != batched {b}"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a8_isa_builds_give_identical_tokens_and_logprobs(default_gguf, isa_env, fmt):  # noqa: F811 (the fixture)
    from kvserve import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    results = {}
    for isa in cpu_kernels.host_isas():
        isa_env(isa)
        llm = _a8(default_gguf, threads=2, fmt=fmt)
        outs = llm.generate(GREEDY[:2], params, use_tqdm=False)
        results[isa] = [
            (
                o.outputs[0].token_ids,
                [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs],
                [None if lp is None else (lp.logprob, lp.top) for lp in o.prompt_logprobs],
            )
            for o in outs
        ]
        del llm
    ref = results["portable"]
    for isa, got in results.items():
        assert got == ref, f"{isa} differs from the portable build"


def test_a8_is_close_to_the_reference_and_not_gguf(default_gguf):
    """Prompt logprobs of a text under gguf-a8, gguf-mixed, gguf and fp32 weights: gguf-a8 and
    gguf-mixed agree with fp32 on most next tokens, and their numbers are their own (one part
    changes them; gguf is ~exact); mixed parts drift less than one part."""
    from kvserve import SamplingParams

    text = (" ".join(GREEDY) + " ") * 3
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    top = {}
    for q in ("none", "gguf", "gguf-a8", "gguf-mixed"):
        llm = _llm(default_gguf, threads=2, quantization=q)
        out = llm.generate([text], params, use_tqdm=False)[0]
        top[q] = [
            (max(lp.top, key=lambda t: t[2])[0], lp.logprob) for lp in out.prompt_logprobs[1:]
        ]
        del llm
    exact = torch.tensor([abs(a[1] - b[1]) for a, b in zip(top["gguf"], top["none"])])
    drift = {}
    for fmt in FORMATS:
        agree = sum(a[0] == b[0] for a, b in zip(top[fmt], top["none"])) / len(top["none"])
        assert agree >= 0.9, (fmt, agree)
        drift[fmt] = torch.tensor([abs(a[1] - b[1]) for a, b in zip(top[fmt], top["none"])]).mean()
        assert drift[fmt] > 5 * exact.mean() and drift[fmt] < 0.1, (fmt, drift[fmt], exact.mean())
    assert drift["gguf-mixed"] < drift["gguf-a8"], drift
