"""kvserve.core.beam: the beam bookkeeping, by hand and against transformers' own beam search
driven by the same logits (a tiny random model, so every step's logprobs are exact)."""

import math

import pytest

from kvserve.core.beam import BeamSearch


def test_two_steps_by_hand():
    bs = BeamSearch(width=2, max_tokens=5, eos_token_ids=frozenset({9}))
    assert bs.candidates_per_beam == 4
    step = bs.advance([[(1, -0.1), (2, -0.5), (9, -1.0), (3, -2.0)]])
    assert step.parents == [0, 0] and step.tokens == [1, 2]
    assert [b.tokens for b in bs.running] == [[1], [2]] and bs.finished == []
    # Beam [2] ends with eos among the best two candidates: it becomes a hypothesis; the next
    # running beams are the best two candidates that did not stop.
    step = bs.advance(
        [[(4, -2.0), (5, -2.1), (6, -3.0), (9, -3.5)], [(9, -0.2), (7, -0.3), (8, -3.0), (6, -4.0)]]
    )
    assert step.parents == [1, 0] and step.tokens == [7, 4]
    assert [h.tokens for h in bs.finished] == [[2, 9]]
    assert bs.finished[0].score == pytest.approx((-0.5 - 0.2) / 2)
    assert bs.finished[0].finish_reason == "stop"
    assert not bs.done


def test_max_tokens_finishes_every_candidate():
    bs = BeamSearch(width=2, max_tokens=1)
    bs.advance([[(1, -0.1), (2, -0.2), (3, -0.3), (4, -0.4)]])
    assert bs.done
    assert [h.tokens for h in bs.results()] == [[1], [2]]
    assert all(h.finish_reason == "length" for h in bs.results())


def test_no_improvement_possible_stops():
    # Both slots filled with hypotheses better than any running beam can become.
    bs = BeamSearch(width=2, max_tokens=10, eos_token_ids=frozenset({9}))
    bs.advance([[(9, -0.01), (1, -5.0), (2, -5.1), (3, -6.0)]])
    assert not bs.done  # one slot still empty
    bs.advance(
        [
            [(9, -0.01), (4, -5.0), (5, -5.1), (6, -6.0)],
            [(9, -0.02), (7, -5.0), (8, -5.2), (6, -7.0)],
        ]
    )
    assert bs.done
    assert len(bs.results()) == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="width"):
        BeamSearch(width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearch(width=2, max_tokens=0)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearch(width=2, max_tokens=4, early_stopping="sometimes")
    bs = BeamSearch(width=2, max_tokens=4)
    with pytest.raises(ValueError, match="candidate lists"):
        bs.advance([[(1, -0.1)], [(2, -0.2)]])


def _tiny_model(vocab: int, seed: int, eos: list[int]):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init, so beams diverge and stop
        model.lm_head.weight.mul_(40)
    return model


# Seeds and end-of-sequence ids picked so that hypotheses end by eos, by length, and both.
@pytest.mark.parametrize(
    "width,length_penalty,early_stopping,seed,eos",
    [
        (2, 1.0, False, 0, [7, 9]),
        (3, 1.0, False, 1, [1, 2]),
        (4, 0.5, True, 2, [4, 8]),
        (4, 0.5, True, 2, [7, 9]),
        (3, 2.0, "never", 3, [3, 5]),
        (2, -1.0, False, 4, [3, 5]),
        (2, 1.0, False, 0, [4, 8]),
    ],
)
def test_same_beams_and_scores_as_transformers(width, length_penalty, early_stopping, seed, eos):
    import torch

    vocab, max_new = 24, 12
    model = _tiny_model(vocab, seed, eos)
    prompt = torch.tensor([[0, 5, 7, 11, 3]])
    ref = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref_seqs = [[t for t in row[prompt.shape[1] :].tolist()] for row in ref.sequences]
    ref_scores = ref.sequences_scores.tolist()

    bs = BeamSearch(
        width=width,
        max_tokens=max_new,
        eos_token_ids=frozenset(eos),
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    k = bs.candidates_per_beam
    while not bs.done:
        top = []
        for beam in bs.running:
            ids = torch.cat([prompt[0], torch.tensor(beam.tokens, dtype=torch.long)])[None]
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            v, i = lp.topk(min(k, vocab))
            top.append(list(zip(i.tolist(), v.tolist())))
        bs.advance(top)
    got = bs.results()
    assert len(got) == len(ref_seqs)
    for h, seq, score in zip(got, ref_seqs, ref_scores):
        # transformers pads finished rows with pad/eos after the hypothesis' last token.
        assert seq[: len(h.tokens)] == h.tokens
        assert all(t in (0, eos[0]) for t in seq[len(h.tokens) :])
        assert math.isclose(h.score, score, abs_tol=1e-4), (h.score, score)
