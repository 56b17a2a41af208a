"""Small C kernels for the CPU, built on first use with the system C compiler and called via ctypes.

No torch headers are involved (a torch C++ extension takes a minute to compile on 2 cores; these
take about a second). The shared object is cached under $KVSERVE_CACHE_DIR (default
~/.cache/kvserve) in a file named by the hash of the source, the compiler flags and the CPU model,
so a changed source or another CPU builds anew. Without a compiler, when the build or load fails,
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

_SRC = Path(__file__).parent / "csrc" / "paged_decode.c"
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


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVSERVE_NO_C_KERNELS") == "1":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: paged decode attention uses the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:   # no cache dir, compile or load failed
        log.warning("C attention kernel unavailable (%s): using the slower torch path", e)
        return None
    f = lib.paged_decode_f32
    f.restype = None
    f.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_void_p] + [ctypes.c_int64] * 5 \
        + [ctypes.c_float, ctypes.c_int64, ctypes.c_int64]
    return lib


def _build(cc: str) -> Path:
    """The kernel's shared object, compiled into the cache directory unless already there."""
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + _cpu_model().encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"paged_decode-{key}.so"
    if lib_path.exists():
        return lib_path
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        out = Path(tmp) / lib_path.name
        res = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", str(out), "-lm"], capture_output=True, text=True)
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
    (tables[i] names its blocks), for float32 q [T, Hq, D], pools [NB, BS, Hkv, D], int64
    qrow [R], tables [R, nblk], lens [R]. Every tensor must be contiguous."""
    lib = _library()
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    lib.paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                         qrow.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                         qrow.shape[0], Hq, Hkv, D, bs, scale, window or 0, torch.get_num_threads())


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged_decode takes these tensors (all float32, GQA group <= MAX_GROUP); q is made
    contiguous by the caller."""
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
            and available())
