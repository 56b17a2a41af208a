"""Speculative decoding with the n-gram proposer on the default model.

At temperature 0 the tokens are exactly those of plain decoding (drafts are verified at decode
positions, which the C layer stack computes as it computes decodes), alone and batched; seeded
sampling gives the tokens of plain decoding; every KV block comes back; and the prefix cache never
serves a block that held a rejected draft."""

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.spec.step_cost import MIN_SHARE

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
TOKENS = 128

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "The meeting is moved to Thursday at 3 pm in room 204; bring the quarterly report.",
    "SELECT name, email FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 10;",
]
COPY_PROMPTS = (
    [f"Repeat this text exactly: {t}\nRepeated text: " for t in TEXTS]
    + [f"Text: {t}\nThe same text, copied twice:\n" for t in TEXTS[:3]]
    + [
        "Rename the function add to plus in this code:\n"
        + TEXTS[2]
        + "\nThe code after renaming:\n",
        "Context: "
        + TEXTS[4]
        + "\nQuestion: when and where is the meeting? Quote the context.\nAnswer:",
    ]
)
OPEN_PROMPTS = [
    "The capital of France is",
    "List three primary colors:",
    "Once upon a time, in a small village by the sea, there lived",
    "Translate to French: The weather is nice today.",
    "Q: What is 17 * 23?\nA:",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# compute the mean of each row of a matrix\n",
    "Write a short poem about autumn leaves.",
    "Explain why the sky is blue in one paragraph.",
    "My favourite recipe for pancakes is",
]
PROMPTS = COPY_PROMPTS + OPEN_PROMPTS  # 21
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


def _llm(path, **kw):
    return LLM(path, num_threads=1, kv_cache_memory="96MiB", max_model_len=1024, **kw)


@pytest.fixture(scope="module")
def plain(default_gguf):
    return _llm(default_gguf)


@pytest.fixture(scope="module")
def spec(default_gguf):
    llm = _llm(default_gguf, speculative_config=SPEC)
    if llm.engine.runner.layer_stack is None:
        pytest.skip(
            "no C layer stack here: the PyTorch forward runs verification rows as a prompt chunk"
        )
    # Verification must be exact at every draft length. The lengths the adaptive policy picks
    # follow the step times it measures on this machine (a busy one drafted only single-token
    # probes for 21 requests, all accepted), so the price of a draft row is held at its floor
    # here: every request drafts as its acceptance allows, and drafts get rejected too.
    llm.engine.drafter.step_cost.row_share = lambda batch_rows: MIN_SHARE
    return llm


@pytest.fixture(scope="module")
def plain_tokens(plain):
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_batched_is_token_identical(spec, plain_tokens):
    before = spec.engine.drafter.stats.num_accepted_tokens
    got = _tokens(spec, PROMPTS)
    for prompt, a, b in zip(PROMPTS, plain_tokens, got):
        assert a == b, f"{prompt!r}: plain {a} != speculative {b}"
    stats = spec.engine.drafter.stats
    assert stats.num_accepted_tokens - before > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some drafts were rejected too
    assert stats.verify_seconds > 0 and stats.draft_seconds > 0
    assert spec.engine.scheduler.num_used_blocks == 0


def test_greedy_alone_is_token_identical(spec, plain_tokens):
    for prompt, expected in zip(PROMPTS, plain_tokens):
        assert _tokens(spec, [prompt]) == [expected], prompt


def test_stops_cut_where_plain_decoding_cuts(spec, plain, plain_tokens):
    """Stop token ids, stop strings and max_tokens inside accepted drafts cut at the same token."""
    stop_id = plain_tokens[0][20]
    params = [
        SamplingParams(temperature=0, max_tokens=TOKENS, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=TOKENS, stop=["lazy dog"], ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert (x.outputs[0].token_ids, x.outputs[0].text, x.outputs[0].finish_reason) == (
            y.outputs[0].token_ids,
            y.outputs[0].text,
            y.outputs[0].finish_reason,
        )


def test_logprobs_are_the_targets(spec, plain):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    a = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    b = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    for x, y in zip(a, b):
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert (lx.token_id, lx.rank, [t for t, _, _ in lx.top]) == (
                ly.token_id,
                ly.rank,
                [t for t, _, _ in ly.top],
            )
            assert lx.logprob == pytest.approx(ly.logprob, abs=1e-5)


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(spec, plain):
    """Drafts change with timing (the draft length follows the measured step cost), so a seeded
    request's tokens must not depend on them: they are its tokens without speculation."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=64, ignore_eos=True)
        for s in range(4)
    ]
    prompts = PROMPTS[:2] + PROMPTS[-2:]
    first = _tokens(spec, prompts, params)
    second = _tokens(spec, prompts, params)
    assert first == second == _tokens(plain, prompts, params)
    assert spec.engine.scheduler.num_used_blocks == 0


def test_prefix_cache_never_serves_a_rejected_token(spec, plain, plain_tokens):
    """New requests whose prompts run into earlier requests' generated text (blocks written by
    verification steps) get the same greedy tokens as on the plain engine, whose cache holds
    the same prefixes written by one-token steps."""
    rng = random.Random(5)
    prompt_ids = [spec.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    new_prompts = []
    for i in rng.sample(range(len(PROMPTS)), 6):
        full = prompt_ids[i] + plain_tokens[i]
        cut = rng.randrange(len(prompt_ids[i]) + 20, len(full))
        new_prompts.append({"prompt_token_ids": full[:cut]})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hits = spec.engine.scheduler.stats.prefix_cache_hits
    got = _tokens(spec, new_prompts, params)
    served = spec.engine.scheduler.stats.prefix_cache_hits - hits
    assert served > sum(len(prompt_ids[i]) for i in range(len(PROMPTS))) // len(PROMPTS)
    assert got == _tokens(plain, new_prompts, params)
    assert spec.engine.scheduler.num_used_blocks == 0
