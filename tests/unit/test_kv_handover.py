"""The KV handover without a model: the payload parser (kvserve/engine/kv_payload.py), the
handover namespace (core/block_pool.py PrivateSalt), and the engine side (engine/kv_transfer.py)
on a small fake core: pin, stream, release and adopt, with the pool's free count checked."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from kvserve.config import KVGroup
from kvserve.core.block_pool import PrivateSalt, hash_block_tokens
from kvserve.core.kv_cache import KVCacheManager
from kvserve.core.sequence import Sequence
from kvserve.engine import kv_transfer
from kvserve.engine.kv_payload import (
    MAGIC,
    KVFormat,
    PayloadReader,
    PayloadTooLarge,
    check_transfer_args,
    encode_prefix,
)
from kvserve.sampling_params import SamplingParams

BS = 4
PROBES = itertools.count()
FMT = KVFormat(
    block_size=BS,
    layers=2,
    dtype="float16",
    itemsize=2,
    block_shape=(BS, 2, 3),
    vocab_size=1000,
    max_model_len=32,
)


def payload(token_ids: list[int], num_blocks: int, fmt: KVFormat = FMT, fill: int = 7) -> bytes:
    return encode_prefix(fmt, token_ids, num_blocks) + bytes([fill]) * fmt.kv_bytes(num_blocks)


def read(data: bytes, chunk: int = 5, limit: int | None = None):
    reader = PayloadReader(FMT, FMT.payload_limit() if limit is None else limit)
    for i in range(0, len(data), chunk):
        reader.feed(data[i : i + chunk])
    return reader.finish()


# ---- the payload ----


@pytest.mark.parametrize("chunk", [1, 3, 8, 100, 10**6])
def test_payload_round_trip_in_any_chunks(chunk):
    ids = list(range(10, 22))
    header, kv = read(payload(ids, 3), chunk)
    assert header.token_ids == ids[:12] and header.num_blocks == 3
    assert bytes(kv) == bytes([7]) * FMT.kv_bytes(3)


def test_the_limit_is_a_whole_context():
    biggest = payload(list(range(32)), FMT.max_blocks)
    assert len(biggest) <= FMT.payload_limit()
    assert read(biggest)[0].num_blocks == 8
    head = encode_prefix(FMT, list(range(36)), 9)  # one block past the context
    with pytest.raises(ValueError, match="0 to 8"):
        read(head + b"\0" * FMT.kv_bytes(9))


def test_oversized_payloads_are_refused_before_their_kv_arrives():
    prefix = encode_prefix(FMT, list(range(8)), 2)
    reader = PayloadReader(FMT, limit=len(prefix) + 10)
    with pytest.raises(PayloadTooLarge, match="announces"):
        reader.feed(prefix)  # the header alone says too much
    assert reader.kv is None  # nothing allocated
    with pytest.raises(PayloadTooLarge, match="limit of 50"):
        PayloadReader(FMT, limit=50).feed(b"x" * 51)
    too_long = MAGIC + (FMT.header_limit + 1).to_bytes(4, "little")
    with pytest.raises(ValueError, match="header has"):
        read(too_long)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"junk" * 10, "not a KV payload"),
        (b"KV", "not a KV payload"),
        (MAGIC + (50).to_bytes(4, "little") + b"{}", "ends inside its header"),
        (MAGIC + (3).to_bytes(4, "little") + b"[1]", "not valid"),
        (MAGIC + (0).to_bytes(4, "little"), "not valid"),
    ],
)
def test_malformed_payloads(data, message):
    with pytest.raises(ValueError, match=message):
        read(data)


def crafted(**changes) -> bytes:
    header = {
        "token_ids": [1, 2, 3, 4],
        "block_size": BS,
        "num_blocks": 1,
        "layers": 2,
        "dtype": "float16",
        "block_shape": [BS, 2, 3],
        **changes,
    }
    head = json.dumps(header).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head + b"\0" * FMT.kv_bytes(1)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"dtype": "float32"}, "another model or KV format"),
        ({"block_shape": [BS, 3, 2]}, "another model or KV format"),
        ({"layers": 3}, "another model or KV format"),
        ({"block_size": True}, "not valid"),
        ({"num_blocks": 1.0}, "not valid"),
        ({"num_blocks": float("nan")}, "not valid"),
        ({"num_blocks": 2**64}, "0 to 8"),
        ({"num_blocks": -1}, "0 to 8"),
        ({"token_ids": [1, 2, 3]}, "do not fill"),
        ({"token_ids": [1, 2, 3, 1000]}, r"in \[0, 1000\)"),
        ({"token_ids": [1, 2, 3, -1]}, r"in \[0, 1000\)"),
        ({"token_ids": [1, 2, 3, True]}, r"in \[0, 1000\)"),
        ({"token_ids": "1234"}, "not valid"),
    ],
)
def test_headers_of_another_format_or_with_bad_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        read(crafted(**changes))


def test_deeply_nested_header_is_a_value_error():
    head = b"[" * 5000 + b"]" * 5000
    fmt = KVFormat(BS, 2, "float16", 2, (BS, 2, 3), 1000, 32 * 1024)  # room for a long header
    reader = PayloadReader(fmt, fmt.payload_limit())
    with pytest.raises(ValueError, match="not valid"):
        reader.feed(MAGIC + len(head).to_bytes(4, "little") + head)


def test_kv_of_the_wrong_length():
    data = payload(list(range(8)), 2)
    with pytest.raises(ValueError, match="bytes of KV"):
        read(data[:-1])
    with pytest.raises(ValueError, match="bytes of KV"):
        read(data + b"\0")


def test_a_role_needs_a_key():
    check_transfer_args(None, None)
    check_transfer_args("decode", "k")
    with pytest.raises(ValueError, match="--kv-transfer-key"):
        check_transfer_args("prefill", None)
    with pytest.raises(ValueError, match="--kv-transfer-role must be one of"):
        check_transfer_args("decoder", "k")
    for key in ("clé", "a key ", "line\nbreak"):
        with pytest.raises(ValueError, match="visible ASCII"):
            check_transfer_args("both", key)


# ---- the namespace ----


def test_a_private_salt_names_no_client_salt():
    ns = kv_transfer.new_namespace()
    tokens = [1, 2, 3, 4]
    private = hash_block_tokens(None, tokens, ns)
    assert private == hash_block_tokens(None, tokens, PrivateSalt(str(ns)))
    assert private != hash_block_tokens(None, tokens, str(ns))
    assert private != hash_block_tokens(None, tokens, None)
    assert kv_transfer.new_namespace() != ns


# ---- the engine side, on a fake core ----


def fake_core(num_blocks: int = 12) -> SimpleNamespace:
    kv = KVCacheManager([KVGroup(None, (0, 1), num_blocks)], BS)
    caches = [
        (
            torch.zeros(num_blocks, BS, 2, 3, dtype=torch.float16),
            torch.zeros(num_blocks, BS, 2, 3, dtype=torch.float16),
        )
        for _ in range(2)
    ]
    cache = SimpleNamespace(enable_prefix_caching=True, block_size=BS)
    return SimpleNamespace(
        config=SimpleNamespace(cache=cache),
        kv_groups=kv.groups,
        ranks=None,
        runner=SimpleNamespace(kv_caches=caches),
        scheduler=SimpleNamespace(kv_cache_manager=kv),
        arch=SimpleNamespace(vocab_size=1000),
        max_model_len=32,
    )


def compute(core, rid: str, tokens: list[int], salt=None) -> Sequence:
    """What a step leaves behind: the prompt's blocks written (values of their own) and cached."""
    kv = core.scheduler.kv_cache_manager
    req = Sequence(rid, list(tokens), SamplingParams(max_tokens=1), cache_salt=salt)
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, [], hits, n)
    for b in kv.block_ids(rid)[0]:
        for k, v in core.runner.kv_caches:
            k[b] = torch.randn(BS, 2, 3)
            v[b] = torch.randn(BS, 2, 3)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_tokens)
    kv.free(req)
    return req


def export(core, tokens, salt) -> bytes:
    pinned = kv_transfer.pin_blocks(core, tokens, salt)
    try:
        count = pinned.num_parts if pinned.blocks else 0
        parts = [kv_transfer.read_part(pinned, i) for i in range(count)]
    finally:
        kv_transfer.release(pinned)
    data = b"".join([pinned.prefix, *parts])
    assert len(data) == pinned.size
    return data


def hit_tokens(core, tokens, salt) -> int:
    req = Sequence(
        f"probe-{next(PROBES)}", list(tokens) + [0], SamplingParams(max_tokens=1), cache_salt=salt
    )
    return core.scheduler.kv_cache_manager.get_computed_blocks(req)[1]


def test_export_pins_while_streaming_and_releases():
    core = fake_core()
    pool = core.scheduler.kv_cache_manager.pools[0]
    ns = kv_transfer.new_namespace()
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    compute(core, "a", tokens, ns)
    idle = pool.num_free_blocks
    pinned = kv_transfer.pin_blocks(core, tokens, ns)
    assert len(pinned.blocks) == 3 and pool.num_free_blocks == idle - 3
    compute(core, "flood", list(range(500, 536)))  # wants every free block: the pinned stay
    assert [pool.get_cached_block(b.block_hash) for b in pinned.blocks] == pinned.blocks
    kv_transfer.release(pinned)
    assert pool.num_free_blocks == idle
    assert kv_transfer.pin_blocks(core, tokens, None).blocks == []  # another namespace: nothing


def test_export_then_adopt_gives_the_same_kv_in_the_namespace_only():
    src, dst = fake_core(), fake_core()
    ns_src, ns_dst = kv_transfer.new_namespace(), kv_transfer.new_namespace()
    tokens = list(range(100, 114))
    compute(src, "a", tokens, ns_src)
    limit = kv_transfer.kv_format(dst).payload_limit()
    header, kv = read(export(src, tokens, ns_src), chunk=97, limit=limit)
    pool = dst.scheduler.kv_cache_manager.pools[0]
    idle = pool.num_free_blocks
    assert kv_transfer.adopt_blocks(dst, header.token_ids, header.num_blocks, kv, ns_dst) == 12
    assert pool.num_free_blocks == idle  # cached, unreferenced
    assert hit_tokens(dst, tokens[:12], ns_dst) == 12
    for salt in (None, str(ns_dst), "alice"):  # users, even one who knew the salt's characters
        assert hit_tokens(dst, tokens[:12], salt) == 0
    pinned_src = kv_transfer.pin_blocks(src, tokens, ns_src)
    pinned_dst = kv_transfer.pin_blocks(dst, tokens, ns_dst)
    for (ks, vs), (kd, vd) in zip(src.runner.kv_caches, dst.runner.kv_caches):
        for a, b in zip(pinned_src.blocks, pinned_dst.blocks):
            assert torch.equal(ks[a.block_id], kd[b.block_id])
            assert torch.equal(vs[a.block_id], vd[b.block_id])
    kv_transfer.release(pinned_src)
    kv_transfer.release(pinned_dst)
    # adopting again changes nothing: the blocks are held already
    assert kv_transfer.adopt_blocks(dst, header.token_ids, header.num_blocks, kv, ns_dst) == 12
    assert pool.num_free_blocks == idle


def test_adopt_stops_when_the_pool_is_full_and_keeps_what_it_holds():
    dst = fake_core(num_blocks=4)
    kv = dst.scheduler.kv_cache_manager
    busy = Sequence("busy", list(range(12)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(busy, 12, [])  # 3 of 4 blocks referenced
    tokens = list(range(100, 112))
    data = bytearray(payload(tokens, 3)[-FMT.kv_bytes(3) :])
    assert kv_transfer.adopt_blocks(dst, tokens, 3, data, None) == 4
    assert kv.pools[0].num_free_blocks == 1 and hit_tokens(dst, tokens, None) == 4
    kv.free(busy)
    assert kv.pools[0].num_free_blocks == 4


def test_a_reset_during_an_export_aborts_it():
    core = fake_core()
    tokens = list(range(100, 108))
    compute(core, "a", tokens)
    pinned = kv_transfer.pin_blocks(core, tokens, None)
    assert kv_transfer.read_part(pinned, 0)
    fresh = KVCacheManager([KVGroup(None, (0, 1), 12)], BS)  # a reset: every block free
    core.scheduler = SimpleNamespace(kv_cache_manager=fresh)
    with pytest.raises(kv_transfer.ExportAborted):
        kv_transfer.read_part(pinned, 1)
