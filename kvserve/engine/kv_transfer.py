"""Prefill/decode disaggregation: a prompt's KV blocks handed from one engine to another.

The prefill instance computes a prompt (a one-token request); its full blocks stay in its prefix
cache. `pin_blocks` (engine thread) takes a reference on the run of leading full blocks the
cache holds for the prompt's tokens, so they cannot be evicted or rewritten, and hands back
their ids; `read_part` (any thread) reads one layer's K or V of those blocks at a time, so the
payload (kv_payload.py's format) is streamed, never built whole; `release` (engine thread) drops
the references. The decode instance's `adopt_blocks` writes a received payload into free blocks
of its own pool and registers them in its prefix cache, unreferenced (evictable like any cached
block). The request then sent to the decode instance finds them as a prefix-cache hit and
computes only the rest of its prompt.

Namespaces: blocks are found and registered under the chained hashes of a cache salt (None: the
namespace every unsalted request shares; the server passes a PrivateSalt to keep handed-over
blocks apart from its users' prefixes). The payload's token ids are hashed here, never trusted.

The handover only fills a cache: a block that is missing, evicted or refused is recomputed. Both
engines must share the model, block size and KV format (checked; a mismatch is a ValueError).
Models with one KV group (one attention window), no tensor or pipeline parallelism.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from kvserve.core.block_pool import Block, BlockPool, PrivateSalt, hash_block_tokens
from kvserve.engine.kv_payload import KVFormat, encode_prefix


class ExportAborted(RuntimeError):
    """The engine dropped every block (a crash and reset) while an export was being read: the
    rest of the payload cannot be trusted and must not be sent."""


def _check_engine(core) -> None:
    if not core.config.cache.enable_prefix_caching:
        raise ValueError("KV handover goes through the prefix cache: this engine runs with it off")
    if len(core.kv_groups) != 1 or core.kv_groups[0].window is not None or core.ranks is not None:
        raise ValueError("KV handover needs a model with one attention window on one process")


def _pool(core) -> BlockPool:
    return core.scheduler.kv_cache_manager.pools[0]


def kv_format(core) -> KVFormat:
    """This engine's KV format (ValueError when it cannot take part in a handover)."""
    _check_engine(core)
    k = core.runner.kv_caches[0][0]
    return KVFormat(
        block_size=core.config.cache.block_size,
        layers=len(core.runner.kv_caches),
        dtype=str(k.dtype).removeprefix("torch."),
        itemsize=k.element_size(),
        block_shape=tuple(k.shape[1:]),
        vocab_size=core.arch.vocab_size,
        max_model_len=core.max_model_len,
    )


def new_namespace() -> PrivateSalt:
    """A fresh handover namespace: a cache salt no client's cache_salt can name (and, should it
    ever be passed on as a plain string, one no client could guess)."""
    return PrivateSalt(f"kv-handover-{secrets.token_hex(16)}")


def _hashes(
    token_ids: list[int], block_size: int, num_blocks: int, salt: str | None
) -> list[bytes]:
    out, parent = [], None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        out.append(parent)
    return out


@dataclass
class Pinned:
    """Blocks an export holds a reference on, with what is needed to read and release them."""

    core: object
    pool: BlockPool
    blocks: list[Block]
    prefix: bytes  # the payload's magic, header length and header
    caches: list
    size: int  # the payload's length in bytes

    @property
    def num_parts(self) -> int:
        return 2 * len(self.caches)


def pin_blocks(core, token_ids: list[int], salt: str | None) -> Pinned:
    """Engine thread: a reference on each leading full block of `token_ids` the prefix cache
    holds under `salt`. Release it with `release`, whatever happens to the export."""
    fmt = kv_format(core)
    pool = _pool(core)
    blocks = []
    for h in _hashes(token_ids, fmt.block_size, len(token_ids) // fmt.block_size, salt):
        b = pool.get_cached_block(h)
        if b is None:
            break
        blocks.append(b)
    pool.touch(blocks)
    prefix = encode_prefix(fmt, token_ids, len(blocks))
    size = len(prefix) + fmt.kv_bytes(len(blocks))
    return Pinned(core, pool, blocks, prefix, core.runner.kv_caches, size)


def read_part(pinned: Pinned, part: int) -> bytes:
    """Any thread: part `part` of the KV data (layer part // 2, K for even parts, V for odd) of
    the pinned blocks, raw. ExportAborted when the engine was reset meanwhile."""
    ids = torch.tensor([b.block_id for b in pinned.blocks], dtype=torch.long)
    tensor = pinned.caches[part // 2][part % 2]
    data = tensor[ids.to(tensor.device)].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    # read while still pinned: a reset (a new scheduler, every block free) voids the pins
    if _pool(pinned.core) is not pinned.pool:
        raise ExportAborted("the engine was reset during the KV export")
    return data


def release(pinned: Pinned) -> None:
    """Engine thread: drop the export's references (tail block first, as a finished request)."""
    pinned.pool.free_blocks(reversed(pinned.blocks))
    pinned.blocks = []


def adopt_blocks(
    core, token_ids: list[int], num_blocks: int, kv: bytearray, salt: str | None
) -> int:
    """Engine thread: write a checked payload's blocks (kv_payload.PayloadReader's header and KV
    bytes) into this engine's pool as cached prefix blocks under `salt`; returns the tokens of
    the prefix the cache now holds for the payload's tokens."""
    fmt = kv_format(core)
    caches = core.runner.kv_caches
    if len(kv) != fmt.kv_bytes(num_blocks) or len(token_ids) != num_blocks * fmt.block_size:
        raise ValueError("the KV payload does not match its header")
    pool = _pool(core)
    new: list[tuple[int, Block, bytes]] = []  # (payload block index, block, its hash)
    chain: list[Block] = []  # every block of the run, referenced until the end (no eviction)
    for i, h in enumerate(_hashes(token_ids, fmt.block_size, num_blocks, salt)):
        block = pool.get_cached_block(h)
        if block is not None:
            pool.touch([block])
        elif pool.num_free_blocks == 0:
            break
        else:
            block = pool.get_new_blocks(1)[0]
            new.append((i, block, h))
        chain.append(block)
    if new:
        k0 = caches[0][0]
        data = (
            torch.frombuffer(kv, dtype=torch.uint8)
            .view(k0.dtype)
            .view(2 * fmt.layers, num_blocks, *fmt.block_shape)
        )
        src = torch.tensor([i for i, _, _ in new], dtype=torch.long)
        dst = torch.tensor([b.block_id for _, b, _ in new], dtype=torch.long, device=k0.device)
        for part in range(2 * fmt.layers):
            caches[part // 2][part % 2][dst] = data[part, src].to(k0.device)
        for _, block, h in new:
            pool.cache_block(block, h)
    pool.free_blocks(reversed(chain))  # unreferenced: cached and evictable, tail first
    return len(chain) * fmt.block_size
