"""Async scheduling (--async-scheduling) against synchronous steps on the same scripted workload:
every request's greedy tokens, logprobs, finish reason and text are the same bits, and every KV
block is free again at the end.

The model is the tiny random-weight Llama in Q4_0 (kvserve/bench/gguf_presets.py), whose C layer
stack computes a row's bits whatever else shares the step (tests/model/test_determinism.py), so
the two modes must agree exactly even where their schedules differ. The workload mixes prompt
lengths (chunked under a small token budget), arrivals while others decode, max_tokens stops,
stop strings and stop token ids (taken from a first synchronous run), an abort, prefix-cache hits
and preemption under a KV pool too small for everything at once; a seeded sampled request must
draw the same tokens too, and a structured-output (regex) one the same constrained tokens.
"""

import random
import re

import pytest

from kvserve.bench.gguf_presets import write_model
from kvserve.sampling_params import SamplingParams, StructuredOutputs

GRAMMAR = "[a-z]{2,6}( [a-z]{2,6}){1,3}[.]"  # the text a structured-output request must take
BLOCKS = 14  # 224 tokens of KV: the workload needs more at once, so some are preempted


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_gguf):
    path = tmp_path_factory.mktemp("async-scheduling") / "tiny-q4_0.gguf"
    write_model(str(path), "tiny", "q4_0", tokenizer_from=default_gguf)
    return str(path)


def _engine(path, async_scheduling: bool):
    from kvserve import LLM

    llm = LLM(
        path,
        num_threads=1,
        num_blocks=BLOCKS,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
    )
    return llm.engine


def _prompts():
    rng = random.Random(7)
    shared = [rng.randrange(1000, 20000) for _ in range(40)]  # a prefix of 2.5 blocks
    out = {}
    for i, n in enumerate([5, 23, 70, 12, 41, 3, 90, 30]):
        out[f"r{i}"] = [rng.randrange(1000, 20000) for _ in range(n)]
    out["p0"] = shared + [11, 12, 13]
    out["p1"] = shared + [21, 22]  # arrives later: prefix hit on p0's blocks
    out["p2"] = shared + [31]
    return out


def _run(engine, script: dict[int, list], max_steps: int = 2000):
    """Drive the engine: at step k, script[k]'s actions, then one step. Returns per request
    (tokens, logprobs, finish reason, text)."""
    done = {}
    last = max(script)
    for k in range(max_steps):
        for act in script.get(k, []):
            act(engine)
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                lps = [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in o.logprobs or []]
                done[out.request_id] = (list(o.token_ids), lps, o.finish_reason, o.text)
        if k > last and not engine.has_unfinished_requests():
            return done
    raise AssertionError("the workload did not finish")


def _script(prompts, stops: dict[str, SamplingParams]):
    def add(rid, **kw):
        params = stops.get(rid) or SamplingParams(
            temperature=0, max_tokens=kw.pop("max_tokens", 24), ignore_eos=True, logprobs=2, **kw
        )
        return lambda eng: eng.add_request(rid, prompts[rid], params)

    def abort(rid):
        return lambda eng: eng.abort_request(rid)

    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True, logprobs=1)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=40,
        logprobs=2,
        structured_outputs=StructuredOutputs(regex=GRAMMAR),
    )
    return {
        0: [add("r0", max_tokens=40), add("r1", max_tokens=7), add("r2"), add("p0")],
        2: [add("r3", max_tokens=1), add("r4", max_tokens=30)],
        3: [lambda eng: eng.add_request("s0", prompts["r5"], seeded)],
        4: [lambda eng: eng.add_request("g0", prompts["r1"], constrained)],
        5: [add("p1"), add("r5", max_tokens=2)],
        8: [add("r6", max_tokens=35), add("r7", max_tokens=60)],
        11: [abort("r4")],
        14: [add("p2", max_tokens=16)],
    }


def test_async_scheduling_gives_the_same_tokens_and_frees_every_block(tiny):
    prompts = _prompts()
    sync, asyn = _engine(tiny, False), _engine(tiny, True)
    assert asyn.async_scheduling and not sync.async_scheduling
    # Stop strings and stop ids from a first synchronous run: r2's text, r7's tokens.
    probe = _run(sync, _script(prompts, {}))
    text = probe["r2"][3]
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    stop_id = probe["r7"][0][9]
    stops = {
        "r2": SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, stop=[stop_text]
        ),
        "r7": SamplingParams(
            temperature=0, max_tokens=60, ignore_eos=True, logprobs=2, stop_token_ids=[stop_id]
        ),
    }
    script = _script(prompts, stops)
    results, stats = {}, {}
    for name, eng in (("sync", sync), ("async", asyn)):
        free = eng.scheduler.num_free_blocks
        filled = []
        fill = eng.runner.fill_placeholders
        eng.runner.fill_placeholders = lambda b, fill=fill, filled=filled: (
            filled.append(1),
            fill(b),
        )[1]
        results[name] = _run(eng, script)
        assert eng.scheduler.num_free_blocks == free == eng.scheduler.num_total_blocks
        assert eng.scheduler.num_used_blocks == 0
        assert eng.runner._states == {}  # no per-sequence runner state left behind
        stats[name] = (eng.scheduler.stats, len(filled))
        eng.close()
    s, a = results["sync"], results["async"]
    assert set(s) == set(a) == set(prompts) | {"s0", "g0"}
    # the features the workload is meant to exercise did happen, in both modes
    for st, _ in stats.values():
        assert st.num_preemptions > 0
        assert st.prefix_cache_hits > 0
    assert stats["async"][1] > 20 and stats["sync"][1] == 0  # planned steps ran
    assert s["r2"][2] == "stop" and stop_text not in s["r2"][3]
    assert s["r7"][2] == "stop" and s["r7"][0][-1] == stop_id
    assert s["r3"][2] == "length" and len(s["r3"][0]) == 1
    assert s["g0"][2] == "stop" and re.fullmatch(GRAMMAR, s["g0"][3])  # the grammar ended it
    for rid in s:
        if rid == "r4":  # aborted at a step: a prefix of the same greedy tokens in each mode
            assert s[rid][2] == a[rid][2] == "abort"
            n = min(len(s[rid][0]), len(a[rid][0]))
            assert s[rid][0][:n] == a[rid][0][:n] and s[rid][1][:n] == a[rid][1][:n]
            continue
        assert a[rid] == s[rid], rid


def test_a_step_that_raises_with_async_scheduling_fails_only_its_request(tiny):
    """A model step that raises on the step thread is isolated as a synchronous one is: the
    request responsible fails, the others get their clean tokens, no block leaks."""
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = _engine(tiny, False)
    want = _run(
        clean,
        {0: [lambda e, r=r: e.add_request(r, prompts[r], greedy) for r in "r0 r1 r2".split()]},
    )
    clean.close()
    eng = _engine(tiny, True)
    forward = eng.runner.forward  # the half that runs on the step thread
    calls = []

    def poisoned(sched, *args, **kwargs):
        calls.append(len(sched.chunks))
        if any(c.seq.seq_id == "bad" and c.seq.num_output_tokens >= 3 for c in sched.chunks):
            raise RuntimeError("injected fault")
        return forward(sched, *args, **kwargs)

    eng.runner.forward = poisoned
    free = eng.scheduler.num_free_blocks
    script = {0: [lambda e, r=r: e.add_request(r, prompts[r], greedy) for r in "r0 r1 r2".split()]}
    script[1] = [lambda e: e.add_request("bad", prompts["r3"], greedy)]
    got = _run(eng, script)
    assert got["bad"][2] == "abort" and len(got["bad"][0]) == 3
    assert {r: got[r] for r in want} == want
    assert eng.scheduler.num_free_blocks == free and eng.runner._states == {}
    assert len(calls) > 10
    eng.close()
