"""Rejection sampler (kvserve/spec/rejection.py): emitted tokens follow the target exactly.

The distribution tests simulate a small Markov "model" (vocab 8): the target's logits at a
position depend on the previous token, the draft proposes k tokens from its own chain (one-hot
or sampled from q), and the target's probabilities are those the normal sampler would draw from
(process_logits: temperature, top_k, top_p). The first and second emitted tokens must follow the
target's marginals (total variation < 0.01 over 200k samples)."""

from __future__ import annotations

import pytest
import torch

from kvserve.runner.sampler import Sampler, SamplingRow, process_logits
from kvserve.sampling_params import SamplingParams
from kvserve.spec.rejection import (
    Drafts,
    RejectionSampler,
    verify_greedy,
    verify_one_hot,
    verify_sampled,
)

V = 8
START = V  # the context row before the first emitted token
SAMPLES = 200_000


def tables(params: SamplingParams, seed: int = 0):
    """(processed target probs [V + 1, V] by previous token, draft q [V + 1, V],
    one-hot draft [V + 1])."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V + 1, V, generator=g) * 1.5
    rows = [SamplingRow(params, [], [], None, set()) for _ in range(V + 1)]
    target = process_logits(logits, rows).probs
    q = torch.softmax(torch.randn(V + 1, V, generator=g), dim=-1)
    one_hot = target.argmax(dim=-1)  # a good deterministic draft, except after tokens 0 and 1:
    one_hot[:2] = (
        (target[:2] == 0).float().argmax(dim=-1)
    )  # there it proposes a token the target cut
    return target, q, one_hot


def step(ctx: torch.Tensor, k: int, target, q, one_hot, probabilistic: bool, race: bool = False):
    """One verification of k drafts after context token `ctx` [N]:
    (drafts [N, k], accepted [N], next [N])."""
    n = len(ctx)
    drafts, draft_q, prev = [], [], ctx
    for _ in range(k):
        if probabilistic:
            d = torch.multinomial(q[prev], 1).squeeze(1)
            draft_q.append(q[prev])
        else:
            d = one_hot[prev]
        drafts.append(d)
        prev = d
    d = torch.stack(drafts, dim=1) if k else torch.zeros(n, 0, dtype=torch.long)
    contexts = torch.cat([ctx.unsqueeze(1), d], dim=1)  # position j's previous token
    batch = Drafts(
        d,
        torch.full((n,), k, dtype=torch.long),
        torch.stack(draft_q, dim=1) if probabilistic and k else None,
    )
    verify = verify_one_hot if race else verify_sampled
    accepted, nxt = verify(target[contexts].reshape(n * (k + 1), V), batch)
    return d, accepted, nxt


def tv(samples: torch.Tensor, expected: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=V).double() / len(samples)
    return 0.5 * (freq - expected.double()).abs().sum().item()


FILTERS = [
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.8),
]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize(
    "probabilistic,race",
    [(False, False), (False, True), (True, False)],
    ids=["one-hot", "one-hot-race", "sampled-draft"],
)
@pytest.mark.parametrize("params", FILTERS, ids=["top_k", "top_k+top_p"])
def test_first_and_second_tokens_follow_the_target(k, probabilistic, race, params):
    torch.manual_seed(1234 + k)
    target, q, one_hot = tables(params, seed=k)
    assert (target == 0).any(), "the filters must cut some tokens for this test to mean anything"
    ctx = torch.full((SAMPLES,), START, dtype=torch.long)
    d, accepted, nxt = step(ctx, k, target, q, one_hot, probabilistic, race)
    first = torch.where(accepted >= 1, d[:, 0], nxt)
    second = torch.where(accepted >= 2, d[:, min(1, k - 1)], nxt)
    again = accepted == 0  # one token this step: the next step emits the second
    _, acc2, nxt2 = step(first[again], k, target, q, one_hot, probabilistic, race)
    second[again] = torch.where(acc2 >= 1, _[:, 0], nxt2)

    p_first = target[START]
    p_second = p_first @ target[:V]
    assert tv(first, p_first) < 0.01
    assert tv(second, p_second) < 0.01
    assert 0.05 < accepted.float().mean() < k, "drafts are sometimes accepted, sometimes rejected"


def test_rejected_draft_is_never_emitted_where_the_target_has_no_mass():
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    batch = Drafts(torch.tensor([[0]]), torch.tensor([1]))
    for _ in range(50):
        accepted, nxt = verify_sampled(target, batch)
        assert accepted.item() == 0 and nxt.item() in (1, 2)


def test_one_hot_race_gives_a_seeded_request_its_plain_decoding_tokens():
    """One Exp(1) row per emitted token from the request's generator, as the sampler draws: the
    tokens of a seeded request do not depend on what was drafted."""
    torch.manual_seed(0)
    probs = torch.rand(6, V).softmax(dim=-1)
    plain_gen = torch.Generator().manual_seed(7)
    plain = []
    for j in range(4):
        noise = torch.empty(1, V)
        noise[0].exponential_(generator=plain_gen)
        plain.append(int(probs[j : j + 1].div(noise).argmax()))
    for drafts in ([], plain[:3], [plain[0], (plain[1] + 1) % V, 0], [(plain[0] + 1) % V]):
        gen = torch.Generator().manual_seed(7)
        got = []
        while len(got) < 4:
            k = min(len(drafts), 3 - len(got)) if drafts else 0
            d = drafts[:k]
            rows = probs[len(got) : len(got) + k + 1]
            a, nxt = verify_one_hot(
                rows,
                Drafts(torch.tensor([d], dtype=torch.long).reshape(1, k), torch.tensor([k])),
                [gen],
            )
            got += d[: int(a)] + [int(nxt)]
            drafts = []
        assert got[:4] == plain, (drafts, got, plain)


def test_greedy_accepts_while_drafts_equal_the_argmax():
    logits = torch.tensor(
        [
            [0.0, 3.0, 3.0, 1.0],  # tie: torch's argmax takes the first (1)
            [5.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 9.0],
            [1.0, 1.0, 1.0, 1.0],
        ]
    )
    accepted, nxt = verify_greedy(logits, Drafts(torch.tensor([[1, 0, 2]]), torch.tensor([3])))
    assert accepted.tolist() == [2] and nxt.tolist() == [3]
    accepted, nxt = verify_greedy(logits, Drafts(torch.tensor([[2, 0, 3]]), torch.tensor([3])))
    assert accepted.tolist() == [0] and nxt.tolist() == [1]
    accepted, nxt = verify_greedy(logits, Drafts(torch.tensor([[1, 0, 3]]), torch.tensor([3])))
    assert accepted.tolist() == [3] and nxt.tolist() == [0]  # bonus token: argmax of the last row


def position_rows(params, prompt, outputs, drafts, seed=None):
    """The SamplingRows of one request's k + 1 positions, as the runner builds them."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return [
        SamplingRow(params, list(prompt), list(outputs) + list(drafts[:j]), gen, {0})
        for j in range(len(drafts) + 1)
    ]


def test_greedy_matches_the_normal_sampler_position_by_position():
    """With penalties and min_tokens, each position sees the drafts before it as outputs: the
    tokens are those the normal greedy sampler picks one step at a time."""
    torch.manual_seed(0)
    vocab = 12
    params = SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=3, logprobs=2)
    sampler, rejection = Sampler(), RejectionSampler()
    for trial in range(40):
        outputs = torch.randint(0, vocab, (2,)).tolist()
        logits = torch.randn(4, vocab).round(decimals=0)  # rounded: ties happen
        # drafts: the normal sampler's own choices at first, then one off at a random place
        normal = []
        for j in range(4):
            rows = [SamplingRow(params, [5, 6], outputs + normal, None, {0})]
            normal.append(sampler(logits[j : j + 1], rows).token_ids[0])
        drafts = normal[:3]
        wrong_at = trial % 4
        if wrong_at < 3:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % vocab
        out = rejection(logits, position_rows(params, [5, 6], outputs, drafts), [drafts])[0]
        expect = normal[: wrong_at + 1] if wrong_at < 3 else normal
        assert out.token_ids == expect
        for j, lp in enumerate(out.logprobs):
            ref = sampler(
                logits[j : j + 1], [SamplingRow(params, [5, 6], outputs + normal[:j], None, {0})]
            )
            assert lp.token_id == ref.logprobs[0].token_id
            assert lp.logprob == pytest.approx(ref.logprobs[0].logprob, abs=1e-6)
            assert lp.top == ref.logprobs[0].top


def test_full_path_distribution_with_filters_and_penalties():
    """Through RejectionSampler.__call__ (logits in, processed here): the first token of a
    presence-penalized, top-k, tempered request follows the normal sampler's distribution."""
    torch.manual_seed(7)
    n, vocab = 20_000, V
    params = SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.7)
    logits_row = torch.randn(vocab) * 1.5
    outputs = [3]
    expected = process_logits(
        logits_row.unsqueeze(0), [SamplingRow(params, [], outputs, None, set())]
    ).probs[0]
    drafts = [[int(expected.argmin()), 3]] * (n // 2) + [[int(expected.argmax()), 1]] * (n - n // 2)
    rows = [r for d in drafts for r in position_rows(params, [], outputs, d)]
    logits = logits_row.repeat(len(rows), 1)
    outs = RejectionSampler()(logits, rows, drafts)
    first = torch.tensor([o.token_ids[0] for o in outs])
    assert tv(first, expected) < 0.02
    assert all(1 <= len(o.token_ids) <= 3 for o in outs)


def test_seeded_requests_are_reproducible_and_independent_of_the_batch():
    vocab = 16
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    drafts = [int(logits[0].argmax()), int(logits[1].argmax()), 5]

    def run(neighbours: int):
        rows, all_drafts, all_logits = [], [], []
        for i in range(neighbours):
            rows += position_rows(SamplingParams(temperature=1.0), [], [], [1])
            all_drafts.append([1])
            all_logits.append(torch.randn(2, vocab))
        rows += position_rows(params, [], [], drafts, seed=42)
        all_drafts.append(drafts)
        all_logits.append(logits)
        return RejectionSampler()(torch.cat(all_logits), rows, all_drafts)[-1].token_ids

    results = {tuple(run(0)) for _ in range(3)} | {tuple(run(5))}
    assert len(results) == 1


def test_no_drafts_is_plain_sampling():
    logits = torch.tensor([[0.0, 1.0, 4.0]])
    out = RejectionSampler()(logits, position_rows(SamplingParams(temperature=0), [], [], []), [[]])
    assert out[0].token_ids == [2]
