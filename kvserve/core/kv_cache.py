"""KVCacheManager: each request's block table on top of the BlockPool.

Holds, per request, the list of blocks that hold its KV (token i lives in slot
`table[i // block_size] * block_size + i % block_size`), the hashes of its full blocks, and
how many of its leading blocks are already registered in the prefix cache.

Blocks reach a table three ways: fresh from the pool, as a prefix-cache hit
(`get_computed_blocks`), or shared with an n > 1 sibling (`get_fork_blocks`). A shared block
may be referenced by several tables; before a request writes into a block whose refcount is
above 1, `allocate_slots` gives it a private copy (copy-on-write) and records (src, dst) so
the runner copies the block in every layer before the forward.
"""
from __future__ import annotations

from kvserve.core.block_pool import Block, BlockPool, hash_block_tokens
from kvserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first `num_blocks` full blocks (extended lazily)."""
        hashes = self.req_to_hashes.setdefault(req.request_id, [])
        tokens, bs = req.all_token_ids, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], req.cache_salt))
        return hashes

    # ---- where a new request's KV can come from ------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """The longest run of leading full blocks already in the prefix cache, and its tokens.

        Stops one token short of the request's tokens, so the last one is always recomputed
        and produces logits. Takes no reference: pass the blocks to `allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        hits: list[Block] = []
        for h in self._block_hashes(req, (req.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_fork_blocks(self, parent: Request, child: Request) -> tuple[list[Block], int]:
        """The parent's blocks that cover the child's first len(prompt) - 1 tokens.

        The parent must have computed at least that many tokens. The last of these blocks may
        be partial: the child's first write into it triggers copy-on-write.
        """
        num_tokens = child.num_prompt_tokens - 1
        return self.req_to_blocks[parent.request_id][:cdiv(num_tokens, self.block_size)], num_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, copy_blocks: list[tuple[int, int]],
                       new_computed_blocks: list[Block] = (), num_new_computed_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` tokens after the request's computed ones.

        `new_computed_blocks` (with `num_new_computed_tokens` tokens in them) are blocks of a
        prefix hit or a fork that the request starts referencing before its own tokens. Shared
        blocks the new tokens would be written into are replaced by private copies, each
        appended to `copy_blocks` as (src, dst). Returns False, changing nothing, when the pool
        has too few free blocks.
        """
        bs = self.block_size
        blocks = self.req_to_blocks.get(req.request_id, [])
        table = blocks + list(new_computed_blocks)
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        shared = [i for i in range(num_computed // bs, len(table))
                  if table[i].ref_cnt + (i >= len(blocks)) > 1]
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, bs) - len(table))
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # leave the free queue
        if num_new_blocks + len(shared) > self.pool.num_free_blocks - num_revived:
            return False

        self.pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(req.request_id, blocks)
        blocks.extend(new_computed_blocks)
        for i in shared:
            old, new = blocks[i], self.pool.get_new_blocks(1)[0]
            copy_blocks.append((old.block_id, new.block_id))
            self.pool.free_blocks([old])
            blocks[i] = new
        blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        return True

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register in the prefix cache the request's blocks that are now full of computed tokens.

        Call it once the tokens' KV is really in the cache (after the forward), never at
        schedule time: a block must not be found by hash before its content is written.
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(req.request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Drop the request's references, tail block first (so tail blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.req_to_hashes.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
