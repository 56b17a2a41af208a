"""Rotary embedding variants of kvserve.model.layers against transformers' own functions:
LongRoPE (Phi-3) inverse frequencies and attention factor, short and long, partial rotary; and
the GPU path's Triton rope kernel (run by Triton's interpreter on CPU tensors) on a partial
rotary head equal to the CPU tables."""

import math
import os

import pytest
import torch

from kvserve.model.layers import RopeTables, RotaryEmbedding, rope_inv_freq

SHORT = [1.0, 1.3, 1.7, 2.2, 3.0, 4.5]
LONG = [1.0, 2.5, 5.0, 9.0, 17.0, 40.0]


@pytest.mark.parametrize("context_len,which", [(16, "short"), (17, "long"), (256, "long")])
def test_longrope_inv_freq_matches_transformers(context_len, which):
    """kvserve picks the factor set by the served context, transformers by the sequence length
    (longest position + 1 > original length: long); a sequence as long as the context gets the
    same frequencies and attention factor."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=16,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
    )
    want, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=context_len)
    scaling = {
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 16,
        "attention_factor": math.sqrt(1 + math.log(256 / 16) / math.log(16)),
        "context_len": context_len,
    }
    got = rope_inv_freq(12, 10000.0, scaling)
    assert torch.equal(got, want)
    chosen = torch.tensor(SHORT if which == "short" else LONG)
    torch.testing.assert_close(got * chosen, rope_inv_freq(12, 10000.0, None))
    rotary = RotaryEmbedding(12, 64, 10000.0, scaling)
    assert rotary.attention_factor == pytest.approx(factor)
    freqs = torch.outer(torch.arange(64).float(), want)
    torch.testing.assert_close(rotary.cos[:, :6], freqs.cos() * factor)


def test_partial_rotary_passes_the_other_dims_through():
    rotary = RotaryEmbedding(12, 32, 10000.0)
    x = torch.randn(5, 3, 16)
    y = rotary.apply(x, rotary.tables(torch.arange(5), torch.float32))
    assert torch.equal(y[..., 12:], x[..., 12:])
    full = rotary.apply(x[..., :12].contiguous(), rotary.tables(torch.arange(5), torch.float32))
    assert torch.equal(y[..., :12], full)
    assert not torch.allclose(y[1:, :, :12], x[1:, :, :12])  # position 0 is the identity


def test_triton_rope_on_a_partial_rotary_head():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    rotary = RotaryEmbedding(12, 32, 10000.0)
    x = torch.randn(4, 3, 16)
    pos = torch.tensor([0, 5, 9, 31])
    want = rotary.apply(x, rotary.tables(pos, torch.float32))
    got = rotary.apply(x, RopeTables(rotary.cos, rotary.sin, pos))  # the GPU path's tables
    torch.testing.assert_close(got, want)
