"""Scheduler with draft tokens: budget, slots, rollback of rejected drafts, stops, prefix cache."""

from kvserve.core.block_pool import hash_block_tokens
from kvserve.core.sequence import SequenceStatus
from tests.unit.test_scheduler import EOS, make_req, make_sched


def prefill(s, req, token=7):
    """Admit `req` and run its prompt; it then holds one sampled token."""
    s.add_sequence(req)
    out = s.schedule()
    s.update_from_output(out, {req.seq_id: [token]})
    assert req.num_output_tokens == 1 and req.num_tokens - req.num_computed_tokens == 1


def test_drafts_ride_after_the_last_token_and_count_in_the_budget():
    s = make_sched(budget=64)
    req = make_req("a", 10, max_tokens=20)
    prefill(s, req)
    req.spec_token_ids = [11, 12, 13]
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.token_ids == [7, 11, 12, 13] and chunk.draft_token_ids == [11, 12, 13]
    assert chunk.start_pos == 10 and chunk.sample and out.num_batched_tokens == 4
    assert req.num_computed_tokens == 14 and req.spec_token_ids == []
    # two accepted, then the target's own token: the third draft's KV is stale
    s.update_from_output(out, {"a": [11, 12, 99]})
    assert req.output_token_ids == [7, 11, 12, 99]
    assert req.num_computed_tokens == 13 == req.num_tokens - 1


def test_all_rejected_rolls_back_to_a_plain_decode():
    s = make_sched()
    req = make_req("a", 10, max_tokens=20)
    prefill(s, req)
    req.spec_token_ids = [11, 12]
    out = s.schedule()
    s.update_from_output(out, {"a": [50]})
    assert req.output_token_ids == [7, 50] and req.num_computed_tokens == 11
    out = s.schedule()
    assert out.chunks[0].token_ids == [50] and out.chunks[0].start_pos == 11


def test_drafts_are_cut_to_the_budget_and_to_max_tokens():
    s = make_sched(budget=3)
    req = make_req("a", 2, max_tokens=20)
    prefill(s, req)
    req.spec_token_ids = [1, 2, 3, 4]
    assert s.schedule().chunks[0].draft_token_ids == [1, 2]
    s = make_sched()
    req = make_req("b", 10, max_tokens=3)
    prefill(s, req)
    req.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    assert out.chunks[0].draft_token_ids == [1]  # 1 output + 1 draft + 1 token = max_tokens
    s.update_from_output(out, {"b": [1, 5]})
    assert req.is_finished and req.output_token_ids == [7, 1, 5]


def test_a_stop_among_accepted_drafts_cuts_exactly_there():
    s = make_sched()
    req = make_req("a", 10, max_tokens=20)
    prefill(s, req)
    req.spec_token_ids = [11, EOS, 13]
    out = s.schedule()
    finished = s.update_from_output(out, {"a": [11, EOS, 13, 14]})
    assert finished == [req] and req.status == SequenceStatus.FINISHED_STOPPED
    assert req.output_token_ids == [7, 11, EOS]
    assert s.num_used_blocks == 0


def test_no_preemption_for_drafts():
    s = make_sched(num_blocks=2, budget=64)
    a = make_req("a", 15, max_tokens=17)  # 15 + 17 - 1 = 31 slots: the whole pool of 2 blocks
    prefill(s, a)
    b = make_req("b", 1, max_tokens=1)
    s.add_sequence(b)
    a.spec_token_ids = [1] * 16  # would need a third block
    out = s.schedule()
    assert [c.seq.seq_id for c in out.chunks] == ["a"]
    assert out.chunks[0].draft_token_ids == [1] * 15 and not out.preempted_ids


def test_a_block_with_a_rejected_token_never_enters_the_prefix_cache():
    s = make_sched()
    req = make_req("a", 14, max_tokens=30)  # prompt 14 + 1 sampled = 15 known tokens
    prefill(s, req)
    pool = s.kv_cache_manager.pools[0]
    req.spec_token_ids = [21, 22, 23]  # positions 15..17: block 0 filled by a draft
    out = s.schedule()
    s.update_from_output(out, {"a": [40]})  # the draft at position 15 rejected
    assert not pool.cached, "block 0 holds the rejected draft 21 at slot 15"
    out = s.schedule()  # the real token 40 goes to slot 15
    s.update_from_output(out, {"a": [41]})
    assert len(pool.cached) == 1
    expected = hash_block_tokens(None, req.all_token_ids[:16])
    assert req.all_token_ids[15] == 40 and expected in pool.cached


def test_accepted_drafts_fill_blocks_that_enter_the_prefix_cache():
    s = make_sched()
    req = make_req("a", 14, max_tokens=30)
    prefill(s, req)
    req.spec_token_ids = [21, 22, 23]
    out = s.schedule()
    s.update_from_output(out, {"a": [21, 22, 23, 24]})
    assert req.num_computed_tokens == 18
    assert list(s.kv_cache_manager.pools[0].cached) == [
        hash_block_tokens(None, req.all_token_ids[:16])
    ]


def test_blocks_all_return_after_speculative_runs():
    s = make_sched(num_blocks=16, budget=32)
    reqs = [make_req(f"r{i}", 5 + 7 * i, max_tokens=25) for i in range(4)]
    for r in reqs:
        s.add_sequence(r)
    step = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = {}
        for c in out.chunks:
            if c.sample:
                accepted = c.draft_token_ids[: step % (len(c.draft_token_ids) + 1)]
                sampled[c.seq.seq_id] = accepted + [100 + step % 50]
        s.update_from_output(out, sampled)
        for r in reqs:
            if r.status == SequenceStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1:
                r.spec_token_ids = [3, 4, 5, 6]
        step += 1
        assert step < 200
    assert s.num_used_blocks == 0
    assert all(r.num_output_tokens == 25 for r in reqs)
