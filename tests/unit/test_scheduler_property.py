"""Random add / step / abort / finish sequences against the scheduler's block bookkeeping.

After every operation: each block is free exactly when no table holds it, and otherwise its
refcount is the number of tables holding it. Every step also runs a fake KV cache (token ids
instead of vectors): copies first, then every chunk's writes, then each chunk's whole context
must read back as the request's own tokens, which catches a wrong prefix hit, a missing
copy-on-write or a block reused while still in use. At the end everything is free.
"""

import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.scheduler import QueueFullError, Scheduler
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.sampling_params import SamplingParams

BS = 4
EOS = 1
BASES = [[random.Random(i).randrange(2, 50) for _ in range(64)] for i in range(3)]

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
    st.one_of(add_op, add_op, step_op, step_op, step_op, abort_op, finish_op),
    min_size=5,
    max_size=60,
)


def add_requests(s: Scheduler, op: tuple, ids: list[str]) -> None:
    """An add_op: a request (n > 1: its forked siblings too), its ids appended to `ids`; ones the
    scheduler refuses (too long, queue full) are left out."""
    _, length, base, suffix, max_tokens, priority, n, salted = op
    prompt = BASES[base][:length] + [60 + i for i in range(suffix)]
    rid = f"r{len(ids)}"
    for i in range(n):
        req = Sequence(
            f"{rid}-{i}" if i else rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, min_tokens=min(2, max_tokens)),
            eos_token_ids={EOS},
            priority=priority,
            arrival_time=float(len(ids)),
            cache_salt="salt" if salted else None,
            fork_of=rid if i else None,
        )
        try:
            s.add_sequence(req)
            ids.append(req.seq_id)
        except (ValueError, QueueFullError):
            pass


def run_ops(s: Scheduler, ops: list[tuple], step, check) -> None:
    """Apply hypothesis ops in order: add (add_requests), step (`step(rng)` seeded by the op),
    abort / finish a request added so far; `check()` after each."""
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            add_requests(s, op, ids)
        elif op[0] == "step":
            step(random.Random(op[1]))
        elif ids:
            rid = ids[op[1] % len(ids)]
            if op[0] == "abort":
                s.abort_sequence(rid)
            else:
                s.finish_sequence(rid, SequenceStatus.FINISHED_STOPPED)
        check()


def check_blocks(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    for g, pool in enumerate(kv.pools):
        tables = [t[g] for t in kv.tables.values()]
        holders = Counter(b.block_id for blocks in tables for b in blocks if b is not None)
        for blocks in tables:
            held = [b.block_id for b in blocks if b is not None]
            assert len(set(held)) == len(held), "a table holds a block twice"
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
            assert (b.block_id in pool.free_queue) == (b.ref_cnt == 0), b
        for h, b in pool.cached.items():
            assert b.block_hash == h
    for rid in kv.tables:
        assert s.sequences[rid].status == SequenceStatus.RUNNING
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and r.seq_id not in kv.tables
    assert s.num_running <= s.sched.max_num_seqs


def run_step(s: Scheduler, store: dict[int, list], rng: random.Random) -> None:
    out = s.schedule()
    assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks)
    assert out.num_batched_tokens <= s.sched.max_num_batched_tokens
    assert len({c.seq.seq_id for c in out.chunks}) == len(out.chunks)
    for g, src, dst in out.copy_blocks:
        assert g == 0
        store[dst] = list(store.get(src, [None] * BS))
    for c in out.chunks:
        (table,) = c.block_tables
        for i, tok in enumerate(c.token_ids):
            pos = c.start_pos + i
            store.setdefault(table[pos // BS], [None] * BS)[pos % BS] = tok
    for c in out.chunks:
        (table,) = c.block_tables
        seen = [store[table[p // BS]][p % BS] for p in range(c.start_pos + len(c.token_ids))]
        assert seen == c.seq.all_token_ids[: len(seen)], c.seq
        assert c.sample == (c.start_pos + len(c.token_ids) == c.seq.num_tokens)
    sampled = {
        c.seq.seq_id: [rng.choice([EOS] + list(range(2, 32)))] for c in out.chunks if c.sample
    }
    for r in s.update_from_output(out, sampled):
        assert r.is_finished and r.seq_id not in s.sequences


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(12, 30),
    budget=st.integers(4, 40),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
)
def test_random_workloads_keep_blocks_consistent(ops, num_blocks, budget, max_seqs, caching):
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_waiting=12),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
        max_model_len=64,
    )
    store: dict[int, list] = {}
    run_ops(s, ops, lambda rng: run_step(s, store, rng), lambda: check_blocks(s))

    rng = random.Random(0)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        run_step(s, store, rng)
        check_blocks(s)
    assert not s.has_unfinished_requests(), "requests never finished"
    assert s.num_free_blocks == s.num_total_blocks and s.kv_cache_usage == 0.0
    assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.pools[0].blocks)
    assert not s.kv_cache_manager.tables
