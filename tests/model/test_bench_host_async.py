"""`kvserve bench host --forward-ms X --async-scheduling`: the null forward stands in for a
device's forward time, and with async scheduling the next step's scheduling runs during it.

The overlap is measured with sleeps on both sides (the forward's, and one added to the
scheduler's schedule(), both leaving the GIL): synchronous steps take at least their sum, async
ones about the larger of the two.
"""

import json
import time

import pytest

from kvserve.bench import cli, host
from kvserve.sampling_params import SamplingParams

FORWARD_MS, SCHEDULE_MS = 30, 20


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("host-async"))


def _step_ms(cache_dir, async_scheduling: bool) -> list[float]:
    eng = host.null_engine(
        None,
        max_batch=4,
        max_len=64,
        cache_dir=cache_dir,
        async_scheduling=async_scheduling,
        forward_ms=FORWARD_MS,
    )
    schedule = eng.scheduler.schedule

    def slow_schedule(*args):
        time.sleep(SCHEDULE_MS / 1000)
        return schedule(*args)

    eng.scheduler.schedule = slow_schedule
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"q{i}", [1000 + i, 2000 + i, 3000], params)
    times = []
    for _ in range(12):
        t = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t) * 1e3)
    eng.close()
    return times[2:]  # after the prefill


def test_async_scheduling_overlaps_scheduling_with_the_forward(cache_dir):
    sync = _step_ms(cache_dir, False)
    asyn = _step_ms(cache_dir, True)
    assert min(sync) >= FORWARD_MS + SCHEDULE_MS
    assert min(asyn) >= FORWARD_MS
    assert sorted(asyn)[len(asyn) // 2] < FORWARD_MS + 0.5 * SCHEDULE_MS, (sync, asyn)


def test_command_runs_both_modes(tmp_path):
    out = tmp_path / "host.json"
    argv = ["host", "--batch-sizes", "1,4", "--steps", "3", "--warmup", "1", "--rounds", "1"]
    argv += ["--forward-ms", "2", "--async-scheduling", "both", "--output", str(out)]
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["workload"]["clock"] == "wall" and res["workload"]["forward_ms"] == 2
    runs = res["runs"]
    assert [r["config"]["async_scheduling"] for r in runs] == [False, True]
    for r in runs:
        assert "sleeping 2 ms" in r["config"]["steps"]
        assert [b["batch"] for b in r["batches"]] == [1, 4]
        assert all(b["step_wall_us"] >= 2000 for b in r["batches"])


def test_negative_forward_time_is_refused():
    assert cli.main(["host", "--forward-ms", "-1"]) == 2
