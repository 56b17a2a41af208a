"""Prefill/decode disaggregation: a prompt's KV blocks handed from one engine to another.

The prefill instance computes a prompt (a one-token request); its full blocks stay in its prefix
cache. `export_blocks` reads the run of leading full blocks the cache holds for the prompt's
tokens, every layer's K and V, into one payload. The decode instance's `adopt_blocks` writes
them into free blocks of its own pool and registers them in its prefix cache under the same
chained hashes, unreferenced (evictable like any cached block). The request then sent to the
decode instance finds them as a prefix-cache hit and computes only the rest of its prompt.

The handover only fills a cache: a block that is missing, evicted or refused is recomputed, so
outputs never depend on it. Both engines must share the model, block size and KV format
(checked; a mismatch is a ValueError). Models with one KV group (one attention window), no
tensor or pipeline parallelism.

Payload: b"KVX1", the header's length (4 bytes, little-endian), the JSON header (token_ids,
block_size, num_blocks, layers, dtype, block_shape), then per layer K then V of the blocks in
order, raw.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from kvserve.core.block_pool import hash_block_tokens

MAGIC = b"KVX1"


def _check_engine(core) -> None:
    if not core.config.cache.enable_prefix_caching:
        raise ValueError("KV handover goes through the prefix cache: this engine runs with it off")
    if len(core.kv_groups) != 1 or core.kv_groups[0].window is not None or core.ranks is not None:
        raise ValueError("KV handover needs a model with one attention window on one process")


def _pool(core):
    return core.scheduler.kv_cache_manager.pools[0]


def _hashes(token_ids: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    out, parent = [], None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def export_blocks(core, token_ids: list[int]) -> bytes:
    """The payload of the leading full blocks of `token_ids` this engine's prefix cache holds."""
    _check_engine(core)
    bs = core.config.cache.block_size
    pool = _pool(core)
    blocks = []
    for h in _hashes(token_ids, bs, len(token_ids) // bs):
        b = pool.get_cached_block(h)
        if b is None:
            break
        blocks.append(b.block_id)
    caches = core.runner.kv_caches
    ids = torch.tensor(blocks, dtype=torch.long)
    parts = [t[ids].contiguous() for k, v in caches for t in (k, v)]
    block_shape = list(caches[0][0].shape[1:])
    header = {"token_ids": list(token_ids[:len(blocks) * bs]), "block_size": bs, "num_blocks": len(blocks),
              "layers": len(caches), "dtype": str(caches[0][0].dtype).removeprefix("torch."),
              "block_shape": block_shape}
    head = json.dumps(header).encode()
    return b"".join([MAGIC, len(head).to_bytes(4, "little"), head] + [p.numpy().tobytes() for p in parts])


def adopt_blocks(core, payload: bytes) -> int:
    """Write the payload's blocks into this engine's pool as cached prefix blocks; returns the
    tokens of the prefix the cache now holds for the payload's tokens (ValueError: not a
    payload of this model and KV format)."""
    _check_engine(core)
    if len(payload) < 8 or payload[:4] != MAGIC:
        raise ValueError("not a KV payload (it starts with b'KVX1')")
    n = int.from_bytes(payload[4:8], "little")
    try:
        header = json.loads(payload[8:8 + n])
        token_ids, bs, count = list(header["token_ids"]), int(header["block_size"]), int(header["num_blocks"])
        layers, dtype, block_shape = int(header["layers"]), header["dtype"], list(header["block_shape"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the KV payload's header is not valid ({e})") from None
    caches = core.runner.kv_caches
    own = {"block_size": core.config.cache.block_size, "layers": len(caches),
           "dtype": str(caches[0][0].dtype).removeprefix("torch."), "block_shape": list(caches[0][0].shape[1:])}
    theirs = {"block_size": bs, "layers": layers, "dtype": dtype, "block_shape": block_shape}
    if own != theirs:
        raise ValueError(f"the KV payload is for another model or KV format: {theirs}, this engine has {own}")
    if not 0 <= count or len(token_ids) != count * bs:
        raise ValueError("the KV payload's token_ids do not fill its blocks")
    vocab = core.arch.vocab_size
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
        raise ValueError(f"the KV payload's token_ids must be token ids in [0, {vocab})")
    np_dtype = caches[0][0].numpy().dtype
    per_block = int(np.prod(block_shape)) * np_dtype.itemsize
    if len(payload) != 8 + n + 2 * layers * count * per_block:
        raise ValueError(f"the KV payload has {len(payload) - 8 - n} bytes of KV, {2 * layers * count * per_block} "
                         f"expected for {count} blocks")
    data = np.frombuffer(payload, dtype=np_dtype, offset=8 + n).reshape(2 * layers, count, *block_shape)
    pool = _pool(core)
    held = 0
    for i, h in enumerate(_hashes(token_ids, bs, count)):
        if pool.get_cached_block(h) is not None:
            held += 1
            continue
        if pool.num_free_blocks == 0:
            break
        block = pool.get_new_blocks(1)[0]
        for layer, (k, v) in enumerate(caches):
            k[block.block_id] = torch.from_numpy(data[2 * layer, i].copy())
            v[block.block_id] = torch.from_numpy(data[2 * layer + 1, i].copy())
        pool.cache_block(block, h)
        pool.free_blocks([block])          # unreferenced: cached and evictable, as a finished request's
        held += 1
    return held * bs
