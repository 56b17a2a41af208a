"""LoRA adapters without an engine: a PEFT directory read and checked against a tiny kvserve
Llama (kvserve/lora/adapter.py), every malformed adapter refused with a ValueError naming the
problem, the manager's slots, the batched delta of a step that mixes adapters and the base
compared with each token's dense W + scale * B @ A, and the LoRA flags of kvserve.config."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from kvserve.config import make_engine_config
from kvserve.lora.adapter import load_adapter
from kvserve.lora.manager import LoRAManager
from kvserve.model.arch import ModelArch
from kvserve.model.llama import LlamaForCausalLM

ARCH = dict(
    name="llama",
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=64,
    max_position_embeddings=64,
)
OUT = {"q_proj": 32, "k_proj": 16, "v_proj": 16, "o_proj": 32, "gate_proj": 48, "up_proj": 48}
OUT["down_proj"] = 32
IN = {m: 48 if m == "down_proj" else 32 for m in OUT}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(ModelArch(**ARCH))
    for p in m.parameters():
        p.data.normal_(0, 0.1)
    return m


def write_adapter(path, targets=("q_proj", "v_proj"), r=4, alpha=8, seed=1, config=None, **shapes):
    """A PEFT LoRA directory as save_pretrained writes it; `shapes` overrides a module's (A, B)
    shapes; `config` adds or replaces adapter_config.json fields."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(ARCH["num_layers"]):
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            a_shape, b_shape = shapes.get(module, ((r, IN[module]), (OUT[module], r)))
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(a_shape, generator=g) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(b_shape, generator=g) * 0.2
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(path)


def test_an_adapter_loads_with_its_rank_and_scale(tmp_path, model):
    a = load_adapter("a", write_adapter(tmp_path / "a", r=4, alpha=8), model, max_rank=8)
    assert (a.rank, a.scaling, a.target_modules) == (4, 2.0, ("q_proj", "v_proj"))
    assert set(a.weights) == {(i, m) for i in range(2) for m in ("q_proj", "v_proj")}
    A, B = a.weights[(1, "v_proj")]
    assert tuple(A.shape) == (4, 32) and tuple(B.shape) == (16, 4)
    rs = write_adapter(tmp_path / "rs", r=4, alpha=8, config={"use_rslora": True})
    assert load_adapter("rs", rs, model, max_rank=8).scaling == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"target_modules": ["q_proj", "lm_head"]}, "unknown target module.*lm_head"),
        ({"use_dora": True}, "DoRA"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"bias": "lora_only"}, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"r": 0}, "r must be an integer"),
        ({"lora_bias": True}, "lora_bias"),
    ],
)
def test_an_unsupported_config_is_refused_by_name(tmp_path, model, config, message):
    path = write_adapter(tmp_path / "x", config=config)
    with pytest.raises(ValueError, match=message):
        load_adapter("x", path, model, max_rank=8)


def test_a_rank_above_the_limit_is_refused(tmp_path, model):
    path = write_adapter(tmp_path / "big", r=8)
    with pytest.raises(ValueError, match="rank r=8 is above --max-lora-rank 4"):
        load_adapter("big", path, model, max_rank=4)


def test_shapes_of_another_model_are_refused(tmp_path, model):
    path = write_adapter(tmp_path / "w", v_proj=((4, 32), (32, 4)))  # v_proj is 16 wide here
    with pytest.raises(ValueError, match="v_proj.*trained for another model"):
        load_adapter("w", path, model, max_rank=8)
    path = write_adapter(tmp_path / "r", q_proj=((2, 32), (32, 2)))  # rank 2 in a rank-4 file
    with pytest.raises(ValueError, match="q_proj.*\\(4, 32\\)"):
        load_adapter("r", path, model, max_rank=8)


def test_missing_and_pickled_files_are_refused(tmp_path, model):
    with pytest.raises(ValueError, match="is not a directory"):
        load_adapter("x", str(tmp_path / "nowhere"), model, max_rank=8)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_adapter("x", str(empty), model, max_rank=8)
    path = write_adapter(tmp_path / "pickled")
    (tmp_path / "pickled" / "adapter_model.safetensors").rename(
        tmp_path / "pickled" / "adapter_model.bin"
    )
    with pytest.raises(ValueError, match="adapter_model.bin is a pickle"):
        load_adapter("x", path, model, max_rank=8)
    (tmp_path / "pickled" / "adapter_model.bin").unlink()
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        load_adapter("x", path, model, max_rank=8)
    bad = write_adapter(tmp_path / "badjson")
    (tmp_path / "badjson" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_adapter("x", bad, model, max_rank=8)
    garbage = write_adapter(tmp_path / "garbage")
    (tmp_path / "garbage" / "adapter_model.safetensors").write_bytes(b"\x10" * 64)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_adapter("x", garbage, model, max_rank=8)


def test_a_file_too_large_for_its_rank_is_refused_before_reading(tmp_path, model):
    path = write_adapter(tmp_path / "huge")
    with open(tmp_path / "huge" / "adapter_model.safetensors", "ab") as f:
        f.truncate(3 << 20)  # beyond what rank 4 on this model can need
    with pytest.raises(ValueError, match="does not belong to this base model"):
        load_adapter("x", path, model, max_rank=8)


def test_a_tensor_that_is_not_a_lora_matrix_is_refused(tmp_path, model):
    path = write_adapter(tmp_path / "extra")
    save_file(
        {"base_model.model.lm_head.weight": torch.zeros(64, 32)},
        str(tmp_path / "extra" / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="lm_head.weight.*not a LoRA matrix"):
        load_adapter("x", path, model, max_rank=8)


def test_the_manager_bounds_its_slots(tmp_path, model):
    manager = LoRAManager(model, max_loras=2, max_rank=8)
    try:
        manager.load("a", write_adapter(tmp_path / "a"))
        with pytest.raises(ValueError, match="already loaded"):
            manager.load("a", write_adapter(tmp_path / "a2"))
        manager.load("b", write_adapter(tmp_path / "b"))
        with pytest.raises(ValueError, match="2 LoRA adapters are loaded.*--max-loras"):
            manager.load("c", write_adapter(tmp_path / "c"))
        key = manager.key_of("a")
        manager.unload("a")
        assert manager.names() == ["b"]
        with pytest.raises(ValueError, match="unknown target module"):  # nothing installed
            manager.load("c", write_adapter(tmp_path / "bad", config={"target_modules": ["x"]}))
        assert manager.names() == ["b"]
        manager.load("a", write_adapter(tmp_path / "a"))
        assert manager.key_of("a") != key  # a reload is a new prefix-cache namespace
    finally:
        for layer in model.layers:  # the module-scoped model serves the other tests bare
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
                linear.lora = None
            for linear in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
                linear.lora = None


def served(t: torch.Tensor) -> torch.Tensor:
    """An adapter matrix as the manager holds it: A, and B times the scale, rounded to bfloat16."""
    return t.to(torch.bfloat16).float()


def test_a_mixed_step_adds_each_tokens_own_delta(tmp_path, model):
    """Tokens of the base, adapter a (q/v) and adapter b (every projection, rsLoRA) in one batch:
    each Linear's output equals x (W + scale * B @ A)^T for the token's own adapter, A and
    scale * B rounded to bfloat16 as the manager holds them."""
    manager = LoRAManager(model, max_loras=3, max_rank=8)
    try:
        a = manager.load("a", write_adapter(tmp_path / "a", r=4, alpha=8, seed=2))
        every = tuple(OUT)
        b_path = write_adapter(
            tmp_path / "b", targets=every, r=8, alpha=4, seed=3, config={"use_rslora": True}
        )
        b = manager.load("b", b_path)
        slots = torch.tensor([-1, 0, 1, 0, -1, 1, 1])
        manager.step.set(slots)
        x = torch.randn(len(slots), 32)
        layer = model.layers[1]
        linear = layer.self_attn.qkv_proj
        got = linear(x)
        for t, slot in enumerate(slots.tolist()):
            parts = []
            for shard, module in enumerate(("q_proj", "k_proj", "v_proj")):
                start = sum(linear.shard_sizes[:shard])
                w = linear.weight[start : start + linear.shard_sizes[shard]].clone()
                adapter = {0: a, 1: b}.get(slot)
                if adapter is not None and (1, module) in adapter.weights:
                    A, B = adapter.weights[(1, module)]
                    w += served(adapter.scaling * B) @ served(A)
                parts.append(x[t] @ w.t())
            torch.testing.assert_close(got[t], torch.cat(parts), atol=1e-5, rtol=1e-5)
        down = layer.mlp.down_proj
        h = torch.randn(len(slots), 48)
        A, B = b.weights[(1, "down_proj")]
        want = h @ down.weight.t()
        want[slots == 1] = h[slots == 1] @ (down.weight + served(b.scaling * B) @ served(A)).t()
        torch.testing.assert_close(down(h), want, atol=1e-5, rtol=1e-5)
        manager.step.set(torch.full((3,), -1))  # a step of the base alone adds nothing
        x3 = torch.randn(3, 32)
        torch.testing.assert_close(linear(x3), x3 @ linear.weight.t())
    finally:
        for layer in model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
                linear.lora = None
            for linear in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
                linear.lora = None


def test_a_pipeline_stage_keeps_its_layers_part(tmp_path, model):
    """A stage holding layer 1 of 2 (runner/pipeline_parallel.keep_stage's marks) keeps that
    layer's matrices under its own index 0, and checks the other stage's layers too."""
    import copy

    from kvserve.lora.adapter import max_weights_bytes

    stage = copy.deepcopy(model)
    stage.layers = torch.nn.ModuleList([stage.layers[1]])
    stage.first_layer, stage.num_model_layers = 1, 2
    assert max_weights_bytes(stage, 8) == max_weights_bytes(model, 8)
    path = write_adapter(tmp_path / "a")
    whole, part = load_adapter("a", path, model, 8), load_adapter("a", path, stage, 8)
    assert set(part.weights) == {(0, "q_proj"), (0, "v_proj")}
    for m in ("q_proj", "v_proj"):
        assert all(torch.equal(x, y) for x, y in zip(part.weights[(0, m)], whole.weights[(1, m)]))
    bad = write_adapter(tmp_path / "bad", v_proj=((4, 32), (24, 4)))  # layer 0's v is wrong too
    with pytest.raises(ValueError, match="layer 0 v_proj"):
        load_adapter("bad", bad, stage, 8)


def test_the_lora_flags():
    cfg = make_engine_config(enable_lora=True, lora_modules=["a=/x", "b=/y"], max_loras=2)
    assert cfg.lora_modules == {"a": "/x", "b": "/y"}
    assert make_engine_config(enable_lora=True, lora_modules='["a=/x"]').lora_modules == {"a": "/x"}
    with pytest.raises(ValueError, match="needs --enable-lora"):
        make_engine_config(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="raise --max-loras"):
        make_engine_config(enable_lora=True, lora_modules=["a=/x", "b=/y"], max_loras=1)
    with pytest.raises(ValueError, match="is not NAME=PATH"):
        make_engine_config(enable_lora=True, lora_modules=["/just/a/path"])
    with pytest.raises(ValueError, match="twice"):
        make_engine_config(enable_lora=True, lora_modules=["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        make_engine_config(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="not run over tensor-parallel ranks"):
        make_engine_config(enable_lora=True, tensor_parallel_size=2, quantization="none")
    assert make_engine_config(enable_lora=True, pipeline_parallel_size=2).enable_lora
    with pytest.raises(ValueError, match="drop --enable-lora with --device cuda"):
        make_engine_config(enable_lora=True, device="cuda").on_device(cuda_available=True)
