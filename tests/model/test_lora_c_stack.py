"""LoRA adapters on the C layer stack: a tiny random Llama written as a GGUF file (Q8_0 linears,
llama.cpp's Q/K row order) with three PEFT adapters (random B), served with --enable-lora.

    path        the steps run on the C layer stack, not the PyTorch forward
    alone       each adapter (and the base) on its own: the PyTorch forward's tokens (the same
                engine forced off the C stack), and transformers + PEFT merged on the file's
                dequantized weights, by test_engine_vs_hf's rule at a divergence
    mixed       every prompt under the base and each adapter in one generate call: one step
                holds them all, and each request's tokens and logprobs are the bits it got alone
    run time    an adapter loaded into a slot another one left changes the C path's output to
                the new adapter's
    isa         each kernel build this CPU runs gives the same bits (KVSERVE_ISA builds)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.test_lora_engine import greedy

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

NEW = 12
TOP = 5
PROMPTS = [[500, 600, 700, 800, 900, 1000, 1100], [1200, 2300, 3400, 170, 180], [400, 41, 4200]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (target modules, r, lora_alpha, use_rslora)
ADAPTERS = {
    "a": (["q_proj", "v_proj", "down_proj"], 8, 16, False),  # q, v of the fused qkv, not k
    "b": (ALL, 8, 16, True),  # qkv: one unit of 16 shrink columns and a narrow one
    "c": (["o_proj", "up_proj"], 2, 4, False),  # up of the fused gate_up, not gate
}


def write_llama_gguf(path: str, hf, tokenizer: dict) -> None:
    """`hf` as llama.cpp's converter writes a llama model (Q and K rows permuted, linears in
    Q8_0, the embedding in float32); `hf` gets the dequantized values back."""
    from gguf.quants import dequantize, quantize

    from kvserve.model.gguf_loader import unpermute_rows

    c = hf.config
    arch = gguf.MODEL_ARCH.LLAMA
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
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
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for hf_name, p in hf.state_dict().items():
            target = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            a = p.float().numpy()
            if a.ndim == 2 and hf_name != "model.embed_tokens.weight":
                a = dequantize(quantize(a, q8), q8)
                p.copy_(torch.from_numpy(a))
                heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
                for proj, n in heads.items():
                    if proj in hf_name:  # the file's row r holds HF's row order^-1[r]
                        a = a[np.argsort(unpermute_rows(a.shape[0], n))]
                w.add_tensor(target, quantize(a, q8), raw_dtype=q8)
            else:
                w.add_tensor(target, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_gguf):
    """(gguf path, {adapter: dir}, {adapter or None: {prompt: (tokens, per-token top-5)}}) with
    the references from transformers + PEFT merged."""
    from tests.model.test_gguf_qwen3_phi3 import tokenizer_fields

    root = tmp_path_factory.mktemp("lora_c")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,  # the default model's tokenizer, copied into the file
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    path = str(root / "tiny.gguf")
    write_llama_gguf(path, hf, tokenizer_fields(default_gguf))
    base_state = {k: v.clone() for k, v in hf.state_dict().items()}

    def fresh():
        m = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
        m.load_state_dict(base_state)
        return m.eval()

    paths, refs = {}, {None: {tuple(p): hf_greedy(hf, p) for p in PROMPTS}}
    for seed, (name, (targets, r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        lcfg = peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
        )
        model = peft.get_peft_model(fresh(), lcfg)
        torch.manual_seed(10 + seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    torch.nn.init.normal_(p, std=0.3)
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
        merged = model.merge_and_unload().eval()
        refs[name] = {tuple(p): hf_greedy(merged, p) for p in PROMPTS}
    for name in ADAPTERS:  # every adapter changes what the model says
        assert refs[name][tuple(PROMPTS[0])][0] != refs[None][tuple(PROMPTS[0])][0]
    return path, paths, refs


@torch.no_grad()
def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[set[int]]]:
    ids = greedy(model, prompt, NEW)
    logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    return ids, [set(row.topk(TOP).indices.tolist()) for row in logits]


def make_llm(path: str, paths: dict, c_stack: bool):
    from kvserve.engine.llm import LLM
    from kvserve.runner.backends import select
    from kvserve.runner.layer_stack import Refusal

    with pytest.MonkeyPatch.context() as mp:
        if not c_stack:  # the reference: the same engine on the PyTorch forward
            mp.setattr(
                select.CLayerStack,
                "build_with_reason",
                classmethod(lambda cls, m, kv=None: (None, Refusal("the test's reference"))),
            )
        return LLM(
            path,
            enable_lora=True,
            lora_modules=[f"a={paths['a']}", f"b={paths['b']}"],
            max_loras=3,
            max_lora_rank=8,
            kv_cache_dtype="float32",
            kv_cache_memory="16MiB",
            num_threads=1,
        )


@pytest.fixture(scope="module")
def llm(setup):
    path, paths, _ = setup
    llm = make_llm(path, paths, c_stack=True)
    if "C layer stack" not in llm.engine.step_path and "not built" in llm.engine.step_path:
        pytest.skip(llm.engine.step_path)
    return llm


@pytest.fixture(scope="module")
def torch_llm(setup):
    path, paths, _ = setup
    return make_llm(path, paths, c_stack=False)


def params():
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP)


def run(llm, prompts, names):
    """[(tokens, per-token top-5 ids, per-token chosen logprob)] of each prompt under its
    adapter name (None: the base)."""
    outs = llm.generate(prompts, params(), use_tqdm=False, lora_request=list(names))
    res = []
    for o in outs:
        c = o.outputs[0]
        tops = [{t for t, _, _ in d.top} for d in c.logprobs]
        chosen = [d.logprob for d in c.logprobs]
        res.append((list(c.token_ids), tops, chosen))
    return res


def close(ours, ref, label: str) -> None:
    """test_engine_vs_hf's rule: equal tokens, or at the first divergence each side's token in
    the other's top-5, the comparison stopping there."""
    (a_ids, a_tops), (b_ids, b_tops) = ours[:2], ref[:2]
    assert len(a_ids) == len(b_ids) == NEW, label
    for i, (a, b) in enumerate(zip(a_ids, b_ids)):
        if a != b:
            assert a in b_tops[i] and b in a_tops[i], f"{label}: token {i}: {a} vs {b}"
            return


def test_lora_runs_on_the_c_layer_stack(llm):
    assert "C layer stack" in llm.engine.step_path, llm.engine.step_path
    assert type(llm.engine.runner.backend).__name__ == "LayerStackBackend"


@pytest.mark.parametrize("name", [None, "a", "b"])
def test_each_adapter_alone_matches_pytorch_and_peft(setup, llm, torch_llm, name):
    _, _, refs = setup
    names = [name] * len(PROMPTS)
    ours, theirs = run(llm, PROMPTS, names), run(torch_llm, PROMPTS, names)
    assert "PyTorch forward" in torch_llm.engine.step_path
    for p, o, t in zip(PROMPTS, ours, theirs):
        close(o, t, f"{name} {p} vs the PyTorch forward")
        close(o, refs[name][tuple(p)], f"{name} {p} vs PEFT merged")


def test_a_step_mixing_adapters_and_the_base_gives_each_its_bits(llm, monkeypatch):
    names = [None, "a", "b"]
    alone = {n: run(llm, PROMPTS, [n] * len(PROMPTS)) for n in names}
    step = llm.engine.lora.step
    seen: list[set[int]] = []
    set_slots = step.set
    monkeypatch.setattr(step, "set", lambda idx: (seen.append(set(idx.tolist())), set_slots(idx)))
    prompts = [p for p in PROMPTS for _ in names]
    mixed = run(llm, prompts, [n for _ in PROMPTS for n in names])
    assert any(s >= {-1, 0, 1} for s in seen)  # one step held the base and both adapters
    for i, p in enumerate(PROMPTS):
        for j, n in enumerate(names):
            assert mixed[i * len(names) + j] == alone[n][i], (n, p)  # tokens and logprobs


def test_loading_at_run_time_changes_the_c_path(setup, llm, torch_llm):
    _, paths, refs = setup
    engine = llm.engine
    before = run(llm, PROMPTS[:1], ["b"])[0]
    engine.unload_lora("b")
    engine.load_lora("c", paths["c"])  # into the slot b left
    assert engine.lora.slot_of_key(engine.lora.key_of("c")) == 1
    after = run(llm, PROMPTS[:1], ["c"])[0]
    torch_llm.engine.load_lora("c", paths["c"])
    close(after, run(torch_llm, PROMPTS[:1], ["c"])[0], "c vs the PyTorch forward")
    close(after, refs["c"][tuple(PROMPTS[0])], "c vs PEFT merged")
    assert after[0] != before[0]
    engine.unload_lora("c")
    engine.load_lora("b", paths["b"])
    assert run(llm, PROMPTS[:1], ["b"])[0] == before  # b back: the same bits


def test_every_isa_build_gives_the_same_bits(llm):
    from kvserve.ops import cpu_kernels

    stack = llm.engine.runner.backend.stack
    names = [None, "a", "b"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    first = stack.isa
    try:
        results = {}
        for isa in cpu_kernels.host_isas():
            if isa == "avxvnni":
                continue  # the same source as avx2 but for its dot instruction
            stack.isa = isa
            results[isa] = run(llm, prompts, loras)
    finally:
        stack.isa = first
    ref = results.pop("portable")
    for isa, got in results.items():
        assert got == ref, isa
