"""For every GGUF mix llama-quantize writes (kvserve/bench/gguf_presets.py, random weights of the
tiny Llama shape), a greedy request's tokens and logprobs are the same bits on every ISA build
the host executes, with one thread or two, alone or among chunked and sampled neighbours, and
(for the K-quant mix with kinds side by side) split over two pipeline stages."""

import pytest

from kvserve.bench.gguf_presets import PRESETS, write_model
from kvserve.ops import cpu_kernels

PROMPTS = ["The capital of France is", "def f(x):\n    return"]
NEIGHBOURS = [("Once upon a time " * (4 + 4 * i)) + f"story {i}:" for i in range(3)]
STEPS = 8


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("preset-determinism")


def _file(preset_dir, default_gguf, preset):
    path = preset_dir / f"tiny-{preset}.gguf"
    if not path.exists():
        write_model(str(path), "tiny", preset, tokenizer_from=default_gguf)
    return str(path)


def _llm(path, threads, **kw):
    from kvserve import LLM

    return LLM(path, num_threads=threads, kv_cache_memory="16MiB", max_model_len=512, **kw)


def _greedy(llm, neighbours: bool):
    """(tokens, top-3 logprobs) of each of PROMPTS; with neighbours, submitted interleaved with
    sampled requests whose long prompts are chunked under a small token budget."""
    from kvserve import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    if not neighbours:
        outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in PROMPTS]
    else:
        sampled = [
            SamplingParams(temperature=0.9, seed=i, max_tokens=4 + 3 * i, ignore_eos=True)
            for i in range(len(NEIGHBOURS))
        ]
        prompts = [NEIGHBOURS[0], PROMPTS[0], NEIGHBOURS[1], PROMPTS[1], NEIGHBOURS[2]]
        params = [sampled[0], greedy, sampled[1], greedy, sampled[2]]
        outs = llm.generate(prompts, params, use_tqdm=False)[1:4:2]
    return [
        (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
        for o in outs
    ]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_tokens_do_not_depend_on_isa_threads_or_company(
    preset_dir, default_gguf, monkeypatch, preset
):
    path = _file(preset_dir, default_gguf, preset)
    isas = cpu_kernels.host_isas()  # best first, portable (slow) last
    runs = [(isas[0], 1, False)] + [(isa, 2, True) for isa in isas[1:-1] or isas[:1]]
    runs += [(isas[-1], 1, False)] * (len(isas) > 1)
    results = {}
    for isa, threads, neighbours in runs:
        monkeypatch.setenv("KVSERVE_ISA", isa)
        llm = _llm(path, threads, max_num_batched_tokens=32 if neighbours else 512)
        if llm.engine.runner.layer_stack is None:
            pytest.skip("no C layer stack here (no compiler)")
        assert llm.engine.runner.layer_stack.isa == isa
        results[(isa, threads, neighbours)] = _greedy(llm, neighbours)
        del llm
    (ref_key, ref), *rest = results.items()
    assert all(len(toks) == STEPS for toks, _ in ref)
    for key, got in rest:
        assert got == ref, f"{preset}: {key} differs from {ref_key}"


def test_q4_k_m_pipeline_stages_give_one_process_bits(preset_dir, default_gguf):
    """Q4_K_M's q/k/v run as two kinds side by side; over two stages, the same bits."""
    path = _file(preset_dir, default_gguf, "q4_k_m")
    one = _llm(path, 1)
    if one.engine.runner.layer_stack is None:
        pytest.skip("no C layer stack here (no compiler)")
    ref = _greedy(one, neighbours=True)
    del one
    pp = _llm(path, 1, pipeline_parallel_size=2, max_num_batched_tokens=32)
    try:
        assert pp.engine.runner.pp is not None, pp.engine.runner.step_path
        assert pp.engine.runner.step_path.startswith("C layer stack"), pp.engine.runner.step_path
        assert _greedy(pp, neighbours=True) == ref
    finally:
        pp.engine.close()
