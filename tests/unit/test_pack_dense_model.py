"""pack_dense_model: a dense float32 model's linears (and its tied head) packed as kind 32 with
float32 activations give what the dense ones gave, within the float32 sums' rounding; what it
cannot pack it leaves alone and names."""

import types

import pytest
import torch
from torch import nn

from kvserve.model.layers import Embedding, Linear, UnquantizedMethod
from kvserve.model.quant.gguf import FLOAT_ACTS, GgufMethod, pack_dense_model
from kvserve.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C kernels")


class _Tiny(nn.Module):
    """Two linears and a tied head over an embedding: the attributes pack_dense_model reads."""

    def __init__(self, hidden: int, vocab: int = 40):
        super().__init__()
        torch.manual_seed(0)
        self.arch = types.SimpleNamespace(
            hidden_size=hidden, vocab_size=vocab, tie_word_embeddings=True
        )
        self.dtype = torch.float32
        self.up = Linear(hidden, [24, 40])  # a fused pair of shards
        self.down = Linear(64, hidden, bias=True)
        for shard, rows in enumerate(self.up.shard_sizes):
            self.up.load_weight(torch.randn(rows, hidden), shard)
        self.down.load_weight(torch.randn(hidden, 64))
        self.down.load_bias(torch.randn(hidden))
        self.embed_tokens = Embedding(vocab, hidden)
        self.embed_tokens.load_weight(torch.randn(vocab, hidden))
        self.lm_head = None
        self.tied_head = False

    def tie_quantized_head(self, head):
        self.lm_head, self.tied_head = head, True


def test_packed_linears_and_head_compute_what_the_dense_ones_did():
    m = _Tiny(hidden=64)
    x, h = torch.randn(5, 64), torch.randn(3, 64)
    want_up, want_down = m.up(x), m.down(h)
    table = m.embed_tokens.weight.clone()
    ids = torch.tensor([3, 0, 39])
    assert pack_dense_model(m) is None
    for lin in (m.up, m.down, m.lm_head):
        assert isinstance(lin.quant_method, GgufMethod) and lin.quant_method.parts == FLOAT_ACTS
        assert lin.weight is None and lin.gguf_kind == 32
    torch.testing.assert_close(m.up(x), want_up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.down(h), want_down, rtol=1e-5, atol=1e-5)  # the bias added
    torch.testing.assert_close(m.lm_head(x), x @ table.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(m.embed_tokens(ids), table[ids])  # rows read back from the packed head


def test_a_model_it_cannot_pack_is_left_dense_and_named():
    m = _Tiny(hidden=48)  # 48 inputs: not whole blocks of 32
    assert pack_dense_model(m) == "a linear's 48 inputs are not a multiple of 32"
    assert isinstance(m.up.quant_method, UnquantizedMethod) and m.lm_head is None
    m = _Tiny(hidden=64)
    m.dtype = torch.bfloat16
    assert pack_dense_model(m) == "the model computes in torch.bfloat16"
    assert isinstance(m.down.quant_method, UnquantizedMethod)
    m = _Tiny(hidden=64).to("meta")  # any device but the CPU
    assert pack_dense_model(m) == "the weights are not on the CPU"
