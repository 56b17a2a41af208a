"""KV memory calculator: the textbook figures, sliding windows, loaders, the CLI."""

import json
import os

import pytest

from kvserve import kv_calc
from kvserve.kv_calc import KVArch


def test_llama3_8b_fp16_8k_is_one_gib_per_sequence():
    arch = kv_calc.load_arch("llama-3-8b")
    assert kv_calc.kv_bytes_per_token(arch, "float16") == 131_072
    assert kv_calc.kv_bytes_per_sequence(arch, "fp16", 8192) == 1_073_741_824


def test_llama_7b_mha_fp16_2k_is_one_gib_per_sequence():
    arch = kv_calc.load_arch("llama-7b")
    assert kv_calc.kv_bytes_per_token(arch, "bf16") == 524_288
    assert kv_calc.kv_bytes_per_sequence(arch, "float16", 2048) == 1_073_741_824


def test_sliding_window_layers_cap_at_the_window():
    full = KVArch("x", 4, 2, 8)
    swa = KVArch("x", 4, 2, 8, sliding_window=100)
    half = KVArch("x", 4, 2, 8, sliding_window=100, sliding_layers=[0, 2])
    per_layer_token = 2 * 2 * 8 * 4
    assert kv_calc.kv_bytes_per_sequence(full, "fp32", 1000) == 4 * 1000 * per_layer_token
    assert kv_calc.kv_bytes_per_sequence(swa, "fp32", 1000) == 4 * 100 * per_layer_token
    assert kv_calc.kv_bytes_per_sequence(swa, "fp32", 50) == 4 * 50 * per_layer_token
    assert (
        kv_calc.kv_bytes_per_sequence(half, "fp32", 1000) == (2 * 100 + 2 * 1000) * per_layer_token
    )


def test_static_vs_paged_capacity():
    arch = kv_calc.load_arch("llama-3-8b")
    memory = 16 * 2**30
    assert kv_calc.max_seqs_static(arch, "fp16", memory, 8192) == 16
    # 1000 tokens -> 63 blocks of 16 -> 1008 tokens of KV each.
    lengths = kv_calc.length_distribution(1000)
    assert kv_calc.max_seqs_paged(arch, "fp16", memory, lengths, 16) == memory // (1008 * 131_072)


def test_length_distributions_keep_their_mean():
    for kind in ("fixed", "uniform", "geometric"):
        dist = kv_calc.length_distribution(100, kind)
        assert sum(dist.values()) == pytest.approx(1.0)
        assert sum(n * q for n, q in dist.items()) == pytest.approx(100, rel=1e-3)
    capped = kv_calc.length_distribution(100, "uniform", cap=50)
    assert max(capped) == 50
    with pytest.raises(ValueError):
        kv_calc.length_distribution(10, "zipf")


def test_hf_config_defaults_and_sliding_patterns():
    arch = kv_calc.from_hf_config(
        {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}
    )
    assert (arch.num_kv_heads, arch.head_dim) == (8, 64)
    gemma3 = kv_calc.from_hf_config(
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 12,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_size": 1152,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
        }
    )
    assert gemma3.sliding_layers == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    typed = kv_calc.from_hf_config(
        {
            "text_config": {
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "hidden_size": 64,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            }
        }
    )
    assert typed.sliding_layers == [0, 2]
    qwen = kv_calc.from_hf_config(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "hidden_size": 64,
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert qwen.sliding_window is None


def test_hf_directory(tmp_path):
    cfg = {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    arch = kv_calc.load_arch(str(tmp_path))
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (30, 3, 64)
    assert arch.num_params == 134_515_008  # SmolLM2-135M's real count
    assert arch.weight_bytes == 1000


def test_smollm2_gguf_figures():
    from tests.conftest import default_model_or_skip

    path = default_model_or_skip()
    arch = kv_calc.load_arch(None)
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.num_heads) == (30, 3, 64, 9)
    assert arch.context_length == 8192 and arch.sliding_window is None
    assert kv_calc.kv_bytes_per_token(arch, "float32") == 46_080
    assert arch.num_params == 134_515_008
    assert 0 < arch.weight_bytes < os.path.getsize(path)


def test_report_and_cli(capsys):
    arch = kv_calc.load_arch("llama-3-8b")
    text = kv_calc.format_report(arch, "fp16", 8192, 24 * 2**30, 512, 256)
    assert "1,073,741,824 bytes" in text and "131,072 bytes" in text
    assert (
        kv_calc.main(
            [
                "--model",
                "llama-7b",
                "--dtype",
                "fp16",
                "--context-len",
                "2048",
                "--memory",
                "24GiB",
                "--mean-output-len",
                "128",
                "--block-size",
                "16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1.07 GB" in out and "static           24 sequences" in out
    assert kv_calc.main(["--model", "no-such-model"]) == 2
    assert kv_calc.main(["--model", "llama-7b", "--dtype", "fp7"]) == 2


def test_int8_kv_counts_its_scales_as_the_engine_does():
    """The engine's int8 cache keeps a float32 scale per (token, KV head) row: 12,240 bytes per
    token for SmolLM2-135M, not 11,520; and the KV dtype never changes the weights line."""
    from kvserve.config import KV_SCALE_BYTES, KVShape
    from kvserve.kv_calc import PRESETS, format_report, kv_bytes_per_token, paged_bytes_per_sequence

    arch = PRESETS["smollm2-135m"]
    engine = KVShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, 1, KV_SCALE_BYTES["int8"])
    assert kv_bytes_per_token(arch, "int8") == engine.bytes_per_token == 12_240
    assert paged_bytes_per_sequence(arch, "int8", 16) == 16 * 12_240
    weights = {
        line
        for d in ("float32", "int8")
        for line in format_report(arch, d, 4096, 2**30, 512, 256).splitlines()
        if line.startswith("weights")
    }
    assert len(weights) == 1


def test_config_torch_dtype_sizes_the_weights_line():
    from kvserve.kv_calc import format_report, from_hf_config

    cfg = {
        "num_attention_heads": 8,
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "intermediate_size": 1024,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
    }
    arch = from_hf_config(cfg)
    assert arch.weight_dtype == "bfloat16"
    line = next(
        ln
        for ln in format_report(arch, "float32", 2048, 2**30, 256, 64).splitlines()
        if ln.startswith("weights")
    )
    assert f"{arch.num_params * 2:,} bytes" in line


def test_window_figures_are_the_engine_allocators():
    """kv-calc's paged sizes and pools come from the functions the engine's allocator uses."""
    from kvserve.config import CacheConfig, SchedulerConfig

    gemma = KVArch(
        "gemma3-270m",
        18,
        1,
        256,
        num_heads=4,
        sliding_window=512,
        sliding_layers=[i for i in range(18) if (i + 1) % 6 != 0],
    )
    per_layer_block = 2 * 256 * 4 * 16
    # 8192 tokens decoding: 512 blocks on each of 3 full layers, 32 on each of 15 window layers
    # (the count the KV manager holds, tests/unit/test_sliding_window_kv.py).
    assert (
        kv_calc.paged_bytes_per_sequence(gemma, "fp32", 8192)
        == (3 * 512 + 15 * 32) * per_layer_block
    )
    assert kv_calc.paged_bytes_per_sequence(gemma, "fp32", 8192) * 4 <= 18 * 512 * per_layer_block
    # A misaligned window spans one more block: 1000 tokens hold blocks 30..62.
    assert (
        kv_calc.paged_bytes_per_sequence(gemma, "fp32", 1000)
        == (3 * 63 + 15 * 33) * per_layer_block
    )
    memory = 2**30
    pools = kv_calc.engine_pools(gemma, "fp32", memory)
    engine = CacheConfig(kv_cache_memory=memory).kv_groups(
        gemma.kv_shape("fp32"), gemma.layer_windows, SchedulerConfig()
    )
    assert pools == engine
    lengths = kv_calc.length_distribution(768)
    assert kv_calc.max_seqs_paged(gemma, "fp32", memory, lengths) == pools[0].num_blocks // 48
    assert kv_calc.max_seqs_paged(gemma, "fp32", 1000, lengths) == 0
