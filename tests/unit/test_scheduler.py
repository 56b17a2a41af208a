"""Scheduler: one token budget, chunked prefill, preemption, priorities, forks, stops, aborts."""

import subprocess
import sys

import pytest

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.scheduler import QueueFullError, Scheduler
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.sampling_params import SamplingParams

EOS = 2


def make_sched(
    num_blocks=64,
    budget=64,
    max_seqs=8,
    max_model_len=256,
    max_waiting=100,
    chunked=True,
    caching=True,
):
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_waiting=max_waiting,
            chunked_prefill=chunked,
        ),
        CacheConfig(block_size=16, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
    )


def make_req(rid, prompt, max_tokens=4, priority=0, arrival=0.0, fork_of=None, salt=None, **params):
    prompt = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids={EOS},
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt,
        fork_of=fork_of,
    )


def step(s, token=7):
    """schedule + update, sampling `token` (or token[rid]) for every chunk that samples."""
    out = s.schedule()
    sampled = {
        c.seq.seq_id: [token if isinstance(token, int) else token[c.seq.seq_id]]
        for c in out.chunks
        if c.sample
    }
    return out, s.update_from_output(out, sampled)


def summary(out):
    return [(c.seq.seq_id, c.start_pos, len(c.token_ids), c.sample) for c in out.chunks]


def run_all(s, max_steps=500):
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        step(s)
    raise AssertionError("requests did not finish")


def test_core_does_not_import_torch():
    code = (
        "import sys, kvserve.core.scheduler, kvserve.core.kv_cache, kvserve.core.block_pool; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- budget and chunking ---------------------------------------------------------------------
def test_long_prompt_is_chunked_by_the_budget():
    s = make_sched(budget=32)
    r = make_req("a", 100, max_tokens=2)
    s.add_sequence(r)
    starts = []
    for _ in range(4):
        out, _ = step(s)
        (c,) = out.chunks
        assert c.token_ids == r.prompt_token_ids[c.start_pos : c.start_pos + len(c.token_ids)]
        starts.append((c.start_pos, len(c.token_ids), c.sample))
    assert starts == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert r.output_token_ids == [7] and r.num_computed_tokens == 100
    out, finished = step(s)
    assert summary(out) == [("a", 100, 1, True)] and out.chunks[0].token_ids == [7]
    assert finished == [r] and r.finish_reason == "length"


def test_running_decodes_first_then_prompt_chunks_share_the_budget():
    s = make_sched(budget=16)
    s.add_sequence(make_req("a", 8, max_tokens=10))
    step(s)
    s.add_sequence(make_req("b", 40, max_tokens=2))
    s.add_sequence(make_req("c", 40, max_tokens=2))
    out, _ = step(s)
    assert summary(out) == [("a", 8, 1, True), ("b", 0, 15, False)]
    assert out.num_batched_tokens == 16
    out, _ = step(s)
    assert summary(out) == [("a", 9, 1, True), ("b", 15, 15, False)]
    out, _ = step(s)
    # c shares b's prompt: b's first block, computed two steps ago, is a prefix-cache hit.
    assert summary(out) == [("a", 10, 1, True), ("b", 30, 10, True), ("c", 16, 5, False)]


def test_max_num_seqs_bounds_running_requests():
    s = make_sched(max_seqs=2)
    for rid in "abc":
        s.add_sequence(make_req(rid, 4, max_tokens=3))
    out, _ = step(s)
    assert [c.seq.seq_id for c in out.chunks] == ["a", "b"]
    assert s.num_running == 2 and s.num_waiting == 1
    step(s)
    out, finished = step(s)
    assert {r.seq_id for r in finished} == {"a", "b"}
    out, _ = step(s)
    assert [c.seq.seq_id for c in out.chunks] == ["c"]


def test_without_chunked_prefill_prompts_are_scheduled_whole():
    s = make_sched(budget=32, chunked=False)
    s.add_sequence(make_req("a", 20))
    s.add_sequence(make_req("b", range(20)))
    out, _ = step(s)
    assert summary(out) == [("a", 0, 20, True)]
    out, _ = step(s)
    assert summary(out) == [("a", 20, 1, True), ("b", 0, 20, True)]
    s.add_sequence(make_req("long", 50, max_tokens=1))  # longer than the whole budget: chunked
    run_all(s)


def test_max_tokens_none_is_resolved_to_the_room_left():
    s = make_sched(max_model_len=64)
    r = make_req("a", 10)
    r.max_tokens = None
    s.add_sequence(r)
    assert r.max_tokens == 54


# ---- prefix cache through the scheduler ----------------------------------------------------------
def test_prefix_cache_hit_skips_cached_tokens_but_computes_the_last():
    s = make_sched()
    a = make_req("a", 48, max_tokens=1)
    s.add_sequence(a)
    run_all(s)
    b = make_req("b", 48, max_tokens=1)
    s.add_sequence(b)
    out, _ = step(s)
    assert summary(out) == [("b", 32, 16, True)]
    assert b.num_cached_tokens == 32
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (96, 32)
    c = make_req("c", list(range(1000, 1048)) + [5], max_tokens=1)
    s.add_sequence(c)
    out, _ = step(s)
    assert summary(out) == [("c", 48, 1, True)]


def test_blocks_are_cached_only_once_their_step_is_computed():
    s = make_sched()
    s.add_sequence(make_req("a", 40))
    out = s.schedule()
    probe = make_req("probe", 40)
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 0  # KV not written yet
    s.update_from_output(out, {"a": [7]})
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 32


def test_no_stats_without_prefix_caching():
    s = make_sched(caching=False)
    s.add_sequence(make_req("a", 48, max_tokens=1))
    run_all(s)
    s.add_sequence(make_req("b", 48, max_tokens=1))
    out, _ = step(s)
    assert summary(out) == [("b", 0, 48, True)]
    assert s.stats.prefix_cache_queries == 0


def test_kv_cache_usage_counts_cached_free_blocks_as_free():
    s = make_sched(num_blocks=10)
    r = make_req("a", 40, max_tokens=2)
    s.add_sequence(r)
    step(s)
    assert s.get_block_table("a")[0] == [0, 1, 2]
    assert s.num_free_blocks == 7 and s.kv_cache_usage == pytest.approx(0.3)
    run_all(s)
    assert s.num_free_blocks == 10 and s.kv_cache_usage == 0.0 and s.num_total_blocks == 10
    assert s.get_block_table("a")[0] == []


# ---- preemption ----------------------------------------------------------------------------
def test_preempts_newest_by_recompute_and_resumes_with_outputs_kept():
    s = make_sched(num_blocks=4)
    a = make_req("a", 16, max_tokens=30, arrival=1.0)
    b = make_req("b", list(range(2000, 2016)), max_tokens=30, arrival=2.0)
    s.add_sequence(a)
    s.add_sequence(b)
    preempted_at = None
    for i in range(40):
        out, _ = step(s)
        if out.preempted_ids:
            preempted_at = i
            break
    assert out.preempted_ids == ["b"] and preempted_at is not None
    assert [c.seq.seq_id for c in out.chunks] == ["a"]
    assert b.status == SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.stats.num_preemptions == 1
    kept = list(b.output_token_ids)
    assert len(kept) == 17 and s.get_block_table("b")[0] == [] and s.waiting[0] is b
    seen_resume = False
    while s.has_unfinished_requests():
        out, _ = step(s)
        for c in out.chunks:
            if c.seq is b and not seen_resume:
                seen_resume = True
                assert (
                    c.token_ids
                    == (b.prompt_token_ids + kept)[c.start_pos : c.start_pos + len(c.token_ids)]
                )
    assert seen_resume and a.num_output_tokens == b.num_output_tokens == 30
    assert b.output_token_ids[:17] == kept and b.num_cached_tokens == 0
    assert s.num_free_blocks == 4


def _full_pool_with(a_prio, b_prio):
    """a (older, prompt 20: room to decode in place) and b (newer, prompt 16: needs a new block)."""
    s = make_sched(num_blocks=3)
    a = make_req("a", 20, max_tokens=8, priority=a_prio, arrival=1.0)
    b = make_req("b", list(range(3000, 3016)), max_tokens=8, priority=b_prio, arrival=2.0)
    s.add_sequence(a)
    s.add_sequence(b)
    step(s)
    assert s.num_free_blocks == 0
    return s, a, b


def test_the_request_being_scheduled_can_be_its_own_victim():
    s, a, b = _full_pool_with(0, 0)
    out, _ = step(s)
    assert summary(out) == [("a", 20, 1, True)] and out.preempted_ids == ["b"]
    assert b.status == SequenceStatus.PREEMPTED


def test_lower_priority_is_preempted_before_newer_even_if_already_scheduled():
    s, a, b = _full_pool_with(5, 0)
    out, _ = step(s)
    assert out.preempted_ids == ["a"]
    assert summary(out) == [("b", 16, 1, True)] and out.num_batched_tokens == 1
    assert a.status == SequenceStatus.PREEMPTED and a.num_computed_tokens == 0
    assert a.output_token_ids == [7]


def test_blocks_of_a_victim_unscheduled_in_the_same_step_are_not_cached():
    s = make_sched(num_blocks=3)
    a = make_req("a", 30, max_tokens=8, priority=5, arrival=1.0)
    s.add_sequence(a)
    step(s)  # a: prompt 0..29
    b = make_req("b", list(range(3000, 3016)), max_tokens=8, arrival=2.0)
    s.add_sequence(b)
    step(s)  # a writes 30, b its prompt: pool full
    out, _ = step(s)  # a schedules 31 (fills block 1), then is the victim
    assert out.preempted_ids == ["a"] and summary(out) == [("b", 16, 1, True)]
    probe = make_req("probe", a.all_token_ids + [5])
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 16  # block 1 was never computed


def test_no_admission_in_a_step_that_preempted():
    s, a, b = _full_pool_with(0, 0)
    s.add_sequence(make_req("c", 1, max_tokens=1))
    out, _ = step(s)
    assert out.preempted_ids == ["b"] and "c" not in [c.seq.seq_id for c in out.chunks]


# ---- priorities ------------------------------------------------------------------------------
def test_waiting_order_is_priority_then_arrival():
    s = make_sched(max_seqs=2)
    s.add_sequence(make_req("c", 4, priority=1, arrival=0.0))
    s.add_sequence(make_req("e", 4, priority=0, arrival=2.0))
    s.add_sequence(make_req("d", 4, priority=0, arrival=1.0))
    s.add_sequence(make_req("f", 4, priority=-1, arrival=3.0))
    out, _ = step(s)
    assert [c.seq.seq_id for c in out.chunks] == ["f", "d"]
    assert [r.seq_id for r in s.waiting] == ["e", "c"]


def test_preempted_request_requeues_at_the_front_of_its_priority_class():
    s, a, b = _full_pool_with(0, 0)
    s.add_sequence(make_req("early", 1, priority=0, arrival=0.5))
    s.add_sequence(make_req("urgent", 1, priority=-1, arrival=9.0))
    s.add_sequence(make_req("later", 1, priority=1, arrival=0.0))
    step(s)
    assert [r.seq_id for r in s.waiting] == ["urgent", "b", "early", "later"]


# ---- n > 1: fork from the parent's prompt -------------------------------------------------------
def test_children_wait_for_the_parent_prompt_then_fork_with_copy_on_write():
    s = make_sched(budget=16)
    p = make_req("p", 20, max_tokens=3, temperature=1.0)
    kids = [make_req(f"p-{i}", 20, max_tokens=3, fork_of="p") for i in (1, 2)]
    for r in [p, *kids]:
        s.add_sequence(r)
    out, _ = step(s)
    assert summary(out) == [("p", 0, 16, False)]  # kids wait: parent prompt unfinished
    out, _ = step(s)
    assert summary(out) == [("p", 16, 4, True)]  # still waiting: not computed before this step
    out, _ = step(s)
    assert summary(out) == [("p", 20, 1, True), ("p-1", 19, 1, True), ("p-2", 19, 1, True)]
    assert out.chunks[1].token_ids == [p.prompt_token_ids[-1]]
    pt, t1, t2 = (s.get_block_table(r)[0] for r in ("p", "p-1", "p-2"))
    assert pt[0] == t1[0] == t2[0]  # full prompt block shared
    assert len({pt[1], t1[1], t2[1]}) == 3  # partial block: private copies
    assert sorted(out.copy_blocks) == sorted([(0, pt[1], t1[1]), (0, pt[1], t2[1])])
    assert s.kv_cache_manager.pools[0].blocks[pt[0]].ref_cnt == 3
    assert kids[0].num_cached_tokens == 19
    assert s.stats.prefix_cache_queries == 20  # forks are not prefix lookups
    run_all(s)
    assert all(r.num_output_tokens == 3 for r in [p, *kids])
    assert s.num_free_blocks == s.num_total_blocks


def test_child_of_a_finished_parent_runs_on_its_own():
    s = make_sched()
    s.add_sequence(make_req("p", 20, max_tokens=1))
    run_all(s)
    kid = make_req("k", 20, max_tokens=1, fork_of="p")
    s.add_sequence(kid)
    out, _ = step(s)
    assert summary(out) == [("k", 16, 4, True)]  # prefix cache hit, no fork


def test_child_of_a_preempted_parent_runs_on_its_own():
    s, a, b = _full_pool_with(0, 0)
    step(s)  # b preempted
    kid = make_req("k", list(range(3000, 3016)), max_tokens=1, fork_of="b")
    s.add_sequence(kid)
    assert s._fork_parent(kid) is None
    run_all(s)
    assert kid.finish_reason == "length"


# ---- aborts --------------------------------------------------------------------------------
def test_abort_waiting_running_and_preempted_frees_everything():
    s, a, b = _full_pool_with(0, 0)
    step(s)
    assert b.status == SequenceStatus.PREEMPTED
    s.abort_sequence("b")
    assert b.status == SequenceStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    w = make_req("w", 4)
    s.add_sequence(w)
    s.abort_sequence("w")
    assert w.finish_reason == "abort" and s.num_waiting == 0
    s.abort_sequence("a")
    assert a.finish_reason == "abort" and s.num_running == 0
    assert s.num_free_blocks == 3 and not s.has_unfinished_requests()
    s.abort_sequence("a")  # finished: no-op
    s.abort_sequence("nope")  # unknown: no-op


def test_abort_between_schedule_and_update_is_skipped():
    s = make_sched(budget=16)
    r = make_req("a", 40)
    other = make_req("b", 4)
    s.add_sequence(other)
    s.add_sequence(r)
    out = s.schedule()
    s.abort_sequence("a")
    assert s.get_block_table("a")[0] == []
    finished = s.update_from_output(out, {"a": [7], "b": [7]})
    assert finished == [] and r.output_token_ids == [] and other.output_token_ids == [7]
    assert s.num_free_blocks == 64 - 1


def test_finish_request_from_the_engine():
    s = make_sched()
    r = make_req("a", 4, max_tokens=10)
    s.add_sequence(r)
    step(s)
    s.finish_sequence("a", SequenceStatus.FINISHED_STOPPED)
    assert r.finish_reason == "stop" and s.num_free_blocks == 64


# ---- admission ------------------------------------------------------------------------------
def test_admission_errors():
    s = make_sched(num_blocks=4, max_model_len=100, max_waiting=2)
    with pytest.raises(ValueError, match="empty"):
        s.add_sequence(make_req("e", []))
    with pytest.raises(ValueError, match=r"90.*20.*110.*max_model_len=100"):
        s.add_sequence(make_req("long", 90, max_tokens=20))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks.*has 4"):
        s.add_sequence(make_req("big", 60, max_tokens=20))
    s.add_sequence(make_req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_sequence(make_req("a", 4))
    s.add_sequence(make_req("b", 4))
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        s.add_sequence(make_req("c", 4))
    assert issubclass(QueueFullError, RuntimeError)
    assert s.num_waiting == 2


# ---- stop rules -----------------------------------------------------------------------------
def _decode(s, r, tokens):
    s.add_sequence(r)
    finished = []
    for t in tokens:
        _, finished = step(s, t)
        if finished:
            break
    return finished


def test_eos_stops():
    s = make_sched()
    r = make_req("a", 4, max_tokens=10)
    assert _decode(s, r, [5, EOS, 6]) == [r]
    assert r.output_token_ids == [5, EOS] and r.finish_reason == "stop" and r.stop_reason is None
    assert s.num_free_blocks == 64


def test_ignore_eos():
    s = make_sched()
    r = make_req("a", 4, max_tokens=3, ignore_eos=True)
    _decode(s, r, [EOS, EOS, EOS])
    assert r.output_token_ids == [EOS] * 3 and r.finish_reason == "length"


def test_stop_token_ids():
    s = make_sched()
    r = make_req("a", 4, max_tokens=10, stop_token_ids=[9])
    _decode(s, r, [5, 9])
    assert r.finish_reason == "stop" and r.stop_reason == 9


def test_min_tokens_defers_eos_and_stop_ids():
    s = make_sched()
    r = make_req("a", 4, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    _decode(s, r, [EOS, 9, EOS])
    assert r.output_token_ids == [EOS, 9, EOS] and r.finish_reason == "stop"


def test_max_tokens_and_max_model_len_give_length():
    s = make_sched(max_model_len=8)
    r = make_req("a", 4, max_tokens=4)
    _decode(s, r, [5] * 10)
    assert r.num_output_tokens == 4 and r.finish_reason == "length"
    s2 = make_sched(max_model_len=8)
    r2 = make_req("b", 4, max_tokens=4)
    s2.add_sequence(r2)
    r2.max_tokens = 100  # as if the engine let it through: the context caps it
    for _ in range(10):
        if step(s2)[1]:
            break
    assert r2.num_tokens == 8 and r2.finish_reason == "length"
