"""How tensor parallelism splits a model (kvserve/runner/tensor_parallel.py): KV heads in
contiguous runs, uneven where they must be, every head and row exactly once."""

import pytest

from kvserve.config import make_engine_config
from kvserve.runner.tensor_parallel import even_split, kv_head_split


def test_kv_heads_split_contiguously_and_unevenly_where_needed():
    assert kv_head_split(3, 2) == [range(0, 2), range(2, 3)]
    assert kv_head_split(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert kv_head_split(5, 1) == [range(0, 5)]
    with pytest.raises(ValueError, match="more than the model's 3 KV heads"):
        kv_head_split(3, 4)


@pytest.mark.parametrize("n,world", [(1536, 2), (49152, 3), (7, 4), (5, 5)])
def test_even_splits_cover_every_row_once(n, world):
    parts = [even_split(n, world, r) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_tensor_parallel_configuration():
    cfg = make_engine_config(tensor_parallel_size=2, num_threads=None)
    assert cfg.tensor_parallel_size == 2 and cfg.model.quantization == "none"
    for bad in (0, 65, True, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            make_engine_config(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="float weights"):
        make_engine_config(tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match="speculative"):
        make_engine_config(tensor_parallel_size=2, speculative_config={"method": "ngram"})
