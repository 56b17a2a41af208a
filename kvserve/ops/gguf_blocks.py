"""GGUF block packing for the C GEMV (kvserve/ops/csrc/gguf_gemv.c): the file's blocks decoded into
integers and scales without changing a value, and interleaved 16 rows at a time in one of the
packed kinds (pack_gguf_parts / pack_gguf_rows); back to float32 with unpack_gguf_rows.

    kind  from            per block of 32 weights and row                         bytes / 16 rows
    4     Q4_0, Q4_1      fp16 d, fp16 m, 4-bit q (0..15)            w = d q + m               320
    8     Q8_0, Q5_0,     fp16 d, 8-bit q (stored q + 128)           w = d q                   544
          IQ4_NL
    14    Q4_K            u8 sc, u8 mn, 4-bit q (0..15)              w = D sc q - DMIN mn      288
    15    Q5_K            u8 sc, u8 mn, 5-bit q (4 + 1 bits)         w = D sc q - DMIN mn      352
    18                    s8 s0 (weights 0..15), s8 s1 (16..31),
                          u8 mn, 8-bit q (stored q + 128)            w = D s_half q - DMIN mn  560
    19    Q5_1            fp32 d0 = d1 = d, fp32 m, 8-bit q          w = d q + m               704
    26    Q6_K            s8 s0, s1, 6-bit u = q + 32 (4 + 2 bits)   w = D s_half q            416
    13    Q3_K            s8 s0, s1, 3-bit u = q + 4 (2 + 1 bits)    w = D s_half q            224
    24    IQ4_XS          s8 s, 4-bit index i (0..15)                w = D s value[i]          272
    10    Q2_K            u8 sc0, sc1, mn0, mn1 (per 16 weights),
                          4-bit q (0..3)                             w = D sc_half q
                                                                         - DMIN mn_half       320
    32    F32             float32 weights                            w                        2048
    33    F16             fp16 weights                               w                        1024
    34    BF16            bf16 weights                               w                        1024

Kinds 14, 15, 18, 26, 13, 24 and 10 keep the file's fp16 super-block scales D, DMIN (per 256
weights) once: before a group's blocks, 64 bytes per super-block (16 rows' D, then their DMIN;
kinds 26, 13 and 24: D, 32 bytes), so a decode step streams the weights without a gap.

Every value is the file's: Q5_0's q - 16 is a signed 8-bit integer with the block's fp16 d; a
K-quant's sub-block scale (fp16 super-block d times a 4..8-bit sub-scale) and min are exact
float32 products (the kernels form them from D and the sub-scale), and d_half q is exact in
float32 (at most 24 significant bits), so the one rounding of d q + m is gguf's own
(gguf.quants.dequantize). Formats without an offset store mn = 0 (m = -0.0), which leaves every
d q (signed zeros included) unchanged.
IQ4_NL and IQ4_XS store indices into a table of 16 signed 8-bit values: the value is q (IQ4_NL:
kind 8 holds the values; IQ4_XS: kind 24 keeps the 4-bit indices, and its 6-bit sub-scale - 32 is
s). Q5_1 (an fp16 min beside its fp16 d per block, no
super-block) takes kind 19. Q2_K (a scale and a min per 16 weights) takes kind 10. Float weights
(F32, F16, BF16 tensors, which the loader hands over as float32: every F16 and BF16 value is a
float32) pack through pack_float_parts: a weight all of whose parts were F16 (BF16) in the file as
its 16-bit values again (kind 33, 34: the kernels widen each exactly), any other as kind 32.

`w` is any object with the GGUF tensor's `raw` blocks ([rows, bytes_per_row] uint8), `qtype` and
`shape` (kvserve.model.quant.BlockTensor). Imports numpy and torch only (GGUF's type codes:
kvserve.ops.gguf_types).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.ops.gguf_types import GGMLQuantizationType as Q

GROUP = 32  # weights per packed block (and per GGUF Q4_0 / Q4_1 / Q5_0 / Q8_0 block)
SUPER = 256  # weights per GGUF K-quant super-block

# Bytes of one block of 32 weights of 16 rows, per kind (gguf_packed_block_bytes in gguf_gemv.h).
BLOCK_BYTES = {
    4: 320,
    8: 544,
    14: 288,
    15: 352,
    18: 560,
    19: 704,
    26: 416,
    13: 224,
    24: 272,
    10: 320,
    32: 2048,
    33: 1024,
    34: 1024,
}
SUPER_KINDS = (14, 15, 18, 26, 13, 24, 10)  # kinds with super-block scales before a group's blocks
NO_MIN_KINDS = (26, 13, 24)  # super-block kinds with D only (no DMIN) and no m
SUPER_BYTES = 64  # per super-block of a group: 16 fp16 D, 16 fp16 DMIN (NO_MIN_KINDS: D only)


def super_bytes(kind: int) -> int:
    """Bytes of a group's super-block scales per 8 blocks (gguf_super_bytes in gguf_gemv.h)."""
    return 32 if kind in NO_MIN_KINDS else SUPER_BYTES if kind in SUPER_KINDS else 0


def supers_bytes(kind: int, nb: int) -> int:
    """Bytes of a group's super-block scales, where its blocks start (gguf_group_blocks)."""
    return nb // 8 * super_bytes(kind)


def group_bytes(kind: int, nb: int) -> int:
    """Bytes of one group of 16 rows and nb blocks (gguf_group_bytes in gguf_gemv.h)."""
    return supers_bytes(kind, nb) + nb * BLOCK_BYTES[kind]


def packed_kind(qtype) -> int | None:
    """The kind a GGUF type packs into, or None for a type the C kernels do not run."""
    return {
        Q.Q4_0: 4,
        Q.Q4_1: 4,
        Q.Q8_0: 8,
        Q.Q5_0: 8,
        Q.IQ4_NL: 8,
        Q.Q4_K: 14,
        Q.Q5_K: 15,
        Q.Q6_K: 26,
        Q.Q3_K: 13,
        Q.Q5_1: 19,
        Q.IQ4_XS: 24,
        Q.Q2_K: 10,
    }.get(qtype)


FLOAT_KIND = 32  # float weights (pack_float_parts)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)  # GGUF types whose float32 values kind 32 holds exactly
HALF_KINDS = {33: torch.float16, 34: torch.bfloat16}  # float weights in 16 bits
_HALF_KIND_OF = {Q.F16: 33, Q.BF16: 34}


# The 16 values an IQ4_NL / IQ4_XS index stands for (ggml's kvalues_iq4nl).
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16
)


def packable_types() -> tuple:
    """The GGUF types pack_gguf_rows takes."""
    return tuple(t for t in Q if packed_kind(t) is not None)


@dataclass
class _Decoded:
    """One tensor's blocks of 32, decoded: `ints` [N, nb, 16 | 32] uint8 as the kind stores them
    (4-bit kinds: byte t = q[t] | q[t + 16] << 4; 8-bit kinds: q + 128, or with `signed` the
    file's int8 q, to which packing adds 128), `scales` one [N, nb] array per scale in the kind's
    order (kinds 4 / 8: fp16 d, m; 14: u8 sc, mn; 18: s8 s0, s1, u8 mn; 19: fp32 d0, d1, m;
    26 / 13: s8 s0, s1; 24: s8 s) and, for the super-block kinds, `supers` the fp16 D and DMIN
    [N, nb / 8] (NO_MIN_KINDS: D only). All may be views of the file's
    blocks (strided over blocks, each block's bytes contiguous): packing copies them once,
    straight into place."""

    kind: int
    scales: list
    ints: np.ndarray
    signed: bool = False
    supers: list | None = None


def _blocks(w, bytes_per_block):
    N, K = w.shape
    return np.ascontiguousarray(w.raw).reshape(N, -1, bytes_per_block)


def _half(b, at):
    """fp16 at byte `at` of each block -> float32 [..., 1]."""
    return b[..., at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles_of(q):
    """q [N, nb, 32] in 0..15 -> the 4-bit kinds' bytes q[t] | q[t + 16] << 4, t = 0..15."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _per_32(x, N):
    """[N, nsuper, 8 sub-blocks, ...] -> [N, nb, ...]: super-block order is weight order."""
    return x.reshape(N, -1, *x.shape[3:])


def _halves(sc, N):
    """Scales [N, nsuper, 8, 2] (int8, one per 16 weights) of a kind-18 type without an offset
    -> [s0, s1, mn = 0]."""
    sc = _per_32(sc, N)
    return [sc[..., 0], sc[..., 1], np.zeros(sc.shape[:-1], np.uint8)]


def _k_scale_min(s):
    """The 12 packed bytes of Q4_K / Q5_K -> (sc, mn) [..., 8] 6-bit sub-block scales and mins."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode_q4_0_1(w, N) -> _Decoded:
    """Q4_0, Q4_1: the file's bytes as they are: q[t] | q[t + 16] << 4."""
    qt = w.qtype
    b = _blocks(w, 18 if qt == Q.Q4_0 else 20)
    half = b.view(np.uint16).view(np.float16)  # blocks of 9 or 10 fp16s: d (m) first
    d = half[..., 0]
    m = half[..., 1] if qt == Q.Q4_1 else (d.astype(np.float32) * -8).astype(np.float16)
    return _Decoded(4, [d, m], b[..., -16:])


def _decode_q8_0(w, N) -> _Decoded:
    b = _blocks(w, 34)
    return _Decoded(8, [b.view(np.uint16).view(np.float16)[..., 0]], b[..., 2:], signed=True)


def _decode_q5_0(w, N) -> _Decoded:
    """fp16 d, 32 high bits, 16 bytes of low nibbles; w = d (q - 16)."""
    b = _blocks(w, 22)
    qh = b[..., 2:6].copy().view(np.uint32)  # [N, nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, nb, 32]
    low = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1)
    q = (low | (high << 4)).astype(np.int16) - 16
    return _Decoded(8, [b.view(np.uint16).view(np.float16)[..., 0]], (q + 128).astype(np.uint8))


def _decode_q5_1(w, N) -> _Decoded:
    """fp16 d, fp16 m, 32 high bits, low nibbles; w = d q + m."""
    b = _blocks(w, 24)
    qh = b[..., 4:8].copy().view(np.uint32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = np.concatenate([b[..., 8:] & 15, b[..., 8:] >> 4], axis=-1) | (high << 4)
    d, m = _half(b, 0)[..., 0], _half(b, 2)[..., 0]
    return _Decoded(19, [d, d, m], (q + 128).astype(np.uint8))


def _decode_iq4_nl(w, N) -> _Decoded:
    """fp16 d, 16 bytes of table indices; w = d value[q]."""
    b = _blocks(w, 18)
    idx = np.concatenate([b[..., 2:] & 15, b[..., 2:] >> 4], axis=-1)
    return _Decoded(
        8,
        [b.view(np.uint16).view(np.float16)[..., 0]],
        (IQ4_VALUES[idx] + 128).astype(np.uint8),
    )


def _decode_iq4_xs(w, N) -> _Decoded:
    """Super-block: fp16 d, 6-bit sub-scales, table indices; kind 24 keeps the indices as nibbles
    (the kernels look their values up) and ls - 32 as s."""
    b = _blocks(w, 136)
    lo = (b[..., 4:8].reshape(N, -1, 4, 1) >> np.array([0, 4], np.uint8)) & 15  # [N, ns, 4, 2]
    hi = b[..., 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))  # [N, ns, 8]
    ls = lo.reshape(N, -1, 8).astype(np.int16) | ((hi & 3).astype(np.int16) << 4)
    s = _per_32((ls - 32).astype(np.int8), N)  # [N, nb]: d0 = d1 = D (ls - 32)
    qs = b[..., 8:].reshape(N, -1, 8, 16)
    idx = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, ns, 8, 32]
    return _Decoded(24, [s], _nibbles_of(_per_32(idx, N)), supers=_supers(b, 0, None)[:1])


def _supers(b, d_at, dmin_at):
    """The fp16 super-block scales D and DMIN (at those byte offsets of each super-block; None:
    0) -> two [N, nsuper] fp16 arrays."""
    d = b[..., d_at : d_at + 2].copy().view(np.float16)[..., 0]
    if dmin_at is None:
        return [d, np.zeros(d.shape, np.float16)]
    return [d, b[..., dmin_at : dmin_at + 2].copy().view(np.float16)[..., 0]]


def _decode_q4_5_k(w, N) -> _Decoded:
    """Q4_K, Q5_K: w = (D sc) q - (DMIN mn) per sub-block of 32."""
    qt = w.qtype
    b = _blocks(w, 144 if qt == Q.Q4_K else 176)
    sc, mn = _k_scale_min(b[..., 4:16])  # [N, ns, 8] 6-bit
    sc, mn = _per_32(sc, N), _per_32(mn, N)
    qs = b[..., -128:].reshape(N, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (qs & 15).reshape(N, -1, 8, 32)  # sub-block 2j + h
    if qt == Q.Q4_K:
        return _Decoded(14, [sc, mn], _nibbles_of(_per_32(q, N)), supers=_supers(b, 0, 2))
    qh = (b[..., 16:48].reshape(N, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    return _Decoded(15, [sc, mn], _k5_ints(_per_32(q, N), _per_32(qh, N)), supers=_supers(b, 0, 2))


def _k5_ints(low, top):
    """The low 4 bits [N, nb, 32] and the top bits [N, nb, 32] of Q5_K's q -> kind 15's 20 bytes
    per block and row: _nibbles_of(low), then 4 bytes whose bit c is the top bit of weight 4c + t
    (c < 4) or 16 + 4(c - 4) + t (t: the byte)."""
    top = top.reshape(*top.shape[:-1], 8, 4)  # [.., c, t]: weight 4c + t is chunk c's
    tops = np.bitwise_or.reduce(top << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=-2)
    return np.concatenate([_nibbles_of(low), tops.astype(np.uint8)], axis=-1)


def _decode_q6_k(w, N) -> _Decoded:
    """w = (d sc_16) (u - 32), u 6 bits, a scale per 16 weights: kind 26, the file's 6 bits
    (4 low bits as the 4-bit kinds keep nibbles, then the top 2 bits of 4 weights a byte)."""
    b = _blocks(w, 210)
    ql = b[..., 0:128].reshape(N, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = b[..., 128:192].reshape(N, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    u = _per_32((ql & 15).reshape(N, -1, 8, 32) | ((qh & 3).reshape(N, -1, 8, 32) << 4), N)
    sc = b[..., 192:208].view(np.int8).reshape(N, -1, 8, 2)  # a scale per 16 weights
    d = _supers(b, 208, None)[:1]
    return _Decoded(26, _halves(sc, N)[:2], _k6_ints(u), supers=d)


def _k6_ints(u):
    """u [N, nb, 32] in 0..63 -> kind 26's 24 bytes per block and row: the low 4 bits as
    _nibbles_of, then for each half h and t < 4 the top 2 bits of weights 16 h + 4 c + t at bits
    2c, 2c + 1 (c < 4)."""
    top = (u >> 4).reshape(*u.shape[:-1], 2, 4, 4)  # [.., h, c, t]
    shift = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    tops = np.bitwise_or.reduce(top << shift, axis=-2).reshape(*u.shape[:-1], 8)
    return np.concatenate([_nibbles_of(u & 15), tops.astype(np.uint8)], axis=-1)


def _decode_q3_k(w, N) -> _Decoded:
    """w = (d (sc_16 - 32)) q, q = 2 low bits - 4 (hmask bit clear): kind 13, the file's 3 bits
    u = q + 4 (the 2 low bits as kind 26 keeps its top 2, then the high bit as kind 15 keeps its
    top bit)."""
    b = _blocks(w, 110)
    s = b[..., 96:108]
    low = (s[..., 0:8].reshape(N, -1, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
    high = (s[..., 8:12].reshape(N, -1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    sc = (low.reshape(N, -1, 16) | (high.reshape(N, -1, 16) << 4)).astype(np.int8) - 32
    sc = sc.reshape(N, -1, 8, 2)
    ql = (
        b[..., 32:96].reshape(N, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    ) & 3
    hm = (b[..., 0:32].reshape(N, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    u = _per_32(ql.reshape(N, -1, 8, 32) | (hm.reshape(N, -1, 8, 32) << 2), N)  # q + 4
    return _Decoded(13, _halves(sc, N)[:2], _k3_ints(u), supers=_supers(b, 108, None)[:1])


def _k3_ints(u):
    """u [N, nb, 32] in 0..7 -> kind 13's 12 bytes per block and row: for each half h and t < 4
    the low 2 bits of weights 16 h + 4 c + t at bits 2c, 2c + 1 (c < 4), then 4 bytes whose bit c
    is bit 2 of weight 4c + t (t: the byte)."""
    low = (u & 3).reshape(*u.shape[:-1], 2, 4, 4)  # [.., h, c, t]
    shift = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    lows = np.bitwise_or.reduce(low << shift, axis=-2).reshape(*u.shape[:-1], 8)
    top = (u >> 2).reshape(*u.shape[:-1], 8, 4)  # [.., c, t]
    tops = np.bitwise_or.reduce(top << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=-2)
    return np.concatenate([lows.astype(np.uint8), tops.astype(np.uint8)], axis=-1)


def _decode_q2_k(w, N) -> _Decoded:
    """w = (D sc_16) q - (DMIN mn_16), q 2 bits, a 4-bit scale and min per 16 weights."""
    b = _blocks(w, 84)
    s = b[..., 0:16].reshape(N, -1, 8, 2)  # [N, ns, sub-block, half]
    sc, mn = _per_32(s & 15, N), _per_32(s >> 4, N)  # [N, nb, 2]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (b[..., 16:80].reshape(N, -1, 2, 1, 32) >> shifts) & 3  # [N, ns, 128s, shift, 32]
    return _Decoded(
        10,
        [sc[..., 0], sc[..., 1], mn[..., 0], mn[..., 1]],
        _nibbles_of(_per_32(q.reshape(N, -1, 8, 32), N)),
        supers=_supers(b, 80, 82),
    )


# GGUF type -> its decoder (w, N rows) -> _Decoded; the same types as packed_kind's.
_DECODERS = {
    Q.Q4_0: _decode_q4_0_1,
    Q.Q4_1: _decode_q4_0_1,
    Q.Q8_0: _decode_q8_0,
    Q.Q5_0: _decode_q5_0,
    Q.Q5_1: _decode_q5_1,
    Q.IQ4_NL: _decode_iq4_nl,
    Q.IQ4_XS: _decode_iq4_xs,
    Q.Q4_K: _decode_q4_5_k,
    Q.Q5_K: _decode_q4_5_k,
    Q.Q6_K: _decode_q6_k,
    Q.Q3_K: _decode_q3_k,
    Q.Q2_K: _decode_q2_k,
}


def _decode(w) -> _Decoded:
    N, K = w.shape
    decode = _DECODERS.get(w.qtype)
    if decode is None:
        raise AssertionError(f"packed_kind and _decode disagree on {w.qtype}")
    return decode(w, N)


def _check(w):
    N, K = w.shape
    per = SUPER if w.qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.IQ4_XS, Q.Q2_K) else GROUP
    if K % per:
        raise ValueError(
            f"a {w.qtype.name} tensor needs rows of a multiple of {per} weights, "
            f"got shape {tuple(w.shape)}"
        )


def pack_gguf_parts(parts) -> tuple[torch.Tensor, int]:
    """Row blocks of one weight (fused shards: their rows one after the other), every part of a
    type that packs into the same kind (Q5_0 and Q8_0 may share kind 8) -> (uint8 tensor, kind)
    in the interleaved layout of kvserve/ops/csrc/gguf_gemv.h: per group of 16 rows and block of
    32 weights, the 16 rows' scales (each scale array in turn), then the integers, 4 weights of
    each row side by side in 64-byte chunks."""
    from kvserve.ops.gguf_repack import repack_parts  # C, the same bytes; None: not covered

    done = repack_parts(parts)
    return done if done is not None else pack_gguf_parts_numpy(parts)


def pack_gguf_parts_numpy(parts) -> tuple[torch.Tensor, int]:
    """pack_gguf_parts in numpy: every packed kind (the C repack covers the common types)."""
    for p in parts:
        if packed_kind(p.qtype) is None:
            raise ValueError(
                f"GGUF type {getattr(p.qtype, 'name', p.qtype)} has no packed kind: the C "
                f"kernels run {[t.name for t in packable_types()]}; load it dense (dequantized)"
            )
    if len({packed_kind(p.qtype) for p in parts}) != 1:
        raise ValueError(
            f"GGUF types {sorted({p.qtype.name for p in parts})} do not pack into one "
            "kind: keep such a weight dense"
        )
    for p in parts:
        _check(p)
    dec = [_decode(p) for p in parts]
    if any(d.ints.shape[0] % 16 for d in dec[:-1]):  # a part that does not end a group of 16 rows
        dec = [_joined(dec)]
    kind, nb = dec[0].kind, dec[0].ints.shape[1]
    G = sum(-(-d.ints.shape[0] // 16) for d in dec)
    packed = np.empty((G, group_bytes(kind, nb)), np.uint8)
    at = supers_bytes(kind, nb)
    blocks = packed[:, at:].reshape(G, nb, BLOCK_BYTES[kind])
    ns = nb // 8 if kind in SUPER_KINDS else 0
    supers = packed[:, :at].reshape(G, ns, super_bytes(kind))
    g = 0
    for d in dec:  # each part into its own groups of 16 rows
        n = d.ints.shape[0]
        full = n // 16
        if full:
            _place(
                blocks[g : g + full],
                [s[: 16 * full] for s in d.scales],
                d.ints[: 16 * full],
                d.signed,
            )
            if d.supers is not None:
                _place_scales(supers[g : g + full], [s[: 16 * full] for s in d.supers])
        if n % 16:  # its last group, padded with q = 0, scales 0
            pad = 16 - n % 16
            scales = [_pad_rows(s[16 * full :], pad) for s in d.scales]
            fill = 0 if kind in (4, 14, 15, 26, 13, 24, 10) or d.signed else 128
            ints = np.concatenate(
                [d.ints[16 * full :], np.full((pad, *d.ints.shape[1:]), fill, np.uint8)]
            )
            _place(blocks[g + full : g + full + 1], scales, ints, d.signed)
            if d.supers is not None:
                _place_scales(
                    supers[g + full : g + full + 1],
                    [_pad_rows(s[16 * full :], pad) for s in d.supers],
                )
        g += -(-n // 16)
    return torch.from_numpy(packed).reshape(-1), kind


def _pad_rows(x, pad):
    """x [n, ...] with `pad` rows of zeros after it."""
    return np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])


def _joined(dec) -> _Decoded:
    """Parts decoded one by one -> one part of all their rows (the integers as the kind stores
    them)."""
    ints = [d.ints ^ np.uint8(0x80) if d.signed else d.ints for d in dec]
    supers = None
    if dec[0].supers is not None:
        supers = [np.concatenate(s) for s in zip(*(d.supers for d in dec))]
    return _Decoded(
        dec[0].kind,
        [np.concatenate(s) for s in zip(*(d.scales for d in dec))],
        np.concatenate(ints),
        supers=supers,
    )


def _place(out, scales, ints, signed) -> None:
    """Whole groups of 16 rows into their packed blocks out [G, nb, bytes], one strided copy per
    array: each scale array as [G, nb, 16 rows], then the integers as [G, nb, chunk, 16 rows] of 4
    weights each (4 bytes moved as one uint32), signed 8-bit ones offset by 128 on the way."""
    at = _place_scales(out, scales)
    G, nb = out.shape[:2]
    chunks = ints.shape[-1] // 4  # 4 (4-bit kinds), 5 (kind 15), 6 (kind 26), 3 (kind 13) or 8
    assert at + chunks * 64 == out.shape[-1]
    dst = out[..., at:].view(np.uint32).reshape(G, nb, chunks, 16)  # splits the last axis: a view
    src = ints.view(np.uint32).reshape(G, 16, nb, chunks).transpose(0, 2, 3, 1)
    if signed:
        np.bitwise_xor(src, np.uint32(0x80808080), out=dst)
    else:
        dst[...] = src


def _place_scales(out, scales) -> int:
    """Each [16 G, n] scale array as [G, n, 16 rows] at the start of out [G, n, bytes], one after
    the other; returns the bytes they take."""
    G, n = out.shape[:2]
    at = 0
    for s in scales:
        size = 16 * s.dtype.itemsize
        out[..., at : at + size].view(s.dtype)[...] = s.reshape(G, 16, n).swapaxes(1, 2)
        at += size
    return at


def pack_float_parts(parts) -> tuple[torch.Tensor, int]:
    """Float weights [n, K] (fused shards: their rows one after the other; F32, F16 or BF16
    tensors as float32, which holds each of their values exactly) -> (uint8 tensor, kind): per
    group of 16 rows and block of 32 weights, weight j of the 16 rows as 16 values at byte
    16 j times the value's bytes (rows past the end zero). Kind 33 (fp16) or 34 (bf16) where every
    part is a file's F16 (BF16) tensor (its `gguf_qtype`, as kvserve.model.gguf_loader hands it
    over) whose values the 16 bits hold exactly, else kind 32 (float32)."""
    w = torch.cat([torch.as_tensor(p).float() for p in parts])
    qtypes = {getattr(p, "gguf_qtype", None) for p in parts}
    kind = _HALF_KIND_OF.get(qtypes.pop()) if len(qtypes) == 1 else None
    N, K = w.shape
    if K % GROUP:
        raise ValueError(
            f"float weights pack in blocks of {GROUP} columns, got shape {tuple(w.shape)}: "
            "keep such a weight dense"
        )
    if kind is not None:
        half = w.to(HALF_KINDS[kind])
        if torch.equal(half.float().view(torch.int32), w.view(torch.int32)):  # every bit kept
            w = half
        else:
            kind = None
    G = -(-N // 16)
    w = torch.cat([w, w.new_zeros(G * 16 - N, K)]) if G * 16 != N else w
    packed = w.reshape(G, 16, K // GROUP, GROUP).permute(0, 2, 3, 1).contiguous()
    return packed.view(torch.uint8).reshape(-1), kind or FLOAT_KIND


def pack_gguf_rows(w) -> tuple[torch.Tensor, int]:
    """One GGUF tensor's blocks -> (uint8 tensor, kind): pack_gguf_parts of a single part."""
    return pack_gguf_parts([w])


def unpack_gguf_rows(packed: torch.Tensor, kind: int, shape: tuple[int, int]) -> torch.Tensor:
    """The float32 [N, K] weight held by pack_gguf_parts' layout: d q + m per weight, each product
    exact and rounded once at the add, exactly as the file's dequantization gives it."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"packed kind {kind} is not one of {sorted(BLOCK_BYTES)}")
    N, K = shape
    nb, G = K // GROUP, -(-N // 16)
    flat = packed.numpy().reshape(G, group_bytes(kind, nb))
    a = flat[:, supers_bytes(kind, nb) :].reshape(G, nb, BLOCK_BYTES[kind])
    types = {
        4: [np.float16] * 2,
        8: [np.float16],
        14: [np.uint8] * 2,
        15: [np.uint8] * 2,
        18: [np.int8, np.int8, np.uint8],
        19: [np.float32] * 3,
        26: [np.int8, np.int8],
        13: [np.int8, np.int8],
        24: [np.int8],
        10: [np.uint8] * 4,
        32: [],
        33: [],
        34: [],
    }[kind]
    if kind == FLOAT_KIND:
        w = a.view(np.float32).reshape(G, nb, 32, 16).transpose(0, 3, 1, 2)
        return torch.from_numpy(np.ascontiguousarray(w.reshape(G * 16, K)[:N]))
    if kind in HALF_KINDS:
        w = torch.from_numpy(a.copy()).view(HALF_KINDS[kind]).float()  # [G, nb, 32 * 16]
        w = w.reshape(G, nb, 32, 16).permute(0, 3, 1, 2).reshape(G * 16, K)
        return w[:N].contiguous()
    s, at = [], 0
    for t in types:
        size = 16 * np.dtype(t).itemsize
        v = a[..., at : at + size].copy().view(t).astype(np.float32).transpose(0, 2, 1)
        s.append(v[..., None])  # [G, row, nb, 1]
        at += size
    if kind in NO_MIN_KINDS:  # d = D s (exact), no m
        sup = flat[:, : supers_bytes(kind, nb)].reshape(G, nb // 8, 32).copy()
        sup = sup.view(np.float16).astype(np.float32)  # [G, ns, 16]
        d_ = np.repeat(sup.transpose(0, 2, 1), 8, -1)[..., None]
        s = [d_ * x for x in s]
    elif kind in SUPER_KINDS:  # d = D s (exact), m = -(DMIN mn)
        sup = flat[:, : supers_bytes(kind, nb)].reshape(G, nb // 8, 2, 32).copy()
        sup = sup.view(np.float16).astype(np.float32)  # [G, ns, 2, 16]
        d_, dmin = (np.repeat(sup[:, :, i].transpose(0, 2, 1), 8, -1)[..., None] for i in (0, 1))
        if kind == 10:  # a min per half: m0, m1
            s = [d_ * x for x in s[:2]] + [-(dmin * x) for x in s[2:]]
        else:
            s = [d_ * x for x in s[:-1]] + [-(dmin * s[-1])]
    ints = a[..., at:]
    if kind == 26:
        byts = ints.reshape(G, nb, 6, 16, 4).transpose(0, 3, 1, 2, 4)  # [G, row, nb, chunk, t]
        nib = byts[..., :4, :].reshape(G, 16, nb, 16)
        low = np.concatenate([nib & 15, nib >> 4], axis=-1)  # j = 0..15, 16..31
        top = byts[..., 4:, :].reshape(G, 16, nb, 2, 1, 4)  # [.., h, 1, t]
        top = (top >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [.., h, c, t]
        q = (low | (top.reshape(G, 16, nb, 32) << 4)).astype(np.float32) - 32
        d = np.concatenate([np.repeat(s[0], 16, -1), np.repeat(s[1], 16, -1)], axis=-1)
        w = q * d
    elif kind == 13:
        byts = ints.reshape(G, nb, 3, 16, 4).transpose(0, 3, 1, 2, 4)  # [G, row, nb, chunk, t]
        low = byts[..., :2, :].reshape(G, 16, nb, 2, 1, 4)  # [.., h, 1, t]
        low = (low >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [.., h, c, t]
        top = (byts[..., 2:, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [.., c, t]
        u = low.reshape(G, 16, nb, 32) | (top.reshape(G, 16, nb, 32) << 2)
        d = np.concatenate([np.repeat(s[0], 16, -1), np.repeat(s[1], 16, -1)], axis=-1)
        w = (u.astype(np.float32) - 4) * d
    elif kind == 24:
        qs = ints.reshape(G, nb, 4, 16, 4).transpose(0, 3, 1, 2, 4).reshape(G, 16, nb, 16)
        idx = np.concatenate([qs & 15, qs >> 4], axis=-1)  # j = 0..15, 16..31
        w = IQ4_VALUES[idx].astype(np.float32) * s[0]
    elif kind == 15:
        byts = ints.reshape(G, nb, 5, 16, 4).transpose(0, 3, 1, 2, 4)  # [G, row, nb, chunk, t]
        nib = byts[..., :4, :].reshape(G, 16, nb, 16)
        low = np.concatenate([nib & 15, nib >> 4], axis=-1)  # j = 0..15, 16..31
        top = byts[..., 4:, :]  # [.., 1, t]: bit c is weight 4c + t's (chunk c)
        top = (top >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [.., c, t]
        q = (low | (top.reshape(G, 16, nb, 32) << 4)).astype(np.float32)
        w = q * s[0] + s[1]
    elif kind in (4, 14, 10):
        qs = ints.reshape(G, nb, 4, 16, 4).transpose(0, 3, 1, 2, 4).reshape(G, 16, nb, 16)
        if kind == 10:  # each half with its own d and m
            lo, hi = (qs & 15).astype(np.float32), (qs >> 4).astype(np.float32)
            w = np.concatenate([lo * s[0] + s[2], hi * s[1] + s[3]], axis=-1)
        else:
            q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)  # j = 0..15, 16..31
            w = q * s[0] + s[1]
    else:
        q = (ints.reshape(G, nb, 8, 16, 4) ^ 0x80).view(np.int8).astype(np.float32)
        q = q.transpose(0, 3, 1, 2, 4).reshape(G, 16, nb, 32)  # [G, row, nb, j]
        if kind == 8:
            w = q * s[0]
        else:
            d = np.concatenate([np.repeat(s[0], 16, -1), np.repeat(s[1], 16, -1)], axis=-1)
            w = q * d + s[2]
    return torch.from_numpy(np.ascontiguousarray(w.reshape(G * 16, K)[:N]))
