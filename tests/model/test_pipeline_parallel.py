"""Pipeline parallelism on the default model: 2 stages (15 + 15 layers), one process and one thread
each, gloo over 127.0.0.1, micro-batches in flight.

Float weights (--quantization none): the stages run the same modules in the same order as one
process's PyTorch forward; only the shapes of the matrix products change (a step's batch is cut
into micro-batches), so PP=2 gives the greedy tokens of PP=1 and logprobs within 1e-4; chunked
prompts and prompt logprobs go through. GGUF blocks (gguf, gguf-mixed): each stage runs its layers
on the C layer stack, whose tokens do not depend on the batch, so PP=2 gives one process's tokens
and logprobs bit for bit."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.scheduler import ScheduledChunk, SchedulerOutput
from kvserve.runner.pipeline_parallel import micro_batches, stage_layers
from tests.model.test_tensor_parallel import PARAMS, PROMPTS


def _llm(default_gguf, pp):
    # 32-token steps: prompts in chunks, and steps of several chunks cut into micro-batches
    return LLM(
        default_gguf,
        quantization="none",
        pipeline_parallel_size=pp,
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory="64MiB",
        kv_cache_dtype="float32",
        max_num_batched_tokens=32,
    )


def _close(a, b, tol=1e-4):
    """Two logprob lists (token, text, logprob) with the same tokens and values within tol."""
    return [t[:2] for t in a] == [t[:2] for t in b] and all(
        abs(x[2] - y[2]) < tol for x, y in zip(a, b)
    )


def test_stages_and_micro_batches():
    assert [stage_layers(30, 2, s) for s in range(2)] == [range(0, 15), range(15, 30)]
    assert [len(stage_layers(30, 4, s)) for s in range(4)] == [8, 8, 7, 7]
    with pytest.raises(ValueError, match="more than the model's 30 layers"):
        stage_layers(30, 31, 0)

    def step(lengths):
        return SchedulerOutput(
            [ScheduledChunk(None, [0] * n, 0, [[0]], True) for n in lengths], [], [], sum(lengths)
        )

    assert micro_batches(step([1] * 8), 2) == [list(range(8))]  # 8 tokens: too few to split
    assert micro_batches(step([100, 1, 1, 100]), 2) == [[0, 1], [2, 3]]
    assert micro_batches(step([512]), 4) == [[0]]  # one chunk: one micro-batch
    runs = micro_batches(step([16] * 10), 3)
    assert len(runs) == 3 and sum(runs, []) == list(range(10))


def test_pp2_gives_the_tokens_and_logprobs_of_one_process(default_gguf):
    one = _llm(default_gguf, 1)
    ref = one.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = _llm(default_gguf, 2)
    try:
        assert len(llm.engine.runner.model.layers) == 15 and llm.engine.runner.pp is not None
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        for a, b in zip(ref, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert _close(la.top, lb.top), (la.top, lb.top)
        long_prompt = " ".join(PROMPTS) * 3
        p = SamplingParams(max_tokens=1, prompt_logprobs=1)
        x = one.generate([long_prompt], p, use_tqdm=False)[0].prompt_logprobs
        y = llm.generate([long_prompt], p, use_tqdm=False)[0].prompt_logprobs
        assert len(x) == len(y) > 60 and x[0] is None and y[0] is None
        assert all(_close(a.top, b.top) and a.token_id == b.token_id for a, b in zip(x[1:], y[1:]))
        assert llm.engine.scheduler.num_used_blocks == 0
    finally:
        llm.engine.close()


@pytest.mark.parametrize("quantization", ["gguf", None])  # None: the default, gguf-mixed
def test_pp2_on_the_c_layer_stack_gives_one_process_bits(default_gguf, quantization):
    """Every stage on the C layer stack (its own layers; stage 0 embeds, the last stage norms):
    the greedy tokens and logprobs of one process exactly, prompts chunked and batched."""

    def llm(pp):
        return LLM(
            default_gguf,
            quantization=quantization,
            pipeline_parallel_size=pp,
            num_threads=1,
            max_model_len=1024,
            kv_cache_memory="64MiB",
            max_num_batched_tokens=32,
        )

    prompts = PROMPTS[:4] + [" ".join(PROMPTS) * 2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    one = llm(1)
    if one.engine.runner.layer_stack is None:
        pytest.skip("no C layer stack here (no compiler)")
    ref = [
        (o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs])
        for o in one.generate(prompts, params, use_tqdm=False)
    ]
    del one
    pp = llm(2)
    try:
        runner = pp.engine.runner
        assert runner.pp is not None and runner.layer_stack is not None, runner.step_path
        assert runner.step_path.startswith("C layer stack"), runner.step_path
        got = [
            (o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs])
            for o in pp.generate(prompts, params, use_tqdm=False)
        ]
        assert got == ref
        assert pp.engine.scheduler.num_used_blocks == 0
    finally:
        pp.engine.close()
