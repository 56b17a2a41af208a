"""Engine configuration: bad values fail at construction with the fix in the message."""

import pytest

from kvserve.config import DTYPE_BYTES, KVShape, canonical_dtype, make_engine_config


def test_unsupported_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4' is not supported"):
        make_engine_config(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="fp8 runs on cuda only"):  # fp8 is a GPU cache format
        make_engine_config(kv_cache_dtype="fp8", device="cpu").on_device(cuda_available=False)
    assert make_engine_config(kv_cache_dtype="bfloat16").cache.kv_cache_dtype == "bfloat16"
    assert make_engine_config(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"


def test_int8_kv_bytes_per_token_include_the_row_scales():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    assert KVShape(30, 3, 64, 4).bytes_per_token == 46080
    assert KVShape(30, 3, 64, 1, 4).bytes_per_token == 2 * 30 * 3 * (64 + 4)  # 12,240: 3.76x fewer


@pytest.mark.parametrize(
    "alias, name",
    [
        ("bf16", "bfloat16"),
        ("BFloat16", "bfloat16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("float32", "float32"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("int8", "int8"),
    ],
)
def test_canonical_dtype_maps_every_alias(alias, name):
    assert canonical_dtype(alias) == name
    assert DTYPE_BYTES[alias.lower()] == DTYPE_BYTES[name]


def test_engine_config_canonicalizes_dtypes_once():
    # LLM(dtype="bf16") builds its config here: downstream (runner, KV sizing) sees canonical names
    # only.
    cfg = make_engine_config(dtype="bf16")
    assert cfg.model.dtype == "bfloat16" and cfg.cache.kv_cache_dtype == "auto"
    cfg = make_engine_config(dtype="half", kv_cache_dtype="fp16")
    assert (cfg.model.dtype, cfg.cache.kv_cache_dtype) == ("float16", "float16")
    assert make_engine_config(kv_cache_dtype="fp32").cache.kv_cache_dtype == "float32"


def test_bad_dtypes_name_the_accepted_values():
    with pytest.raises(
        ValueError,
        match=r"dtype 'fp64' is not supported: choose one of "
        r"\['float32', 'bfloat16', 'float16'\].*bf16",
    ):
        make_engine_config(dtype="fp64")
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):  # not a compute dtype
        make_engine_config(dtype="int8")
    with pytest.raises(ValueError, match=r"'float32', 'bfloat16', 'float16', 'int8'.*half"):
        canonical_dtype("double")
    with pytest.raises(ValueError, match="not supported"):
        canonical_dtype(None)


def test_torch_dtype_is_the_one_mapping_of_canonical_names():
    torch = pytest.importorskip("torch")
    from kvserve.model.loader import TORCH_DTYPES, torch_dtype
    from kvserve.runner import model_runner

    assert model_runner._TORCH_DTYPES is TORCH_DTYPES
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("int8") is torch.int8
    cfg = make_engine_config(dtype="bf16", kv_cache_dtype="half")
    assert (
        TORCH_DTYPES[cfg.model.dtype] is torch.bfloat16
        and TORCH_DTYPES[cfg.cache.kv_cache_dtype] is torch.float16
    )


def test_speculative_config_is_parsed_like_vllms_flag():
    import pytest

    from kvserve.config import SpeculativeConfig, make_engine_config

    cfg = make_engine_config(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 5, "prompt_lookup_min": 1}'
    )
    assert cfg.speculative == SpeculativeConfig("ngram", 3, 5, 1)
    assert make_engine_config().speculative is None
    for bad, field in [
        ("{", "not valid JSON"),
        ('{"method": "eagle"}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 18446744073709551616}', "at most 32"),
        ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
        (
            '{"method": "ngram", "prompt_lookup_max": 18446744073709551616}',
            "prompt_lookup_max must be at most 32",
        ),
        ('{"method": "ngram", "prompt_lookup_min": 5}', "prompt_lookup_min"),
        ('{"method": "ngram", "k": 2}', "unknown field"),
        ('{"num_speculative_tokens": 2}', "method"),
        ('{"method": "draft_model"}', "must name the draft model"),
        ('{"method": "draft_model", "model": ""}', "must name the draft model"),
        (
            '{"method": "draft_model", "model": "m.gguf", "prompt_lookup_max": 3}',
            r"unknown field\(s\) \['prompt_lookup_max'\] for method draft_model",
        ),
        ('{"method": "self_speculative", "draft_layers": 0}', "draft_layers"),
        ('{"method": "self_speculative", "draft_layers": true}', "draft_layers"),
        ('{"method": "self_speculative", "model": "m.gguf"}', "unknown field"),
        ('{"method": ["ngram"]}', "method"),
    ]:
        with pytest.raises(ValueError, match=field):
            make_engine_config(speculative_config=bad)
    cfg = make_engine_config(
        speculative_config='{"method": "draft_model", "model": "small.gguf", '
        '"num_speculative_tokens": 3}'
    )
    assert (
        cfg.speculative.method,
        cfg.speculative.model,
        cfg.speculative.num_speculative_tokens,
    ) == ("draft_model", "small.gguf", 3)
    cfg = make_engine_config(speculative_config='{"method": "self_speculative", "draft_layers": 8}')
    assert (cfg.speculative.method, cfg.speculative.draft_layers) == ("self_speculative", 8)
