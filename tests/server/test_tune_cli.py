"""`kvserve tune` end to end: two real server trials, the table, the YAML that `kvserve serve
--config` reads, the plot."""

import json
import subprocess
import sys

from kvserve.config_file import parse_args_with_config
from kvserve.server.launcher import build_parser


def test_tune_runs_trials_and_writes_a_config_serve_loads(tmp_path):
    out, results = tmp_path / "tuned.yaml", tmp_path / "trials.json"
    cmd = [
        sys.executable,
        "-m",
        "kvserve",
        "tune",
        "--dataset",
        "random",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--knobs",
        "max-num-seqs",
        "--max-trials",
        "2",
        "--slo",
        "ttft=60s,tpot=10s",
        "--no-progress",
        "--output",
        str(out),
        "--results",
        str(results),
        "--server-args",
        "--threads 1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "goodput req/s" in proc.stdout and "best of 2 trials" in proc.stdout
    data = json.loads(results.read_text())
    assert [t["config"]["max-num-seqs"] for t in data["trials"]] == ["64", "4"]
    for t in data["trials"]:
        assert t["error"] is None and t["metrics"]["completed"] == 4
        assert t["metrics"]["goodput"]["good_requests"] == 4  # a generous SLO
    args = parse_args_with_config(build_parser(), ["--config", str(out)])
    assert str(args.max_num_seqs) == data["best"]["max-num-seqs"]
    assert out.with_suffix(".png").stat().st_size > 1000


def test_tune_refuses_an_unknown_knob():
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "tune", "--knobs", "max-num-seqs,warp-drive"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "warp-drive" in proc.stderr
