"""Small C kernels for the CPU, built on first use with the system C compiler and called via ctypes.

csrc/decode_layers.c includes the other sources, so all kernels are one library: paged decode
attention (float32 or int8 KV rows), the GGUF block GEMV and the fused decode layer stack. No torch
headers are involved (a torch C++ extension takes a minute to compile on 2 cores; this takes about
2 s). The shared object is cached under $KVSERVE_CACHE_DIR (default ~/.cache/kvserve) in a file
named by the hash of the sources, the compiler flags and the CPU model, so a changed source or
another CPU builds anew. Without a compiler, when the build or load fails,
or with KVSERVE_NO_C_KERNELS=1, `available()` is False and callers use their torch path.
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
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kvserve")

_CSRC = Path(__file__).parent / "csrc"
_SRC = _CSRC / "decode_layers.c"     # includes gguf_gemv.c and paged_decode.c: one library
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC"]
MAX_GROUP = 16      # query heads per KV head the kernel handles (MAX_GROUP in the C source)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def _signatures(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.paged_decode_pool.restype = None
    lib.paged_decode_pool.argtypes = [p] * 6 + [i64, p] + [i64] * 5 + [f32, i64, i64, i64]
    lib.gguf_gemv.restype = ctypes.c_int
    lib.gguf_gemv.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64, p, i64, i64]
    lib.gguf_gemv_isa.restype = i64
    lib.gguf_gemv_isa.argtypes = []
    lib.decode_layers.restype = ctypes.c_int
    lib.decode_layers.argtypes = [p, p, p, i64, p, p, i64, p, p, i64]


@functools.cache
def _library(portable: bool = False) -> ctypes.CDLL | None:
    """The kernels of csrc/ built and loaded, or None (no compiler, failed build or load,
    KVSERVE_NO_C_KERNELS=1). portable=True builds the plain-C loops instead of the SIMD code
    (-DKVSERVE_PORTABLE: tests check both give the same results)."""
    if os.environ.get("KVSERVE_NO_C_KERNELS") == "1":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the C kernels fall back to slower torch paths")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, ["-DKVSERVE_PORTABLE"] if portable else [])))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:   # no cache dir, compile or load failed
        log.warning("C kernels unavailable (%s): using the slower torch paths", e)
        return None
    _signatures(lib)
    return lib


def _build(cc: str, extra_flags: list[str]) -> Path:
    """The kernels' shared object, compiled into the cache directory unless already there."""
    flags = _FLAGS + extra_flags
    src = b"".join(f.read_bytes() for f in sorted(_CSRC.glob("*.c")))
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_model().encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"kvserve-cpu-{key}.so"
    if lib_path.exists():
        return lib_path
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        out = Path(tmp) / lib_path.name
        res = subprocess.run([cc, *flags, str(_SRC), "-o", str(out), "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr[-2000:]}")
        os.replace(out, lib_path)      # atomic: concurrent builders never see a partial file
    return lib_path


def available() -> bool:
    return _library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 qrow: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 window: int | None) -> None:
    """out[qrow[i]] = softmax(q[qrow[i]] K^T * scale) V over row i's `lens[i]` context slots
    (tables[i] names its blocks), for float32 q [T, Hq, D], pools [NB, BS, Hkv, D] float32 or
    [NB, BS, Hkv, D + 4] int8 (kv_int8 rows), int64 qrow [R], tables [R, nblk], lens [R]. Every
    tensor must be contiguous."""
    lib = _library()
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    lib.paged_decode_pool(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                          qrow.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                          qrow.shape[0], Hq, Hkv, D, bs, scale, window or 0, torch.get_num_threads(),
                          int(k_cache.dtype == torch.int8))


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged_decode takes these tensors (float32 q, float32 or int8 pools, GQA group <=
    MAX_GROUP); q is made contiguous by the caller."""
    return (q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (torch.float32, torch.int8)
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
            and available())


def gguf_gemv(w: torch.Tensor, kind: int, n: int, x: torch.Tensor, out: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, accumulate: bool = False, portable: bool = False) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) times a weight of `n` rows packed by
    kvserve.model.quant.pack_gguf_rows (`kind` 4: Q4_0/Q4_1, 8: Q8_0): [M, n] float32, written
    into `out` when given (added to it with accumulate=True). See csrc/gguf_gemv.c."""
    lib = _library(portable)
    M, K = x.shape
    if out is None:
        out = torch.empty(M, n, dtype=torch.float32)
    rc = lib.gguf_gemv(w.data_ptr(), kind, n, K, x.data_ptr(), x.stride(0), M, out.data_ptr(),
                       out.stride(0), bias.data_ptr() if bias is not None else None, int(accumulate),
                       torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gguf_gemv failed ({rc}): kind {kind}, K={K} (K must be a multiple of 32)")
    return out


def gguf_gemv_fast() -> bool:
    """Whether gguf_gemv was built with its SIMD path (AVX-512 VNNI). Its portable loops give the
    same results but are slower than torch's kernels, so callers use it only when this is True."""
    lib = _library()
    return lib is not None and lib.gguf_gemv_isa() > 0


class DecodeLayer(ctypes.Structure):
    """decode_layer_t of csrc/decode_layers.c: one layer's weights and KV pool."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("ln1", "ln2", "qkv", "o", "gate_up", "down")] \
        + [(n, ctypes.c_int64) for n in ("qkv_kind", "o_kind", "gate_up_kind", "down_kind")] \
        + [(n, ctypes.c_void_p) for n in ("qkv_bias", "o_bias", "k_cache", "v_cache")]


class DecodeModel(ctypes.Structure):
    """decode_model_t of csrc/decode_layers.c: shapes, embedding, final norm, rope tables, layers."""
    _fields_ = [(n, ctypes.c_int64) for n in ("num_layers", "hidden", "num_heads", "kv_heads", "head_dim",
                                             "intermediate", "block_size", "window", "kv_int8")] \
        + [("eps", ctypes.c_double), ("scale", ctypes.c_double)] \
        + [(n, ctypes.c_void_p) for n in ("embed", "norm", "cos", "sin")] \
        + [("layers", ctypes.POINTER(DecodeLayer))]


def decode_layers(model: DecodeModel, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor) -> None:
    """Every layer of a decode-only batch in one call (csrc/decode_layers.c): token ids, positions,
    KV slots and context lengths int64 [T], block tables int64 [T, nblk] (rows contiguous) ->
    out [T, hidden] float32, the final-normed hidden states."""
    rc = _library().decode_layers(ctypes.byref(model), ids.data_ptr(), positions.data_ptr(), ids.shape[0],
                                  slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                                  out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode_layers failed ({rc})")
