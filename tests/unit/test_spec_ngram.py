"""Prompt-lookup proposer (kvserve/spec/ngram.py), adaptive draft length (spec/adaptive.py),
step cost (spec/step_cost.py) and the Drafter (spec/drafter.py)."""

import random

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.core.sequence import Sequence
from kvserve.sampling_params import SamplingParams
from kvserve.spec.adaptive import MAX_COOLDOWN, AdaptiveDraftLength
from kvserve.spec.drafter import Drafter
from kvserve.spec.ngram import CANDIDATES, MATCH_CAP, NgramIndex, NgramProposer
from kvserve.spec.step_cost import MIN_SHARE, PRIOR_SHARE, StepCostModel


def brute_force(tokens, k, min_n, max_n):
    """The specification: longest n first; of its CANDIDATES most recent earlier occurrences, the
    one with the longest match (the longest m <= MATCH_CAP with the m tokens before the
    occurrence's end equal to the context's last m), the most recent among equals; no draft when
    the occurrences with that match disagree on the next token; the continuation runs on into its
    own draft past the end, no longer than the match."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        starts = [s for s in range(length - n - 1, -1, -1) if tokens[s : s + n] == suffix][
            :CANDIDATES
        ]
        if not starts:
            continue

        def match(start):
            end = start + n
            return max(
                m
                for m in range(n, min(MATCH_CAP, end) + 1)
                if tokens[end - m : end] == tokens[length - m :]
            )

        best = max(match(s) for s in starts)
        tied = [s for s in starts if match(s) == best]
        if len({tokens[s + n] for s in tied}) > 1:
            return []
        start = tied[0]
        stream = list(tokens)
        for i in range(min(k, best)):
            stream.append(stream[start + n + i])
        return stream[length:]
    return []


def test_finds_the_longest_most_recent_match():
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    # suffix [2, 3]: 3-gram [5, 2, 3] never occurred; [2, 3] occurred at 1 (-> 9) and 5 (-> 8), each
    # a 2-token match (1 before both, 5 before the suffix): equal evidence for 9 and for 8, no draft
    assert index.propose(tokens, 3) == []
    tokens = tokens + [8]  # suffix [2, 3, 8] occurred at 5 -> 5, 2, 3 (3 matched)
    assert index.propose(tokens, 4) == [5, 2, 3]


def test_the_occurrence_that_agrees_longest_is_followed():
    """Not the latest occurrence of the n-gram, but the one whose earlier tokens match the context
    further back: `for start, end in merged(` was followed by `x`, `for ... in sorted(` by `y`."""
    a, b = [20, 21, 22, 23], [30, 31, 32, 33]  # two texts after which [7, 8] recurs
    tokens = a + [7, 8, 100, 101] + b + [7, 8, 200, 201] + [50] + a + [7, 8]
    # [7, 8] last occurred after b (-> 200), but after a (-> 100) it matches 6 tokens
    assert NgramIndex(2, 2).propose(tokens, 8) == [100, 101, 30, 31, 32, 33]
    tokens = tokens[:-6] + b + [7, 8]
    assert NgramIndex(2, 2).propose(tokens, 2) == [200, 201]


def test_no_draft_when_equally_good_occurrences_disagree():
    # [1, 5, 6] twice (-> 7, then -> 8), each time after a different token than the suffix's 4:
    # both a 3-token match, two continuations
    assert NgramIndex(2, 2).propose([2, 1, 5, 6, 7, 3, 1, 5, 6, 8, 4, 1, 5, 6], 4) == []
    # the same continuation twice: no doubt (3 drafts: the match's length)
    assert NgramIndex(2, 2).propose([2, 1, 5, 6, 7, 3, 1, 5, 6, 7, 4, 1, 5, 6], 4) == [7, 4, 1]


def test_only_the_latest_candidates_are_compared():
    """An n-gram's older occurrences beyond CANDIDATES are forgotten: bounded memory and work per
    lookup on repetitive text."""
    filler = [
        [90 + i, 5, 6, 70 + i] for i in range(CANDIDATES)
    ]  # [5, 6] CANDIDATES times, 1 match each
    tokens = [1, 2, 5, 6, 3] + sum(filler, []) + [1, 2, 5, 6]
    # the old occurrence after [1, 2] (-> 3) would match 4 tokens but is no longer a candidate;
    # the candidates' 2-token matches disagree
    assert NgramIndex(2, 2).propose(tokens, 4) == []
    index = NgramIndex(2, 2)
    index.propose(list(range(10)) + [5, 6] * 200, 1)
    assert max(len(v) for v in index._starts[2].values()) == CANDIDATES


def test_a_draft_is_no_longer_than_its_match():
    """A match of m tokens drafts at most m, however far the copied text goes on."""
    index = NgramIndex(2, 2)
    text = list(range(100, 140))
    # [7, 100] then 101..139 earlier; the context ends [.., 9, 100, 101]: a 2-token match
    assert index.propose([7] + text + [9, 100, 101], 8) == [102, 103]
    # the same text copied for 5 tokens back: 5 drafts
    assert NgramIndex(2, 2).propose([7] + text + [9] + text[:5], 8) == text[5:10]
    # copied 20 tokens back: the full 8
    assert NgramIndex(2, 2).propose([7] + text + [9] + text[:20], 8) == text[20:28]


def test_no_match_no_draft():
    index = NgramIndex(2, 3)
    assert index.propose([1, 2, 3, 4, 5], 4) == []
    assert index.propose([7], 4) == []
    assert index.propose([1, 2, 1, 2], 0) == []


def test_a_repeating_pattern_keeps_repeating():
    # the latest earlier [5, 6] (at 2) has 5, 6 before it as well: a 4-token match, 4 drafts
    assert NgramIndex(2, 2).propose([5, 6, 5, 6, 5, 6], 5) == [5, 6, 5, 6]
    assert NgramIndex(1, 3).propose([4, 4, 4, 4], 3) == [4, 4, 4]
    assert NgramIndex(2, 2).propose([5, 6] * 10, 8) == [5, 6] * 4


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (2, 4), (3, 5)])
def test_incremental_index_agrees_with_a_rescan(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    index = NgramIndex(min_n, max_n)
    tokens: list[int] = []
    for _ in range(600):
        tokens.append(rng.randrange(6))
        k = rng.randrange(1, 6)
        assert index.propose(tokens, k) == brute_force(tokens, k, min_n, max_n), tokens


def test_a_shorter_sequence_rebuilds_the_index():
    index = NgramIndex(2, 2)
    assert index.propose([1, 2, 3, 1, 2], 1) == [3]
    assert index.propose([9, 8, 9, 8], 2) == [9, 8]


def test_long_contexts_are_cheap_per_step():
    """8k tokens fed one at a time: the work per step is the new tokens, not the context."""
    import time

    rng = random.Random(0)
    proposer = NgramProposer(2, 4)
    tokens = [rng.randrange(50) for _ in range(8000)]
    proposer.propose("r", tokens, 4)
    t0 = time.perf_counter()
    for _ in range(500):
        tokens.append(rng.randrange(50))
        proposer.propose("r", tokens, 4)
    assert time.perf_counter() - t0 < 1.0  # a rescan would be ~500 x 8000 x 3 tuple builds
    proposer.free("r")
    assert len(proposer) == 0


def test_sizes_are_validated():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 2)


# ---------------------------------------------------------------- adaptive draft length


SHARE = 0.25  # a row costs a quarter of a one-row step's throughput


def test_full_length_while_accepted():
    a = AdaptiveDraftLength(4)
    for _ in range(10):
        assert a.next_length(SHARE) == 4
        a.record(4, 4)


def test_length_is_the_last_draft_that_pays_for_its_row():
    """alpha^k > share: the same acceptance drafts fewer tokens where rows are dear."""
    a = AdaptiveDraftLength(8)
    for _ in range(30):  # two accepted, then a rejection: alpha -> 2/3
        a.record(3, 2)
    assert abs(a.alpha - 2 / 3) < 0.01
    assert a.next_length(0.16) == 4  # (2/3)^4 = 0.198 > 0.16 > (2/3)^5 = 0.132
    assert a.next_length(0.33) == 2  # (2/3)^2 = 0.444 > 0.33 > (2/3)^3 = 0.296
    assert a.next_length(0.0) == 8  # free rows: the whole length
    assert a.worth(0.7) == 0  # nothing pays a row that costs more than alpha


def test_shrinks_to_plain_decoding_then_probes_and_backs_off():
    a = AdaptiveDraftLength(4)
    lengths = []
    for _ in range(12):
        k = a.next_length(SHARE)
        lengths.append(k)
        a.record(k, 0) if k else None
    assert lengths[0] == 4 and 0 in lengths[:8], lengths
    first_zero = lengths.index(0)
    assert lengths[:first_zero] == sorted(lengths[:first_zero], reverse=True), lengths
    # plain steps between probes, and the pause doubles after each failed probe
    pauses, run = [], 0
    for _ in range(400):
        k = a.next_length(SHARE)
        if k == 0:
            run += 1
            continue
        assert k == 1
        pauses.append(run)
        run = 0
        a.record(1, 0)
    assert pauses[1:] == sorted(pauses[1:]) and pauses[-1] == MAX_COOLDOWN


def test_grows_back_when_probes_are_accepted():
    a = AdaptiveDraftLength(4)
    while (k := a.next_length(SHARE)) > 0:
        a.record(k, 0)
    k = a.next_length(SHARE)
    while k == 0:
        k = a.next_length(SHARE)
    seen = []
    for _ in range(12):
        a.record(k, k)
        k = a.next_length(SHARE)
        seen.append(k)
    assert seen[-1] == 4


# ---------------------------------------------------------------- step cost


def test_never_drafts_when_a_draft_costs_a_step_or_more():
    """A draft model as large as the target: every draft accepted still loses (a bench run once
    probed every step, 0.48-0.81x), so no probe either."""
    a = AdaptiveDraftLength(4)
    for _ in range(200):
        k = a.next_length(1.25)
        assert k == 0
        a.record(k, k)


def test_step_cost_fits_the_fixed_and_the_per_row_time():
    m = StepCostModel()
    assert m.fit() is None and m.row_share(1) == PRIOR_SHARE  # nothing seen: the prior
    for rows in [1, 5, 1, 3, 1, 5, 2, 1] * 5:
        m.observe(rows, 0.003 + 0.0015 * rows)
    a, b = m.fit()
    assert abs(a - 0.003) < 1e-9 and abs(b - 0.0015) < 1e-9
    assert abs(m.row_share(1) - 0.0015 / 0.0045) < 1e-6
    assert m.row_share(64) > 0.95  # a large batch: compute-bound


def test_step_cost_needs_spread_rows_and_never_calls_a_row_free():
    m = StepCostModel()
    for _ in range(50):
        m.observe(1, 0.004)  # one row count only: the slope is unknown
    assert m.fit() is None and m.row_share(1) == PRIOR_SHARE
    for rows in [1, 4] * 20:
        m.observe(rows, 0.004)  # rows that cost nothing (noise): still a minimum price
    assert m.row_share(1) == MIN_SHARE
    m.observe(0, 1.0)
    m.observe(3, float("nan"))  # ignored
    assert m.row_share(1) == MIN_SHARE


# ---------------------------------------------------------------- drafter


def make_request(prompt, max_tokens=50):
    return Sequence("r", prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def test_drafter_caps_drafts_to_the_tokens_left():
    d = Drafter(
        SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=2)
    )
    req = make_request([1, 2, 3, 4, 1, 2], max_tokens=3)
    assert d.propose(req) == [3, 4]  # 3 tokens left: 2 drafts + the token after them
    req.append_output_token(3)
    req.append_output_token(4)
    assert d.propose(req) == []  # one token left: nothing to draft


def test_drafter_counts_acceptance_by_position():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=3))
    d.record("r", 3, 2)
    d.record("r", 2, 0)
    d.record("r", 0, 0)
    s = d.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.accepted_per_position == [1, 1, 0]


def test_step_cost_predicts_seconds():
    m = StepCostModel()
    assert m.seconds(1) is None
    m.observe(2, 0.004)
    assert m.seconds(7) == 0.004  # one row count seen: the mean step
    for rows in [1, 5, 1, 3] * 5:
        m.observe(rows, 0.003 + 0.0015 * rows)
    assert abs(m.seconds(4) - 0.009) < 1e-4  # the fit, the first step weighing in


class _ModelProposer:
    """A draft model's proposer, as the Drafter sees it: drafts and the cost of its rounds."""

    def __init__(self):
        self.round_cost = StepCostModel()
        self.asked = []

    def propose_batch(self, items):
        self.asked.append([k for _, k in items])
        return [[7] * k for _, k in items]


def test_a_draft_models_rounds_raise_the_price_of_a_draft():
    proposer = _ModelProposer()
    d = Drafter(SpeculativeConfig(num_speculative_tokens=4), proposer)
    for rows in [1, 2, 1, 3] * 10:
        d.observe_step(rows, 0.004 + 0.001 * rows, verified=False)
    row_share = d.step_cost.row_share(1)
    assert d.token_price(1) == row_share  # no round measured yet: the row alone
    for _ in range(10):
        proposer.round_cost.observe(1, 0.004)  # a round costs 0.8 of a one-row step
    assert abs(d.token_price(1) - (row_share + 0.8)) < 1e-6
    assert d.propose_batch([make_request([1, 2, 3])]) == [[]]
    # alpha 0.8 (the prior) does not pay for a price of 1.0: the request decodes plainly
    assert proposer.asked[-1] == [0]
    cheap = Drafter(SpeculativeConfig(num_speculative_tokens=4), _ModelProposer())
    assert cheap.propose_batch([make_request([1, 2, 3])]) == [[7] * 4]  # rows at the prior price


def test_a_draft_models_cache_takes_its_share_of_the_budget():
    from kvserve.config import CacheConfig

    c = CacheConfig(kv_cache_memory=1000)
    assert c.share(0.6).kv_cache_memory == 600 and c.kv_cache_memory == 1000
    assert CacheConfig(kv_cache_fraction=0.5).share(0.5).kv_cache_fraction == 0.25
    assert CacheConfig(num_blocks_override=9).share(0.1).num_blocks_override == 9


class _CatchUpProposer(_ModelProposer):
    """A draft model that must first feed `pending` context tokens, at `per_token` seconds each."""

    def __init__(self, pending, per_token):
        super().__init__()
        self.pending, self.per_token = pending, per_token

    def catch_up_tokens(self, req):
        return self.pending

    def catch_up_seconds(self, tokens):
        return None if self.per_token is None else self.per_token * tokens


def _drafter_with_steps(proposer):
    d = Drafter(SpeculativeConfig(num_speculative_tokens=4), proposer)
    for rows in [1, 2, 1, 3] * 10:  # a one-row step: 5 ms, a row 1 ms (share 0.2)
        d.observe_step(rows, 0.004 + 0.001 * rows, verified=False)
    return d


def test_a_catch_up_that_costs_more_than_drafting_saves_is_not_made():
    # 300 tokens to feed at 1 ms: 0.299 s beyond one token, 60 steps of 5 ms. Drafting saves at
    # most (0.8 - 0.2) + (0.64 - 0.2) + (0.51 - 0.2) + (0.41 - 0.2) = 1.56 steps a step, over the
    # 19 steps left: 29.6 steps
    expensive = _drafter_with_steps(_CatchUpProposer(pending=300, per_token=0.001))
    assert expensive.propose(make_request(list(range(10)), max_tokens=20)) == []
    assert expensive.proposer.asked[-1] == [0]
    # the same feed pays over a longer answer (64 steps counted: 100 steps saved), as does a
    # cheap feed at once
    long_answer = _drafter_with_steps(_CatchUpProposer(pending=300, per_token=0.001))
    assert long_answer.propose(make_request(list(range(10)), max_tokens=500)) == [7] * 4
    cheap = _drafter_with_steps(_CatchUpProposer(pending=300, per_token=0.00001))
    assert cheap.propose(make_request(list(range(10)), max_tokens=20)) == [7] * 4


def test_a_catch_up_of_unknown_cost_or_of_one_or_two_tokens_is_made():
    unknown = _drafter_with_steps(_CatchUpProposer(pending=300, per_token=None))
    assert unknown.propose(make_request(list(range(10)))) == [7] * 4  # the first feed measures it
    continuing = _drafter_with_steps(_CatchUpProposer(pending=2, per_token=1.0))
    assert continuing.propose(make_request(list(range(10)))) == [7] * 4  # part of a round's price


def test_gain_per_step_counts_the_drafts_that_pay():
    a = AdaptiveDraftLength(4)  # alpha 0.8 (the prior)
    assert abs(a.gain_per_step(0.2) - (0.6 + 0.44 + 0.312 + 0.2096)) < 1e-9
    assert a.gain_per_step(0.8) == 0.0  # nothing pays at the prior's own rate
    for _ in range(20):
        a.record(4, 4)  # alpha near 1: the rate it reached counts
    assert a.gain_per_step(0.8) > 0.5
