"""Sliding-window KV groups in the KV cache manager and the scheduler (issue 14 item 3).

Two KV groups: a full-attention group and a window-W group with their own pools. The property
test drives the scheduler through random schedules (prompts sharing prefixes, chunked prefill,
decodes with speculative drafts accepted or rolled back, finishes, aborts, preemption from small
pools, n > 1 forks) against a fake KV store per group (token ids instead of vectors), and checks
after every step:
  - every key a scheduled query can see reads back as the request's own token (full group: the
    whole context; window group: from the chunk's first query - W + 1 on), which catches a wrong
    prefix hit, a missing copy-on-write, a block freed too early or reused while still in use;
  - a window group's table holds exactly the blocks from the first one the chunk's first query
    reads to its end, None before: at most ceil((W + n - 2) / B) + 1 blocks for a chunk of n
    tokens (plus blocks a rolled-back draft left allocated), ceil(W / B) + 1 for a decode;
  - refcounts equal the number of tables holding each block, free exactly when unheld;
and at the end every block of every pool is free (nothing leaked).
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_property import BASES, BS, EOS, check_blocks, run_ops

from kvserve.config import (
    CacheConfig,
    KVGroup,
    KVShape,
    SchedulerConfig,
    blocks_held,
    cdiv,
    first_needed_block,
    group_layers_by_window,
    kv_group_blocks,
    sliding_group_cap,
)
from kvserve.core.kv_cache import KVCacheManager
from kvserve.core.scheduler import Scheduler
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.sampling_params import SamplingParams


def make_req(rid, tokens, max_tokens=8, **kw):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), **kw)


def two_groups(window, full_blocks, window_blocks):
    return [KVGroup(None, (1, 3), full_blocks), KVGroup(window, (0, 2), window_blocks)]


# ---- the manager, step by step -------------------------------------------------------------


def step_decode(kv, req, token=7):
    """Schedule one decode (as the scheduler does) and compute it."""
    assert kv.allocate_slots(req, 1, [])
    req.num_computed_tokens += 1
    req.append_output_token(token)
    kv.cache_blocks(req, req.num_computed_tokens)


def test_decoding_frees_blocks_behind_the_window():
    kv = KVCacheManager(two_groups(8, 32, 32), BS)
    req = make_req("a", range(10, 30), max_tokens=40)  # 20 tokens
    assert kv.allocate_slots(req, 20, [])
    req.num_computed_tokens = 20
    req.append_output_token(5)
    kv.cache_blocks(req, 20)
    assert kv.num_held_blocks("a") == [5, 5]  # the prefill holds every block
    for _ in range(30):
        step_decode(kv, req)
        p = req.num_computed_tokens - 1  # position of the decode just computed
        full, window = kv.tables["a"]
        assert all(b is not None for b in full) and len(full) == cdiv(p + 1, BS)
        first = first_needed_block(p, 8, BS)
        assert window[:first] == [None] * first and all(b is not None for b in window[first:])
        assert kv.num_held_blocks("a")[1] == blocks_held(p + 1, 8, BS) <= cdiv(8, BS) + 1
    assert kv.pools[1].num_free_blocks == 32 - kv.num_held_blocks("a")[1]  # really given back
    assert kv.block_ids("a")[1][0] == 0  # freed entries keep their place
    kv.free(req)
    assert kv.num_free_blocks == 64 and not kv.tables


def test_a_chunk_keeps_the_keys_its_first_query_needs():
    kv = KVCacheManager(two_groups(8, 32, 32), BS)
    req = make_req("a", range(100, 140))
    for start, n in [(0, 10), (10, 13), (23, 17)]:
        assert kv.allocate_slots(req, n, [])
        window = kv.tables["a"][1]
        first = first_needed_block(start, 8, BS)  # the chunk's first query reads from here
        assert all(b is not None for b in window[first:]) and window[:first] == [None] * first
        assert len(window) - first <= cdiv(8 + n - 2, BS) + 1
        req.num_computed_tokens += n
        kv.cache_blocks(req, req.num_computed_tokens)


def test_prefix_hit_is_cut_back_to_what_the_window_group_still_holds():
    kv = KVCacheManager(two_groups(8, 64, 64), BS)
    prompt = list(range(200, 240))  # 40 tokens: 10 blocks
    a = make_req("a", prompt, max_tokens=30)
    assert kv.allocate_slots(a, 40, [])
    a.num_computed_tokens = 40
    kv.cache_blocks(a, 40)
    # Both groups hold every block: a hit of 9 full blocks (the last token is recomputed).
    hits, n = kv.get_computed_blocks(make_req("b", prompt + [1, 2, 3]))
    assert n == 40 and len(hits[0]) == 10
    assert hits[1][: first_needed_block(40, 8, BS)] == [None] * first_needed_block(40, 8, BS)
    # Evict the window group's cached blocks 6..9 (block 5 stays): a query at 24 reads blocks 4, 5.
    for i in range(6, 10):
        kv.pools[1]._evict_hash(kv.tables["a"][1][i])
    hits, n = kv.get_computed_blocks(make_req("c", prompt + [1, 2, 3]))
    assert n == 24 and len(hits[0]) == 6
    assert hits[1] == [None] * 4 + kv.tables["a"][1][4:6]
    # And the hit really serves: admitting it frees nothing it needs.
    c = make_req("c", prompt + [1, 2, 3])
    assert kv.allocate_slots(c, c.num_tokens - n, [], hits, n)
    assert kv.num_held_blocks("c") == [cdiv(43, BS), cdiv(43, BS) - 4]


def test_fork_shares_only_the_window_and_falls_back_when_the_parent_freed_it():
    kv = KVCacheManager(two_groups(8, 64, 64), BS)
    parent = make_req("p", range(300, 318), max_tokens=40)  # 18 tokens
    assert kv.allocate_slots(parent, 18, [])
    parent.num_computed_tokens = 18
    kv.cache_blocks(parent, 18)
    child = make_req("c", range(300, 318))
    shared, n = kv.get_fork_blocks(parent, child)
    first = first_needed_block(17, 8, BS)  # the child's first query is at 17
    assert n == 17 and shared[0] == kv.tables["p"][0][:5]
    assert shared[1] == [None] * first + kv.tables["p"][1][first:5]
    copies = []
    assert kv.allocate_slots(child, 1, copies, shared, n)
    assert copies == [
        (0, kv.tables["p"][0][4].block_id, kv.tables["c"][0][4].block_id),
        (1, kv.tables["p"][1][4].block_id, kv.tables["c"][1][4].block_id),
    ]
    # The parent decodes on; its window drops blocks a second child would need.
    parent.append_output_token(9)
    for _ in range(12):
        step_decode(kv, parent)
    assert kv.get_fork_blocks(parent, make_req("d", range(300, 318))) is None


def test_preemption_and_abort_give_every_group_back():
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
        CacheConfig(block_size=BS),
        two_groups(8, 12, 8),
        max_model_len=64,
    )
    for i in range(3):
        s.add_sequence(
            make_req(f"r{i}", range(10 * i, 10 * i + 12), max_tokens=30, arrival_time=float(i))
        )
    preempted = 0
    for _ in range(40):
        out = s.schedule()
        preempted += len(out.preempted_ids)
        s.update_from_output(out, {c.seq.seq_id: [3] for c in out.chunks if c.sample})
    assert preempted > 0
    for rid in list(s.sequences):
        s.abort_sequence(rid)
    assert s.num_used_blocks == 0 and s.num_free_blocks == 20 and s.kv_cache_usage == 0.0


def test_a_request_whose_window_chunk_cannot_fit_is_refused_at_admission():
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16),
        CacheConfig(block_size=BS),
        two_groups(8, 64, 4),
        max_model_len=64,
    )
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_sequence(
            make_req("a", range(30), max_tokens=10)
        )  # a 16-token chunk needs 7 window blocks
    s2 = Scheduler(
        SchedulerConfig(max_num_batched_tokens=4),
        CacheConfig(block_size=BS),
        two_groups(8, 64, 4),
        max_model_len=64,
    )
    s2.add_sequence(make_req("a", range(30), max_tokens=10))  # 4-token chunks: at most 4 blocks


# ---- sizing: the budget split and the 8k figure ------------------------------------------

GEMMA3_270M_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


def test_groups_are_made_by_window():
    groups = group_layers_by_window(GEMMA3_270M_WINDOWS)
    assert [(g.window, len(g.layers)) for g in groups] == [(None, 3), (512, 15)]
    assert groups[0].layers == (5, 11, 17)
    assert [g.window for g in group_layers_by_window([None] * 4)] == [None]


def test_budget_split_caps_window_groups_at_what_they_can_need():
    groups = group_layers_by_window(GEMMA3_270M_WINDOWS)
    layer_block = 2 * 1 * 256 * 4 * 16
    cap = sliding_group_cap(512, 16, 8, 512)
    big = kv_group_blocks(2**30, groups, layer_block, 16, 8, 512)
    assert big[1].num_blocks == cap
    assert big[0].num_blocks == (2**30 - cap * 15 * layer_block) // (3 * layer_block)
    # A small budget: both groups get the same count (a window table is never the longer one).
    small = kv_group_blocks(64 * 2**20, groups, layer_block, 16, 8, 512)
    assert small[0].num_blocks == small[1].num_blocks == 64 * 2**20 // (18 * layer_block)
    # One full group: the plain formula of CacheConfig.num_blocks.
    kv = KVShape(30, 3, 64, 2)
    assert CacheConfig(kv_cache_memory=2**30).num_blocks(kv) == 2**30 // (kv.bytes_per_token * 16)
    with pytest.raises(ValueError, match="kv-cache-memory"):
        kv_group_blocks(1000, groups, layer_block, 16, 8, 512)


@pytest.mark.parametrize("dtype_bytes,scale_bytes", [(4, 0), (1, 4)])
def test_gemma3_270m_holds_under_a_quarter_of_full_attention_at_8k(dtype_bytes, scale_bytes):
    """The manager's own block counts for one 8k-token sequence, Gemma 3 270M's shape."""
    groups = [replace_blocks(g, 600) for g in group_layers_by_window(GEMMA3_270M_WINDOWS)]
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=512),
        CacheConfig(block_size=16),
        groups,
        max_model_len=8193,
    )
    s.add_sequence(make_req("a", [5] * 8000, max_tokens=193))  # decodes up to position 8191
    held = None
    while s.has_unfinished_requests():
        out = s.schedule()
        held = s.kv_cache_manager.num_held_blocks("a")
        s.update_from_output(out, {"a": [3]} if out.chunks[0].sample else {})
    assert held == [512, 32]  # 8192 tokens: 512 blocks; the window's 512 keys fill 32 whole blocks
    layer_block = 2 * 1 * (256 * dtype_bytes + scale_bytes) * 16
    held_bytes = sum(n * len(g.layers) * layer_block for n, g in zip(held, groups))
    full_bytes = 18 * cdiv(8192, 16) * layer_block
    assert held_bytes * 4 <= full_bytes
    assert s.num_used_blocks == 0


def replace_blocks(group, n):
    return KVGroup(group.window, group.layers, n)


# ---- the property test ---------------------------------------------------------------------

add_op = st.tuples(
    st.just("add"),
    st.integers(1, 40),
    st.integers(0, 2),
    st.integers(0, 6),
    st.integers(1, 24),
    st.integers(0, 2),
    st.integers(1, 3),
    st.booleans(),
)
step_op = st.tuples(st.just("step"), st.integers(0, 2**16))
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))
finish_op = st.tuples(st.just("finish"), st.integers(0, 50))
ops = st.lists(
    st.one_of(add_op, add_op, step_op, step_op, step_op, step_op, abort_op, finish_op),
    min_size=5,
    max_size=60,
)


class Checker:
    """The fake KV stores and per-request facts the checks need."""

    def __init__(self, s: Scheduler, window: int, drafts: bool):
        self.s, self.window, self.drafts = s, window, drafts
        self.stores = [dict() for _ in s.kv_cache_manager.groups]
        self.alloc_end: dict[str, int] = {}  # request -> furthest position + 1 given slots
        self.freed = 0  # window blocks seen freed behind a window

    def check_blocks(self) -> None:
        s, kv = self.s, self.s.kv_cache_manager
        check_blocks(s)
        for rid in kv.tables:
            assert s.sequences[rid].status == SequenceStatus.RUNNING
        for r in s.waiting:
            assert r.num_computed_tokens == 0 and r.seq_id not in kv.tables
            self.alloc_end.pop(r.seq_id, None)

    def run_step(self, rng: random.Random) -> None:
        s, kv, W = self.s, self.s.kv_cache_manager, self.window
        out = s.schedule()
        assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks)
        assert out.num_batched_tokens <= s.sched.max_num_batched_tokens
        for g, src, dst in out.copy_blocks:
            self.stores[g][dst] = list(self.stores[g].get(src, [None] * BS))
        for c in out.chunks:
            for g, table in enumerate(c.block_tables):
                for i, tok in enumerate(c.token_ids):
                    pos = c.start_pos + i
                    self.stores[g].setdefault(table[pos // BS], [None] * BS)[pos % BS] = tok
        for c in out.chunks:
            rid, end, n = c.seq.seq_id, c.start_pos + len(c.token_ids), len(c.token_ids)
            known = c.seq.all_token_ids[: c.start_pos] + c.token_ids
            full, win = c.block_tables
            assert [self.stores[0][full[p // BS]][p % BS] for p in range(end)] == known
            lo = max(0, c.start_pos - W + 1)  # the first key the chunk's first query sees
            assert [self.stores[1][win[p // BS]][p % BS] for p in range(lo, end)] == known[lo:]
            # The window table: None before the first needed block, held from there to its end.
            table = kv.tables[rid][1]
            first = first_needed_block(c.start_pos, W, BS)
            assert table[:first] == [None] * first and all(b is not None for b in table[first:])
            self.alloc_end[rid] = max(self.alloc_end.get(rid, 0), end)
            leftover = cdiv(self.alloc_end[rid], BS) - cdiv(end, BS)  # blocks of rolled-back drafts
            held = kv.num_held_blocks(rid)[1]
            assert held <= cdiv(W + n - 2, BS) + 1 + leftover
            if n == 1 and leftover == 0:
                assert held <= cdiv(W, BS) + 1
            assert kv.num_held_blocks(rid)[0] == cdiv(self.alloc_end[rid], BS)
            self.freed += first
        sampled = {}
        for c in out.chunks:
            if not c.sample:
                continue
            accepted = c.draft_token_ids[: rng.randint(0, len(c.draft_token_ids))]
            sampled[c.seq.seq_id] = accepted + [rng.choice([EOS] + list(range(2, 32)))]
        for r in s.update_from_output(out, sampled):
            assert r.is_finished and r.seq_id not in s.sequences
        if self.drafts:  # as the engine's drafter: propose for every request that just sampled
            for c in out.chunks:
                r = c.seq
                if c.sample and r.status == SequenceStatus.RUNNING:
                    r.spec_token_ids = [rng.randrange(2, 32) for _ in range(rng.randint(0, 5))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    full_blocks=st.integers(12, 30),
    window_blocks=st.integers(8, 30),
    window=st.integers(3, 13),
    budget=st.integers(4, 24),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    drafts=st.booleans(),
)
def test_random_schedules_keep_window_groups_tight_correct_and_leak_free(
    ops, full_blocks, window_blocks, window, budget, max_seqs, caching, drafts
):
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_waiting=12),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        two_groups(window, full_blocks, window_blocks),
        max_model_len=64,
    )
    check = Checker(s, window, drafts)
    run_ops(s, ops, check.run_step, check.check_blocks)

    rng = random.Random(0)
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        check.run_step(rng)
        check.check_blocks()
    assert not s.has_unfinished_requests(), "requests never finished"
    kv = s.kv_cache_manager
    assert (
        s.num_free_blocks == s.num_total_blocks == full_blocks + window_blocks
        and s.kv_cache_usage == 0.0
    )
    assert all(b.ref_cnt == 0 for pool in kv.pools for b in pool.blocks)
    assert not kv.tables and not kv.num_dropped


def test_the_property_test_sees_blocks_freed_and_drafts_rolled_back():
    """The schedules above do exercise freeing: a fixed one with long decodes frees blocks."""
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3),
        CacheConfig(block_size=BS),
        two_groups(5, 40, 20),
        max_model_len=64,
    )
    check = Checker(s, 5, drafts=True)
    for i in range(3):
        s.add_sequence(
            Sequence(
                f"r{i}",
                BASES[i][:20],
                SamplingParams(max_tokens=30, ignore_eos=True),
                arrival_time=float(i),
            )
        )
    rng = random.Random(1)
    while s.has_unfinished_requests():
        check.run_step(rng)
        check.check_blocks()
    assert check.freed > 0 and s.num_used_blocks == 0
