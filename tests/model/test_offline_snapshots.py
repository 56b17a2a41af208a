"""LLM.generate reads only deltas and final outputs, so the engine's unfinished outputs carry the
step's tokens, not copies of every token so far: the final outputs are whole (n > 1, logprobs,
the same as with whole snapshots every step) and the engine's own setting is back afterwards."""

from kvserve.sampling_params import SamplingParams

PROMPTS = [[504, 3575, 282, 4649, 314], [6081, 1870, 253, 655]]


def test_generate_copies_no_whole_lists_until_the_end(default_gguf, monkeypatch):
    from kvserve import LLM

    llm = LLM(default_gguf, num_threads=1, kv_cache_memory="64MiB", max_model_len=256)
    params = SamplingParams(
        temperature=0.8, seed=3, n=2, max_tokens=24, logprobs=1, ignore_eos=True
    )
    proc = llm.engine.processor
    proc.delta_snapshots = False  # the engine's own setting, whole snapshots
    snapshot = type(proc)._snapshot
    seen = []  # (finished, len(token_ids)) of every snapshot taken during generate

    def watched(self, sample):
        snap = snapshot(self, sample)
        seen.append((snap.finish_reason is not None, len(snap.token_ids)))
        return snap

    monkeypatch.setattr(type(proc), "_snapshot", watched)
    lean = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert proc.delta_snapshots is False
    assert all(n <= 1 for done, n in seen if not done)  # a step's token, not the whole list
    assert any(done and n == 24 for done, n in seen)

    monkeypatch.setattr(type(proc), "_snapshot", snapshot)
    whole = _whole_snapshot_run(llm.engine, params)
    for a, b in zip(lean, whole):
        assert len(a.outputs) == len(b) == 2
        for x, y in zip(a.outputs, b):
            assert x.token_ids == y.token_ids and len(x.token_ids) == 24
            assert x.text == y.text and x.cumulative_logprob == y.cumulative_logprob
            assert [lp.token_id for lp in x.logprobs] == x.token_ids
            assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]


def _whole_snapshot_run(engine, params):
    """The prompts through the engine itself, whole snapshots every step: per request, the last
    output of each sample."""
    latest = {}
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"whole{i}", ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                latest.setdefault(out.request_id, {})[o.index] = o
    return [[latest[f"whole{i}"][j] for j in (0, 1)] for i in range(len(PROMPTS))]
