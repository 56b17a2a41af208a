"""The packed-weight cache (kvserve/model/packed_cache.py): a second load of a GGUF file maps the
bytes the first one packed, byte for byte and with the same greedy tokens; a changed file, a
damaged cache file or an entry packed from other blocks is repacked, never trusted; a failed
write leaves nothing behind; small loads and --no-packed-cache write nothing."""

import json
import logging
import os
import threading

import numpy as np
import pytest
import torch

from kvserve.bench.gguf_presets import write_model
from kvserve.config import ModelConfig
from kvserve.model import packed_cache
from kvserve.model.loader import load_model
from kvserve.model.quant.blocks import BlockTensor
from kvserve.ops.gguf_blocks import pack_gguf_parts
from kvserve.ops.gguf_types import GGMLQuantizationType as Q
from kvserve.sampling_params import SamplingParams

PROMPTS = [[1000 + 37 * i for i in range(n)] for n in (5, 12)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_gguf):
    path = str(tmp_path_factory.mktemp("packed") / "tiny-q4_k_m.gguf")
    write_model(path, "tiny", "q4_k_m", tokenizer_from=default_gguf)
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache of its own that keeps loads of any size."""
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path / "packed")
    monkeypatch.setattr(packed_cache, "MIN_BYTES", 0)
    return tmp_path / "packed"


def _load(path, **kw):
    loaded = load_model(ModelConfig(model=path, **kw))
    for t in threading.enumerate():  # the file is written in the background
        if t.name == "kvserve-packed-cache":
            t.join()
    return loaded


def _packed(model) -> list[torch.Tensor]:
    out = []
    for m in model.modules():
        out += [w for w, _, _ in getattr(m, "gguf_parts", None) or ()]
        if getattr(m, "packed", None) is not None:
            out.append(m.packed)
    return out


def _greedy(path) -> list[list[int]]:
    from kvserve import LLM

    llm = LLM(path, num_threads=1, num_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_second_load_maps_the_bytes_the_first_packed(tiny, cache_dir, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.model")
    first = _packed(_load(tiny).model)
    files = list(cache_dir.glob("*.pack"))
    assert len(files) == 1 and len(first) > 10
    assert "cached in" in caplog.text
    caplog.clear()
    second = _packed(_load(tiny).model)
    assert "mapped from" in caplog.text
    assert len(second) == len(first)
    size = files[0].stat().st_size
    for a, b in zip(first, second):
        assert torch.equal(a, b)
        assert not b.untyped_storage().resizable()  # a view of the mapping, not a copy
    assert sum(b.numel() for b in second) <= size
    assert oct(files[0].stat().st_mode & 0o777) == oct(0o600)
    assert oct(cache_dir.stat().st_mode & 0o777) == oct(0o700)


def test_greedy_tokens_are_the_same_from_the_cache(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(packed_cache, "MIN_BYTES", 0)
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path / "packed")
    with monkeypatch.context() as m:
        m.setattr(packed_cache, "PackedCache", _Absent)
        repacked = _greedy(tiny)
    writes = _greedy(tiny)
    for t in threading.enumerate():
        if t.name == "kvserve-packed-cache":
            t.join()
    caplog.set_level(logging.INFO, logger="kvserve.model")
    mapped = _greedy(tiny)
    assert "mapped from" in caplog.text
    assert repacked == writes == mapped


class _Absent:
    """A PackedCache that never holds anything nor writes (the load without a cache)."""

    def __init__(self, *a, **kw):
        pass

    def take(self, parts):
        return None

    def put(self, parts, packed, kind):
        pass

    def finish(self, background=True):
        return None


def test_a_changed_file_is_repacked(tiny, tmp_path, cache_dir, caplog):
    path = str(tmp_path / "copy.gguf")
    with open(tiny, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    _load(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    caplog.set_level(logging.INFO, logger="kvserve.model")
    _load(path)
    assert "mapped from" not in caplog.text and "cached in" in caplog.text
    assert len(list(cache_dir.glob("*.pack"))) == 2


def _parts(seed: int, rows: int = 32):
    """One Q8_0 weight of `rows` x 64 with random blocks (scale bytes kept finite)."""
    raw = np.random.default_rng(seed).integers(0, 256, (rows, 2 * 34), dtype=np.uint8)
    raw[:, 1::34] &= 0x3B
    return [BlockTensor(raw, Q.Q8_0, (rows, 64))]


def _cache(tmp_path, path=None) -> packed_cache.PackedCache:
    if path is None:
        path = tmp_path / "model.gguf"
        if not path.exists():
            path.write_bytes(b"GGUF")
    return packed_cache.PackedCache(str(path), "gguf", tmp_path / "packed")


def _write(tmp_path, seeds, path=None) -> list:
    c = _cache(tmp_path, path)
    with packed_cache.active(c):
        out = [packed_cache.pack(_parts(s), pack_gguf_parts)[0] for s in seeds]
    c.finish(background=False)
    return out


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(packed_cache, "MIN_BYTES", 0)


def test_an_entry_packed_from_other_blocks_turns_the_cache_off(tmp_path, small):
    _write(tmp_path, [1, 2, 3])
    c = _cache(tmp_path)
    assert c.take(_parts(1)) is not None
    assert c.take(_parts(9)) is None  # not what entry 1 was packed from
    assert c.take(_parts(3)) is None  # the rest of the load repacks
    c.put(_parts(9), *pack_gguf_parts(_parts(9)))
    c.put(_parts(3), *pack_gguf_parts(_parts(3)))
    c.finish(background=False)  # written afresh
    again = _cache(tmp_path)
    for s in (1, 9, 3):
        t, _ = again.take(_parts(s))
        assert torch.equal(t, pack_gguf_parts(_parts(s))[0])
    assert again.hits == 3


@pytest.mark.parametrize(
    "damage",
    ["magic", "truncated", "header", "huge header", "not a dict", "entry past the end", "mode"],
)
def test_a_damaged_file_is_repacked(tmp_path, small, damage):
    _write(tmp_path, [1, 2])
    (f,) = (tmp_path / "packed").glob("*.pack")
    data = bytearray(f.read_bytes())
    if damage == "magic":
        data[:8] = b"NOTAPACK"
    elif damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "header":
        data[20:30] = b"\xff" * 10
    elif damage == "huge header":
        data[8:16] = (1 << 62).to_bytes(8, "little")
    elif damage in ("not a dict", "entry past the end"):
        n = int.from_bytes(data[8:16], "little")
        meta = json.loads(bytes(data[16 : 16 + n]))
        if damage == "not a dict":
            meta = [meta]
        else:
            meta["entries"][1]["nbytes"] = len(data)
        body = json.dumps(meta).encode()  # into the header's spare room
        data[8:16] = len(body).to_bytes(8, "little")
        data[16 : 16 + len(body)] = body
    f.write_bytes(bytes(data))
    if damage == "mode":  # writable by others
        f.chmod(0o666)
    c = _cache(tmp_path)
    assert c.take(_parts(1)) is None and c.mapped is None


def test_mapped_weights_are_copy_on_write(tmp_path, small):
    _write(tmp_path, [1])
    (f,) = (tmp_path / "packed").glob("*.pack")
    before = f.read_bytes()
    t, _ = _cache(tmp_path).take(_parts(1))
    t.fill_(7)
    assert f.read_bytes() == before
    t2, _ = _cache(tmp_path).take(_parts(1))
    assert torch.equal(t2, pack_gguf_parts(_parts(1))[0])


def test_a_failed_write_leaves_nothing(tmp_path, small, monkeypatch, caplog):
    def broken(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    _write(tmp_path, [1, 2])
    assert list((tmp_path / "packed").iterdir()) == []
    assert "not written" in caplog.text


def test_only_the_most_recently_used_files_are_kept(tmp_path, small, monkeypatch):
    monkeypatch.setattr(packed_cache, "KEEP_FILES", 2)
    models, seen = [], set()
    for i in range(4):
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(b"GGUF" * (i + 1))
        models.append(p)
        _write(tmp_path, [i], p)
        (new,) = set((tmp_path / "packed").glob("*.pack")) - seen
        os.utime(new, (1000 + i, 1000 + i))  # each older than the next write
        seen.add(new)
    assert len(list((tmp_path / "packed").glob("*.pack"))) == 2
    assert _cache(tmp_path, models[3]).take(_parts(3)) is not None  # the newest two are kept
    assert _cache(tmp_path, models[2]).take(_parts(2)) is not None
    assert _cache(tmp_path, models[1]).take(_parts(1)) is None


def test_small_loads_and_the_flag_write_nothing(tiny, tmp_path, monkeypatch):
    from kvserve.config import engine_config_from_args
    from kvserve.server.launcher import build_parser

    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path / "packed")
    _load(tiny)  # a tiny model: below MIN_BYTES
    assert not (tmp_path / "packed").exists() or not list((tmp_path / "packed").iterdir())
    args = build_parser().parse_args(["--model", tiny, "--no-packed-cache"])
    cfg = engine_config_from_args(args)
    assert cfg.model.packed_cache is False
    monkeypatch.setattr(packed_cache, "MIN_BYTES", 0)
    _load(tiny, packed_cache=False)
    assert not (tmp_path / "packed").exists() or not list((tmp_path / "packed").iterdir())
