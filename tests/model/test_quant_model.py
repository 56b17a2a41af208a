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
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
]
STEPS = 12


@pytest.fixture(scope="module")
def models(default_gguf):
    from kvserve.model.loader import load_model

    return {
        f: load_model(ModelConfig(model=default_gguf, quantization=f))
        for f in ("none", "gguf", "int4")
    }


@torch.inference_mode()
def greedy(lm, ids, n, kv_dtype=torch.float32):
    """Greedy continuation over a paged pool; returns (tokens, logits of each step)."""
    from kvserve.ops import kv_int8

    T = len(ids) + n
    blocks = -(-T // 16)
    shape = (blocks, 16, lm.arch.num_kv_heads, lm.arch.head_dim)
    if kv_dtype == torch.int8:
        shape = kv_int8.pool_shape(*shape)
    kv = [
        (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
        for _ in range(lm.arch.num_layers)
    ]
    table = torch.arange(blocks).flip(0)[None]  # non-trivial block order

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
            assert x in lb[i].topk(5).indices.tolist() and y in la[i].topk(5).indices.tolist(), (
                i,
                ta,
                tb,
            )
            return
    assert ta == tb


@pytest.mark.parametrize("prompt", PROMPTS)
def test_gguf_packed_q4_agrees_with_fp32_dequantized(models, prompt):
    """gguf: the file's Q4_1 / Q8_0 blocks (fp16 GEMM for the prompt, the C GEMV / layer stack for
    decode steps) vs the same weights dequantized to fp32: identical weights, only activation
    rounding differs."""
    ids = models["none"].tokenizer.encode(prompt)
    ref = greedy(models["none"], ids, STEPS)
    out = greedy(models["gguf"], ids, STEPS)
    assert_agree(out, ref)
    same = next((i for i, (x, y) in enumerate(zip(out[0], ref[0])) if x != y), STEPS)
    for i in range(same):  # the steps before any divergence saw the same tokens
        scale = ref[1][i].abs().max().item()
        assert (out[1][i] - ref[1][i]).abs().max().item() < 0.05 * scale, i


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
    checks = {
        "attn_q": (layer.self_attn.qkv_proj, 0, lm.arch.num_heads),
        "attn_k": (layer.self_attn.qkv_proj, 1, lm.arch.num_kv_heads),
        "attn_v": (layer.self_attn.qkv_proj, 2, None),
        "ffn_gate": (layer.mlp.gate_up_proj, 0, None),
        "ffn_up": (layer.mlp.gate_up_proj, 1, None),
        "ffn_down": (layer.mlp.down_proj, 0, None),
        "attn_output": (layer.self_attn.o_proj, 0, None),
    }
    for name, (lin, shard, heads) in checks.items():
        t = g.tensors[f"blk.3.{name}.weight"]
        assert t.qtype == Q.Q4_1
        raw = g.raw(t)
        if heads:
            raw = raw[unpermute_rows(t.shape[0], heads)]
        ref = torch.from_numpy(dequantize(raw, t.qtype)).reshape(t.shape)
        start = sum(lin.shard_sizes[:shard])
        got = lin.quant_method.dequantized(lin)[start : start + t.shape[0]]
        assert torch.equal(got, ref), name


def test_tied_embedding_is_read_from_the_packed_head(models, default_gguf):
    """The default model's embedding is tied to its head: with the gguf format the head's packed
    Q8_0 blocks are the only copy, and a lookup gives the file's dequantized rows (the dense
    format keeps its own float32 embedding)."""
    from kvserve.model.gguf_file import GGUFFile

    g = GGUFFile(default_gguf)
    t = g.tensors["token_embd.weight"]
    ids = torch.tensor([[0, 2, 49151], [17, 17, 300]])
    ref = torch.from_numpy(dequantize(g.raw(t)[ids.reshape(-1).numpy()], t.qtype)).reshape(2, 3, -1)
    packed = models["gguf"].model
    assert packed.tied_head and packed.embed_tokens.weight is None
    assert torch.equal(packed.embed_tokens(ids), ref)
    dense = models["none"].model
    assert dense.embed_tokens.weight is not None and torch.equal(dense.embed_tokens(ids), ref)
    with pytest.raises(IndexError):
        packed.embed_tokens(torch.tensor([49152]))


def test_default_format_is_recorded(default_gguf):
    from kvserve.model.loader import resolve_quantization
    from kvserve.model.quant import DEFAULT_GGUF

    assert resolve_quantization(None, default_gguf) == DEFAULT_GGUF
    with pytest.raises(ValueError):
        resolve_quantization("int3", default_gguf)


def _mixed_step(lm, prompts, c_stack):
    """Prefill each prompt but the last (one step each), then one step that mixes a decode of
    each with the whole last prompt (a prompt chunk beside decodes), through the C layer stack
    (runner/layer_stack.py) or the model's PyTorch forward. Returns the final hidden states of
    every row of that step's sampled positions: [len(prompts), H]."""
    from kvserve.runner.layer_stack import CLayerStack

    stack = CLayerStack.build(lm.model)
    ids = [lm.tokenizer.encode(p) for p in prompts]
    per = -(-max(len(x) for x in ids) // 16) + 1
    shape = (per * len(ids), 16, lm.arch.num_kv_heads, lm.arch.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(lm.arch.num_layers)]
    tables = torch.arange(per * len(ids)).flip(0).reshape(len(ids), per)  # ragged, reversed blocks

    def run(toks, pos, meta, rows, prompt_lens):
        if c_stack:
            return stack(torch.tensor(toks), pos, meta, kv, torch.tensor(rows), prompt_lens)
        return lm.model(torch.tensor(toks), pos, meta, kv)[rows]

    with torch.inference_mode():
        for b, x in enumerate(ids[:-1]):
            pos = torch.arange(len(x))
            meta = AttentionMetadata(
                tables[b][pos // 16] * 16 + pos % 16, [0, len(x)], [len(x)], tables[b : b + 1], 16
            )
            run(x, pos, meta, [len(x) - 1], [len(x)])
        n = len(ids) - 1
        last = ids[-1]
        pos = torch.cat([torch.tensor([len(x) for x in ids[:-1]]), torch.arange(len(last))])
        seq = list(range(n)) + [n] * len(last)
        slots = tables[seq, pos // 16] * 16 + pos % 16
        qsl = list(range(n + 1)) + [n + len(last)]
        seq_lens = [len(x) + 1 for x in ids[:-1]] + [len(last)]
        meta = AttentionMetadata(slots, qsl, seq_lens, tables, 16)
        return run(
            [7, 42, 1000][:n] + last,
            pos,
            meta,
            list(range(n)) + [n + len(last) - 1],
            [len(x) for x in ids],
        )


def test_c_layer_stack_matches_the_pytorch_layers(models):
    """The C layer stack (ops/csrc/layer_stack.c) computes what LlamaForCausalLM's PyTorch layers
    compute with the same weights: ragged contexts, reversed block tables, decodes and a prompt
    chunk in one step."""
    from kvserve.runner.layer_stack import CLayerStack

    lm = models["gguf"]
    if CLayerStack.build(lm.model) is None:
        pytest.skip("no C layer stack on this machine (no compiler)")
    a = _mixed_step(lm, PROMPTS, c_stack=True)
    b = _mixed_step(lm, PROMPTS, c_stack=False)
    assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_engine_greedy_equals_pytorch_path(models, default_gguf, prompt):
    """The engine (every step through the C layer stack) and greedy decoding through the model's
    PyTorch forward pick the same tokens, in the gguf format."""
    from kvserve import LLM, SamplingParams

    lm = models["gguf"]
    ids = lm.tokenizer.encode(prompt)
    plain = greedy(lm, ids, STEPS)
    llm = LLM(default_gguf, kv_cache_memory="32MiB", max_model_len=512, quantization="gguf")
    if llm.engine.runner.layer_stack is None:
        pytest.skip("no C layer stack on this machine")
    out = (
        llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert out == plain[0]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("fmt", ["none", "gguf"])
def test_int8_kv_cache_agrees_with_float32_kv(models, prompt, fmt):
    """An int8 KV pool (per-row scales) against a float32 one on the same weights: greedy equal or
    top-5 close at the first divergence, logits close before it (prompt path and decode path:
    the C layer stack reads int8 rows too)."""
    lm = models[fmt]
    ids = lm.tokenizer.encode(prompt)
    ref = greedy(lm, ids, STEPS)
    out = greedy(lm, ids, STEPS, kv_dtype=torch.int8)
    assert_agree(out, ref)
    same = next((i for i, (x, y) in enumerate(zip(out[0], ref[0])) if x != y), STEPS)
    for i in range(same):
        scale = ref[1][i].abs().max().item()
        assert (out[1][i] - ref[1][i]).abs().max().item() < 0.05 * scale, i
