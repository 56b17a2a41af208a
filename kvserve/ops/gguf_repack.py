"""GGUF blocks into the C kernels' packed layout in C (csrc/gguf_repack.c): the bytes
kvserve.ops.gguf_blocks.pack_gguf_parts gives, for the types most files hold (Q4_0 and Q4_1 as
kind 4, Q8_0 as kind 8, Q4_K as kind 14, Q5_K as kind 15, Q6_K as kind 26), in one pass over the
file's bytes on every core. Loading a model repacks each weight once; numpy's many strided passes
over every tensor made that most of the start-up time.

repack_parts answers None for what it does not cover (another type, parts of different kinds, a
shape pack_gguf_parts refuses, no C kernels): the numpy path then packs, or raises its error.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvserve.ops import cpu_kernels
from kvserve.ops.gguf_blocks import group_bytes
from kvserve.ops.gguf_types import GGML_QUANT_SIZES
from kvserve.ops.gguf_types import GGMLQuantizationType as Q

# The GGUF types repacked here and the kind each packs into (gguf_blocks.packed_kind's).
KINDS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8, Q.Q4_K: 14, Q.Q5_K: 15, Q.Q6_K: 26}


def _raw(p) -> np.ndarray | None:
    """Part p's blocks as a C-contiguous uint8 array of rows x bytes per row, or None."""
    N, K = p.shape
    per, size = GGML_QUANT_SIZES[p.qtype]
    raw = np.asarray(p.raw)
    if raw.dtype != np.uint8 or raw.size != N * (K // per) * size:
        return None
    return np.ascontiguousarray(raw)


def repack_parts(parts, isa: str | None = None) -> tuple[torch.Tensor, int] | None:
    """Row blocks of one weight (fused shards, rows one after the other; BlockTensor-like: `raw`,
    `qtype`, `shape`) -> (uint8 tensor, kind), byte for byte pack_gguf_parts' result, or None
    when this packer does not take them. isa: the kernel build to run it in (tests; the bytes are
    the same in every build)."""
    if not parts or any(p.qtype not in KINDS or len(p.shape) != 2 for p in parts):
        return None
    kinds = {KINDS[p.qtype] for p in parts}
    K = parts[0].shape[1]
    if len(kinds) != 1 or any(p.shape[1] != K or p.shape[0] <= 0 for p in parts):
        return None
    kind = kinds.pop()
    if K <= 0 or any(K % GGML_QUANT_SIZES[p.qtype][0] for p in parts):
        return None  # pack_gguf_parts names the shape it needs
    lib = cpu_kernels.library(isa)
    if lib is None:
        return None
    raws = [_raw(p) for p in parts]
    if any(r is None for r in raws):
        return None
    rows = [p.shape[0] for p in parts]
    # Each part starts a group of 16 rows, unless a part before the last ends inside one: then
    # all parts are joined row after row (pack_gguf_parts' rule).
    if any(n % 16 for n in rows[:-1]):
        starts = np.cumsum([0, *rows[:-1]])
        groups = -(-sum(rows) // 16)
    else:
        starts = 16 * np.cumsum([0, *(-(-n // 16) for n in rows[:-1])])
        groups = sum(-(-n // 16) for n in rows)
    out = torch.empty(groups * group_bytes(kind, K // 32), dtype=torch.uint8)
    n = len(parts)
    src = (ctypes.c_void_p * n)(*(r.ctypes.data for r in raws))
    i64 = ctypes.c_int64 * n
    rc = lib.gguf_repack(
        n,
        src,
        i64(*(int(p.qtype) for p in parts)),
        i64(*rows),
        i64(*(int(s) for s in starts)),
        K,
        kind,
        out.data_ptr(),
        groups,
        torch.get_num_threads(),
    )
    if rc != 0:  # 1: a NaN Q4_0 scale, whose -8 d numpy rounds with its payload
        return None
    return out, kind
