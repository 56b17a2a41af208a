"""kvserve's C kernels for the CPU, one build per instruction set, chosen at run time.

csrc/ holds the kernels: the GGUF block GEMV (a driver, gguf_gemv.c, and one kernel file per
instruction set: gguf_gemv_avx512vnni.c, gguf_gemv_avx2.c, gguf_gemv_neon.c and the portable C
reference gguf_gemv_portable.c), paged attention (paged_attention.c), the whole-model layer
stack (layer_stack.c) and the load-time repacking of GGUF blocks (gguf_repack.c). A library is
built per ISA from the common files plus that ISA's kernel,
every file compiled with that ISA's target flags (never -march=native), and loaded with ctypes.
No torch headers are involved (a torch C++ extension takes a minute to compile on 2 cores; this
takes a few seconds). Libraries are cached under $KVSERVE_CACHE_DIR (default ~/.cache/kvserve)
in files named by the hash of the sources, flags and compiler.

The ISA is the best one the CPU reports (`host_isas()`);
KVSERVE_ISA=avx512|avxvnni|avx2|neon|portable forces one (tests and benchmarks run every build
the host can execute). Every build computes
the same bits (see csrc/gguf_gemv.h): the ISA changes speed, never results.
Without a compiler, when the build or load fails, or with KVSERVE_NO_C_KERNELS=1, `available()`
is False and callers use their torch paths. Without OpenMP (Apple clang) the kernels build
single-threaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kvserve.ops import gguf_blocks

log = logging.getLogger("kvserve")

_CSRC = Path(__file__).parent / "csrc"
_COMMON = ("gguf_gemv.c", "paged_attention.c", "layer_stack.c", "gguf_repack.c")
# Values never depend on the ISA: no fused multiply-add contraction, no reassociation.
_BASE_FLAGS = [
    "-O3",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
]
ISA_FLAGS = {
    "avx512vnni": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512vnni",
        "-mavx2",
        "-mfma",
        "-mf16c",
    ],
    "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": ["-march=armv8.2-a+dotprod"],
    "portable": [],
}
ISAS = tuple(ISA_FLAGS)  # best first
_ALIASES = {
    "avx512": "avx512vnni",
    "avx512_vnni": "avx512vnni",
    "avx_vnni": "avxvnni",
    "avx-vnni": "avxvnni",
    "arm": "neon",
    "c": "portable",
}
MAX_GROUP = 16  # query heads per KV head the attention kernel handles (MAX_GROUP in its source)


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux (/proc/cpuinfo) or macOS (sysctl) report them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if sys.platform == "darwin":
        names = [
            "machdep.cpu.features",
            "machdep.cpu.leaf7_features",
            "hw.optional.arm.FEAT_DotProd",
        ]
        flags: set[str] = set()
        for name in names:
            res = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True)
            if res.returncode == 0:
                value = res.stdout.strip()
                flags |= (
                    {"asimddp"}
                    if name.endswith("DotProd") and value == "1"
                    else set(value.lower().split())
                )
        return {f.replace(".", "_") for f in flags}
    return set()


def host_isas() -> list[str]:
    """The ISA builds this CPU can execute, best first (portable always last). AVX-VNNI counts
    only where the C compiler knows -mavxvnni (GCC 11+, clang 12+): elsewhere its CPUs take the
    AVX2 build."""
    return list(_host_isas(platform.machine().lower()))


@functools.cache
def _host_isas(machine: str) -> tuple[str, ...]:
    flags = _cpu_flags()
    isas = []
    if machine in ("x86_64", "amd64", "i686", "x86"):
        if {"avx512f", "avx512bw", "avx512vl"} <= flags and (
            "avx512_vnni" in flags or "avx512vnni" in flags
        ):
            isas.append("avx512vnni")
        if {"avx2", "fma", "f16c", "avx_vnni"} <= flags and _compiler_accepts(
            tuple(ISA_FLAGS["avxvnni"])
        ):
            isas.append("avxvnni")
        if {"avx2", "fma", "f16c"} <= flags:
            isas.append("avx2")
    elif machine in ("aarch64", "arm64") and "asimddp" in flags:  # Linux; macOS: FEAT_DotProd
        isas.append("neon")
    return (*isas, "portable")


@functools.cache
def _compiler_accepts(flags: tuple[str, ...]) -> bool:
    """The C compiler (if any) builds a trivial file with these target flags."""
    cc = _compiler()
    return cc is None or _builds(
        cc, flags, "int f(void) { return 0; }\n"
    )  # no compiler: no C kernels anyway


def selected_isa() -> str:
    """KVSERVE_ISA when set (it must be one this CPU can execute), else the best of host_isas()."""
    forced = os.environ.get("KVSERVE_ISA", "").strip().lower()
    return check_isa(forced, "KVSERVE_ISA") if forced else host_isas()[0]


def check_isa(name: str, what: str = "isa") -> str:
    """The build named `name` (aliases allowed), or ValueError when it is unknown or this CPU
    cannot execute it."""
    forced = name.strip().lower()
    isa = _ALIASES.get(forced, forced)
    if isa not in ISA_FLAGS:
        raise ValueError(
            f"{what}={forced!r} is not a kernel build: choose one of {list(ISAS)} "
            "(or unset it to pick the best this CPU runs)"
        )
    if isa not in host_isas():
        raise ValueError(
            f"{what}={forced!r}: this CPU cannot execute the {isa} build; it runs {host_isas()}"
        )
    return isa


def cache_dir() -> Path:
    """Where kvserve keeps what it builds (these kernels) or converts (packed weights):
    $KVSERVE_CACHE_DIR, else ~/.cache/kvserve."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def _signatures(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.paged_attention.restype = None
    lib.paged_attention.argtypes = [p] * 7 + [i64, p] + [i64] * 5 + [f32, i64, i64, i64]
    lib.gguf_gemv.restype = ctypes.c_int
    lib.gguf_gemv.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64, p, i64, i64, i64]
    lib.gguf_gemm_f32.restype = ctypes.c_int
    lib.gguf_gemm_f32.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64, p, i64, i64]
    lib.gguf_dequantize_rows.restype = ctypes.c_int
    lib.gguf_dequantize_rows.argtypes = [p, i64, i64, p, i64, p]
    lib.gguf_gemv_isa.restype = ctypes.c_char_p
    lib.gguf_gemv_isa.argtypes = []
    lib.layer_stack.restype = ctypes.c_int
    lib.layer_stack.argtypes = [p, p, p, p, p, p, p, i64, p, i64, p, i64, p, i64, i64, p]
    lib.gguf_repack.restype = ctypes.c_int
    lib.gguf_repack.argtypes = [i64, p, p, p, p, i64, i64, p, i64, i64]


def _compiler() -> str | None:
    return (
        os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    )


@functools.cache
def _openmp_flags(cc: str) -> tuple[str, ...]:
    """("-fopenmp",) when the compiler builds and links OpenMP code, else () (Apple clang without
    libomp): the kernels then run single-threaded rather than not at all."""
    if not _builds(
        cc, ("-fopenmp",), "#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n"
    ):
        log.warning("%s has no OpenMP: the C kernels are built single-threaded", cc)
        return ()
    return ("-fopenmp",)


def _builds(cc: str, flags: tuple[str, ...], source: str) -> bool:
    """`source` compiles and links into a shared library with `cc` and these flags."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(source)
        res = subprocess.run(
            [cc, *flags, "-shared", "-fPIC", str(src), "-o", str(Path(tmp) / "probe.so")],
            capture_output=True,
            text=True,
        )
    return res.returncode == 0


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for `isa` (default: selected_isa(), read from KVSERVE_ISA at each call)
    and loaded, or None (no compiler, failed build or load, KVSERVE_NO_C_KERNELS=1)."""
    if os.environ.get("KVSERVE_NO_C_KERNELS") == "1":
        return None
    return _load(check_isa(isa) if isa else selected_isa(), os.environ.get("KVSERVE_CACHE_DIR"))


@functools.cache
def _load(isa: str, cache_dir: str | None) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: the C kernels fall back to slower torch paths")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, isa)))
    except (
        OSError,
        subprocess.SubprocessError,
        RuntimeError,
    ) as e:  # no cache dir, compile or load failed
        log.warning("C kernels (%s) unavailable (%s): using the slower torch paths", isa, e)
        return None
    _signatures(lib)
    if lib.gguf_gemv_isa().decode() != isa:
        raise RuntimeError(f"the {isa} kernel library reports {lib.gguf_gemv_isa().decode()}")
    log.info(
        "C kernels: %s build (GGUF GEMV gguf_gemv_%s.c, paged attention, layer stack)", isa, isa
    )
    return lib


def build(cc: str, isa: str) -> Path:
    """The `isa` library's shared object, compiled into the cache directory unless already there.
    The name's key covers the sources, the compiler and the flags; whether OpenMP links is the
    compiler's answer, so it is asked only when a build is needed."""
    sources = [_CSRC / name for name in _COMMON] + [_CSRC / f"gguf_gemv_{isa}.c"]
    text = b"".join(f.read_bytes() for f in sorted(_CSRC.glob("*.[ch]")))
    key = hashlib.sha256(
        text + " ".join([cc, isa, *_BASE_FLAGS, *ISA_FLAGS[isa]]).encode()
    ).hexdigest()[:16]
    lib_path = cache_dir() / f"kvserve-{isa}-{key}.so"
    if lib_path.exists():
        return lib_path
    flags = _BASE_FLAGS + list(_openmp_flags(cc)) + ISA_FLAGS[isa]
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        out = Path(tmp) / lib_path.name
        res = subprocess.run(
            [cc, *flags, *map(str, sources), "-o", str(out), "-lm"], capture_output=True, text=True
        )
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr[-2000:]}")
        os.replace(out, lib_path)  # atomic: concurrent builders never see a partial file
    return lib_path


def available() -> bool:
    return library() is not None


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qrow: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
    qseq: torch.Tensor | None = None,
) -> None:
    """out[qrow[i]] = softmax(q[qrow[i]] K^T * scale) V over row i's `lens[i]` context slots,
    whose blocks table row qseq[i] names (qseq None: row i), for float32 q [T, Hq, D], pools
    [NB, BS, Hkv, D] float32 / float16 or [NB, BS, Hkv, D + 4] int8 (kv_int8 rows), int64 qrow
    [R], tables [B, nblk], lens [R]. Every tensor must be contiguous."""
    lib = library()
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    lib.paged_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        qrow.data_ptr(),
        qseq.data_ptr() if qseq is not None else None,
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        qrow.shape[0],
        Hq,
        Hkv,
        D,
        bs,
        scale,
        window or 0,
        torch.get_num_threads(),
        kv_format(k_cache.dtype),
    )


# The KV pool dtypes the C kernels read, and their kv_format codes (csrc/paged_attention.c).
KV_FORMATS = {torch.float32: 0, torch.int8: 1, torch.float16: 2}


def kv_format(dtype: torch.dtype) -> int:
    return KV_FORMATS[dtype]


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged_attention takes these tensors (float32 q, float32, float16 or int8 pools,
    GQA group <= MAX_GROUP); q is made contiguous by the caller."""
    return (
        q.dtype == torch.float32
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in KV_FORMATS
        and q.shape[1] % k_cache.shape[2] == 0
        and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
        and available()
    )


ACT_PARTS = {
    "two": 0,
    "one": 1,
    "mixed": 2,
}  # GGUF_TWO_PARTS, GGUF_ONE_PART, GGUF_MIXED_PARTS (gguf_gemv.h)


def gguf_gemv(
    w: torch.Tensor,
    kind: int,
    n: int,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    accumulate: bool = False,
    isa: str | None = None,
    f32: bool = False,
    parts: str = "two",
) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) times a weight of `n` rows packed by
    kvserve.ops.gguf_blocks.pack_gguf_parts (`kind`: one of its packed kinds, e.g. 4: Q4_0/Q4_1,
    14: Q4_K, 26: Q6_K): [M, n] float32, written
    into `out` when given (added to it with accumulate=True). `isa`: a build other than the
    selected one (tests). f32: through the float32 tiles (what prompt tokens take in the layer
    stack) instead of the integer dot products. parts: the activations' 8-bit parts per block of
    32 (ACT_PARTS: "two", the gguf format; "one", gguf-a8; "mixed", gguf-mixed: one or two by
    block). See csrc/gguf_gemv.h."""
    if parts not in ACT_PARTS:
        raise ValueError(f"parts must be one of {sorted(ACT_PARTS)}, got {parts!r}")
    if f32 and parts != "two":
        raise ValueError(
            f"parts={parts!r} applies to the integer GEMV, not to the float32 tiles (f32=True)"
        )
    lib = library(isa)
    M, K = x.shape
    if out is None:
        out = torch.empty(M, n, dtype=torch.float32)
    args = (
        w.data_ptr(),
        kind,
        n,
        K,
        x.data_ptr(),
        x.stride(0),
        M,
        out.data_ptr(),
        out.stride(0),
        bias.data_ptr() if bias is not None else None,
        int(accumulate),
        torch.get_num_threads(),
    )
    rc = lib.gguf_gemm_f32(*args) if f32 else lib.gguf_gemv(*args, ACT_PARTS[parts])
    if rc != 0:
        raise ValueError(
            f"gguf_gemv failed ({rc}): kind {kind}, K={K} (the kind must be one of "
            f"pack_gguf_parts' kinds, {sorted(gguf_blocks.BLOCK_BYTES)}, and K a multiple of 32)"
        )
    return out


STACK_MAX_PARTS = 3  # packed parts of one fused linear (csrc/layer_stack.c)


class StackPart(ctypes.Structure):
    """stack_part_t of csrc/layer_stack.c: packed weights, their kind, their output rows."""

    _fields_ = [("w", ctypes.c_void_p), ("kind", ctypes.c_int64), ("rows", ctypes.c_int64)]


class StackLayer(ctypes.Structure):
    """stack_layer_t of csrc/layer_stack.c: one layer's weights and KV pool; a fused linear (qkv,
    gate_up) as up to STACK_MAX_PARTS parts of different kinds, run side by side."""

    _fields_ = [
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("qkv", StackPart * STACK_MAX_PARTS),
        ("o", StackPart),
        ("gate_up", StackPart * STACK_MAX_PARTS),
        ("down", StackPart),
    ] + [
        (n, ctypes.c_void_p)
        for n in ("qkv_bias", "o_bias", "k_cache", "v_cache", "q_norm", "k_norm")
    ]


LORA_LINEARS = 4  # qkv, o, gate_up, down: a layer's linears in the LoRA table (csrc/lora_delta.h)


class StackLora(ctypes.Structure):
    """stack_lora_t of csrc/lora_delta.h: one adapter slot on one linear: its parts' stacked A
    [rank, K] and per part B [width, r] (times the scale), output offset, width, rank offset,
    rank; a NULL `a`: the slot's adapter leaves the linear alone."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("b", ctypes.c_void_p * STACK_MAX_PARTS),
    ] + [(n, ctypes.c_int64 * STACK_MAX_PARTS) for n in ("off", "width", "r0", "r")]


class StackModel(ctypes.Structure):
    """stack_model_t of csrc/layer_stack.c: shapes, embedding (float32 rows, or NULL and a tied
    head's packed rows and kind), final norm, rope tables, layers."""

    _fields_ = (
        [
            (n, ctypes.c_int64)
            for n in (
                "num_layers",
                "hidden",
                "num_heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "block_size",
                "window",
                "kv_format",
            )
        ]
        + [("eps", ctypes.c_double), ("scale", ctypes.c_double)]
        + [
            ("embed", ctypes.c_void_p),
            ("embed_packed", ctypes.c_void_p),
            ("embed_kind", ctypes.c_int64),
        ]
        + [(n, ctypes.c_void_p) for n in ("norm", "cos", "sin")]
        + [("layers", ctypes.POINTER(StackLayer)), ("act_parts", ctypes.c_int64)]
        + [("rotary_dim", ctypes.c_int64)]
        + [("lora", ctypes.POINTER(StackLora)), ("lora_slots", ctypes.c_int64)]
    )


def gguf_rows(
    w: torch.Tensor, kind: int, n: int, k: int, ids: torch.Tensor, isa: str | None = None
) -> torch.Tensor:
    """Rows `ids` (int64 [R], each in [0, n)) of a weight of n rows and k columns packed by
    kvserve.ops.gguf_blocks.pack_gguf_parts -> float32 [R, k], the values unpack_gguf_rows gives
    (an embedding looked up in a tied head's packed weight)."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"row ids must be in [0, {n}), got {int(ids.min())}..{int(ids.max())}")
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    if library(isa).gguf_dequantize_rows(
        w.data_ptr(), kind, k, ids.data_ptr(), ids.numel(), out.data_ptr()
    ):
        raise ValueError(
            f"gguf_rows: kind {kind} with K={k} is not a packed layout (kinds "
            f"{sorted(gguf_blocks.BLOCK_BYTES)}; K a multiple of 32)"
        )
    return out


def layer_stack(
    model: StackModel,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq: torch.Tensor,
    prompt: torch.Tensor,
    tables: torch.Tensor,
    out_rows: torch.Tensor,
    out: torch.Tensor,
    isa: str | None = None,
    h_in: torch.Tensor | None = None,
    final_norm: bool = True,
    lora_slots: torch.Tensor | None = None,
) -> None:
    """Every layer of a flat batch in one call (csrc/layer_stack.c): token ids, positions, KV
    slots and sequence indices int64 [T], `prompt` bool [T] (prompt tokens take the float32
    GEMM, the others the integer GEMV; with model.act_parts other than two every token takes the
    GEMV), block tables int64 [B, nblk] (rows contiguous) ->
    out [len(out_rows), hidden] float32, the final-normed hidden states of rows out_rows.
    A pipeline stage (model's layer table: its layers): h_in float32 [T, hidden] (contiguous)
    replaces the embedding of ids, and final_norm=False gives the rows of h unnormed.
    lora_slots: int64 [T] contiguous, each token's adapter slot in model.lora (-1: the base)."""
    if lora_slots is not None and (
        lora_slots.dtype != torch.int64
        or not lora_slots.is_contiguous()
        or lora_slots.shape != ids.shape
    ):
        raise ValueError("lora_slots must be a contiguous int64 [T] tensor, one slot per token")
    if h_in is not None and (h_in.dtype != torch.float32 or not h_in.is_contiguous()):
        raise ValueError("h_in must be a contiguous float32 [T, hidden] tensor")
    rc = library(isa).layer_stack(
        ctypes.byref(model),
        ids.data_ptr(),
        None if h_in is None else h_in.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        seq.data_ptr(),
        prompt.data_ptr(),
        ids.shape[0],
        tables.data_ptr(),
        tables.stride(0),
        out_rows.data_ptr(),
        out_rows.shape[0],
        out.data_ptr(),
        int(final_norm),
        torch.get_num_threads(),
        None if lora_slots is None else lora_slots.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"layer_stack failed ({rc})")
