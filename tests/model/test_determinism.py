"""At temperature 0 a request's tokens depend on its prompt only: not on the thread count, not on
what else runs in the same steps (other requests, chunked prompts, sampling neighbours), not on
the ISA build of the kernels (every build computes the same bits: ops/csrc/gguf_gemv.h).

Each ISA build the host can execute is tested (KVSERVE_ISA); the portable C build, which is
slow, only in the cross-ISA comparison on a short run.

Float weights (--quantization none) run on the same C layer stack, every token through its float32
GEMM (one fixed order of every sum), so the same holds for them: batch, threads, chunks, ISA
(prefix hits: tests/model/test_prefix_caching.py; docs/architecture.md, determinism)."""

import os

import pytest

from kvserve.ops import cpu_kernels

GREEDY = [
    "The capital of France is",
    "List three primary colors:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
    "Translate to French: The weather is nice today.",
    "Q: What is 17 * 23?\nA:",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# compute the mean of each row of a matrix\n",
]
# Neighbours: long prompts (chunked across steps), sampled with seeds, various lengths.
OTHERS = [("In the beginning " * (20 + 7 * i)) + f"request {i}:" for i in range(8)]
STEPS = 32


@pytest.fixture
def isa_env(monkeypatch):
    def use(isa):
        monkeypatch.setenv("KVSERVE_ISA", isa)

    return use


def _llm(default_gguf, threads, **kw):
    from kvserve import LLM

    return LLM(default_gguf, num_threads=threads, kv_cache_memory="96MiB", max_model_len=1024, **kw)


def _greedy_tokens(llm, prompts, steps):
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


FAST_ISAS = [isa for isa in cpu_kernels.host_isas() if isa != "portable"]


@pytest.mark.parametrize("fmt", [None, "none"], ids=["default", "float32"])
@pytest.mark.parametrize("isa", FAST_ISAS)
def test_greedy_tokens_do_not_depend_on_batch_or_threads(default_gguf, isa_env, isa, fmt):
    from kvserve import SamplingParams

    isa_env(isa)
    llm = _llm(default_gguf, threads=1, quantization=fmt)
    if llm.engine.runner.layer_stack is None:
        pytest.skip("no C layer stack here (no compiler)")
    assert llm.engine.runner.layer_stack.isa == isa
    alone = [_greedy_tokens(llm, [p], STEPS)[0] for p in GREEDY]
    del llm
    # Two threads, a small token budget (prompts chunked, decodes mixed with prompt chunks) and
    # 8 sampled neighbours of other lengths, all submitted together.
    llm = _llm(default_gguf, threads=2, max_num_batched_tokens=48, quantization=fmt)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    sampled = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=8 + 5 * i, ignore_eos=True)
        for i in range(len(OTHERS))
    ]
    prompts = [p for pair in zip(OTHERS, GREEDY) for p in pair]  # interleaved
    params = [q for pair in zip(sampled, [greedy] * len(GREEDY)) for q in pair]
    outs = llm.generate(prompts, params, use_tqdm=False)
    batched = [o.outputs[0].token_ids for o in outs[1::2]]
    for prompt, a, b in zip(GREEDY, alone, batched):
        assert a == b, f"{isa}: {prompt!r} alone {a} != batched {b}"


def test_isa_builds_give_identical_tokens_and_logprobs(default_gguf, isa_env):
    """Every build the host can execute (portable C included) gives the same tokens and the same
    logprobs, bit for bit."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    results = {}
    for isa in cpu_kernels.host_isas():
        isa_env(isa)
        llm = _llm(default_gguf, threads=2)
        if llm.engine.runner.layer_stack is None:
            pytest.skip("no C layer stack here (no compiler)")
        outs = llm.generate(GREEDY[:2], params, use_tqdm=False)
        results[isa] = [
            (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
            for o in outs
        ]
        del llm
    ref = results["portable"]
    for isa, got in results.items():
        assert got == ref, f"{isa} differs from the portable build"


def test_forced_isa_that_the_cpu_lacks_is_refused(default_gguf, isa_env):
    from kvserve import LLM

    missing = [isa for isa in cpu_kernels.ISAS if isa not in cpu_kernels.host_isas()]
    if not missing:
        pytest.skip("this CPU executes every build")
    isa_env(missing[0])
    with pytest.raises(ValueError, match="cannot execute"):
        LLM(default_gguf, kv_cache_memory="32MiB")
    assert os.environ["KVSERVE_ISA"] == missing[0]


def test_float_weights_tokens_and_logprobs_do_not_depend_on_the_isa(default_gguf, isa_env):
    """--quantization none: the float32 weights on the C stack's float32 GEMM give the same
    tokens and logprobs in every build the host executes (portable C included), bit for bit."""
    from kvserve import SamplingParams
    from kvserve.model.quant.gguf import FLOAT_ACTS

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = {}
    for isa in cpu_kernels.host_isas():
        isa_env(isa)
        llm = _llm(default_gguf, threads=2, quantization="none")
        if llm.engine.runner.layer_stack is None:
            pytest.skip("no C layer stack here (no compiler)")
        assert llm.engine.runner.layer_stack.parts == FLOAT_ACTS
        outs = llm.generate(GREEDY[:2], params, use_tqdm=False)
        results[isa] = [
            (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
            for o in outs
        ]
        del llm
    ref = results["portable"]
    for isa, got in results.items():
        assert got == ref, f"{isa} differs from the portable build"
