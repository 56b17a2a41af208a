"""`kvserve bench roofline` on the real model: each batch-1 decode request's MBU is taken against
the read bandwidth measured right before and after it (the higher of the two), and the reported
MBU is the median of those."""

import json
import statistics

import pytest

from kvserve.bench.cli import main
from kvserve.bench.roofline import DECODE_REPEATS, bandwidth_beside_decode


def test_roofline_takes_each_requests_mbu_against_the_bandwidth_beside_it(default_gguf, tmp_path):
    out = tmp_path / "roofline.json"
    rc = main(
        [
            "roofline",
            "--seconds",
            "0.3",
            "--decode-prompt-len",
            "16",
            "--decode-len",
            "8",
            "--prefill-len",
            "32",
            "--batch",
            "2",
            "--threads",
            "1",
            "--kv-cache-memory",
            "64MiB",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    d = json.loads(out.read_text())["model"]["decode_batch1"]
    assert (
        len(d["step_s_samples"])
        == len(d["read_gbs_samples"])
        == len(d["mbu_samples"])
        == DECODE_REPEATS
    )
    for step, (before, after), mbu in zip(
        d["step_s_samples"], d["read_gbs_samples"], d["mbu_samples"]
    ):
        assert before > 0 and after > 0
        assert mbu == pytest.approx(d["bytes_per_step"] / step / 1e9 / max(before, after))
    assert d["mbu"] == statistics.median(d["mbu_samples"])
    line = bandwidth_beside_decode(d)
    assert f"{d['mbu_samples'][0] * 100:.0f}%" in line and "GB/s" in line
