"""The host-side fast paths against the general code they shortcut.

- The runner's flat batch (persistent block-table rows, rewritten only when a table's version
  changes) against a flattening written out plainly from the KV manager's fresh block ids, over
  random scheduler workloads (prefix hits, forks with copy-on-write, preemption, a window group).
- The KV manager's append fast path against its general allocation path: the same workloads
  give the same chunks, tables and copies.
- The sampler (batched temperature, min_p, top_k, top_p, penalties, min_tokens, logprobs)
  against a per-row reference written from the sampler's documented rules, and the runner's
  one-argmax greedy path against the sampler.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_property import BASES, BS, EOS, abort_op, add_op, run_ops, step_op

from kvserve.config import CacheConfig, KVGroup, SchedulerConfig
from kvserve.core.scheduler import ScheduledChunk, Scheduler
from kvserve.core.sequence import Sequence
from kvserve.runner.kv_pools import layer_groups
from kvserve.runner.model_runner import ModelRunner
from kvserve.runner.sampler import Sampler, SamplingRow
from kvserve.sampling_params import SamplingParams

# ---------------------------------------------------------------- the flat batch


def bare_runner(groups, num_layers: int, max_num_seqs: int) -> ModelRunner:
    """A ModelRunner with only what flattening and sampling read (no model, no pools)."""
    r = object.__new__(ModelRunner)
    r.block_size = BS
    r.kv_groups, r.layer_group = layer_groups(groups, num_layers)
    r.model = None
    r.device = torch.device("cpu")
    r.sampler = Sampler()
    r.verifier = None
    r._init_sequence_state(max_num_seqs)
    return r


def reference_flatten(chunks, tables_of, num_groups: int):
    """The flat batch as the definition reads, from each chunk's fresh block ids."""
    ids, positions, sample_idx, qsl, seq_lens = [], [], [], [0], []
    slots = [[] for _ in range(num_groups)]
    tables = [[tables_of(c.seq.seq_id)[g] for c in chunks] for g in range(num_groups)]
    for c in chunks:
        n = len(c.token_ids)
        ids += c.token_ids
        pos = list(range(c.start_pos, c.start_pos + n))
        positions += pos
        for g in range(num_groups):
            t = tables_of(c.seq.seq_id)[g]
            slots[g] += [t[p // BS] * BS + p % BS for p in pos]
        qsl.append(qsl[-1] + n)
        seq_lens.append(c.start_pos + n)
        if c.sample:
            sample_idx += list(range(qsl[-1] - 1 - len(c.draft_token_ids), qsl[-1]))
    padded = []
    for g in range(num_groups):
        width = max(len(t) for t in tables[g])
        padded.append([t + [0] * (width - len(t)) for t in tables[g]])
    return ids, positions, slots, padded, qsl, seq_lens, sample_idx


def check_flatten(runner: ModelRunner, s: Scheduler, out, groups_of_layers) -> None:
    kv = s.kv_cache_manager
    num_groups = len(kv.groups)
    ids, positions, meta, sample_idx = runner.prepare(out)
    ref = reference_flatten(out.chunks, kv.block_ids, num_groups)
    r_ids, r_pos, r_slots, r_tables, r_qsl, r_lens, r_sample = ref
    assert ids.tolist() == r_ids and positions.tolist() == r_pos
    assert meta.query_start_loc == r_qsl and meta.seq_lens == r_lens
    assert list(sample_idx) == r_sample
    metas = [meta] if num_groups == 1 else [meta.layers[groups_of_layers[g]] for g in range(2)]
    for g, m in enumerate(metas):
        assert m.slot_mapping.dtype == torch.long and m.block_tables.dtype == torch.long
        assert m.slot_mapping.tolist() == r_slots[g]
        assert m.block_tables.tolist() == r_tables[g]


def flatten_step(s: Scheduler, runner: ModelRunner, rng: random.Random, groups_of_layers) -> None:
    out = s.schedule()
    if out.chunks:
        check_flatten(runner, s, out, groups_of_layers)
    sampled = {
        c.seq.seq_id: [rng.choice([EOS] + list(range(2, 32)))] for c in out.chunks if c.sample
    }
    for seq in s.update_from_output(out, sampled):
        if rng.random() < 0.5:  # the engine reports most ends, not necessarily all
            runner.free_sequence(seq.seq_id)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.one_of(add_op, step_op, step_op, abort_op),
        min_size=5,
        max_size=50,
    ),
    num_blocks=st.integers(12, 30),
    budget=st.integers(4, 40),
    window=st.sampled_from([None, 6]),
    max_states=st.sampled_from([2, 1000]),
)
def test_flat_batch_matches_the_plain_flattening(ops, num_blocks, budget, window, max_states):
    if window is None:
        groups = num_blocks
        layer_of_group = [0]
    else:  # layers 0, 2 full, 1, 3 windowed
        groups = [KVGroup(None, (0, 2), num_blocks), KVGroup(window, (1, 3), num_blocks)]
        layer_of_group = [0, 1]
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_waiting=12),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        groups,
        max_model_len=64,
    )
    runner = bare_runner(groups, 4, 4)
    runner._max_states = max_states  # 2: rows of unseen sequences are dropped and reused
    run_ops(s, ops, lambda rng: flatten_step(s, runner, rng, layer_of_group), lambda: None)
    rng = random.Random(0)
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        flatten_step(s, runner, rng, layer_of_group)


def test_flatten_without_versions_and_reused_rows():
    """Chunks built by hand (no table version) are always read afresh; a row handed to another
    sequence with a shorter table is padded with zeros again."""
    runner = bare_runner(64, 2, 4)
    params = SamplingParams(max_tokens=4)

    def chunk(sid, table, pos):
        return ScheduledChunk(Sequence(sid, [5] * (pos + 1), params), [5], pos, [table], True)

    def run(chunks):
        from kvserve.core.scheduler import SchedulerOutput

        _, positions, meta, _ = runner.prepare(SchedulerOutput(chunks, [], [], len(chunks)))
        return meta.block_tables.tolist(), meta.slot_mapping.tolist()

    assert run([chunk("a", [3, 4, 5], 9)]) == ([[3, 4, 5]], [5 * BS + 1])
    assert run([chunk("a", [3, 7, 5], 5)]) == ([[3, 7, 5]], [7 * BS + 1])  # changed in place
    runner.free_sequence("a")
    tables, slots = run([chunk("b", [9], 2), chunk("c", [8, 6], 4)])
    assert tables == [[9, 0], [8, 6]] and slots == [9 * BS + 2, 6 * BS]
    with pytest.raises(ValueError, match="past its sequence's block table"):
        run([chunk("d", [1], BS)])


# ---------------------------------------------------------------- KV fast path


def test_append_fast_path_matches_the_general_path():
    """The same random workloads with the fast path on and off: the same chunks, the same
    block tables and copies, the same free blocks, step by step."""
    for seed in range(40):
        rng = random.Random(seed)
        pair = []
        for fast in (True, False):
            s = Scheduler(
                SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=5, max_waiting=30),
                CacheConfig(block_size=BS, enable_prefix_caching=True),
                18,
                max_model_len=64,
            )
            s.kv_cache_manager._all_full = fast
            pair.append(s)
        for i in range(6):
            n = rng.randint(1, 3)
            prompt = BASES[i % 3][: rng.randint(1, 30)]
            for s in pair:
                for j in range(n):
                    s.add_sequence(
                        Sequence(
                            f"r{i}-{j}",
                            prompt,
                            SamplingParams(max_tokens=random.Random(i * 7 + j).randint(1, 20)),
                            eos_token_ids={EOS},
                            arrival_time=float(i),
                            fork_of=f"r{i}-0" if j else None,
                        )
                    )
        versions: dict[str, tuple] = {}
        for _ in range(200):
            outs = [s.schedule() for s in pair]
            a, b = outs
            assert [(c.seq.seq_id, c.token_ids, c.start_pos) for c in a.chunks] == [
                (c.seq.seq_id, c.token_ids, c.start_pos) for c in b.chunks
            ]
            assert [c.block_tables for c in a.chunks] == [c.block_tables for c in b.chunks]
            assert a.copy_blocks == b.copy_blocks and a.preempted_ids == b.preempted_ids
            for c in a.chunks:  # the same version: the same tables
                seen = versions.get(c.seq.seq_id)
                if seen is not None and seen[0] == c.table_version:
                    assert seen[1] == c.block_tables
                versions[c.seq.seq_id] = (c.table_version, [list(t) for t in c.block_tables])
            step_rng = random.Random(rng.random())
            sampled = {
                c.seq.seq_id: [step_rng.choice([EOS] + list(range(2, 40)))]
                for c in a.chunks
                if c.sample
            }
            for s, out in zip(pair, outs):
                s.update_from_output(out, sampled)
            assert pair[0].num_free_blocks == pair[1].num_free_blocks
            if not pair[0].has_unfinished_requests():
                break
        assert not pair[1].has_unfinished_requests()


# ---------------------------------------------------------------- sampling

V = 300


def reference_row(logits: torch.Tensor, row: SamplingRow):
    """One row by the sampler's documented rules: (token, logprob of it or None)."""
    p = row.params
    x = logits.clone().float()
    if len(row.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else row.eos_token_ids)
        for t in banned:
            x[t] = float("-inf")
    if p.repetition_penalty != 1.0:
        for t in set(row.prompt_token_ids + row.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        x[t] -= p.frequency_penalty * row.output_token_ids.count(t) + p.presence_penalty
    greedy = p.temperature < 1e-5
    if not greedy:
        x = x / p.temperature
    lp = x.log_softmax(-1)
    if greedy:
        tok = int(x.argmax())
    else:
        y = x.clone()
        if p.min_p > 0:
            probs = y.softmax(-1)
            y[probs < p.min_p * probs.max()] = float("-inf")
        s, order = y.sort()
        if 0 < p.top_k < V:
            s[s < s[V - p.top_k]] = float("-inf")
        if p.top_p < 1.0:
            drop = s.softmax(-1).cumsum(-1) <= 1 - p.top_p
            drop[-1] = False
            s[drop] = float("-inf")
        y = torch.empty_like(y).scatter_(0, order, s)
        q = torch.empty(V).exponential_(generator=row.generator)
        tok = int((y.softmax(-1) / q).argmax())
    return tok, (float(lp[tok]) if p.logprobs is not None else None)


def random_rows(rng: random.Random, n: int, seed: int, greedy_share: float):
    rows = []
    for i in range(n):
        greedy = rng.random() < greedy_share
        kw = dict(
            temperature=0.0 if greedy else rng.choice([1.0, 0.7, 1.3]),
            top_k=rng.choice([0, 0, 5, 40]),
            top_p=rng.choice([1.0, 1.0, 0.8]),
            min_p=rng.choice([0.0, 0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
            presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, 0.3]),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=rng.choice([[], [7]]),
            logprobs=rng.choice([None, None, 2]),
            max_tokens=10,
        )
        params = SamplingParams(**kw)
        outs = [rng.randrange(V) for _ in range(rng.randint(0, 5))]
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        rows.append(SamplingRow(params, [rng.randrange(V) for _ in range(4)], outs, gen, {3}))
    return rows


@pytest.mark.parametrize("greedy_share", [0.0, 0.3, 1.0])
def test_batched_sampler_matches_the_per_row_reference(greedy_share):
    for seed in range(6):
        rng = random.Random(seed)
        rows = random_rows(rng, 12, seed, greedy_share)
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3
        before = logits.clone()
        expect = [
            reference_row(
                logits[i],
                SamplingRow(
                    r.params,
                    r.prompt_token_ids,
                    r.output_token_ids,
                    torch.Generator().manual_seed(seed * 1000 + i),
                    r.eos_token_ids,
                ),
            )
            for i, r in enumerate(rows)
        ]
        got = Sampler()(logits, rows)
        assert torch.equal(logits, before), "the caller's logits were modified"
        assert got.token_ids == [t for t, _ in expect]
        for lp, (_, want) in zip(got.logprobs, expect):
            if want is None:
                assert lp is None
            else:
                assert lp.logprob == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_every_row_sampled_without_filters(temperature):
    """The branch that reads the logits without a copy (every row sampled, no filter)."""
    n = 9
    params = SamplingParams(temperature=temperature, max_tokens=4)
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    rows = [
        SamplingRow(params, [1], [], torch.Generator().manual_seed(50 + i), set()) for i in range(n)
    ]
    ref = [
        reference_row(
            logits[i], SamplingRow(params, [1], [], torch.Generator().manual_seed(50 + i), set())
        )[0]
        for i in range(n)
    ]
    assert Sampler()(logits, rows).token_ids == ref
    assert torch.equal(logits, before)


def test_greedy_fast_path_is_the_samplers_argmax():
    """Plain greedy chunks take one argmax over the batch (StepBatch.greedy): the same tokens
    as the sampler; a row with logprobs, a pending min_tokens or a draft turns it off."""
    from kvserve.core.scheduler import SchedulerOutput

    runner = bare_runner(64, 2, 8)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    seqs = [Sequence(f"s{i}", [1, 2, 3], plain, eos_token_ids={3}) for i in range(6)]

    def chunks():
        return [ScheduledChunk(s, [3], 2, [[i + 1]], True) for i, s in enumerate(seqs)]

    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    logits[2, 3] = 50.0  # eos is the argmax of row 2
    batch = runner.batch(SchedulerOutput(chunks(), [], [], 6))
    assert batch.greedy
    fast = runner._sample(chunks(), logits, None, greedy=True)
    slow = runner._sample(chunks(), logits, None, greedy=False)
    assert {k: [t.token_id for t in v] for k, v in fast.items()} == {
        k: [t.token_id for t in v] for k, v in slow.items()
    }
    assert fast["s2"][0].token_id == 3

    seqs[2] = Sequence(
        "m", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2), {3}
    )
    assert not runner.batch(SchedulerOutput(chunks(), [], [], 6)).greedy
    slow = runner._sample(chunks(), logits, None, greedy=False)
    assert slow["m"][0].token_id != 3  # eos banned until min_tokens
    seqs[2].append_output_token(9)
    seqs[2].append_output_token(9)
    assert runner.batch(SchedulerOutput(chunks(), [], [], 6)).greedy  # min_tokens reached
    seqs[4] = Sequence(
        "l", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, logprobs=1), {3}
    )
    assert not runner.batch(SchedulerOutput(chunks(), [], [], 6)).greedy
    drafted = chunks()
    drafted[0] = ScheduledChunk(seqs[0], [3, 4], 2, [[1]], True, [4])
    assert not runner.batch(SchedulerOutput(drafted, [], [], 7)).greedy


def test_field_orders_the_hot_paths_construct_by_position():
    """The scheduler's chunks and the output processor's snapshots are built once per sequence
    per step with positional fields (keywords cost twice as much): a field moved or inserted
    before these would shift the values silently."""
    from dataclasses import fields

    from kvserve.outputs import CompletionOutput, RequestOutput

    def names(cls):
        return [f.name for f in fields(cls)]

    assert names(ScheduledChunk) == [
        "seq", "token_ids", "start_pos", "block_tables", "sample", "draft_token_ids",
        "table_version", "placeholder",
    ]  # fmt: skip
    assert names(CompletionOutput) == [
        "index", "text", "token_ids", "delta_text", "delta_token_ids", "logprobs",
        "delta_logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
    ]  # fmt: skip
    assert names(RequestOutput) == [
        "request_id", "prompt_token_ids", "outputs", "finished", "num_cached_tokens", "metrics",
        "prompt", "error", "prompt_logprobs",
    ]  # fmt: skip
