"""BlockPool: refcounts, the LRU free queue, prefix hashes."""

import pytest

from kvserve.core.block_pool import BlockPool, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_alloc_and_free_refcounts_no_leak():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [0, 1, 2] and ids(b) == [3, 4]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert pool.num_free_blocks == 3
    pool.touch(a[:2])  # a second owner
    pool.free_blocks(a)
    assert [x.ref_cnt for x in a] == [1, 1, 0]
    assert pool.num_free_blocks == 4
    pool.free_blocks(a[:2])
    pool.free_blocks(b)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    assert sorted(pool.free_queue) == list(range(8))


def test_over_allocation_and_double_free_are_refused():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="asked for 1 blocks, only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks[:1])


def test_usage():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    assert pool.usage == 0.25


def test_hash_chains_parent_tokens_and_salt():
    h0 = hash_block_tokens(None, [1, 2, 3])
    assert len(h0) == 32 and h0 == hash_block_tokens(None, [1, 2, 3])
    assert h0 != hash_block_tokens(None, [1, 2, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7])
    other_parent = hash_block_tokens(None, [9, 9, 9])
    assert h1 != hash_block_tokens(other_parent, [5, 6, 7])  # same tokens, other prefix
    assert h1 != hash_block_tokens(None, [5, 6, 7])
    assert hash_block_tokens(None, [1, 2, 3], "alice") != h0
    assert hash_block_tokens(None, [1, 2, 3], "alice") != hash_block_tokens(None, [1, 2, 3], "bob")
    assert hash_block_tokens(None, [1, 2, 3], "") != h0
    assert hash_block_tokens(None, [2**40, 0]) != hash_block_tokens(None, [0, 2**40])


def test_freed_hashed_blocks_stay_cached_until_evicted_lru():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    for blk, h in zip(blocks, hashes):
        pool.cache_block(blk, h)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert all(pool.get_cached_block(h) is blk for blk, h in zip(blocks, hashes))
    # Least recently freed goes first, and its hash goes with it.
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(hashes[2]) is None and blocks[2].block_hash is None
    assert ids(pool.get_new_blocks(2)) == [0, 3]
    assert pool.get_cached_block(hashes[1]) is blocks[1]


def test_unhashed_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[0], hash_block_tokens(None, [0]))
    pool.free_blocks(blocks)  # 0 hashed -> tail; 1, 2 unhashed -> head
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert ids(pool.get_new_blocks(1)) == [0]


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    blk = pool.get_new_blocks(1)[0]
    h = hash_block_tokens(None, [42])
    pool.cache_block(blk, h)
    pool.free_blocks([blk])
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(h)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    assert blk.block_id not in ids(pool.get_new_blocks(2))


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([b, a])
    assert ids(pool.get_new_blocks(1)) == [b.block_id]


def test_caching_disabled_never_records_hashes():
    pool = BlockPool(2, enable_caching=False)
    blk = pool.get_new_blocks(1)[0]
    pool.cache_block(blk, hash_block_tokens(None, [1]))
    assert blk.block_hash is None and not pool.cached
