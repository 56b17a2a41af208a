"""`kvserve bench start`'s parts without a server: the peak RSS of a process tree, and the
report's rows of a result (tests/server/test_bench_start.py runs it against a real server)."""

import os

from kvserve.bench import report, start


def test_tree_peak_rss_sums_a_process_and_its_children(tmp_path):
    import subprocess
    import sys

    alone = start.tree_peak_rss(os.getpid())
    with open(f"/proc/{os.getpid()}/status") as f:
        hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    assert alone >= hwm
    child = subprocess.Popen(
        [sys.executable, "-c", "b = bytearray(200 << 20); import time; time.sleep(30)"]
    )
    try:
        deadline = 100
        while start.tree_peak_rss(child.pid) < 200 << 20 and deadline:
            deadline -= 1
            __import__("time").sleep(0.1)
        assert start.tree_peak_rss(os.getpid()) >= hwm + (200 << 20)
    finally:
        child.kill()
        child.wait()


def test_the_report_gives_each_figure_against_the_peer():
    def run(engine, ready, first, peak):
        sample = {"ready_s": ready, "first_reply_s": first, "peak_rss_bytes": peak}
        return {"engine": engine, "samples": [sample], "summary": start.summarize([sample])}

    res = {
        "kind": "start",
        "workload": {"model_bytes": 1_000_000_000},
        "runs": [run("kvserve", 2.0, 2.5, 1.3e9), run("llamacpp", 3.0, 3.2, 1.1e9)],
    }
    ready, rss = report.rows_start(res)
    assert ready["ours"] == "2.00 (first reply 2.50)" and ready["theirs"].startswith("3.00")
    assert ready["ratio"] == report.x(1.5)
    assert rss["ours"] == "1.30 (+0.30 over the file)" and rss["ratio"] == report.x(1.1 / 1.3)


def test_the_report_names_the_untimed_start_before_the_rounds():
    sample = {"ready_s": 2.0, "first_reply_s": 2.5, "peak_rss_bytes": 1.3e9}
    base = {"engine": "kvserve", "samples": [sample], "summary": start.summarize([sample])}
    base["first_start"] = {"ready_s": 9.25, "first_reply_s": 9.5, "peak_rss_bytes": 1.3e9}
    res = {"kind": "start", "workload": {"model_bytes": 1_000_000_000}, "runs": [base]}
    ready, _ = report.rows_start(res)
    assert ready["ours"] == "2.00 (first reply 2.50; the start before, 9.25)"
