"""KVCacheManager: each sequence's block tables on top of one BlockPool per KV group.

A KV group (config.KVGroup) is the set of layers that attend with the same window: a model with
full attention everywhere has one group; Gemma 3 has a full group and a window-512 group. Each
group has its own pool and block ids, and each sequence one table per group. Token i lives in
slot `table[i // block_size] * block_size + i % block_size` of its group's layers.

Sliding windows: a query at position p reads keys j with p - j < W only, and later queries read
no older keys, so once a step's first query is at p, every block of a window-W group before
`first_needed_block(p)` is dead. `allocate_slots` returns those blocks to the pool (keeping their
prefix hash: they stay findable until evicted) and leaves None in the table, so positions still
index tables by p // block_size (`block_ids` writes NULL_BLOCK there). The position p is the first
query of the chunk being scheduled, never a later one: speculative rollback only takes back draft
tokens of the chunk (after the first one), so a later chunk starts at p + 1 or later and needs
nothing freed. A decoding sequence holds at most ceil(W / B) + 1 blocks of a window group; a chunk
of n tokens at most ceil((W + n - 2) / B) + 1 (config.blocks_held).

Blocks reach a table three ways: fresh from the pool, as a prefix-cache hit
(`get_computed_blocks`), or shared with an n > 1 sibling (`get_fork_blocks`). A shared block
may be referenced by several tables; before a sequence writes into a block whose refcount is
above 1, `allocate_slots` gives it a private copy (copy-on-write) and records (group, src, dst)
so the runner copies the block in the group's layers before the forward.

Prefix hits: every group registers its full blocks under the same chain hash. A hit of k blocks
needs the full groups' blocks 0..k-1 and, in a window group, the blocks from
first_needed_block(k * B) to k - 1 (those a query at k * B reads); the hit is cut back to the
longest k for which every group still holds what it needs.
"""

from __future__ import annotations

import hashlib
import itertools

from kvserve.config import KVGroup, cdiv, first_needed_block
from kvserve.core.block_pool import Block, BlockPool, hash_block_tokens
from kvserve.core.sequence import Sequence


def lora_root(lora_key: str | None) -> bytes | None:
    """The parent hash of a sequence's first block: None for the base model, else a hash of its
    LoRA adapter's key (tagged apart from every block hash's input)."""
    if lora_key is None:
        return None
    return hashlib.sha256(b"kvserve-lora\0" + lora_key.encode()).digest()


NULL_BLOCK = 0  # what block_ids() names for a freed (out-of-window) table entry; never read

# Per group, the blocks of a table (None where a window group freed one).
Tables = list[list["Block | None"]]

__all__ = ["KVCacheManager", "NULL_BLOCK", "cdiv"]

# Table versions, unique in the process (across managers too): a runner that keeps a copy of a
# table knows it is current while the version it copied is the table's.
_versions = itertools.count(1)


class KVCacheManager:
    def __init__(
        self, groups: int | list[KVGroup], block_size: int = 16, enable_caching: bool = True
    ) -> None:
        """`groups`: the KV groups with their pool sizes, or a block count for one full-attention
        group (every layer at the same block ids)."""
        if isinstance(groups, int):
            groups = [KVGroup(None, (), groups)]
        self.groups = list(groups)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pools = [BlockPool(g.num_blocks, enable_caching) for g in self.groups]
        self.tables: dict[str, Tables] = {}  # sequence id -> one table per group
        self.num_dropped: dict[
            str, list[int]
        ] = {}  # sequence id -> per group, leading None entries
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # sequence id -> its tables as block ids (table_ids), kept up to date by appends and
        # dropped on any other change; and the version of its tables, new on every change
        self._ids: dict[str, list[list[int]]] = {}
        self._versions: dict[str, int] = {}
        self._all_full = all(g.window is None for g in self.groups)
        # Usage weighs a group's blocks by its layers (memory); an unlabelled group counts as one.
        self._weights = [max(1, len(g.layers)) for g in self.groups]

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def num_total_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def usage(self) -> float:
        """Referenced KV memory / all KV memory (a group's blocks weighted by its layers)."""
        used = sum(
            w * (p.num_blocks - p.num_free_blocks) for w, p in zip(self._weights, self.pools)
        )
        return used / sum(w * p.num_blocks for w, p in zip(self._weights, self.pools))

    def block_ids(self, seq_id: str) -> list[list[int]]:
        """Per group, the sequence's table as block ids (NULL_BLOCK where a window freed one)."""
        tables = self.tables.get(seq_id)
        if tables is None:
            return [[] for _ in self.groups]
        return [[NULL_BLOCK if b is None else b.block_id for b in t] for t in tables]

    def table_ids(self, seq_id: str) -> tuple[list[list[int]], int | None]:
        """Per group, the sequence's table as block ids, and its version: the lists are the
        manager's own, current until its next allocation or free (read them, do not keep them),
        and the version changes whenever the table does."""
        ids = self._ids.get(seq_id)
        if ids is None:
            ids = self.block_ids(seq_id)
            if seq_id in self.tables:
                self._ids[seq_id] = ids
        return ids, self._versions.get(seq_id)

    def _changed(self, rid: str) -> None:
        """The sequence's table changed other than by appends: new version, ids rebuilt."""
        self._ids.pop(rid, None)
        self._versions[rid] = next(_versions)

    def num_held_blocks(self, seq_id: str) -> list[int]:
        """Per group, the blocks the sequence's table really holds (freed entries not counted)."""
        tables = self.tables.get(seq_id)
        if tables is None:
            return [0] * len(self.groups)
        return [len(t) - d for t, d in zip(tables, self.num_dropped[seq_id])]

    def _block_hashes(self, req: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the sequence's first `num_blocks` full blocks (extended lazily)."""
        hashes = self.req_to_hashes.setdefault(req.seq_id, [])
        tokens, bs = req.all_token_ids, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            # Under a LoRA adapter the same tokens have other KV: the first block's parent is a
            # root of the adapter's own, so no block is shared with the base or another adapter.
            parent = hashes[-1] if hashes else lora_root(req.lora_key)
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], req.cache_salt))
        return hashes

    # ---- where a new sequence's KV can come from ------------------------------------------
    def get_computed_blocks(self, req: Sequence) -> tuple[Tables, int]:
        """The longest run of leading full blocks every group can serve from the prefix cache,
        per group (None before a window group's first needed block), and its tokens.

        Stops one token short of the sequence's tokens, so the last one is always recomputed
        and produces logits. Takes no reference: pass the blocks to `allocate_slots`.
        """
        if not self.enable_caching:
            return [[] for _ in self.groups], 0
        hashes = self._block_hashes(req, (req.num_tokens - 1) // self.block_size)
        found = [[pool.get_cached_block(h) for h in hashes] for pool in self.pools]
        k = len(hashes)
        while True:  # cut back until every group holds what a query at k * B needs (a fixed point)
            cut = min(self._longest_hit(f, g.window, k) for f, g in zip(found, self.groups))
            if cut == k:
                break
            k = cut
        bs = self.block_size
        hits = [
            [None] * first_needed_block(k * bs, g.window, bs)
            + f[first_needed_block(k * bs, g.window, bs) : k]
            for f, g in zip(found, self.groups)
        ]
        return hits, k * bs

    def _longest_hit(self, found: list[Block | None], window: int | None, k: int) -> int:
        """The largest j <= k whose blocks first_needed_block(j * B)..j-1 are all found."""
        if window is None:
            return next((i for i in range(k) if found[i] is None), k)
        runs, run = [0], 0  # runs[j]: found blocks in a row ending at block j - 1
        for b in found[:k]:
            run = run + 1 if b is not None else 0
            runs.append(run)
        bs = self.block_size
        return next(
            (j for j in range(k, 0, -1) if runs[j] >= j - first_needed_block(j * bs, window, bs)), 0
        )

    def get_fork_blocks(self, parent: Sequence, child: Sequence) -> tuple[Tables, int] | None:
        """The parent's blocks that the child's first len(prompt) - 1 tokens need, per group, or
        None when a window group of the parent has already freed one of them (the child then runs
        on its own). The parent must have computed at least that many tokens. The last of these
        blocks may be partial: the child's first write into it triggers copy-on-write.
        """
        num_tokens, bs = child.num_prompt_tokens - 1, self.block_size
        end = cdiv(num_tokens, bs)
        shared = []
        for table, g in zip(self.tables[parent.seq_id], self.groups):
            first = first_needed_block(num_tokens, g.window, bs)
            if any(b is None for b in table[first:end]):
                return None
            shared.append([None] * first + table[first:end])
        return shared, num_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Sequence,
        num_new_tokens: int,
        copy_blocks: list[tuple[int, int, int]],
        new_computed_blocks: Tables = (),
        num_new_computed_tokens: int = 0,
    ) -> bool:
        """Make room in every group for `num_new_tokens` tokens after the sequence's computed ones.

        `new_computed_blocks` (per group, with `num_new_computed_tokens` tokens in them) are
        blocks of a prefix hit or a fork that the sequence starts referencing before its own
        tokens. Shared blocks the new tokens would be written into are replaced by private
        copies, each appended to `copy_blocks` as (group, src, dst). Returns False when some
        group's pool has too few free blocks; the only change then is that blocks no query can
        read any more (before a window group's first needed block) went back to their pool.
        """
        bs = self.block_size
        rid = req.seq_id
        old = self.tables.get(rid)
        if (
            old is not None
            and self._all_full
            and not new_computed_blocks
            and not num_new_computed_tokens
        ):
            done = self._append_slots(rid, old, req.num_computed_tokens, num_new_tokens)
            if done is not None:
                return done
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        if old is not None:
            self._free_dead_blocks(rid, num_computed)
            self._changed(rid)
        plans = []
        for g, pool in enumerate(self.pools):
            blocks = old[g] if old is not None else []
            new = list(new_computed_blocks[g]) if new_computed_blocks else []
            table = blocks + new
            shared = [
                i
                for i in range(num_computed // bs, len(table))
                if table[i] is not None and table[i].ref_cnt + (i >= len(blocks)) > 1
            ]
            num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, bs) - len(table))
            num_revived = sum(
                1 for b in new if b is not None and b.ref_cnt == 0
            )  # leave the free queue
            if num_new_blocks + len(shared) > pool.num_free_blocks - num_revived:
                return False
            plans.append((new, shared, num_new_blocks))

        if old is None:
            old = self.tables[rid] = [[] for _ in self.groups]
            self.num_dropped[rid] = [0] * len(self.groups)
        dropped = self.num_dropped[rid]
        for g, (pool, (new, shared, num_new_blocks)) in enumerate(zip(self.pools, plans)):
            blocks = old[g]
            if not blocks:  # a fresh table: its leading None entries are already dropped
                dropped[g] = next((i for i, b in enumerate(new) if b is not None), len(new))
            pool.touch(b for b in new if b is not None)
            blocks.extend(new)
            for i in shared:
                src, dst = blocks[i], pool.get_new_blocks(1)[0]
                copy_blocks.append((g, src.block_id, dst.block_id))
                pool.free_blocks([src])
                blocks[i] = dst
            blocks.extend(pool.get_new_blocks(num_new_blocks))
        self._changed(rid)
        return True

    def _append_slots(
        self, rid: str, tables: Tables, num_computed: int, num_new_tokens: int
    ) -> bool | None:
        """allocate_slots for a sequence whose tables exist, every group full attention and no
        block shared where it writes: new blocks only where it crosses into them. None: the
        general path decides (a copy-on-write, or too few free blocks)."""
        bs = self.block_size
        first, end = num_computed // bs, -(-(num_computed + num_new_tokens) // bs)
        need = 0
        for table, pool in zip(tables, self.pools):
            for i in range(first, len(table)):
                if table[i].ref_cnt > 1:
                    return None
            n = end - len(table)
            if n > 0:
                if n > pool.num_free_blocks:
                    return None
                need += 1
        if not need:
            return True
        ids = self._ids.get(rid)
        for g, (table, pool) in enumerate(zip(tables, self.pools)):
            n = end - len(table)
            if n > 0:
                new = pool.get_new_blocks(n)
                table.extend(new)
                if ids is not None:
                    ids[g].extend(b.block_id for b in new)
        self._versions[rid] = next(_versions)
        return True

    def _free_dead_blocks(self, rid: str, first_query_pos: int) -> None:
        """Return to their pools the window groups' blocks no query at or after
        `first_query_pos` can read, oldest first, leaving None in the table."""
        tables, dropped = self.tables[rid], self.num_dropped[rid]
        for g, (group, pool) in enumerate(zip(self.groups, self.pools)):
            if group.window is None:
                continue
            table = tables[g]
            end = min(
                first_needed_block(first_query_pos, group.window, self.block_size), len(table)
            )
            if end <= dropped[g]:
                continue
            pool.free_blocks(b for b in table[dropped[g] : end] if b is not None)
            table[dropped[g] : end] = [None] * (end - dropped[g])
            dropped[g] = end

    def cache_blocks(self, req: Sequence, num_computed_tokens: int) -> None:
        """Register in the prefix cache the sequence's blocks that are now full of computed tokens.

        Call it once the tokens' KV is really in the cache (after the forward), never at
        schedule time: a block must not be found by hash before its content is written.
        """
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(req.seq_id, 0)
        if num_computed_tokens // self.block_size <= start:  # no block filled since the last call
            return
        tables = self.tables.get(req.seq_id)
        if not tables:
            return
        num_full = min(num_computed_tokens // self.block_size, max(len(t) for t in tables))
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        for table, pool in zip(tables, self.pools):
            for i in range(start, min(num_full, len(table))):
                if table[i] is not None:
                    pool.cache_block(table[i], hashes[i])
        self.num_cached_blocks[req.seq_id] = num_full

    def free(self, req: Sequence) -> None:
        """Drop the sequence's references, tail block first (so tail blocks are evicted first)."""
        tables = self.tables.pop(req.seq_id, None)
        self._ids.pop(req.seq_id, None)
        self._versions.pop(req.seq_id, None)
        if tables is not None:
            for table, pool in zip(tables, self.pools):
                pool.free_blocks(b for b in reversed(table) if b is not None)
            del self.num_dropped[req.seq_id]
        self.req_to_hashes.pop(req.seq_id, None)
        self.num_cached_blocks.pop(req.seq_id, None)
