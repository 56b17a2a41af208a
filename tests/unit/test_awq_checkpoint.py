"""scripts/awq_checkpoint.py's quantizer: the activation-aware scales must cost the outputs less
than round-to-nearest where a few input channels carry large activations (what AWQ is for), the
clip search never costs more than no clipping, and folding 1/s into the op before leaves the float
model's function as it was (with and without grouped-query attention)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(
            "awq_checkpoint", SCRIPTS / "awq_checkpoint.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPTS))
    return mod


def salient_inputs(cols: int, gen: torch.Generator) -> torch.Tensor:
    """Inputs in which 4 of the channels are 20 times larger than the rest."""
    x = torch.randn(4096, cols, generator=gen, dtype=torch.float64)
    x[:, :4] *= 20
    return x


def test_scales_beat_round_to_nearest_on_salient_channels(script):
    gen = torch.Generator().manual_seed(0)
    x = salient_inputs(160, gen)
    w = torch.randn(48, 160, generator=gen, dtype=torch.float64) * 0.05
    H = x.t() @ x / x.shape[0]
    rtn = script.output_error(w - script.fake_quant(w, 128), H).sum()
    s, a = script.search_scale([w], H, x.abs().mean(0), 128)
    awq = script.output_error(w - script.fake_quant(w * s, 128) / s, H).sum()
    assert a > 0 and awq < 0.8 * rtn, (a, awq, rtn)
    assert torch.isclose((s.max() * s.min()).sqrt(), torch.tensor(1.0, dtype=s.dtype))


def test_clipping_never_costs_more_than_none(script):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 96, generator=gen, dtype=torch.float64)
    w = torch.distributions.StudentT(2.0).sample((32, 96)).double() * 0.02  # heavy tails
    H = x.t() @ x / x.shape[0]
    clipped = script.search_clip(w, H, 32)
    for a in range(0, 96, 32):
        cut = slice(a, a + 32)
        Hg = H[cut, cut]
        plain = script.output_error(w[:, cut] - script.fake_quant(w[:, cut], 32), Hg)
        ours = script.output_error(w[:, cut] - script.fake_quant(clipped[:, cut], 32), Hg)
        assert (ours <= plain + 1e-12).all()
    assert (clipped.abs() <= w.abs()).all() and not torch.equal(clipped, w)


@pytest.mark.parametrize("kv_heads", [4, 2])  # 4: o_proj is scaled through v's rows
def test_folded_scales_keep_the_float_function(script, kv_heads, monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=300,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM._from_config(config).double().eval()
    ids = torch.randint(0, 300, (1, 48))
    with torch.no_grad():
        want = model(ids).logits
    H, absmean = script.input_stats(model, ids[0].tolist(), 16)
    monkeypatch.setattr(script, "search_clip", lambda w, h, group: w)  # the scales alone
    lines = []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            script.awq_layer(layer, H, absmean, f"model.layers.{i}.", 32, lines.append)
        got = model(ids).logits
    assert any("o_proj" in line for line in lines) == (kv_heads == 4)
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(64))
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
