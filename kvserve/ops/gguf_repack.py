"""GGUF blocks into the C kernels' packed layout in C (csrc/gguf_repack.c): the bytes
kvserve.ops.gguf_blocks.pack_gguf_parts gives, for every block type it packs (Q4_0 and Q4_1 as
kind 4, Q8_0, Q5_0 and IQ4_NL as kind 8, Q5_1 as kind 19, Q4_K as kind 14, Q5_K as kind 15, Q6_K
as kind 26, Q3_K as kind 13, IQ4_XS as kind 24, Q2_K as kind 10), in one pass over the file's
bytes on every core. Loading a model repacks each weight once; numpy's many strided passes
over every tensor made that most of the start-up time.

repack_parts answers None for what it does not cover (another type, parts of different kinds, a
shape pack_gguf_parts refuses, no C kernels): the numpy path then packs, or raises its error.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import torch

from kvserve.ops import cpu_kernels
from kvserve.ops.gguf_blocks import group_bytes
from kvserve.ops.gguf_types import GGML_QUANT_SIZES
from kvserve.ops.gguf_types import GGMLQuantizationType as Q

# The GGUF types repacked here and the kind each packs into (gguf_blocks.packed_kind's).
KINDS = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q8_0: 8,
    Q.Q5_0: 8,
    Q.IQ4_NL: 8,
    Q.Q5_1: 19,
    Q.Q4_K: 14,
    Q.Q5_K: 15,
    Q.Q6_K: 26,
    Q.Q3_K: 13,
    Q.IQ4_XS: 24,
    Q.Q2_K: 10,
}

_threads: int | None = None  # set by threads(): the repack's threads while a model loads


@contextlib.contextmanager
def threads(n: int):
    """Repack on n threads inside the block, whatever torch's count is there: the loader runs
    torch on one thread while it hands weights over, but the repack (and the first touch of the
    packed buffers, most of a load's time) splits over every core it is given."""
    global _threads
    saved, _threads = _threads, max(1, int(n))
    try:
        yield
    finally:
        _threads = saved


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
        _threads or torch.get_num_threads(),
    )
    if rc != 0:  # 1: a NaN Q4_0 or Q5_1 scale, whose payload numpy handles its own way
        return None
    return out, kind
