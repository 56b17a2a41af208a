"""The KV handover's wire protocol, and its payload parser (pure Python: no torch, no engine,
so the router and the flag parsers import it cheaply).

Every handover call carries the shared secret in the header KEY_HEADER; a server takes part
with one of ROLES (`kvserve serve --kv-transfer-role`).

A payload is b"KVX1", the JSON header's length (4 bytes, little-endian), the JSON header
(token_ids, block_size, num_blocks, layers, dtype, block_shape), then per layer K then V of the
blocks in order, raw. `KVFormat` is what one engine's KV cache looks like; a payload is accepted
only for exactly that format, with at most a context's worth of blocks.

`PayloadReader` takes a payload in chunks as they arrive: it checks the header as soon as it is
complete (before the KV data comes), then copies the KV bytes once, into one buffer of exactly
the size the header announces. So a payload is never held twice, and a bad or oversized one is
refused early (PayloadTooLarge for the size, ValueError for everything else).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")
KEY_HEADER = "X-KV-Transfer-Key"
KEY_ENV = "KVSERVE_KV_TRANSFER_KEY"
MAGIC = b"KVX1"
PREFIX_BYTES = 8  # MAGIC and the header's length
HEADER_FIXED_BYTES = 512  # the header's fields other than token_ids, with room to spare


def check_transfer_args(role: str | None, key: str | None) -> None:
    """ValueError naming the flag when a role is unknown or has no key, or the key cannot be
    sent in a header."""
    if role is not None and role not in ROLES:
        raise ValueError(f"--kv-transfer-role must be one of {', '.join(ROLES)}, got {role!r}")
    if role is not None and not key:
        raise ValueError(
            f"--kv-transfer-role {role} needs a secret for the handover's endpoints: "
            f"give --kv-transfer-key KEY (or set ${KEY_ENV}), the same on the router "
            "and every prefill and decode replica"
        )
    if key and not (key.isascii() and key.isprintable() and key == key.strip()):
        raise ValueError(
            "--kv-transfer-key must be visible ASCII (it travels in an HTTP header), "
            "e.g. `openssl rand -hex 32`"
        )


class PayloadTooLarge(ValueError):
    """A payload over the size limit (an HTTP 413, where other ValueErrors are a 400)."""


@dataclass(frozen=True)
class KVFormat:
    """One engine's KV cache as the handover sees it: block size, layers, the dtype's name and
    bytes per element, one block's shape in one layer's K (or V) pool, the vocabulary size and
    the context length (which caps a payload's blocks)."""

    block_size: int
    layers: int
    dtype: str
    itemsize: int
    block_shape: tuple[int, ...]
    vocab_size: int
    max_model_len: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer's K (or V)."""
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n

    @property
    def max_blocks(self) -> int:
        return self.max_model_len // self.block_size

    @property
    def header_limit(self) -> int:
        """The largest JSON header of a payload of max_blocks blocks (", id" per token)."""
        per_token = len(str(self.vocab_size)) + 2
        return HEADER_FIXED_BYTES + self.max_blocks * self.block_size * per_token

    def kv_bytes(self, num_blocks: int) -> int:
        return 2 * self.layers * num_blocks * self.block_bytes

    def payload_limit(self) -> int:
        """The largest payload this engine can take: a context's worth of full blocks."""
        return PREFIX_BYTES + self.header_limit + self.kv_bytes(self.max_blocks)

    def describe(self) -> dict:
        return {
            "block_size": self.block_size,
            "layers": self.layers,
            "dtype": self.dtype,
            "block_shape": list(self.block_shape),
        }


@dataclass(frozen=True)
class Header:
    token_ids: list[int]
    num_blocks: int


def encode_prefix(fmt: KVFormat, token_ids: list[int], num_blocks: int) -> bytes:
    """MAGIC, the header's length and the header of a payload of `num_blocks` blocks holding
    the first num_blocks * block_size of `token_ids`; the KV data follows it."""
    header = {
        "token_ids": list(token_ids[: num_blocks * fmt.block_size]),
        "num_blocks": num_blocks,
        **fmt.describe(),
    }
    head = json.dumps(header).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head


def _int(header: dict, key: str) -> int:
    value = header[key]
    if type(value) is not int:
        raise TypeError(f"{key} must be an integer")
    return value


def parse_header(raw: bytes, fmt: KVFormat) -> Header:
    """The header's token ids and block count, checked against `fmt` (ValueError saying what
    is wrong: not JSON, another model or KV format, token ids that do not fill the blocks or
    are outside the vocabulary, more blocks than the context holds)."""
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise TypeError("it must be a JSON object")
        token_ids, count = header["token_ids"], _int(header, "num_blocks")
        theirs = {
            "block_size": _int(header, "block_size"),
            "layers": _int(header, "layers"),
            "dtype": header["dtype"],
            "block_shape": header["block_shape"],
        }
        if not isinstance(token_ids, list):
            raise TypeError("token_ids must be a list")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        why = f"{type(e).__name__}: {e}"
        raise ValueError(f"the KV payload's header is not valid ({why})") from None
    if theirs != fmt.describe():
        raise ValueError(
            f"the KV payload is for another model or KV format: {theirs}, this engine "
            f"has {fmt.describe()}"
        )
    if not 0 <= count <= fmt.max_blocks:
        raise ValueError(
            f"the KV payload has {count} blocks: this engine takes 0 to "
            f"{fmt.max_blocks} (its context of {fmt.max_model_len} tokens)"
        )
    if len(token_ids) != count * fmt.block_size:
        raise ValueError("the KV payload's token_ids do not fill its blocks")
    if any(type(t) is not int or not 0 <= t < fmt.vocab_size for t in token_ids):
        raise ValueError(f"the KV payload's token_ids must be token ids in [0, {fmt.vocab_size})")
    return Header(token_ids, count)


class PayloadReader:
    """feed(chunk) the payload as it arrives, then finish() -> (Header, KV bytes)."""

    def __init__(self, fmt: KVFormat, limit: int) -> None:
        self.fmt = fmt
        self.limit = limit
        self.size = 0
        self.head = bytearray()
        self.head_len: int | None = None
        self.header: Header | None = None
        self.kv: bytearray | None = None
        self.filled = 0
        self.extra = 0

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise PayloadTooLarge(
                f"the KV payload is larger than the limit of {self.limit} bytes "
                "(--max-kv-transfer-bytes)"
            )
        data = memoryview(chunk)
        while self.header is None and data:
            want = PREFIX_BYTES if self.head_len is None else PREFIX_BYTES + self.head_len
            take = want - len(self.head)
            self.head += data[:take]
            data = data[take:]
            self._advance()
        if self.header is not None and data:
            take = min(len(data), len(self.kv) - self.filled)
            self.kv[self.filled : self.filled + take] = data[:take]
            self.filled += take
            self.extra += len(data) - take

    def _advance(self) -> None:
        """Parse the prefix, then the header, as soon as each is complete."""
        started = len(self.head) >= len(MAGIC)
        if self.head_len is None and started and self.head[: len(MAGIC)] != MAGIC:
            raise ValueError("not a KV payload (it starts with b'KVX1')")
        if self.head_len is None and len(self.head) == PREFIX_BYTES:
            self.head_len = int.from_bytes(self.head[len(MAGIC) : PREFIX_BYTES], "little")
            if self.head_len > self.fmt.header_limit:
                raise ValueError(
                    f"the KV payload's header has {self.head_len} bytes: at most "
                    f"{self.fmt.header_limit} for this engine's context"
                )
        if self.head_len is not None and len(self.head) == PREFIX_BYTES + self.head_len:
            self.header = parse_header(bytes(self.head[PREFIX_BYTES:]), self.fmt)
            total = len(self.head) + self.fmt.kv_bytes(self.header.num_blocks)
            if total > self.limit:
                raise PayloadTooLarge(
                    f"the KV payload announces {total} bytes, over the limit of "
                    f"{self.limit} bytes (--max-kv-transfer-bytes)"
                )
            self.kv = bytearray(self.fmt.kv_bytes(self.header.num_blocks))

    def finish(self) -> tuple[Header, bytearray]:
        if self.header is None:
            if len(self.head) < len(MAGIC) or self.head_len is None:
                raise ValueError(
                    "not a KV payload (it starts with b'KVX1' and the header's length)"
                )
            raise ValueError("the KV payload ends inside its header")
        if self.filled != len(self.kv) or self.extra:
            raise ValueError(
                f"the KV payload has {self.filled + self.extra} bytes of KV, "
                f"{len(self.kv)} expected for {self.header.num_blocks} blocks"
            )
        return self.header, self.kv
