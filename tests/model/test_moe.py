"""Mixture-of-experts models against transformers: a tiny random MixtralForCausalLM (4 experts,
top 2, 2 layers, hidden 64) written by the test with save_pretrained, and the same weights as a
GGUF in llama.cpp's layout (general.architecture "llama" with expert_count, stacked
ffn_{gate,up,down}_exps tensors, Q/K rows permuted as its converter does); a tiny
Qwen3MoeForCausalLM (q/k norms, head_dim 32 != hidden / heads, expert width != intermediate_size)
with and without norm_topk_prob, and its GGUF (general.architecture "qwen3moe").

    - the HF directory: logits equal to transformers' at every position, prefilled in two chunks
      through a paged KV pool; greedy-identical over 32 tokens through kvserve.LLM
    - the float32 GGUF (weight format none): the same logits
    - a GGUF whose experts are Q8_0 under the gguf weight format: the experts keep the file's
      blocks for the C kernels, and the logits match transformers run on the dequantized weights
    - Qwen3-MoE: the HF directory's logits, both routings; the float32 GGUF's logits
    - Qwen2-MoE (q/k/v biases, a sigmoid-gated shared expert): the HF directory's logits, and
      32 greedy tokens through kvserve.LLM
    - the runner declines the C layer stack for them; two tensor-parallel ranks or two
      pipeline stages give one process's tokens (Mixtral, and Qwen2-MoE's shared expert)
"""

from __future__ import annotations

import copy
import logging
import shutil

import numpy as np
import pytest
import torch

from kvserve.ops.attention import AttentionMetadata
from tests.model.test_forward_vs_hf import BLOCK, PagedPool

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

EXPERTS, TOP_K, LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 4, 2, 2, 64, 96, 4, 2
IDS = list(range(1000, 1030))


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory, default_gguf):
    """The default model's tokenizer as tokenizer.json (any tokenizer: ids go in directly)."""
    from kvserve.model.gguf_file import GGUFFile
    from kvserve.model.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    Tokenizer.from_gguf_metadata(GGUFFile(default_gguf).metadata).backend.save(str(path))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tokenizer_json):
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        vocab_size=49152,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM._from_config(config, attn_implementation="eager")
    model = model.eval()
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    shutil.copy(tokenizer_json, path / "tokenizer.json")
    return str(path), model


def _logits(lm, ids=IDS):
    """Every position's logits, the prompt prefilled in two chunks through a paged pool."""
    pool = PagedPool(lm.arch, num_blocks=8, seed=3)
    outs = []
    for start, end in ((0, 17), (17, len(ids))):
        ids_t, pos = torch.tensor(ids[start:end]), torch.arange(start, end)
        slots = torch.tensor(pool.slots(0, start, end - start))
        meta = AttentionMetadata(
            slots, [0, end - start], [end], torch.tensor([pool.tables[0]]), BLOCK
        )
        outs.append(lm.model.compute_logits(lm.model(ids_t, pos, meta, pool.kv)))
    return torch.cat(outs)


def _reference(hf, ids=IDS):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _load(path, **kw):
    """kvserve's LoadedModel of `path` (ModelConfig fields in kw)."""
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    return load_model(ModelConfig(model=path, **kw))


def _routes_spread(lm):
    """Every expert of layer 0 is picked by some prompt token (so each expert is exercised)."""
    from kvserve.model.mixtral import route

    moe = lm.model.layers[0].mlp
    h = lm.model.layers[0].input_layernorm(lm.model.embed_tokens(torch.tensor(IDS)))
    _, ids = route(torch.nn.functional.linear(h, moe.gate), TOP_K)
    return set(ids.flatten().tolist())


def test_hf_checkpoint_logits_match_transformers(hf_dir, caplog):
    path, hf = hf_dir
    with caplog.at_level(logging.INFO, logger="kvserve.model"):
        lm = _load(path)
    assert type(lm.model).__name__ == "MixtralForCausalLM"
    assert (lm.arch.name, lm.arch.num_experts, lm.arch.num_experts_per_tok) == ("mixtral", 4, 2)
    assert "experts: 4 per layer, top 2 per token, weights dense torch.float32" in caplog.text
    torch.testing.assert_close(_logits(lm), _reference(hf), atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_through_engine(hf_dir):
    from kvserve import LLM, SamplingParams

    path, hf = hf_dir
    prompts = [IDS[:5], list(range(2000, 2023))]
    llm = LLM(path, kv_cache_memory="16MiB", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
        assert list(o.outputs[0].token_ids) == ref


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def qwen3_moe_dir(request, tmp_path_factory, tokenizer_json):
    torch.manual_seed(1)
    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=160,  # the dense MLP's width: unused, every layer is sparse
        moe_intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=request.param,
        vocab_size=49152,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3MoeForCausalLM._from_config(config, attn_implementation="eager")
    model = model.eval()
    with torch.no_grad():  # HF starts the q/k norms at one: make them matter
        for name, p in model.named_parameters():
            if "_norm" in name:
                torch.nn.init.normal_(p, mean=1.0, std=0.3)
    path = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(path)
    shutil.copy(tokenizer_json, path / "tokenizer.json")
    return str(path), model


def test_qwen3_moe_checkpoint_logits_match_transformers(qwen3_moe_dir):
    path, hf = qwen3_moe_dir
    lm = _load(path)
    assert type(lm.model).__name__ == "Qwen3MoeForCausalLM"
    a = lm.arch
    assert (a.name, a.num_experts, a.num_experts_per_tok, a.intermediate_size) == (
        "qwen3_moe",
        EXPERTS,
        TOP_K,
        FFN,
    )
    assert a.qk_norm and a.norm_topk_prob == hf.config.norm_topk_prob
    torch.testing.assert_close(_logits(lm), _reference(hf), atol=1e-4, rtol=1e-4)


def test_qwen3_moe_gguf_float32_matches_transformers(qwen3_moe_dir, tmp_path):
    hf_path, hf = qwen3_moe_dir
    if not hf.config.norm_topk_prob:
        pytest.skip("llama.cpp's qwen3moe renormalizes the top k: no such GGUF without it")
    path = str(tmp_path / "qwen3moe-f32.gguf")
    write_gguf(path, hf, arch="qwen3moe")
    lm = _load(path, quantization="none", tokenizer=hf_path)
    assert type(lm.model).__name__ == "Qwen3MoeForCausalLM"
    assert (lm.arch.intermediate_size, lm.arch.head_dim, lm.arch.qk_norm) == (FFN, 32, True)
    torch.testing.assert_close(_logits(lm), _reference(hf), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory, tokenizer_json):
    """A tiny Qwen2MoeForCausalLM: q/k/v biases, a shared expert wider than the routed ones and
    its sigmoid gate, no top-k renormalization (Qwen2-MoE's default)."""
    torch.manual_seed(2)
    config = transformers.Qwen2MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=160,  # the dense MLP's width: unused, every layer is sparse
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        vocab_size=49152,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2MoeForCausalLM._from_config(config, attn_implementation="eager")
    model = model.eval()
    with torch.no_grad():  # HF starts biases at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                torch.nn.init.normal_(p, std=0.2)
    path = tmp_path_factory.mktemp("qwen2moe")
    model.save_pretrained(path)
    shutil.copy(tokenizer_json, path / "tokenizer.json")
    return str(path), model


def test_qwen2_moe_checkpoint_logits_match_transformers(qwen2_moe_dir):
    path, hf = qwen2_moe_dir
    lm = _load(path)
    assert type(lm.model).__name__ == "Qwen2MoeForCausalLM"
    a = lm.arch
    assert (a.name, a.num_experts, a.intermediate_size, a.shared_expert_size) == (
        "qwen2_moe",
        EXPERTS,
        FFN,
        128,
    )
    assert a.attention_bias and not a.qk_norm and not a.norm_topk_prob
    assert _routes_spread(lm) == set(range(EXPERTS))
    # the shared expert and its gate count: without them the logits move
    gate = torch.sigmoid(
        torch.nn.functional.linear(
            torch.randn(8, HIDDEN), lm.model.layers[0].mlp.shared_expert_gate
        )
    )
    assert ((gate > 0.05) & (gate < 0.95)).any()
    torch.testing.assert_close(_logits(lm), _reference(hf), atol=1e-4, rtol=1e-4)


def test_qwen2_moe_gguf_float32_matches_transformers(qwen2_moe_dir, tmp_path):
    hf_path, hf = qwen2_moe_dir
    path = str(tmp_path / "qwen2moe-f32.gguf")
    write_gguf(path, hf, arch="qwen2moe")
    lm = _load(path, quantization="none", tokenizer=hf_path)
    assert type(lm.model).__name__ == "Qwen2MoeForCausalLM"
    a = lm.arch
    assert (a.intermediate_size, a.shared_expert_size, a.norm_topk_prob) == (FFN, 128, False)
    assert a.attention_bias
    torch.testing.assert_close(_logits(lm), _reference(hf), atol=1e-4, rtol=1e-4)


def test_qwen2_moe_gguf_q8_experts_stay_packed(qwen2_moe_dir, tmp_path):
    """Q8_0 experts under the gguf format keep the file's blocks; the logits follow transformers
    on the same dequantized expert weights (the shared expert and its gate float32)."""
    from kvserve.ops import cpu_kernels

    hf_path, hf = qwen2_moe_dir
    path = str(tmp_path / "qwen2moe-q8.gguf")
    write_gguf(path, hf, expert_type="Q8_0", arch="qwen2moe")
    lm = _load(path, quantization="gguf", tokenizer=hf_path)
    expert = lm.model.layers[1].mlp.experts[3].down_proj
    if cpu_kernels.available():
        assert expert.gguf_parts and expert.dense_weight is None
    ours, want = _logits(lm), _reference(_q8_experts(hf))
    assert (ours.argmax(-1) == want.argmax(-1)).all()
    torch.testing.assert_close(ours, want, atol=2e-2, rtol=2e-2)


def test_qwen2_moe_greedy_matches_transformers_through_engine(qwen2_moe_dir):
    from kvserve import LLM, SamplingParams

    path, hf = qwen2_moe_dir
    prompts = [IDS[:5], list(range(2000, 2023))]
    llm = LLM(path, kv_cache_memory="16MiB", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
        assert list(o.outputs[0].token_ids) == ref


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for the "llama" architecture."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path: str, hf, expert_type=None, arch="llama") -> None:
    """hf's weights as llama.cpp writes a Mixtral ("llama"), Qwen2-MoE ("qwen2moe") or Qwen3-MoE
    ("qwen3moe") GGUF; experts in `expert_type` (a GGML type name) or float32. No tokenizer in
    the file: the tests load the HF directory's (ModelConfig.tokenizer)."""
    from gguf import GGMLQuantizationType as Q

    cfg, sd = hf.config, {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    head_dim = getattr(cfg, "head_dim", None) or HIDDEN // HEADS
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch != "llama":
        w.add_expert_feed_forward_length(FFN)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])

    def experts(name, a):
        if expert_type is None:
            w.add_tensor(name, np.ascontiguousarray(a))
        else:
            q = gguf.quants.quantize(
                np.ascontiguousarray(a), gguf.GGMLQuantizationType[expert_type]
            )
            w.add_tensor(name, q, raw_dtype=Q[expert_type])

    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":  # llama.cpp's rope order; its qwen files keep HF's
            q, k = _permute(q, HEADS), _permute(k, KV_HEADS)
        elif arch == "qwen3moe":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        else:  # qwen2moe: q/k/v biases, the shared expert and its gate ([H], as llama.cpp's)
            for x in "qkv":
                w.add_tensor(f"blk.{i}.attn_{x}.bias", sd[p + f"self_attn.{x}_proj.bias"])
            for x in ("gate", "up", "down"):
                w.add_tensor(
                    f"blk.{i}.ffn_{x}_shexp.weight", sd[p + f"mlp.shared_expert.{x}_proj.weight"]
                )
            w.add_tensor(
                f"blk.{i}.ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"][0]
            )
        w.add_tensor(f"blk.{i}.attn_q.weight", q)
        w.add_tensor(f"blk.{i}.attn_k.weight", k)
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2 FFN, H]: w1 rows, then w3
        experts(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :FFN])
        experts(f"blk.{i}.ffn_up_exps.weight", gate_up[:, FFN:])
        experts(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _q8_experts(hf):
    """A copy of hf whose expert weights are rounded through Q8_0, as write_gguf stores them."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in ref.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, name)
                raw = gguf.quants.quantize(p.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
                back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(back).reshape(p.shape))
    return ref


def test_gguf_float32_matches_transformers(hf_dir, tmp_path):
    hf_path, hf = hf_dir
    path = str(tmp_path / "mixtral-f32.gguf")
    write_gguf(path, hf)
    lm = _load(path, quantization="none", tokenizer=hf_path)
    assert type(lm.model).__name__ == "MixtralForCausalLM"
    assert (lm.arch.num_experts, lm.arch.num_experts_per_tok) == (4, 2)
    assert _routes_spread(lm) == set(range(EXPERTS))
    torch.testing.assert_close(_logits(lm), _reference(hf), atol=1e-4, rtol=1e-4)


def test_gguf_q8_experts_stay_packed(hf_dir, tmp_path, caplog):
    from kvserve.ops import cpu_kernels
    from kvserve.runner.layer_stack import CLayerStack

    hf_path, hf = hf_dir
    path = str(tmp_path / "mixtral-q8.gguf")
    write_gguf(path, hf, expert_type="Q8_0")
    with caplog.at_level(logging.INFO, logger="kvserve.model"):
        lm = _load(path, quantization="gguf", tokenizer=hf_path)
    expert = lm.model.layers[1].mlp.experts[3].down_proj
    if cpu_kernels.available():
        assert expert.gguf_parts and expert.dense_weight is None
        assert "run by the C kernels one expert at a time" in caplog.text
    why = CLayerStack.declined(lm.model)
    assert why is not None and "4 experts per layer" in why

    # transformers on the dequantized expert weights: the same values kvserve holds
    ours, want = _logits(lm), _reference(_q8_experts(hf))
    assert (ours.argmax(-1) == want.argmax(-1)).all()
    # activations enter the integer kernel as 8-bit parts: close, not bit-equal
    torch.testing.assert_close(ours, want, atol=2e-2, rtol=2e-2)
    # and farther from the float weights' logits than from the dequantized ones'
    assert (ours - want).abs().max() < (ours - _reference(hf)).abs().max()


@pytest.mark.parametrize("which", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_split_over_two_ranks_gives_one_process_tokens(request, which, split):
    """Two ranks (every expert's and the shared expert's width cut in half, or two stages of one
    layer each) give one process's greedy tokens and top-2 logprobs (the tensor-parallel sums
    add in another order: within 1e-4, with a float32 KV cache); every KV block comes back."""
    from kvserve import LLM, SamplingParams

    path, _ = request.getfixturevalue("hf_dir" if which == "mixtral" else "qwen2_moe_dir")
    prompts = [{"prompt_token_ids": p} for p in (IDS[:5], list(range(2000, 2023)))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    engine = {"kv_cache_memory": "16MiB", "kv_cache_dtype": "float32", "num_threads": 1}
    engine["max_num_batched_tokens"] = 16  # prompts in chunks
    want = LLM(path, **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, **engine, **{split: 2})
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_used_blocks == 0
    finally:
        llm.engine.close()
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert [t[0] for t in la.top] == [t[0] for t in lb.top]
            assert all(abs(x[2] - y[2]) < 1e-4 for x, y in zip(la.top, lb.top))
