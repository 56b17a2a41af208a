"""The GPU path's attention plumbing on the CPU: the GPU's step backend (CudaBackend, without
CUDA graphs) hands every step to the Triton kernels (GpuPlan, run by Triton's interpreter on CPU
tensors) instead of the torch attention, and the engine must give the same greedy tokens,
through chunked prefill, a mixed prefill + decode batch and prefix-cache hits. The kernels at
real shapes, CUDA graphs and the GPU's norms run on a CUDA machine (tests/gpu)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip(
    "triton", reason="the GPU path's kernels are Triton kernels: pip install triton"
)
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (tests/conftest.py sets "
        "it when there is no CUDA)",
        allow_module_level=True,
    )

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.runner.backends import CudaBackend, TorchForward  # noqa: E402

NEW = 4
PROMPTS = [
    "The capital of Germany is Berlin. The capital of Italy is Rome. The capital of France is",
    "def add(a, b):\n    return",
    "List three colors of the rainbow, one per line, starting with red:\n1.",
]


def run(triton_attention: bool) -> tuple[LLM, list[tuple[list[int], list[set[int]]]]]:
    # A budget of 16 tokens splits the longer prompts into chunks and mixes them with decodes.
    llm = LLM(quantization="none", kv_cache_memory="32MiB", max_num_batched_tokens=16)
    runner = llm.engine.runner
    # the PyTorch forward, with the torch attention or the Triton kernels as on the GPU
    runner.backend = (
        CudaBackend(runner.model, runner.kv_caches, runner.device, runner.arch.num_kv_heads)
        if triton_attention
        else TorchForward(runner.model, runner.kv_caches)
    )
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    # the first prompt again, alone: its prompt blocks come from the prefix cache
    outs += llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_usage == 0.0
    assert llm.engine.scheduler.stats.prefix_cache_hits > 0
    return llm, [
        (o.outputs[0].token_ids, [{t for t, _, _ in lp.top} for lp in o.outputs[0].logprobs])
        for o in outs
    ]


def test_triton_attention_gives_the_torch_attentions_tokens(monkeypatch):
    from kvserve.ops import triton_attention

    calls = {"decode": 0, "prefill": 0}
    for kind in calls:
        kernel = getattr(triton_attention, f"paged_{kind}_attention")

        def counted(*args, _kernel=kernel, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_attention, f"paged_{kind}_attention", counted)
    _, torch_path = run(triton_attention=False)
    assert calls == {"decode": 0, "prefill": 0}
    llm, triton_path = run(triton_attention=True)
    layers = llm.engine.arch.num_layers
    # prompt chunks ran in at least three steps: two of the batch and the prefix-cached rerun
    assert calls["decode"] >= NEW * layers and calls["prefill"] >= 3 * layers, calls
    for (a, tops_a), (b, tops_b) in zip(torch_path, triton_path):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:  # a near-tie may flip: each must be in the other's top-5 there
                assert x in tops_b[i] and y in tops_a[i], (a, b)
                break
    assert sum(a == b for (a, _), (b, _) in zip(torch_path, triton_path)) >= len(torch_path) - 1
