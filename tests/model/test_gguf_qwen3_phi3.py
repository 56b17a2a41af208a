"""Qwen3 and Phi-3 GGUF files as llama.cpp's converter writes them, from tiny random transformers
models: tensor names from gguf-py's own HF -> GGUF name map (TensorNameMap), llama.cpp's metadata
keys, the linears quantized to Q8_0 (the transformers model then gets the dequantized weights, so
both hold the same numbers).

    qwen3  per-head q/k norms (attn_q_norm / attn_k_norm), head_dim 32 != hidden / heads
           (attention.key_length)
    phi3   fused attn_qkv and ffn_up (gate rows, then up rows), partial rotary
           (rope.dimension_count 12 of 16), LongRoPE: rope_factors_short/long tensors,
           rope.scaling.original_context_length 16 and attn_factor, a 30-token prompt (the long
           factors, in transformers and in kvserve)

Checked: logits at every position equal transformers' (the file dequantized, chunked prefill
through a paged pool), and the C layer stack (packed Q8_0 blocks) computes what the PyTorch
forward computes with the same packed weights.
"""

import math

import numpy as np
import pytest
import torch

from tests.model.test_forward_vs_hf import BLOCK, PagedPool
from tests.model.test_quant_model import _mixed_step

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,  # the default model's tokenizer, copied into the file
    max_position_embeddings=256,
    initializer_range=0.2,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.5],
    "long_factor": [1.0, 2.5, 5.0, 9.0, 17.0, 40.0],
}
CASES = {
    "qwen3": (
        gguf.MODEL_ARCH.QWEN3,
        lambda: transformers.Qwen3ForCausalLM._from_config(
            transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
            attn_implementation="eager",
        ),
    ),
    "phi3": (
        gguf.MODEL_ARCH.PHI3,
        lambda: transformers.Phi3ForCausalLM._from_config(
            transformers.Phi3Config(
                **TINY,
                pad_token_id=0,
                original_max_position_embeddings=16,
                rope_parameters=dict(LONGROPE),
            ),
            attn_implementation="eager",
        ),
    ),
}


def tokenizer_fields(gguf_path: str) -> dict:
    """The tokenizer.* metadata of a GGUF file (kvserve's reader: gguf-py's takes seconds)."""
    from kvserve.model.gguf_file import GGUFFile

    return {k: v for k, v in GGUFFile(gguf_path).metadata.items() if k.startswith("tokenizer.")}


def write_gguf(path: str, name: str, hf, tokenizer: dict) -> None:
    """`hf`'s weights as llama.cpp's convert_hf_to_gguf.py writes a `name` model, with the
    `tokenizer` fields; its 2-D linears (not the embedding) quantized to Q8_0, and `hf` given
    back the dequantized values."""
    from gguf.quants import dequantize, quantize

    arch, _ = CASES[name]
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if name == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        rope = c.rope_parameters
        orig = c.original_max_position_embeddings
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_sliding_window(0)
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        for kind in ("long", "short"):
            w.add_tensor(
                f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], np.float32)
            )
    for key, value in tokenizer.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    with torch.no_grad():
        for hf_name, p in hf.state_dict().items():
            target = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert target is not None, hf_name
            a = p.float().numpy()
            if a.ndim == 2 and hf_name != "model.embed_tokens.weight":
                q = quantize(a, gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
                w.add_tensor(target, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(target, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    return tokenizer_fields(default_gguf)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    hf = CASES[request.param][1]().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "q_norm" in n or "k_norm" in n:  # HF starts them at one: make them matter
                torch.nn.init.normal_(p, mean=1.0, std=0.5)
    path = str(tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf")
    write_gguf(path, request.param, hf, tokenizer)
    return request.param, path, hf


def chunked_logits(lm, ids: list[int], split: int) -> torch.Tensor:
    from kvserve.ops.attention import AttentionMetadata

    pool = PagedPool(lm.arch, num_blocks=8, seed=5)
    outs = []
    for start, end in ((0, split), (split, len(ids))):
        slots = torch.tensor(pool.slots(0, start, end - start))
        meta = AttentionMetadata(
            slots, [0, end - start], [end], torch.tensor([pool.tables[0]]), BLOCK
        )
        h = lm.model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, pool.kv)
        outs.append(lm.model.compute_logits(h))
    return torch.cat(outs)


def test_gguf_logits_match_transformers(case):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    name, path, hf = case
    lm = load_model(ModelConfig(model=path, quantization="none"))
    assert lm.arch.name == name
    assert lm.arch.qk_norm == (name == "qwen3")
    assert (lm.arch.head_dim, lm.arch.rotary_dim) == ((32, None) if name == "qwen3" else (16, 12))
    assert lm.arch.sliding_window is None
    if name == "phi3":
        assert lm.arch.rope_scaling["original_max_position_embeddings"] == 16
        assert lm.model.rotary.attention_factor == pytest.approx(math.sqrt(2))
    ids = list(range(500, 530))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(chunked_logits(lm, ids, 13), ref, atol=1e-4, rtol=1e-4)


def test_c_layer_stack_matches_the_pytorch_forward(case):
    """The file's Q8_0 blocks kept packed (quantization gguf): the C layer stack and the PyTorch
    forward, same weights, a step mixing decodes with a prompt chunk."""
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model
    from kvserve.runner.layer_stack import CLayerStack

    name, path, _ = case
    lm = load_model(ModelConfig(model=path, quantization="gguf"))
    why = CLayerStack.declined(lm.model)
    if why is not None and "C kernels are not built" in why:
        pytest.skip(why)
    assert why is None
    prompts = ["The capital of France is", "def f(x):\n    return", "one two three four five six"]
    a = _mixed_step(lm, prompts, c_stack=True)
    b = _mixed_step(lm, prompts, c_stack=False)
    assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()
