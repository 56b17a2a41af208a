"""Sampler: greedy, temperature, min_p/top_k/top_p, penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runner.sampler import Sampler, SamplingRow, argmax_list, argmax_rows, take_rows
from kvserve.sampling_params import SamplingParams

sampler = Sampler()


def row(
    params: SamplingParams | None = None, prompt=(), output=(), seed=None, eos=()
) -> SamplingRow:
    params = params or SamplingParams()
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, list(prompt), list(output), gen, set(eos))


def frequencies(
    logits: torch.Tensor, params: SamplingParams, draws: int, seeded: bool = False
) -> torch.Tensor:
    """Empirical token frequencies of `draws` independent rows sharing `logits`."""
    rows = [row(params, seed=s if seeded else None) for s in range(draws)]
    out = sampler(logits.expand(draws, -1), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1]).float() / draws


def full_logprobs(logits_row: torch.Tensor, params: SamplingParams, **kw) -> torch.Tensor:
    """The sampler's logprobs of every token (vocab <= 20), read back from its top-N list."""
    vocab = logits_row.shape[-1]
    params.logprobs = vocab
    out = sampler(logits_row.unsqueeze(0), [row(params, **kw)])
    lp = torch.empty(vocab)
    for tok, value in out.logprobs[0].top:
        lp[tok] = value
    return lp


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, [row(SamplingParams(temperature=0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_in_mixed_batch_and_input_untouched():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0, repetition_penalty=1.0),
        SamplingParams(temperature=0.5),
    ]
    rows = [row(p, prompt=[1, 2, 3]) for p in params]
    rows[1].params.repetition_penalty = 1.3  # a penalty on another row must not touch greedy rows
    out = sampler(logits, rows)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == logits[2].argmax().item()
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- temperature, min_p, top_k, top_p


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_matches_softmax(seeded):
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    freq = frequencies(logits, SamplingParams(temperature=0.7), 20000, seeded=seeded)
    expected = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_k_keeps_only_k_tokens():
    torch.manual_seed(0)
    logits = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.0, 0.7, 0.2])
    freq = frequencies(logits, SamplingParams(temperature=1.0, top_k=3), 6000)
    assert set(freq.nonzero().flatten().tolist()) == {1, 3, 5}
    expected = torch.softmax(logits[[1, 3, 5]], -1)
    assert torch.allclose(freq[[1, 3, 5]], expected, atol=0.03)


@pytest.mark.parametrize("top_p, nucleus", [(0.75, [0, 1]), (0.85, [0, 1, 2]), (0.4, [0])])
def test_top_p_keeps_the_nucleus(top_p, nucleus):
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = frequencies(probs.log(), SamplingParams(temperature=1.0, top_p=top_p), 6000)
    assert freq.nonzero().flatten().tolist() == nucleus
    expected = probs[nucleus] / probs[nucleus].sum()
    assert torch.allclose(freq[nucleus], expected, atol=0.03)


def test_min_p_drops_unlikely_tokens():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = frequencies(
        probs.log(), SamplingParams(temperature=1.0, min_p=0.35), 6000
    )  # cut at 0.175
    assert freq.nonzero().flatten().tolist() == [0, 1]
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.03


# ---------------------------------------------------------------- penalties and min_tokens


def test_repetition_penalty_changes_exactly_the_seen_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    lp = full_logprobs(
        logits, SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0, 1, 0], output=[3]
    )
    expected = torch.tensor([1.0, -4.0, 1.0, -2.0, 0.5, 3.0])
    assert torch.allclose(lp, expected.log_softmax(-1), atol=1e-5)


def test_presence_and_frequency_penalties_use_output_counts_only():
    logits = torch.zeros(6)
    lp = full_logprobs(
        logits,
        SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
        prompt=[0, 1],
        output=[2, 2, 4],
    )
    expected = torch.tensor([0.0, 0.0, -2.0, 0.0, -1.5, 0.0])
    assert torch.allclose(lp, expected.log_softmax(-1), atol=1e-5)


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # eos=1 is best, stop id 2 next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [row(params, output=[3], eos=[1])]).token_ids == [3]
    assert sampler(logits, [row(params, output=[3, 3], eos=[1])]).token_ids == [1]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, [row(ignore, output=[3], eos=[1])]).token_ids == [1]


# ---------------------------------------------------------------- seeds


def run_steps(seed: int, batch_of: int, position: int, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for one seeded row, placed at `position` among `batch_of` rows."""
    data = torch.Generator().manual_seed(99)
    target = row(SamplingParams(temperature=0.9, top_p=0.9, seed=seed), prompt=[1, 2], seed=seed)
    others = [
        row(SamplingParams(temperature=1.0, top_k=4)),
        row(SamplingParams(seed=7), seed=7),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(min_p=0.1, presence_penalty=0.5)),
    ]
    tokens = []
    for step in range(steps):
        logits = torch.randn(1, 50, generator=data) * 2
        pos = (position + step) % batch_of  # the row moves around the batch
        rows = others[: batch_of - 1]
        rows = rows[:pos] + [target] + rows[pos:]
        batch = torch.randn(batch_of, 50)
        batch[pos] = logits[0]
        tok = sampler(batch, rows).token_ids[pos]
        target.output_token_ids.append(tok)
        tokens.append(tok)
    return tokens


def test_same_seed_same_tokens_alone_or_in_any_batch():
    alone = run_steps(seed=1234, batch_of=1, position=0)
    assert run_steps(seed=1234, batch_of=5, position=2) == alone
    assert run_steps(seed=1234, batch_of=3, position=1) == alone


def test_different_seeds_differ():
    assert run_steps(seed=1, batch_of=1, position=0) != run_steps(seed=2, batch_of=1, position=0)


# ---------------------------------------------------------------- logprobs


def test_logprobs_top_n_sorted_and_consistent():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.5, logprobs=3),
        SamplingParams(temperature=1.0),
    ]
    out = sampler(logits, [row(p) for p in params])
    assert out.logprobs[2] is None
    for i, temp in [(0, 1.0), (1, 0.5)]:
        ref = (logits[i] / temp).log_softmax(-1)
        info = out.logprobs[i]
        assert info.token_id == out.token_ids[i]
        assert len(info.top) == params[i].logprobs
        values = [v for _, v in info.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in info.top] == ref.topk(params[i].logprobs).indices.tolist()
        for tok, value in info.top:
            assert math.isclose(value, ref[tok].item(), abs_tol=1e-5)
        assert math.isclose(info.logprob, ref[info.token_id].item(), abs_tol=1e-5)
        assert info.rank == int((ref > ref[info.token_id]).sum()) + 1
    assert out.logprobs[0].rank == 1  # greedy picks the best token


def test_logprobs_zero_gives_chosen_token_only():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    info = sampler(logits, [row(SamplingParams(temperature=0, logprobs=0))]).logprobs[0]
    assert info.top == [] and info.token_id == 1 and info.rank == 1
    assert math.isclose(info.logprob, logits[0].log_softmax(-1)[1].item(), abs_tol=1e-6)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).split()[0] == field


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(
            st.sampled_from([-2.0, -1.0, 0.0, 1.0, 2.0, float("inf"), float("-inf"), float("nan")]),
            min_size=1,
            max_size=40,
        ),
        min_size=1,
        max_size=6,
    ).filter(lambda rows: len({len(r) for r in rows}) == 1)
)
def test_argmax_rows_is_torch_argmax(rows):
    """The numpy path gives torch's index on ties (the first), infinities and NaNs (the first
    NaN), as a tensor and as argmax_list's list."""
    x = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[0]), x[0].argmax(dim=-1))  # a 1-d row: a 0-d index
    assert torch.equal(argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))  # a strided view
    assert argmax_list(x) == x.argmax(dim=-1).tolist()  # the greedy step's list
    assert argmax_list(x[:, ::2]) == x[:, ::2].argmax(dim=-1).tolist()
    assert argmax_list(x.double()) == x.double().argmax(dim=-1).tolist()
    assert torch.equal(
        argmax_rows(x.double()), x.double().argmax(dim=-1)
    )  # other dtypes: torch itself


def test_take_rows_copies_only_a_real_selection():
    x = torch.arange(12.0).view(4, 3)
    assert take_rows(x, [0, 1, 2, 3]) is x  # every row in order: no copy
    sub = take_rows(x, [2, 0])
    assert torch.equal(sub, x[[2, 0]]) and sub.data_ptr() != x.data_ptr()
    assert torch.equal(take_rows(x, [0, 1, 3, 2]), x[[0, 1, 3, 2]])
    assert torch.equal(take_rows(x, [0, 1]), x[:2])
    assert take_rows(x, []).shape == (0, 3)
