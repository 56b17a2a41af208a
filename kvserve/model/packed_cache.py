"""The packed weights of a GGUF file kept on disk, so that a later start maps them instead of
repacking the file's blocks.

Repacking (kvserve.ops.gguf_blocks) writes every weight into fresh memory once; for a model of
gigabytes the first touch of those pages, not the shuffling, is most of the start. The cache file
holds the packed bytes of one load, in the order the loader packs them; a start that finds a
valid one maps it copy-on-write (a write would copy the page, never reach the file) and hands
each weight a view of its bytes. The page cache then holds them like any file read before.

A cache file is valid for one GGUF file (path, size, modification time, inode), one weight
format and one packed layout (a digest of the sources that define it): anything else is
another file name. Each entry also records the types, shapes and a checksum of the ends of the
blocks it was packed from; the first entry that disagrees turns the cache off for the rest of
the load (the weights already mapped were checked), and the load writes a fresh file. A file
that is not its user's alone (another owner, writable by others) is never read.

Only loads of at least MIN_BYTES packed bytes are kept, at most KEEP_FILES files (the most
recently used), and none when the disk would keep less than FREE_MARGIN free. The directory
is $KVSERVE_CACHE_DIR/packed (default ~/.cache/kvserve/packed), readable by its owner only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from kvserve.ops import cpu_kernels

log = logging.getLogger("kvserve.model")

MAGIC = b"KVSPACK1"
ALIGN = 4096  # every entry starts on a page
MIN_BYTES = 256 << 20  # smaller loads repack in well under a second
KEEP_FILES = 4
FREE_MARGIN = 1 << 30
MAX_HEADER = 64 << 20  # the entries' JSON: well under a megabyte for any model
_MADV_POPULATE_READ = 22  # Linux 5.14: map every page now, read faults only (no copies)
_ROOT = Path(__file__).resolve().parent.parent
# The sources that define the packed bytes (the kernels' layout and both packers).
_LAYOUT_SOURCES = ("ops/csrc/gguf_gemv.h", "ops/csrc/gguf_repack.c", "ops/gguf_blocks.py")

_active: PackedCache | None = None


def cache_dir() -> Path:
    return cpu_kernels.cache_dir() / "packed"


@functools.cache
def layout_digest() -> str:
    """The packed layout's digest: read once a process (its sources do not change under it)."""
    h = hashlib.sha256()
    for name in _LAYOUT_SOURCES:
        h.update((_ROOT / name).read_bytes())
    return h.hexdigest()[:16]


def fingerprint(parts) -> list:
    """What an entry was packed from: per part its GGML type, shape and a CRC of its first and
    last 4 KiB of blocks (not a content hash: the file's size and mtime are in the key)."""
    out = []
    for p in parts:
        data = getattr(p, "raw", p)
        if isinstance(data, torch.Tensor):  # float shards (F16, BF16, F32)
            raw = data.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
        else:
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        crc = zlib.crc32(raw[-4096:], zlib.crc32(raw[:4096]))
        qtype = getattr(p, "qtype", None)
        out.append([int(qtype) if qtype is not None else -1, list(p.shape), crc])
    return out


class PackedCache:
    """One GGUF file's packed-weight cache while its model loads (`active` makes it the one
    `pack` consults). `finish()` after the load writes the file when none was used whole."""

    def __init__(self, path: str, fmt: str, directory: Path | None = None):
        st = os.stat(path)
        self.key = {
            "path": os.path.realpath(path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino,
            "format": fmt,
            "layout": layout_digest(),
        }
        name = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:24]
        self.dir = directory or cache_dir()
        self.file = self.dir / f"{name}.pack"
        self.entries: list[dict] = []  # the mapped file's, while it serves this load
        self.packed: list[tuple[torch.Tensor, int, list]] = []  # this load's, in order
        self.mapped = None
        self.hits = 0
        self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.file, os.O_RDONLY)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                log.warning("packed-weight cache %s: not this user's alone; repacking", self.file)
                return
            size = st.st_size
            head = os.pread(fd, 16, 0)
            if len(head) != 16 or head[:8] != MAGIC:
                return
            (n,) = struct.unpack("<Q", head[8:])
            if n > min(size - 16, MAX_HEADER):
                raise ValueError(f"a header of {n} bytes")
            meta = json.loads(os.pread(fd, n, 16))
            if not isinstance(meta, dict) or meta.get("key") != self.key:
                return
            if meta.get("size") != size or not _valid_entries(meta.get("entries"), size):
                raise ValueError("its entries do not fit the file")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, json.JSONDecodeError) as e:
            log.warning("packed-weight cache %s unreadable (%s): repacking", self.file, e)
            return
        finally:
            os.close(fd)
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(_MADV_POPULATE_READ)  # older kernels: pages map on first use instead
        self.mapped, self.entries = mm, meta["entries"]
        with contextlib.suppress(OSError):
            os.utime(self.file)  # most recently used: the last to be evicted

    def take(self, parts) -> tuple[torch.Tensor, int] | None:
        """The next packed weight from the mapped file when it was packed from `parts`."""
        i = len(self.packed)
        if self.mapped is None or i >= len(self.entries):
            return None
        e, fp = self.entries[i], fingerprint(parts)
        if e["parts"] != fp:
            log.warning(
                "packed-weight cache %s: weight %d differs from the file's blocks; repacking",
                self.file,
                i,
            )
            self.mapped = None  # the views handed out stay valid: they hold the mapping
            return None
        t = torch.frombuffer(self.mapped, dtype=torch.uint8, count=e["nbytes"], offset=e["offset"])
        self.packed.append((t, e["kind"], fp))
        self.hits += 1
        return t, e["kind"]

    def put(self, parts, packed: torch.Tensor, kind: int) -> None:
        self.packed.append((packed, kind, fingerprint(parts)))

    def finish(self, background: bool = True) -> threading.Thread | None:
        """After the load: write the file unless it served the whole load, or the load is
        small, or the disk is short of room; in a thread of its own (not a daemon: the process
        waits for it before it exits) unless `background` is False. A failed or cut write
        leaves no file under the cache's name."""
        if self.hits == len(self.packed) == len(self.entries) and self.hits:
            log.info("packed weights mapped from %s (%d weights)", self.file, self.hits)
            return None
        total = sum(t.numel() for t, _, _ in self.packed)
        if total < MIN_BYTES:
            return None
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            room = shutil.disk_usage(self.dir).free >= total + FREE_MARGIN
        except OSError as e:
            log.warning("packed-weight cache %s not written: %s", self.file, e)
            return None
        if not room:
            log.info("packed-weight cache: not written, %s lacks the room", self.dir)
            return None
        if not background:
            self._store(total)
            return None
        writer = threading.Thread(target=self._store, args=(total,), name="kvserve-packed-cache")
        writer.start()
        return writer

    def _store(self, total: int) -> None:
        t0 = time.perf_counter()
        try:
            self._write()
        except OSError as e:
            log.warning("packed-weight cache %s not written: %s", self.file, e)
            return
        log.info(
            "packed weights cached in %s (%.2f GB, %.1f s): later starts map them",
            self.file,
            total / 1e9,
            time.perf_counter() - t0,
        )
        self._evict()

    def _write(self) -> None:
        entries, at = [], 0
        for t, kind, fp in self.packed:
            entries.append({"offset": at, "nbytes": t.numel(), "kind": kind, "parts": fp})
            at += -(-t.numel() // ALIGN) * ALIGN
        meta = {"key": self.key, "entries": entries}
        # Offsets are relative to the first page after the header; the header's size depends
        # on them only through their digits, so it is sized with room for the final offsets.
        body = json.dumps(meta).encode()
        start = -(-(16 + len(body) + 64 * len(entries) + 64) // ALIGN) * ALIGN
        for e in entries:
            e["offset"] += start
        meta["size"] = start + at
        body = json.dumps(meta).encode()
        assert 16 + len(body) <= start, "the header outgrew its pages"
        fd, tmp = tempfile.mkstemp(suffix=".tmp", prefix=f".{self.file.stem}.", dir=self.dir)
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(MAGIC + struct.pack("<Q", len(body)) + body)
                f.write(b"\0" * (start - 16 - len(body)))
                for (t, _, _), e in zip(self.packed, entries):
                    f.write(memoryview(t.numpy()))
                    f.write(b"\0" * (-e["nbytes"] % ALIGN))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.file)  # atomic: a reader sees the old file or the whole new one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _evict(self) -> None:
        """Keep the KEEP_FILES most recently used files (and no stale temporary ones)."""
        now = time.time()
        files = []
        for p in self.dir.iterdir():
            with contextlib.suppress(OSError):
                if p.name.endswith(".pack"):
                    files.append((p.stat().st_mtime, p))
                elif p.name.endswith(".tmp") and now - p.stat().st_mtime > 3600:
                    p.unlink()  # a writer that died
        for _, p in sorted(files, reverse=True)[KEEP_FILES:]:
            with contextlib.suppress(OSError):
                p.unlink()


def _valid_entries(entries, size: int) -> bool:
    """Whether `entries` (a header's) are what _write writes, each inside a file of `size`."""
    if not isinstance(entries, list):
        return False
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("parts"), list):
            return False
        at, n, kind = e.get("offset"), e.get("nbytes"), e.get("kind")
        if not all(type(v) is int for v in (at, n, kind)) or at < 0 or n < 0 or at + n > size:
            return False
    return True


@contextlib.contextmanager
def active(cache: PackedCache | None):
    """Make `cache` the one `pack` consults inside the block (None: no cache)."""
    global _active
    saved, _active = _active, cache
    try:
        yield cache
    finally:
        _active = saved


def pack(parts, packer) -> tuple[torch.Tensor, int]:
    """packer(parts) -> (uint8 tensor, kind), through the active cache: its mapped bytes when
    it holds this weight, else packed here and recorded for the file."""
    cache = _active
    if cache is None:
        return packer(parts)
    hit = cache.take(parts)
    if hit is not None:
        return hit
    packed, kind = packer(parts)
    cache.put(parts, packed, kind)
    return packed, kind
