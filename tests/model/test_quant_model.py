"""Weight formats on the default model: formats that should agree do (greedy, or top-5 close at the
first divergence), and the int4 kernel runs the file's Q4_1 blocks with the dequantized values."""
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvserve.config import ModelConfig
from kvserve.ops.attention import AttentionMetadata

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]
STEPS = 12


@pytest.fixture(scope="module")
def models(default_gguf):
    from kvserve.model.loader import load_model
    return {f: load_model(ModelConfig(model=default_gguf, quantization=f)) for f in ("none", "gguf", "int4")}


@torch.inference_mode()
def greedy(lm, ids, n):
    """Greedy continuation over a paged pool; returns (tokens, logits of each step)."""
    T = len(ids) + n
    blocks = -(-T // 16)
    shape = (blocks, 16, lm.arch.num_kv_heads, lm.arch.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(lm.arch.num_layers)]
    table = torch.arange(blocks).flip(0)[None]                    # non-trivial block order

    def run(toks, start):
        pos = torch.arange(start, start + len(toks))
        slots = table[0][pos // 16] * 16 + pos % 16
        meta = AttentionMetadata(slots, [0, len(toks)], [start + len(toks)], table, 16)
        return lm.model.compute_logits(lm.model(torch.tensor(toks), pos, meta, kv)[-1:])[0]

    logits = [run(ids, 0)]
    tokens = [int(logits[-1].argmax())]
    for i in range(n - 1):
        logits.append(run(tokens[-1:], len(ids) + i))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def assert_agree(a, b):
    """Greedy equality, or at the first divergence each side's choice is in the other's top 5."""
    (ta, la), (tb, lb) = a, b
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x != y:
            assert x in lb[i].topk(5).indices.tolist() and y in la[i].topk(5).indices.tolist(), (i, ta, tb)
            return
    assert ta == tb


@pytest.mark.parametrize("prompt", PROMPTS)
def test_gguf_packed_q4_agrees_with_fp32_dequantized(models, prompt):
    """gguf: the file's Q4_1 nibbles/scales in int4pack (bf16 activations) vs the same weights
    dequantized to fp32: identical weights, only activation rounding differs."""
    ids = models["none"].tokenizer.encode(prompt)
    ref = greedy(models["none"], ids, STEPS)
    out = greedy(models["gguf"], ids, STEPS)
    assert_agree(out, ref)
    scale = ref[1][0].abs().max().item()
    assert (out[1][0] - ref[1][0]).abs().max().item() < 0.05 * scale


@pytest.mark.parametrize("prompt", PROMPTS)
def test_int4_agrees_with_fp32_dequantized(models, prompt):
    ids = models["none"].tokenizer.encode(prompt)
    assert_agree(greedy(models["int4"], ids, STEPS), greedy(models["none"], ids, STEPS))


def test_loaded_int4_layers_hold_the_files_values(models, default_gguf):
    """Every Q4_1 linear of the loaded gguf model dequantizes bit-exactly to gguf's own
    dequantize of the file (rows of Q/K in HF order)."""
    from kvserve.model.gguf_file import GGUFFile
    from kvserve.model.gguf_loader import unpermute_rows
    lm = models["gguf"]
    g = GGUFFile(default_gguf)
    layer = lm.model.layers[3]
    checks = {"attn_q": (layer.self_attn.qkv_proj, 0, lm.arch.num_heads),
              "attn_k": (layer.self_attn.qkv_proj, 1, lm.arch.num_kv_heads),
              "attn_v": (layer.self_attn.qkv_proj, 2, None),
              "ffn_gate": (layer.mlp.gate_up_proj, 0, None), "ffn_up": (layer.mlp.gate_up_proj, 1, None),
              "ffn_down": (layer.mlp.down_proj, 0, None), "attn_output": (layer.self_attn.o_proj, 0, None)}
    for name, (lin, shard, heads) in checks.items():
        t = g.tensors[f"blk.3.{name}.weight"]
        assert t.qtype == Q.Q4_1
        raw = g.raw(t)
        if heads:
            raw = raw[unpermute_rows(t.shape[0], heads)]
        ref = torch.from_numpy(dequantize(raw, t.qtype)).reshape(t.shape)
        start = sum(lin.shard_sizes[:shard])
        got = lin.quant_method.dequantized(lin)[start:start + t.shape[0]]
        assert torch.equal(got, ref), name


def test_default_format_is_recorded(default_gguf):
    from kvserve.model.loader import resolve_quantization
    from kvserve.model.quant import DEFAULT_GGUF
    assert resolve_quantization(None, default_gguf) == DEFAULT_GGUF
    with pytest.raises(ValueError):
        resolve_quantization("int3", default_gguf)
