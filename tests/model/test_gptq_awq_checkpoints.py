"""GPTQ and AWQ checkpoints end to end: a tiny random transformers Llama, each linear quantized
and packed by the test's reference (tests/unit/test_gptq_awq.py: round-to-nearest per group,
the formats' published layouts), saved as an HF directory with a quantization_config. kvserve
must load the checkpoint onto the packed 4-bit blocks and run it on the C layer stack. Two
transformers models (float32) are the references: one with the exact dequantized weights
(q - z) s, which kvserve's logits must stay close to within the fp16 rounding of m = -z s, and
one with the weights that rounding gives (d q + m, computed by the test), whose logits kvserve
must match tightly and whose 16 greedy tokens it must pick. (transformers itself reads GPTQ /
AWQ files only through gptqmodel / autoawq, which are not test dependencies.)

    gptq      v1 zeros (z - 1 stored), asymmetric, group 128, trivial g_idx
    gptq-v2   gptq_v2 zeros, symmetric, group 32
    awq       AutoAWQ GEMM, group 64
    act-order GPTQ desc_act with a random g_idx: dequantized (logged), off the C layer stack

The float LM head is held as Q8_0 blocks (the default for GPTQ / AWQ under the gguf formats):
the second reference takes gguf-py's Q8_0 round trip of it.
"""

import copy
import json

import gguf
import pytest
import torch

from kvserve.ops import cpu_kernels
from kvserve.ops.attention import AttentionMetadata
from tests.model.test_forward_vs_hf import BLOCK, PagedPool, hf_greedy
from tests.unit.test_gptq_awq import pack_awq, pack_gptq, quantize, reference, rounded_m

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,  # ids below it go in directly, whatever the tokenizer
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
VARIANTS = {  # name -> (quant_method, group, sym, GPTQ v1 zeros, act order)
    "gptq": ("gptq", 128, False, True, False),
    "gptq-v2": ("gptq", 32, True, False, False),
    "awq": ("awq", 64, False, False, False),
    "act-order": ("gptq", 32, False, True, True),
}
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STEPS = 16


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory, kv_model):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    method, group, sym, v1, act_order = VARIANTS[request.param]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY)
    hf = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    hf_m = copy.deepcopy(hf)  # the weights as Q4_1 blocks hold them
    rounded = {}
    path = tmp_path_factory.mktemp(request.param)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    tensors = {}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rpartition(".")[2] not in PROJS:
                continue
            w = module.weight.float()
            cols = w.shape[1]
            order = torch.randperm(cols, generator=gen) if act_order else torch.arange(cols)
            groups = torch.empty(cols, dtype=torch.int64)
            groups[order] = torch.arange(cols) // group
            q, z, s = quantize(w, groups, -(-cols // group), sym)
            packed = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, groups, v1)
            tensors.update({f"{name}.{k}": v.contiguous() for k, v in packed.items()})
            module.weight.copy_(reference(q, z, s, groups).float())  # the exact model
            rounded[name] = rounded_m(q, z, s, groups)
        for name, module in hf_m.named_modules():
            if name in rounded:
                module.weight.copy_(rounded.pop(name) if not act_order else module.weight)
        for name, p in hf.state_dict().items():
            if name.rpartition(".")[0].rpartition(".")[2] not in PROJS:
                tensors[name] = p.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "gptq":
        qc.update(sym=sym, desc_act=act_order)
        qc["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
    else:
        qc.update(zero_point=True, version="gemm")
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    kv_model.tokenizer.backend.save(str(path / "tokenizer.json"))  # any tokenizer: ids go in
    if act_order:  # dequantized exactly: both references are the exact model
        hf_m = copy.deepcopy(hf)
    with torch.no_grad():  # the float LM head as kvserve holds it: Q8_0 blocks (gguf-py's own)
        w = hf_m.lm_head.weight.detach().numpy()
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
        hf_m.lm_head.weight.copy_(torch.from_numpy(back).reshape(w.shape))
    return request.param, str(path), hf, hf_m


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    name, path, hf, hf_m = checkpoint
    return name, path, hf, hf_m, load_model(ModelConfig(model=path, quantization="gguf"))


def test_default_format_is_the_packed_one(checkpoint):
    from kvserve.model.loader import resolve_quantization
    from kvserve.model.quant import DEFAULT_GGUF

    assert resolve_quantization(None, checkpoint[1]) == DEFAULT_GGUF


def test_logits_match_the_dequantized_model(loaded):
    """Every prompt position, prefilled in two chunks (the model's PyTorch forward on the packed
    weights): tight against the weights the blocks hold (the difference: the gguf format's
    8-bit activation parts), and within m's rounding of the exact dequantized model."""
    name, _, hf, hf_m, lm = loaded
    qkv = lm.model.layers[0].self_attn.qkv_proj
    assert (qkv.gguf_kind == 4) != (name == "act-order")  # act-order: dense
    if cpu_kernels.available():  # the float head runs packed (Q8_0: kind 8)
        assert lm.model.lm_head.gguf_kind == 8 and lm.model.lm_head.dense_weight is None
    ids = list(range(1000, 1030))
    with torch.no_grad():
        exact, held = (m(torch.tensor([ids])).logits[0] for m in (hf, hf_m))
    pool = PagedPool(lm.arch, num_blocks=8, seed=3)
    outs = []
    with torch.no_grad():
        for start, end in ((0, 17), (17, 30)):
            ids_t, pos = torch.tensor(ids[start:end]), torch.arange(start, end)
            slots = torch.tensor(pool.slots(0, start, end - start))
            meta = AttentionMetadata(
                slots, [0, end - start], [end], torch.tensor([pool.tables[0]]), BLOCK
            )
            outs.append(lm.model.compute_logits(lm.model(ids_t, pos, meta, pool.kv)))
    ours = torch.cat(outs)
    scale = exact.abs().max().item()
    assert (ours - held).abs().max().item() < 1e-3 * scale
    assert torch.equal(ours.argmax(-1), held.argmax(-1))
    # m = -z s rounded to fp16 moves asymmetric weights (hf_int4's bound), the Q8_0 head all
    # logits (its steps of max |w| / 127 per block)
    assert (ours - exact).abs().max().item() < 1.5e-2 * scale
    assert (ours - exact).abs().max() > (ours - held).abs().max()


def test_float_head_is_kept_with_the_setting(checkpoint):
    """--lm-head-format float keeps the checkpoint's float head (dense), and the logits are
    then the exact model's up to the layers' rounding; a bad value names the accepted ones."""
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    name, path, hf, _ = checkpoint
    if name != "gptq":
        pytest.skip("one variant is enough")
    lm = load_model(ModelConfig(model=path, quantization="gguf", lm_head_format="float"))
    head = lm.model.lm_head
    assert head.dense_weight is not None
    assert torch.equal(head.dense_weight, hf.lm_head.weight.float())
    with pytest.raises(ValueError, match="lm_head_format"):
        load_model(ModelConfig(model=path, quantization="gguf", lm_head_format="q4"))


def test_c_layer_stack_runs_it_and_greedy_matches(loaded):
    """The engine's steps go through the C layer stack (packed kind 4 weights) and pick the
    16 greedy tokens of the model with the weights the blocks hold; act-order weights keep it
    off the stack, naming the layer."""
    from kvserve import LLM, SamplingParams
    from kvserve.ops import cpu_kernels
    from kvserve.runner.layer_stack import CLayerStack

    name, path, _, hf_m, lm = loaded
    if not cpu_kernels.available():
        pytest.skip("no C kernels on this machine (no compiler)")
    if name == "act-order":
        assert CLayerStack.build(lm.model) is None
        assert "layer 0 attn qkv: kept dense" in CLayerStack.declined(lm.model)
        return
    assert CLayerStack.build(lm.model) is not None
    ids = list(range(2000, 2012))
    _, want = hf_greedy(hf_m, ids, STEPS)
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128, quantization="gguf")
    assert llm.engine.runner.layer_stack is not None
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert list(out.outputs[0].token_ids) == want
