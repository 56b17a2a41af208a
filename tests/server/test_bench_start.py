"""`kvserve bench start` end to end: it starts `kvserve serve` on the default model, times it to
ready and to a first reply, reads its peak RSS, and the report turns the result into rows."""

import json

from kvserve.bench import report
from kvserve.bench.cli import main as bench_main


def test_bench_start_times_a_real_server_and_reads_its_memory(tmp_path):
    out = tmp_path / "start.json"
    args = ["start", "--repeat", "2", "--threads", "1", "--server-args", "--kv-cache-memory 32MiB"]
    assert bench_main([*args, "-o", str(out)]) == 0
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert run["engine"] == "kvserve" and len(run["samples"]) == 2
    assert run["config"]["server_args"] == "--kv-cache-memory 32MiB --threads 1"
    size = res["workload"]["model_bytes"]
    for s in run["samples"]:
        assert 0 < s["ready_s"] < s["first_reply_s"] < 600
        # the weights are held (at least the file's bytes, packed) beside Python and torch
        assert size < s["peak_rss_bytes"] < size + 4e9
    first = run["first_start"]  # the untimed start before the rounds
    assert 0 < first["ready_s"] < first["first_reply_s"] < 600
    rows = report.rows_start(res)
    assert [r["metric"] for r in rows] == ["start0", "start1"]
    ready = run["summary"]["ready_s"]["median"]
    assert rows[0]["ours"].startswith(f"{ready:.2f} (first reply ")
    assert rows[0]["ours"].endswith(f"; the start before, {first['ready_s']:.2f})")
