"""scripts/gptq_checkpoint.py's quantizer: GPTQ's rounding must cost the layer's outputs less than
round-to-nearest on inputs whose features are correlated (what the Hessian correction is for),
with the same groups, zero points and scales, and every integer on the 4-bit grid."""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gptq_checkpoint.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gptq_checkpoint", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def output_error(x, w, q, z, s, group):
    g = torch.arange(w.shape[1]) // group
    deq = (q - z[g].t()).double() * s[g].t().double()
    return torch.linalg.norm(x @ (w.double() - deq).t()).item()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_beats_round_to_nearest_on_the_outputs(script, act_order, group):
    gen = torch.Generator().manual_seed(0)
    cols = 160  # the last group of 128 is short
    mix = 3 * torch.randn(cols, cols, generator=gen) / cols**0.5 + torch.eye(cols)
    x = (torch.randn(2048, cols, generator=gen) @ mix).double()  # correlated features
    w = torch.randn(48, cols, generator=gen) * 0.05
    H = 2 * x.t() @ x / x.shape[0]
    args = dict(group=group, bits=4, sym=False, damp=0.01, act_order=act_order)
    qg, zg, sg = script.quantize_linear(w, H, rtn=False, **args)
    qr, zr, sr = script.quantize_linear(w, None, rtn=True, **args)
    assert torch.equal(zg, zr) and torch.equal(sg, sr)  # static groups: same parameters
    assert qg.min() >= 0 and qg.max() <= 15
    assert not torch.equal(qg, qr)
    gptq, rtn = output_error(x, w, qg, zg, sg, group), output_error(x, w, qr, zr, sr, group)
    assert gptq < 0.8 * rtn, (gptq, rtn)
