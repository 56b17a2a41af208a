"""The GGUF type mixes llama-quantize writes (kvserve/bench/gguf_presets.py, random weights of a
tiny Llama shape) load onto the C layer stack, every one of them: Q4_K_M's fused q/k/v of a
Q4_K q and k and a Q6_K v run side by side, and the stack computes what the PyTorch layers do."""
import pytest

from kvserve.bench.gguf_presets import PRESETS, more_bits, tensor_type, write_model
from kvserve.config import ModelConfig
from tests.model.test_quant_model import _mixed_step

PROMPTS = ["The capital of France is", "Once upon a time", "def f(x):\n    return"]


@pytest.fixture(scope="module")
def preset_files(tmp_path_factory, default_gguf):
    root = tmp_path_factory.mktemp("presets")
    files = {}
    for preset in PRESETS:
        files[preset] = str(root / f"tiny-{preset}.gguf")
        write_model(files[preset], "tiny", preset, tokenizer_from=default_gguf)
    return files


def test_q4_k_m_mixes_types_as_llama_quantize_does():
    layers = 32
    v = [tensor_type("q4_k_m", "attn_v", i, layers) for i in range(layers)]
    assert v.count("Q6_K") == sum(more_bits(i, layers) for i in range(layers)) == 16   # half
    assert {tensor_type("q4_k_m", r, 5, layers) for r in ("attn_q", "attn_k", "ffn_up")} == {"Q4_K"}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_the_c_layer_stack(preset_files, preset):
    from kvserve.model.loader import load_model
    from kvserve.runner.layer_stack import CLayerStack
    lm = load_model(ModelConfig(model=preset_files[preset]))
    assert CLayerStack.declined(lm.model) is None
    parts = [len(layer.self_attn.qkv_proj.gguf_parts) for layer in lm.model.layers]
    assert parts == ([1, 1, 2, 2] if preset in ("q4_k_m",) else [1] * 4), parts


def test_mixed_kinds_on_the_c_stack_compute_what_the_pytorch_layers_do(preset_files):
    from kvserve.model.loader import load_model
    lm = load_model(ModelConfig(model=preset_files["q4_k_m"]))
    a = _mixed_step(lm, PROMPTS, c_stack=True)
    b = _mixed_step(lm, PROMPTS, c_stack=False)
    assert b.isfinite().all() and b.abs().max() > 0
    assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()


def test_a_declined_stack_names_the_tensor(preset_files, caplog):
    """A linear kept dense names itself and why in the start-up log (no silent cliff)."""
    import logging

    from kvserve import LLM
    from kvserve.model.quant import GgufMethod
    lm_file = preset_files["q4_k_m"]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(lm_file, kv_cache_memory="16MiB", max_model_len=128, quantization="gguf")
    assert "every step runs the C layer stack" in caplog.text
    model = llm.engine.runner.model
    lin = model.layers[1].mlp.down_proj
    assert isinstance(lin.quant_method, GgufMethod)
    lin.gguf_parts, lin.dense_reason = [], "GGUF type Q5_1 has no packed kind"
    from kvserve.runner.layer_stack import CLayerStack
    assert CLayerStack.declined(model) == "layer 1 mlp down: kept dense (GGUF type Q5_1 has no packed kind)"
