"""Reading a GGUF file: metadata, tensor descriptors and raw tensor bytes (no torch).

The header is parsed here directly (the format is a flat list of typed key/values and tensor
descriptors) because gguf.GGUFReader builds a numpy memmap per string, which is slow for a
vocabulary of tens of thousands of tokens. The type tables are kvserve.ops.gguf_types.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

from kvserve.ops.gguf_types import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_GGUF_MAGIC = b"GGUF"
_U64 = struct.Struct("<Q")
_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


class GGUFTensor:
    __slots__ = ("name", "qtype", "shape", "offset", "nbytes")

    def __init__(self, name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...], offset: int):
        self.name, self.qtype, self.shape, self.offset = name, qtype, shape, offset
        block, size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape))
        self.nbytes = n // block * size

    def __repr__(self):
        return f"GGUFTensor({self.name}, {self.qtype.name}, {self.shape})"


class GGUFFile:
    """metadata: {key: value} (arrays as lists, strings as str); tensors: {name: GGUFTensor}
    with `shape` in PyTorch order (rows first, i.e. GGUF's dims reversed)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            self._mm, self._pos = mm, 0
            try:
                self._parse()
            finally:
                del self._mm

    # -- header --
    def _read(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges): one tight loop, no per-item
        dispatch."""
        mm, pos, out = self._mm, self._pos, []
        for _ in range(count):
            (n,) = _U64.unpack_from(mm, pos)
            out.append(mm[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, vtype: int):
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            itype, count = GGUFValueType(self._read("<I")), self._read("<Q")
            if itype == GGUFValueType.STRING:
                return self._strings(count)
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
                raw = self._mm[self._pos : self._pos + count * dt.itemsize]
                self._pos += count * dt.itemsize
                return np.frombuffer(raw, dtype=dt).tolist()
            return [self._value(itype) for _ in range(count)]
        return self._read(_SCALAR[vtype])

    def _parse(self) -> None:
        if self._mm[:4] != _GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            code = self._read("<I")
            if code not in GGML_QUANT_SIZES:
                raise ValueError(
                    f"{self.path}: tensor {name} has GGML type {code}, which kvserve does not know "
                    f"(it reads {sorted(t.name for t in GGML_QUANT_SIZES)})"
                )
            qtype = GGMLQuantizationType(code)
            infos.append((name, qtype, tuple(reversed(dims)), self._read("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors = {
            name: GGUFTensor(name, qt, shape, data_start + off) for name, qt, shape, off in infos
        }

    # -- tensors --
    def raw(self, t: GGUFTensor) -> np.ndarray:
        """The stored bytes of one tensor, [rows, bytes_per_row] uint8. Quantized blocks come as
        a private (copy-on-write) memory map of the file: packing reads them once from the page
        cache without a copy, and the map goes when the array does. F32 tensors, which
        dequantize_rows hands on as views, come as a fresh, owned buffer."""
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if t.offset + t.nbytes > size:
                raise ValueError(f"{self.path}: tensor {t.name} is truncated")
            if t.qtype == GGMLQuantizationType.F32 or not t.nbytes:
                f.seek(t.offset)
                data = np.fromfile(f, dtype=np.uint8, count=t.nbytes)
            else:
                data = np.memmap(f, dtype=np.uint8, mode="c", offset=t.offset, shape=(t.nbytes,))
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        return data.reshape(rows, -1)
