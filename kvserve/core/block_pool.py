"""The pool of KV blocks: refcounts, the free queue, and the prefix-hash map.

A block is a fixed run of `block_size` token slots in every layer's KV tensor; this module
only tracks ids. A block is either referenced (ref_cnt > 0, held by the block tables of
ref_cnt sequences) or free (ref_cnt == 0, in the free queue). A free block may still carry
the hash of the full block of tokens it holds: a later sequence whose prefix hashes the same
takes it back out of the queue instead of recomputing it. The free queue is an LRU: freed
hashed blocks join its tail, allocation evicts from its head, and freed blocks without a hash
(they hold nothing reusable) join the head so they are reused first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable


class PrivateSalt(str):
    """A cache salt only the server sets (the KV handover's namespace), never a client: it is
    hashed under a tag of its own, so no client's cache_salt string, whatever its value, names
    the same blocks. A plain str with the same characters is an ordinary (client) salt."""

    __slots__ = ()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...], cache_salt: str | None = None
) -> bytes:
    """SHA-256 over (parent block hash, this block's token ids, cache salt).

    Chaining the parent makes the hash name the whole prefix up to this block, and SHA-256
    is collision resistant, so equal hashes mean equal prefixes for all practical purposes
    (unlike Python's hash(), which one user could collide with another's prefix). The salt
    keeps users who do not share a salt from ever sharing a block; a PrivateSalt is tagged
    apart from every client salt.
    """
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else b"\0" * 32)
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if cache_salt is not None:
        h.update((b"\2" if isinstance(cache_salt, PrivateSalt) else b"\1") + cache_salt.encode())
    return h.digest()


class Block:
    """One block id, how many block tables hold it, and the hash of its tokens once full."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """`num_blocks` blocks, the LRU free queue, and hash -> cached block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, hashed (evictable) ones included."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue (evicting their hashes), ref_cnt = 1."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self.free_queue.popitem(last=False)[0]]
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each block, taking free (cached) ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given; unreferenced ones become free."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        """Record that `block` holds the full block of tokens named by `block_hash`."""
        # Two sequences may have computed the same prefix side by side: the first block stays
        # the cached copy, the other stays unhashed and is reused first once freed.
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
