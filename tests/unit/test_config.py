"""Engine configuration: bad values fail at construction with the fix in the message."""
import pytest

from kvserve.config import make_engine_config


def test_unsupported_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not supported"):
        make_engine_config(kv_cache_dtype="int8")
    assert make_engine_config(kv_cache_dtype="bfloat16").cache.kv_cache_dtype == "bfloat16"
