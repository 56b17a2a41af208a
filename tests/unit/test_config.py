"""Engine configuration: bad values fail at construction with the fix in the message."""
import pytest

from kvserve.config import KVShape, make_engine_config


def test_unsupported_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported"):
        make_engine_config(kv_cache_dtype="fp8")
    assert make_engine_config(kv_cache_dtype="bfloat16").cache.kv_cache_dtype == "bfloat16"
    assert make_engine_config(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"


def test_int8_kv_bytes_per_token_include_the_row_scales():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    assert KVShape(30, 3, 64, 4).bytes_per_token == 46080
    assert KVShape(30, 3, 64, 1, 4).bytes_per_token == 2 * 30 * 3 * (64 + 4)     # 12,240: 3.76x fewer
