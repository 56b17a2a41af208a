"""Beam search on the real default model (float32 weights and KV) against transformers'
beam search on the same weights: same beams, same scores within 1e-4; beams share KV blocks
and every block goes back to the pool."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import ParamError

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="256MiB", quantization="none", kv_cache_dtype="float32")


def _hf_beams(hf_model, ids, width, max_new, length_penalty=1.0, early_stopping=False, eos=None):
    x = torch.tensor([ids])
    gen = hf_model.generate(
        x,
        attention_mask=torch.ones_like(x),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return [row[len(ids) :].tolist() for row in gen.sequences], gen.sequences_scores.tolist()


@pytest.mark.parametrize(
    "width,max_new,length_penalty,early_stopping",
    [
        (2, 16, 1.0, False),
        (4, 24, 1.0, False),
        (3, 20, 0.5, True),
    ],
)
def test_same_beams_and_scores_as_transformers(
    llm, hf_model, width, max_new, length_penalty, early_stopping
):
    tok = llm.tokenizer
    eos = sorted(llm.engine.eos_token_ids)
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        hf_seqs, hf_scores = _hf_beams(
            hf_model, ids, width, max_new, length_penalty, early_stopping, eos
        )
        params = SamplingParams(
            n=width,
            use_beam_search=True,
            max_tokens=max_new,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [
            s[: len(c.token_ids)] for c, s in zip(out.outputs, hf_seqs)
        ]
        for c, seq, score in zip(out.outputs, hf_seqs, hf_scores):
            n = len(c.token_ids)
            assert all(t == 0 or t in eos for t in seq[n:])  # transformers pads the shorter beams
            assert abs(c.cumulative_logprob / n**length_penalty - score) < 1e-4, (
                c.cumulative_logprob,
                score,
            )
            assert (c.finish_reason == "stop") == (c.token_ids[-1] in eos)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_batch_of_beam_requests_equals_one_at_a_time_and_frees_every_block(llm):
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=12)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    sched = llm.engine.scheduler
    free_before = sched.num_free_blocks
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(alone, together):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len(b.outputs) == 2
    assert sched.num_free_blocks == free_before
    assert not sched.sequences and not llm.engine.beams.by_seq


def test_beams_share_blocks_and_stay_in_step_when_max_num_seqs_is_small():
    # Fewer running slots than beams: held beams wait for the rest without a deadlock, and the
    # beams fork from each other (prefix hits would show only as fewer new blocks).
    small = LLM(
        kv_cache_memory="64MiB", quantization="none", kv_cache_dtype="float32", max_num_seqs=2
    )
    ref = LLM(kv_cache_memory="64MiB", quantization="none", kv_cache_dtype="float32")
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=10)
    a = small.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    b = ref.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert small.engine.scheduler.num_free_blocks == small.engine.scheduler.num_total_blocks


def test_beams_share_full_blocks_and_abort_frees_every_beam(llm):
    eng = llm.engine
    kv = eng.scheduler.kv_cache_manager
    free_before = eng.scheduler.num_free_blocks
    prompt = llm.tokenizer.encode(" ".join(PROMPTS) * 2)
    assert len(prompt) > 40
    eng.add_request("beam-abort", prompt, SamplingParams(n=3, use_beam_search=True, max_tokens=40))
    for _ in range(4):
        eng.step()
    assert len(eng.beams.by_seq) == 3
    # The prompt's full blocks are the same blocks in every beam (forks share by refcount);
    # the block each beam writes into is its own.
    tables = [kv.block_ids(seq)[0] for seq in eng.beams.by_seq]
    full = len(prompt) // kv.block_size
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert (
        len({t[len(prompt) // kv.block_size] for t in tables}) == 3
        or len(prompt) % kv.block_size == 0
    )
    eng.abort_request("beam-abort")
    outs = eng.step()
    assert any(o.request_id == "beam-abort" and o.finished for o in outs)
    assert eng.scheduler.num_free_blocks == free_before and not eng.beams.by_seq


def test_aborting_a_beam_request_leaves_a_request_named_like_its_outputs(llm):
    """A beam request's completions are not scheduler sequences: aborting it touches only its
    beams."""
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[3])
    eng.add_request("b", ids, SamplingParams(n=2, use_beam_search=True, max_tokens=20))
    eng.add_request("b#0", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()
    eng.abort_request("b")
    outs = []
    for _ in range(200):  # bounded: a request that never finishes fails the test, not hangs it
        if not eng.has_unfinished_requests():
            break
        outs += eng.step()
    assert not eng.has_unfinished_requests()
    (other,) = [o for o in outs if o.request_id == "b#0" and o.finished]
    assert other.outputs[0].finish_reason == "length" and len(other.outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(top_p=0.5), "top_p"),
        (dict(logprobs=2), "logprobs"),
        (dict(stop=["x"]), "stop"),
        (dict(n=2, best_of=1), "best_of"),
        (dict(n=40), "n"),
        (dict(best_of=3, use_beam_search=False, n=1), "best_of"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(early_stopping="soon"), "early_stopping"),
    ],
)
def test_bad_beam_parameters_name_the_field(kwargs, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{"use_beam_search": True, "max_tokens": 8, **kwargs})
    assert e.value.param == param
