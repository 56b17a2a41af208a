"""LoRA adapters through the engine against transformers + PEFT: a tiny random Llama checkpoint
written with transformers, three adapters made with PEFT (random B: PEFT starts B at zero), and
each adapter's greedy tokens compared with the PEFT model merged into its base
(merge_and_unload), float32 weights and KV cache, the adapters' weights bfloat16 values (what
kvserve holds: it rounds A and B once at load; the scales here are powers of two, so rounding
B before or after the scale is the same):

    alone       each adapter (and the base) on its own
    mixed       the base and three adapters in one generate call: one step holds them all
    prefix      the same prompt under adapter a then b: b must not read a's KV blocks
    unload      an adapter a request runs with is not unloaded; an unknown one is refused

The tiny checkpoint and a PEFT-format adapter writer are shared with tests/server/test_lora_*.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvserve.lora import LoRARequest
from kvserve.sampling_params import ParamError, SamplingParams

VOCAB = 512
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 17, 18], [40, 41, 42]]
LONG = [(7 * i + 3) % VOCAB for i in range(40)]  # spans two full blocks of 16
NEW_TOKENS = 16
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (target modules, r, lora_alpha, use_rslora)
ADAPTERS = {
    "a": (["q_proj", "v_proj"], 8, 16, False),  # q and v of the fused qkv, not k
    "b": (list(ALL), 4, 16, True),
    "c": (["o_proj", "up_proj", "down_proj"], 2, 4, False),  # up of gate_up, not gate
}


def make_base(path: str, transformers) -> None:
    """A tiny random Llama (GQA, untied head) and a word-level tokenizer over its vocabulary
    ("t17" is id 17), whose chat template writes the messages' words only."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the words, nothing else
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template}, f)


def write_peft_format(path: str, base, targets, r: int, alpha: int, seed: int) -> dict:
    """An adapter directory as PEFT's save_pretrained writes it (written here without PEFT);
    returns {(layer, module): (A, B)} to merge by hand."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors, weights = {}, {}
    for i, layer in enumerate(base.model.layers):
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            w = getattr(getattr(layer, block), module).weight
            a = torch.randn(r, w.shape[1], generator=g) * 0.3
            b = torch.randn(w.shape[0], r, generator=g) * 0.3
            prefix = f"base_model.model.model.layers.{i}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            weights[(i, block, module)] = (a, b)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return weights


@torch.no_grad()
def greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """n greedy tokens, the whole context recomputed each step (no EOS stop)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base path, {adapter: path}, {adapter or None: {prompt tuple: tokens}})."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    base_path = str(root / "base")
    make_base(base_path, transformers)

    def load_base():
        return transformers.LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()

    paths, refs = {}, {None: {}}
    base = load_base()
    for p in [*PROMPTS, LONG]:
        refs[None][tuple(p)] = greedy(base, p)
    for seed, (name, (targets, r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        config = peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
        )
        model = peft.get_peft_model(load_base(), config)
        torch.manual_seed(10 + seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    torch.nn.init.normal_(p, std=0.3)
                if "lora_" in pname:  # the values kvserve serves: each rounded to bfloat16
                    p.copy_(p.to(torch.bfloat16).float())
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
        merged = model.merge_and_unload().eval()
        refs[name] = {tuple(p): greedy(merged, p) for p in [*PROMPTS, LONG]}
    for name in ADAPTERS:  # every adapter changes what the model says
        assert refs[name][tuple(PROMPTS[0])] != refs[None][tuple(PROMPTS[0])]
    return base_path, paths, refs


@pytest.fixture(scope="module", params=["C layer stack", "PyTorch forward", "pipeline stages"])
def llm(setup, request):
    """The engine on the dense checkpoint, on each step path: the C layer stack (its float32
    weights packed for it, the deltas from its LoRA table), with the C kernels turned off while
    it starts, the PyTorch forward (its Linears adding the deltas), and two pipeline stages of
    one layer each (each stage's C layer stack with its layers' part of every adapter, loaded
    and unloaded on both as rank 0 does)."""
    from kvserve.engine.llm import LLM

    base_path, paths, _ = setup
    before = os.environ.get("KVSERVE_NO_C_KERNELS")
    if request.param == "PyTorch forward":
        os.environ["KVSERVE_NO_C_KERNELS"] = "1"
    try:
        llm = LLM(
            base_path,
            enable_lora=True,
            lora_modules=[f"a={paths['a']}"],
            max_loras=3,
            max_lora_rank=8,
            kv_cache_dtype="float32",
            kv_cache_memory="16MiB",
            num_threads=1,
            pipeline_parallel_size=2 if request.param == "pipeline stages" else 1,
        )
    finally:
        if before is None:
            os.environ.pop("KVSERVE_NO_C_KERNELS", None)
        else:
            os.environ["KVSERVE_NO_C_KERNELS"] = before
    assert request.param in llm.engine.step_path
    yield llm
    llm.engine.close()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
IDS = {"a": 1, "b": 2, "c": 3}


def request(name, paths):
    return None if name is None else LoRARequest(name, IDS[name], paths[name])


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", [None, "a", "b", "c"])
def test_each_adapter_alone_matches_peft_merged(setup, llm, name):
    _, paths, refs = setup
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request(name, paths))
    assert tokens(outs) == [refs[name][tuple(p)] for p in PROMPTS]


def test_a_step_mixing_adapters_and_the_base_matches_each(setup, llm, monkeypatch):
    _, paths, refs = setup
    step = llm.engine.lora.step
    seen: list[set[int]] = []
    set_slots = step.set
    monkeypatch.setattr(step, "set", lambda idx: (seen.append(set(idx.tolist())), set_slots(idx)))
    names = [None, "a", "b", "c"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [request(n, paths) for _ in PROMPTS for n in names]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    slots = {llm.engine.lora.step.slot_of(llm.engine.lora.key_of(n)) for n in ("a", "b", "c")}
    assert any(s >= {-1, *slots} for s in seen)  # one step held the base and every adapter
    assert tokens(outs) == [refs[n][tuple(p)] for p in PROMPTS for n in names]


def test_the_prefix_cache_is_kept_apart_per_adapter(setup, llm):
    _, paths, refs = setup
    for name in ("a", "b", None, "b"):
        (out,) = llm.generate([LONG], GREEDY, use_tqdm=False, lora_request=request(name, paths))
        assert list(out.outputs[0].token_ids) == refs[name][tuple(LONG)], name
    # the second b run read b's own blocks; the first of each read none of another's
    assert out.num_cached_tokens == 32
    (first_c,) = llm.generate([LONG], GREEDY, use_tqdm=False, lora_request=request("c", paths))
    assert first_c.num_cached_tokens == 0


def test_an_adapter_in_use_is_not_unloaded(setup, llm):
    _, paths, _ = setup
    engine = llm.engine
    engine.add_request("busy", PROMPTS[0], GREEDY, lora_request="b")
    with pytest.raises(ValueError, match="'b' is in use by 1 request"):
        engine.unload_lora("b")
    engine.abort_request("busy")
    engine.step()
    engine.unload_lora("b")
    assert "b" not in engine.lora_adapters()
    with pytest.raises(ParamError, match="'b' is not loaded"):
        engine.add_request("gone", PROMPTS[0], GREEDY, lora_request="b")
    with pytest.raises(KeyError, match="not loaded"):
        engine.unload_lora("b")
