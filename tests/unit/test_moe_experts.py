"""The grouped expert computation of kvserve.model.mixtral against a per-token reference.

grouped_experts sorts the (token, expert) pairs by expert and runs one matmul per expert;
all_experts (the capture-safe path) runs every expert on every token. Both must equal a plain
loop over tokens and their k experts, for random routing, routing with ties among the router
logits, an expert that gets no token, a token that lists one expert twice and an empty batch.
"""

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers import GatedMLP
from kvserve.model.mixtral import all_experts, grouped_experts, route

H, FF, E = 16, 24, 5


@pytest.fixture(scope="module")
def experts():
    torch.manual_seed(0)
    mods = torch.nn.ModuleList(GatedMLP(H, FF, F.silu, torch.float32) for _ in range(E))
    for m in mods:
        m.gate_up_proj.weight.data.normal_(0, 0.3)
        m.down_proj.weight.data.normal_(0, 0.3)
    return mods


def reference(x, ids, weights, experts):
    """Token by token, expert by expert, each from its own weights (not through GatedMLP)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            m = experts[int(ids[t, j])]
            gate, up = m.gate_up_proj.weight[:FF], m.gate_up_proj.weight[FF:]
            y = (F.silu(gate @ x[t]) * (up @ x[t])) @ m.down_proj.weight.T
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("fn", [grouped_experts, all_experts])
def test_random_routing(experts, fn):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, H, generator=g)
    logits = torch.randn(37, E, generator=g)
    weights, ids = route(logits, 2)
    torch.testing.assert_close(fn(x, ids, weights, experts), reference(x, ids, weights, experts))


@pytest.mark.parametrize("fn", [grouped_experts, all_experts])
def test_unused_expert_and_repeated_expert(experts, fn):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, H, generator=g)
    ids = torch.randint(0, E - 1, (9, 3), generator=g)  # expert E-1 gets no token
    ids[0] = torch.tensor([1, 1, 2])  # one token lists expert 1 twice: both terms count
    weights = torch.rand(9, 3, generator=g)
    assert (E - 1) not in ids
    torch.testing.assert_close(fn(x, ids, weights, experts), reference(x, ids, weights, experts))


def test_ties_route_to_distinct_experts_with_softmax_weights(experts):
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3))
    logits = torch.zeros(6, E)  # every expert tied
    logits[1] = torch.tensor([2.0, 2.0, 2.0, 0.0, -1.0])  # three tied for the top two
    logits[2] = torch.tensor([0.5, 3.0, 0.5, 0.5, 0.5])  # a tie for second place
    weights, ids = route(logits, 2)
    for t in range(6):
        assert len(set(ids[t].tolist())) == 2
        top = logits[t, ids[t]]
        # the top-k by value, whichever of the tied experts was taken
        assert torch.equal(top.sort(descending=True).values, logits[t].topk(2).values)
        torch.testing.assert_close(weights[t], torch.softmax(top, -1))
    assert ids[2, 0] == 1
    torch.testing.assert_close(
        grouped_experts(x, ids, weights, experts), reference(x, ids, weights, experts)
    )


def test_route_matches_softmax_over_top_logits():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(4))
    weights, ids = route(logits, 2)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), -1))
    assert torch.equal(ids, logits.topk(2).indices)
    unnormalized, _ = route(logits, 2, normalize=False)
    torch.testing.assert_close(unnormalized, torch.softmax(logits, -1).gather(1, ids))


def test_empty_batch(experts):
    x = torch.empty(0, H)
    ids = torch.empty(0, 2, dtype=torch.int64)
    out = grouped_experts(x, ids, torch.empty(0, 2), experts)
    assert out.shape == (0, H)


def test_bf16_keeps_dtype(experts):
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(5))
    weights, ids = route(torch.randn(7, E), 2)
    bf = torch.nn.ModuleList(GatedMLP(H, FF, F.silu, torch.bfloat16) for _ in range(E))
    for a, b in zip(bf, experts):
        a.gate_up_proj.weight.data.copy_(b.gate_up_proj.weight)
        a.down_proj.weight.data.copy_(b.down_proj.weight)
    out = grouped_experts(x.bfloat16(), ids, weights, bf)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), reference(x, ids, weights, experts), atol=0.1, rtol=0.05
    )


def test_gguf_and_hf_names_of_the_moe_families():
    from kvserve.model import registry

    assert registry.gguf_arch_name("llama", "m.gguf", experts=8) == "mixtral"
    assert registry.gguf_arch_name("qwen3moe", "m.gguf", experts=128) == "qwen3_moe"
    assert registry.gguf_arch_name("llama", "m.gguf") == "llama"
    with pytest.raises(ValueError, match="'gemma3' with 4 experts is not supported"):
        registry.gguf_arch_name("gemma3", "m.gguf", experts=4)
    assert registry.hf_arch_name(["MixtralForCausalLM"]) == "mixtral"
    assert registry.hf_arch_name(["Qwen3MoeForCausalLM"]) == "qwen3_moe"


QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=160,
    moe_intermediate_size=96,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=300,
)


def test_hf_config_fields_and_refusals():
    from kvserve.model.hf_loader import hf_arch

    a = hf_arch(QWEN3_MOE)
    assert (a.num_experts, a.num_experts_per_tok, a.intermediate_size) == (8, 2, 96)
    assert a.qk_norm and not a.norm_topk_prob  # transformers' default
    with pytest.raises(ValueError, match="every layer must be sparse"):
        hf_arch(dict(QWEN3_MOE, mlp_only_layers=[1]))
    with pytest.raises(ValueError, match="every layer must be sparse"):
        hf_arch(dict(QWEN3_MOE, decoder_sparse_step=2))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be in"):
        hf_arch(dict(QWEN3_MOE, num_experts_per_tok=9))
    mixtral = dict(
        QWEN3_MOE,
        architectures=["MixtralForCausalLM"],
        num_local_experts=4,
        num_experts=None,
        sliding_window=64,
    )
    m = hf_arch(mixtral)
    assert (m.num_experts, m.sliding_window, m.qk_norm, m.norm_topk_prob) == (4, 64, False, True)
    assert m.intermediate_size == 160
