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
    assert v.count("Q6_K") == sum(more_bits(i, layers) for i in range(layers)) == 16  # half
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
    """In the gguf format (two activation parts, as the layer-stack test of the default model):
    final hidden states and logits of a step of decodes beside a prompt chunk agree; the rows
    differ from each other (the weights are centred: a wrong or missing part shows)."""
    from kvserve.model.loader import load_model

    lm = load_model(ModelConfig(model=preset_files["q4_k_m"], quantization="gguf"))
    a = _mixed_step(lm, PROMPTS, c_stack=True)
    b = _mixed_step(lm, PROMPTS, c_stack=False)
    assert b.isfinite().all() and (b[1:] - b[0]).abs().max() > 0.05 * b.abs().max()
    assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()
    la, lb = lm.model.compute_logits(a), lm.model.compute_logits(b)
    assert (la - lb).abs().max().item() < 1e-3 * lb.abs().max().item()


def test_a_kv_cache_the_stack_cannot_read_is_named_at_start(preset_files, caplog):
    """A bfloat16 KV pool keeps a packed model on the PyTorch forward, and start-up says so
    instead of announcing the C layer stack."""
    import logging

    from kvserve import LLM

    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(
            preset_files["q4_k_m"],
            kv_cache_memory="16MiB",
            max_model_len=128,
            kv_cache_dtype="bfloat16",
        )
    assert llm.engine.runner.layer_stack is None
    assert "steps: C layer stack" not in caplog.text
    assert "steps: PyTorch forward (the KV cache is torch.bfloat16" in caplog.text
    assert "to get the C layer stack back: --kv-cache-dtype float32, float16 or int8" in caplog.text


def test_a_declined_stack_names_the_tensor(preset_files, caplog):
    """A linear kept dense names itself and why in the start-up log (no silent cliff)."""
    import logging

    from kvserve import LLM
    from kvserve.model.quant import GgufMethod

    lm_file = preset_files["q4_k_m"]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(lm_file, kv_cache_memory="16MiB", max_model_len=128, quantization="gguf")
    assert "steps: C layer stack" in caplog.text
    assert llm.engine.step_path.startswith("C layer stack")
    model = llm.engine.runner.model
    lin = model.layers[1].mlp.down_proj
    assert isinstance(lin.quant_method, GgufMethod)
    lin.gguf_parts, lin.dense_reason = [], "GGUF type Q5_1 has no packed kind"
    from kvserve.runner.layer_stack import CLayerStack

    assert (
        CLayerStack.declined(model)
        == "layer 1 mlp down: kept dense (GGUF type Q5_1 has no packed kind)"
    )


def test_a_tensor_without_a_packed_kind_is_named_at_start(tmp_path, default_gguf, caplog):
    """One Q2_K attn_v (a type the C kernels do not run) keeps that fused q/k/v dense and the
    model on the PyTorch forward: start-up names the layer, the linear and the type."""
    import logging

    from kvserve import LLM

    path = str(tmp_path / "tiny-q2_k-v.gguf")
    write_model(
        path, "tiny", "q4_k_m", tokenizer_from=default_gguf, types={"blk.2.attn_v.weight": "Q2_K"}
    )
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128)
    assert llm.engine.runner.layer_stack is None
    why = "layer 2 attn qkv: kept dense (part v: GGUF type Q2_K has no packed kind)"
    assert f"steps: PyTorch forward ({why}); no setting brings" in caplog.text
    assert llm.engine.step_path == f"PyTorch forward ({why})"  # what benchmarks record
