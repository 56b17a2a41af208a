"""The GGUF type mixes llama-quantize writes (kvserve/bench/gguf_presets.py, random weights of a
tiny Llama shape) load onto the C layer stack, every one of them (Q2_K to Q8_0, IQ4_NL, IQ4_XS,
F16, BF16): Q4_K_M's fused q/k/v of a Q4_K q and k and a Q6_K v run side by side, and the stack
computes what the PyTorch layers do, and what a dense float32 model of the file's dequantized
weights does."""

import pytest

from kvserve.bench.gguf_presets import PRESETS, SIZES, more_bits, tensor_type, write_model
from kvserve.config import ModelConfig
from tests.model.test_quant_model import _mixed_step

QKV = ("attn_q", "attn_k", "attn_v")
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


def test_presets_mix_types_as_llama_quantize_does():
    """A few of llama_tensor_get_type's choices for a Llama of 32 layers with 4 query heads per
    KV head."""
    n = 32

    def types(preset, role):
        return [tensor_type(preset, role, i, n, gqa=4) for i in range(n)]

    assert set(types("q2_k", "attn_v")) == {"Q4_K"} and set(types("q2_k", "ffn_down")) == {"Q3_K"}
    assert tensor_type("q2_k", "attn_v", 0, n, gqa=2) == "Q3_K"
    assert types("q3_k_m", "attn_v")[:3] == ["Q5_K", "Q5_K", "Q4_K"]
    assert types("q3_k_m", "ffn_down")[:3] == ["Q5_K", "Q5_K", "Q4_K"]
    assert set(types("q3_k_l", "attn_output")) == {"Q5_K"}
    assert types("q4_k_s", "attn_v").count("Q5_K") == 4
    assert types("iq4_xs", "ffn_down").count("Q5_K") == 4
    assert {tensor_type(p, "output", 0, n) for p in ("q2_k", "q5_k_s", "iq4_nl")} == {"Q6_K"}
    assert {tensor_type("bf16", r, 3, n) for r in ("attn_v", "output", "ffn_up")} == {"BF16"}


def _qkv_runs(preset):
    """How many runs of one packed kind the tiny model's fused q/k/v of each layer has."""
    from kvserve.ops.gguf_blocks import FLOAT_KIND, packed_kind
    from kvserve.ops.gguf_types import GGMLQuantizationType as Q

    layers, heads, kv_heads = SIZES["tiny"][0], SIZES["tiny"][2], SIZES["tiny"][3]
    runs = []
    for i in range(layers):
        kinds = [
            packed_kind(Q[t]) or FLOAT_KIND
            for t in (tensor_type(preset, r, i, layers, heads // kv_heads) for r in QKV)
        ]
        runs.append(1 + sum(a != b for a, b in zip(kinds, kinds[1:])))
    return runs


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_the_c_layer_stack(preset_files, preset):
    from kvserve.model.loader import load_model
    from kvserve.runner.layer_stack import CLayerStack

    lm = load_model(ModelConfig(model=preset_files[preset]))
    assert CLayerStack.declined(lm.model) is None
    parts = [len(layer.self_attn.qkv_proj.gguf_parts) for layer in lm.model.layers]
    assert parts == _qkv_runs(preset), parts
    if preset in ("q4_k_m", "q3_k_m", "q4_k_s", "q2_k"):  # kinds side by side somewhere
        assert max(parts) == 2


@pytest.mark.parametrize("preset", ["q4_k_m", "q3_k_m", "iq4_xs", "q2_k", "f16", "bf16"])
def test_mixed_kinds_on_the_c_stack_compute_what_the_pytorch_layers_do(preset_files, preset):
    """In the gguf format (two activation parts, as the layer-stack test of the default model):
    final hidden states and logits of a step of decodes beside a prompt chunk agree; the rows
    differ from each other (the weights are centred: a wrong or missing part shows)."""
    from kvserve.model.loader import load_model

    lm = load_model(ModelConfig(model=preset_files[preset], quantization="gguf"))
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
    """One IQ2_XXS attn_v (a type the C kernels do not run) keeps that fused q/k/v dense and the
    model on the PyTorch forward: start-up names the layer, the linear and the type."""
    import logging

    from kvserve import LLM

    path = str(tmp_path / "tiny-iq2_xxs-v.gguf")
    write_model(
        path,
        "tiny",
        "q4_k_m",
        tokenizer_from=default_gguf,
        types={"blk.2.attn_v.weight": "IQ2_XXS"},
    )
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128)
    assert llm.engine.runner.layer_stack is None
    why = "layer 2 attn qkv: kept dense (part v: GGUF type IQ2_XXS has no packed kind)"
    assert f"steps: PyTorch forward ({why}); no setting brings" in caplog.text
    assert llm.engine.step_path == f"PyTorch forward ({why})"  # what benchmarks record


@pytest.mark.parametrize("preset", ["q2_k", "f16"])
def test_the_c_stack_computes_what_the_dequantized_weights_do(preset_files, preset):
    """Against the PyTorch forward of a dense float32 model of the file's dequantized weights
    (quantization "none"): the stack's only difference is its activations' two 8-bit parts, so
    the logits agree closely and every row picks the same greedy token."""
    import torch

    from kvserve.model.loader import load_model

    packed = load_model(ModelConfig(model=preset_files[preset], quantization="gguf"))
    dense = load_model(ModelConfig(model=preset_files[preset], quantization="none"))
    assert dense.model.dtype == torch.float32
    la = packed.model.compute_logits(_mixed_step(packed, PROMPTS, c_stack=True))
    lb = dense.model.compute_logits(_mixed_step(dense, PROMPTS, c_stack=False))
    assert (la - lb).abs().max().item() < 1e-3 * lb.abs().max().item()
    assert torch.equal(la.argmax(-1), lb.argmax(-1))


def test_bench_counts_what_a_decode_step_reads(preset_files):
    """`bench latency`'s MBU: llama.cpp's bytes per step are the file's tensors less the gathered
    embedding, plus its float16 KV; kvserve's packed step reads about as much for a 4-bit file."""
    import gguf

    from kvserve import LLM
    from kvserve.bench.datasets import BenchRequest
    from kvserve.bench.latency import gguf_step_bytes, kvserve_step_bytes

    layers, hidden, heads, kv_heads, _ = SIZES["tiny"]
    req = BenchRequest(list(range(1, 41)), 20)  # mean context 50 tokens
    reader = gguf.GGUFReader(preset_files["q4_0"])
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    weights = sum(sizes.values()) - ("output.weight" in sizes) * sizes["token_embd.weight"]
    kv = layers * kv_heads * (hidden // heads) * 2 * 2 * 50
    assert gguf_step_bytes(preset_files["q4_0"], req) == weights + kv
    llm = LLM(preset_files["q4_0"], max_num_seqs=1, max_model_len=128)
    ours = kvserve_step_bytes(llm, req)
    assert 0.97 * (weights + kv) < ours < 1.05 * (weights + kv)  # Q4_0 packs at 4.5 bits too


def test_bench_lora_adapters_fit_the_model(preset_files, tmp_path):
    """kvserve.bench.lora_adapters writes PEFT directories shaped for a model: the engine loads
    them (shapes checked against the base) and a request under one runs on the C stack with its
    delta (its top logprob moves)."""
    from kvserve import LLM, SamplingParams
    from kvserve.bench import lora_adapters
    from kvserve.lora import LoRARequest

    assert (
        lora_adapters.main(
            ["--model", preset_files["q4_0"], "--count", "2", "--rank", "8", "-o", str(tmp_path)]
        )
        == 0
    )
    llm = LLM(preset_files["q4_0"], enable_lora=True, max_lora_rank=8, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=1)
    base = llm.generate(["Hello"], params, use_tqdm=False)[0]
    lora = LoRARequest("a1", 1, str(tmp_path / "a1"))
    tuned = llm.generate(["Hello"], params, use_tqdm=False, lora_request=lora)[0]
    assert "C layer stack" in llm.engine.step_path
    assert tuned.outputs[0].logprobs[0].top[0][2] != base.outputs[0].logprobs[0].top[0][2]
