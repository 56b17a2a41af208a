"""KVCacheManager: block tables, prefix hits, fork with copy-on-write, free order."""

from kvserve.core.kv_cache import KVCacheManager
from kvserve.core.sequence import Sequence
from kvserve.sampling_params import SamplingParams

BS = 16


def make_req(rid, tokens, salt=None):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def compute(kv, req, copies=None):
    """Admit `req` with its prefix hits and compute its whole prompt (as a step would)."""
    hits, n_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(
        req, req.num_tokens - n_hit, copies if copies is not None else [], hits, n_hit
    )
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return n_hit


def test_table_grows_with_tokens():
    kv = KVCacheManager(10, BS)
    req = make_req("a", range(20))
    assert kv.allocate_slots(req, 20, [])
    assert kv.block_ids("a")[0] == [0, 1]
    req.num_computed_tokens = 20
    assert kv.allocate_slots(req, 12, [])  # 32 tokens: still 2 blocks
    assert kv.block_ids("a")[0] == [0, 1]
    req.num_computed_tokens = 32
    assert kv.allocate_slots(req, 1, [])
    assert kv.block_ids("a")[0] == [0, 1, 2]
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.block_ids("a")[0] == []


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(3, BS)
    a = make_req("a", range(40))
    assert kv.allocate_slots(a, 40, [])
    b = make_req("b", range(100, 120))
    assert not kv.allocate_slots(b, 20, [])
    assert kv.num_free_blocks == 0 and kv.block_ids("b")[0] == []


def test_hits_on_shared_prefixes_of_different_lengths():
    kv = KVCacheManager(32, BS)
    base = list(range(1000, 1064))  # 64 tokens = 4 full blocks
    assert compute(kv, make_req("a", base)) == 0
    for rid, shared, expect in [("b", 50, 48), ("c", 40, 32), ("d", 20, 16), ("e", 10, 0)]:
        req = make_req(rid, base[:shared] + [7] * 30)
        blocks, n = kv.get_computed_blocks(req)
        assert n == expect, rid
        assert [b.block_id for b in blocks[0]] == kv.block_ids("a")[0][: expect // BS]


def test_fully_cached_prompt_recomputes_at_least_the_last_token():
    kv = KVCacheManager(32, BS)
    prompt = list(range(48))
    compute(kv, make_req("a", prompt))
    _, n = kv.get_computed_blocks(make_req("b", prompt))
    assert n == 32  # not 48: the last block holds the last token
    compute(kv, make_req("c", prompt + [5]))
    _, n = kv.get_computed_blocks(make_req("d", prompt + [5]))
    assert n == 48  # 49 tokens: only the last one recomputed


def test_partial_last_block_is_never_shared():
    kv = KVCacheManager(32, BS)
    a = make_req("a", range(40))  # blocks: full, full, partial (8 tokens)
    compute(kv, a)
    assert [b.block_hash is not None for b in kv.tables["a"][0]] == [True, True, False]
    _, n = kv.get_computed_blocks(make_req("b", list(range(40)) + [99] * 20))
    assert n == 32


def test_blocks_are_hashed_only_after_cache_blocks():
    kv = KVCacheManager(8, BS)
    a = make_req("a", range(32))
    assert kv.allocate_slots(a, 32, [])
    a.num_computed_tokens = 32
    assert kv.get_computed_blocks(make_req("b", range(40)))[1] == 0
    kv.cache_blocks(a, 32)
    assert kv.get_computed_blocks(make_req("b", range(40)))[1] == 32


def test_hits_on_freed_blocks_take_them_out_of_the_free_queue():
    kv = KVCacheManager(4, BS)
    a = make_req("a", range(33))
    compute(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_req("b", range(33))
    assert compute(kv, b) == 32
    assert kv.block_ids("b")[0][:2] == [0, 1] and kv.num_free_blocks == 1
    assert [blk.ref_cnt for blk in kv.tables["b"][0]] == [1, 1, 1]


def test_allocation_counts_revived_hits_against_free_space():
    kv = KVCacheManager(3, BS)
    a = make_req("a", range(33))
    compute(kv, a)
    kv.free(a)  # 3 free blocks, 2 of them cached
    b = make_req("b", list(range(32)) + list(range(500, 540)))  # hits 2, needs 3 more
    hits, n = kv.get_computed_blocks(b)
    assert n == 32
    assert not kv.allocate_slots(b, b.num_tokens - n, [], hits, n)
    assert kv.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in hits[0])


def test_cache_salt_isolates_users():
    kv = KVCacheManager(16, BS)
    prompt = list(range(40))
    compute(kv, make_req("a", prompt, salt="alice"))
    assert kv.get_computed_blocks(make_req("b", prompt, salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_req("c", prompt))[1] == 0
    assert kv.get_computed_blocks(make_req("d", prompt, salt="alice"))[1] == 32


def test_caching_disabled():
    kv = KVCacheManager(16, BS, enable_caching=False)
    compute(kv, make_req("a", range(40)))
    assert kv.get_computed_blocks(make_req("b", range(40))) == ([[]], 0)


def test_free_releases_tail_blocks_for_eviction_first():
    kv = KVCacheManager(4, BS)
    a = make_req("a", range(48))
    compute(kv, make_req("x", range(100, 101)))  # occupy block 0 so a gets 1, 2, 3
    compute(kv, a)
    a_blocks = kv.block_ids("a")[0]
    assert a_blocks == [1, 2, 3]
    kv.free(a)
    # LRU head first: a's tail block, then the middle, then its first block.
    assert list(kv.pools[0].free_queue) == [3, 2, 1]


def test_fork_shares_prompt_blocks_and_copies_on_write():
    kv = KVCacheManager(16, BS)
    parent = make_req("p", range(20))  # block 0 full, block 1 partial (4 tokens)
    compute(kv, parent)
    child = make_req("c", range(20))
    shared, n = kv.get_fork_blocks(parent, child)
    assert n == 19 and [b.block_id for b in shared[0]] == kv.block_ids("p")[0]
    copies = []
    assert kv.allocate_slots(child, 1, copies, shared, n)
    p0, p1 = kv.tables["p"][0]
    c0, c1 = kv.tables["c"][0]
    assert c0 is p0 and p0.ref_cnt == 2  # full prompt block shared
    assert c1 is not p1 and p1.ref_cnt == 1 and c1.ref_cnt == 1
    assert copies == [(0, p1.block_id, c1.block_id)]
    kv.free(parent)
    assert p0.ref_cnt == 1 and p1.ref_cnt == 0
    kv.free(child)
    assert kv.num_free_blocks == 16


def test_fork_on_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(16, BS)
    parent = make_req("p", range(17))
    compute(kv, parent)
    child = make_req("c", range(17))
    shared, n = kv.get_fork_blocks(parent, child)
    assert n == 16 and len(shared[0]) == 1
    copies = []
    assert kv.allocate_slots(child, 1, copies, shared, n)
    assert copies == []
    assert kv.block_ids("c")[0][0] == kv.block_ids("p")[0][0]
    assert kv.block_ids("c")[0][1] != kv.block_ids("p")[0][1]


def test_parent_writing_first_copies_and_child_then_writes_in_place():
    kv = KVCacheManager(16, BS)
    parent = make_req("p", range(20))
    compute(kv, parent)
    parent.append_output_token(500)
    child = make_req("c", range(20))
    # Share all of the parent's blocks by refcount, as a fork does.
    kv.pools[0].touch(kv.tables["p"][0])
    kv.tables["c"] = [list(kv.tables["p"][0])]
    kv.num_dropped["c"] = [0]
    child.num_computed_tokens = 19
    copies = []
    assert kv.allocate_slots(parent, 1, copies)  # parent writes position 20 into shared block 1
    assert len(copies) == 1 and copies[0][1:] == (kv.block_ids("c")[0][1], kv.block_ids("p")[0][1])
    copies.clear()
    assert kv.allocate_slots(child, 1, copies)  # now the child is the sole owner
    assert copies == []
