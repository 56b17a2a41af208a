"""Async scheduling in the scheduler (`schedule(inflight)`, `settle`) against synchronous steps.

A fake model over a fake KV cache (token ids instead of vectors) drives both: each step writes
its chunks' tokens at their slots, then each sampling chunk reads its whole context back from
the cache and its next token is a hash of what it read. A block found by hash before its
content was written, a slot written twice or a placeholder left in a chunk changes the tokens,
so every sequence's tokens and finish must be the same in both modes, whatever the two
schedules were. The workloads mix arrivals, shared prefixes (prefix hits and n > 1 forks),
EOS, stop tokens applied from outside (as stop strings are), aborts, max_tokens and preemption
under a small pool; at the end every block is free.
"""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_property import BASES, BS, EOS, check_blocks

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.scheduler import PLACEHOLDER, Scheduler
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.sampling_params import SamplingParams

STOP_OUTSIDE = 7  # a token the "engine" stops at after the update, as a stop string would
UNWRITTEN = 0  # what a read of a slot no step wrote gives


def next_token(context: list) -> int:
    if None in context:
        return UNWRITTEN
    h = 0
    for t in context:
        h = (h * 1000003 + t) % (1 << 31)
    return EOS if h % 23 == 0 else 2 + h % 40


def run_model(out, store: dict[int, list]) -> dict[str, list[int]]:
    """One step of the fake model: copies, writes, then each sampling chunk's next token."""
    for _, src, dst in out.copy_blocks:
        store[dst] = list(store.get(src, [None] * BS))
    for c in out.chunks:
        assert PLACEHOLDER not in c.token_ids, c
        (table,) = c.block_tables
        for i, tok in enumerate(c.token_ids):
            pos = c.start_pos + i
            store.setdefault(table[pos // BS], [None] * BS)[pos % BS] = tok
    sampled = {}
    for c in out.chunks:
        if c.sample:
            (table,) = c.block_tables
            end = c.start_pos + len(c.token_ids)
            ctx = [store.get(table[p // BS], [None] * BS)[p % BS] for p in range(end)]
            sampled[c.seq.seq_id] = [next_token(ctx)]
    return sampled


def new_scheduler(num_blocks, budget, max_seqs, caching) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_waiting=64),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
        max_model_len=64,
    )


def run(s: Scheduler, arrivals: list[tuple], aborts: dict[str, int], planned: bool) -> dict:
    """Every sequence's (outputs, final status). arrivals: (step, id, prompt, max_tokens, n);
    aborts: id -> abort it once it has that many outputs."""
    store: dict[int, list] = {}
    seqs: dict[str, Sequence] = {}
    plan = None
    for step in range(3000):
        for at, rid, prompt, max_tokens, n in arrivals:
            if at != step:
                continue
            for i in range(n):
                seq = Sequence(
                    f"{rid}-{i}" if i else rid,
                    prompt,
                    SamplingParams(max_tokens=max_tokens),
                    eos_token_ids={EOS},
                    arrival_time=float(step),
                    fork_of=rid if i else None,
                )
                try:
                    s.add_sequence(seq)
                except ValueError:  # longer than the pool: refused in both modes
                    continue
                seqs[seq.seq_id] = seq
        if step > max(a[0] for a in arrivals) and not s.has_unfinished_requests():
            break
        if plan is not None:
            out = s.settle(plan)
            if not out.chunks:
                out = s.schedule()
        else:
            out = s.schedule()
        plan = s.schedule(out) if planned and out.chunks else None  # while `out` "runs"
        sampled = run_model(out, store)
        s.update_from_output(out, sampled)
        for sid, toks in sampled.items():  # the engine's part: stop strings, aborts
            seq = seqs[sid]
            if seq.status.is_finished:
                continue
            if toks[-1] == STOP_OUTSIDE and seq.output_token_ids[-1:] == toks[-1:]:
                s.finish_sequence(sid, SequenceStatus.FINISHED_STOPPED)
        for sid, n in aborts.items():
            seq = seqs.get(sid)
            if seq is not None and seq.num_output_tokens >= n:
                s.abort_sequence(sid)
        check_blocks(s)
    else:
        raise AssertionError("the workload never finished")
    if plan is not None:
        assert not s.settle(plan).chunks
    assert s.num_free_blocks == s.num_total_blocks and not s.kv_cache_manager.tables
    return {sid: (seq.output_token_ids, seq.status) for sid, seq in seqs.items()}


arrival = st.tuples(
    st.integers(0, 12),  # step
    st.integers(1, 30),  # prompt length
    st.integers(0, 2),  # base
    st.integers(0, 3),  # own suffix
    st.integers(1, 20),  # max_tokens
    st.integers(1, 2),  # n
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=10),
    abort_at=st.lists(st.integers(0, 12), max_size=3),
    num_blocks=st.integers(16, 40),
    budget=st.integers(8, 40),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
)
def test_planned_steps_give_the_same_tokens(
    arrivals, abort_at, num_blocks, budget, max_seqs, caching
):
    work = []
    for i, (at, length, base, suffix, max_tokens, n) in enumerate(arrivals):
        prompt = BASES[base][:length] + [100 + i] * suffix
        work.append((at, f"r{i}", prompt, max_tokens, n))
    aborts = {f"r{i}": k for i, k in enumerate(abort_at)}
    sync = run(new_scheduler(num_blocks, budget, max_seqs, caching), work, aborts, False)
    planned = run(new_scheduler(num_blocks, budget, max_seqs, caching), work, aborts, True)
    assert planned == sync
    assert all(UNWRITTEN not in toks for toks, _ in sync.values())


def test_a_planned_block_is_not_found_by_hash_before_it_is_written():
    """A decode planned into the last slot of a block fills it; if the sequence then finishes
    before the planned step runs, that block was never written and no later prompt may hit it."""
    s = new_scheduler(16, 64, 4, True)
    prompt = BASES[0][: 2 * BS - 1]
    a = Sequence("a", prompt, SamplingParams(max_tokens=10), eos_token_ids={EOS})
    s.add_sequence(a)
    first = s.schedule()  # the whole prompt: it samples
    plan = s.schedule(first)  # a's next token planned into the block's last slot
    assert plan.chunks[0].placeholder and plan.chunks[0].start_pos == 2 * BS - 1
    s.update_from_output(first, {"a": [5]})
    s.abort_sequence("a")  # before the planned step runs
    assert not s.settle(plan).chunks
    b = Sequence("b", prompt + [5, 9], SamplingParams(max_tokens=1), eos_token_ids={EOS})
    s.add_sequence(b)
    out = s.schedule()
    assert out.chunks[0].start_pos == BS  # only the first block, which `first` wrote, is a hit


def test_a_sequence_whose_token_ends_it_is_not_planned():
    s = new_scheduler(16, 64, 4, False)
    a = Sequence("a", [3, 4, 5], SamplingParams(max_tokens=1), eos_token_ids={EOS})
    b = Sequence("b", [3, 4, 6], SamplingParams(max_tokens=5), eos_token_ids={EOS})
    s.add_sequences([a, b])
    first = s.schedule()
    plan = s.schedule(first)
    assert [c.seq.seq_id for c in plan.chunks] == ["b"]
    assert plan.chunks[0].token_ids == [PLACEHOLDER] and plan.chunks[0].sample
    s.update_from_output(first, {"a": [9], "b": [8]})
    assert a.status == SequenceStatus.FINISHED_LENGTH
    out = s.settle(plan)
    assert [c.token_ids for c in out.chunks] == [[8]]


def test_settle_admits_waiting_sequences_into_the_room_left():
    s = new_scheduler(16, 64, 2, False)
    a = Sequence("a", [3, 4, 5], SamplingParams(max_tokens=5), eos_token_ids={EOS})
    s.add_sequence(a)
    first = s.schedule()
    plan = s.schedule(first)
    late = Sequence("late", [6, 7], SamplingParams(max_tokens=5), eos_token_ids={EOS})
    s.add_sequence(late)  # arrives while `first` runs, after the plan
    s.update_from_output(first, {"a": [8]})
    out = s.settle(plan)
    assert [(c.seq.seq_id, c.token_ids) for c in out.chunks] == [("a", [8]), ("late", [6, 7])]
    assert out.num_batched_tokens == 3


def test_a_preempted_sequence_keeps_the_token_of_the_step_in_flight():
    """Planning may preempt a sequence whose step still runs: the token that step samples is
    still appended (its recompute feeds it), and a stop it hits still ends the sequence."""
    s = new_scheduler(2, 64, 4, False)
    params = SamplingParams(max_tokens=5)
    a = Sequence("a", list(range(2, 2 + BS)), params, eos_token_ids={EOS}, arrival_time=0)
    b = Sequence("b", list(range(3, 3 + BS)), params, eos_token_ids={EOS}, arrival_time=1)
    s.add_sequences([a, b])
    first = s.schedule()
    assert len(first.chunks) == 2
    plan = s.schedule(first)  # both need a second block, one is free: b (newest) is preempted
    assert plan.preempted_ids == ["b"] and b.status == SequenceStatus.PREEMPTED
    s.update_from_output(first, {"a": [9], "b": [EOS]})
    assert b.output_token_ids == [EOS] and b.status == SequenceStatus.FINISHED_STOPPED
    assert not s.waiting
    out = s.settle(plan)
    assert [(c.seq.seq_id, c.token_ids) for c in out.chunks] == [("a", [9])]


def test_random_seeded_workload_smoke():
    rng = random.Random(3)
    work = [
        (rng.randrange(8), f"r{i}", BASES[i % 3][: rng.randrange(1, 30)], rng.randrange(1, 16), 1)
        for i in range(8)
    ]
    sync = run(new_scheduler(20, 16, 4, True), work, {"r2": 3}, False)
    planned = run(new_scheduler(20, 16, 4, True), work, {"r2": 3}, True)
    assert planned == sync
