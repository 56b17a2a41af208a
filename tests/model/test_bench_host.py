"""`kvserve bench host` (kvserve/bench/host.py): the engine with a null forward, and the phases.

The null forward must be what ran (the real backend and the model's forward are made to raise),
greedy decoding must follow the cycle of CYCLE_TEXT's tokens as the tokenizer itself gives them,
and the detokenized text must be the tokenizer's own decoding of those tokens. The command's
phases must add up to its step total, with the null forward a small part of it.
"""

import json

import pytest

from kvserve.bench import cli, host, report
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = host.null_engine(
        None, max_batch=4, max_len=64, cache_dir=str(tmp_path_factory.mktemp("m"))
    )
    real = eng.runner.backend.real
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise AssertionError("the real forward ran")

    real.logits = real.hidden = refuse
    eng.runner.model.forward = refuse
    yield eng, calls
    eng.close()


def expected_cycle(tokenizer, special) -> list[int]:
    seen, out = set(), []
    for t in tokenizer.encode(host.CYCLE_TEXT, add_special_tokens=False):
        if t not in seen and t not in special:
            seen.add(t)
            out.append(t)
    return out


def test_null_forward_drives_greedy_through_the_cycle(engine):
    eng, calls = engine
    tok = eng.tokenizer
    special = set(eng.eos_token_ids) | set(tok.all_special_ids)
    cycle = expected_cycle(tok, special)
    assert len(cycle) > 30
    n = len(cycle) + 7  # wraps around once
    prompts = [[1000 + i, 2000 + i, 3000] for i in range(3)]
    prompts = [[t for t in p if t not in cycle] or [5000] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=["\n\nUser:"])
    for i, p in enumerate(prompts):
        eng.add_request(f"c{i}", p, params)
    done = {}
    for _ in range(4 * n):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if len(done) == len(prompts):
            break
    want = [cycle[i % len(cycle)] for i in range(n)]
    for i in range(len(prompts)):
        o = done[f"c{i}"]
        assert o.token_ids == want
        assert o.text == tok.decode(want, skip_special_tokens=True)
        assert o.finish_reason == "length"
    assert calls == []
    assert eng.runner.backend.calls > 0


def test_command_phases_add_up(tmp_path):
    out = tmp_path / "host.json"
    argv = ["host", "--batch-sizes", "1,4", "--steps", "4", "--warmup", "1", "--rounds", "3"]
    assert cli.main(argv + ["--output", str(out)]) == 0
    res = json.loads(out.read_text())
    run = res["runs"][0]
    assert "null forward" in run["config"]["steps"]
    # every timed step (plain and instrumented, every round, 2 batch sizes) went through it
    assert run["null_forward_calls"] >= 2 * 3 * (4 + 4)
    assert [b["batch"] for b in run["batches"]] == [1, 4]
    for b in run["batches"]:
        ph, total = b["phases_us"], b["instrumented_step_us"]
        assert set(ph) == set(host.PHASES)
        assert sum(ph.values()) == pytest.approx(total, rel=1e-6)
        named = total - ph["other"]
        assert 0.6 * total <= named <= total * 1.000001, ph  # the timers see most of a step
        assert all(v >= 0 for k, v in ph.items() if k != "other"), ph
        assert ph["forward"] < 0.3 * named, ph  # the null forward costs little
        assert ph["sample"] > 0 and ph["output"] > 0 and ph["schedule"] > 0
        assert b["tok_s"] == pytest.approx(b["batch"] / b["step_us"] * 1e6)
    rows = report.rows_host(res)
    assert [r["load"] for r in rows] == ["batch 1, prompt 8", "batch 4, prompt 8"]


def test_bad_batch_sizes_are_refused():
    assert cli.main(["host", "--batch-sizes", "0,4"]) == 2
    assert cli.main(["host", "--batch-sizes", "a"]) == 2


def test_command_with_the_server_in_the_loop(tmp_path):
    """--server: the same null-forward engine behind the HTTP server, streamed to a client
    process that must get every token (measure_round raises otherwise); per-step figures."""
    import gc

    from kvserve.bench import host_served

    out = tmp_path / "host.json"
    # 60 steps: the timed window spans several scheduler ticks. The process CPU clock sees another
    # thread's time only as of its last tick or switch, so in a window of about one tick the event
    # loop's CPU, running on the other core, may not be counted yet.
    argv = ["host", "--batch-sizes", "1,3", "--steps", "60", "--warmup", "2", "--rounds", "1"]
    frozen = []  # while serving, the startup objects are out of the collector's reach
    measure = host_served.measure_round

    def watched(*a, **kw):
        frozen.append(gc.get_freeze_count())
        return measure(*a, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(host_served, "measure_round", watched)
        assert cli.main(argv + ["--server", "--output", str(out)]) == 0
    assert len(frozen) == 2 and min(frozen) > 10_000
    assert gc.get_freeze_count() == 0  # and back within reach once the server is closed
    res = json.loads(out.read_text())
    assert [r["mode"] for r in res["runs"]] == ["offline, null forward", "server, null forward"]
    served = res["runs"][1]["batches"]
    assert [b["batch"] for b in served] == [1, 3]
    for b in served:
        # (the process and thread clocks are read a few instructions apart: 0.5 us of slack)
        assert b["step_wall_us"] > 0 and 0 < b["engine_thread_cpu_us"] <= b["process_cpu_us"] + 0.5
        assert 0 < b["core_step_cpu_us"] <= b["engine_thread_cpu_us"]
        assert b["http_cpu_us"] == pytest.approx(b["process_cpu_us"] - b["engine_thread_cpu_us"])
        assert b["http_cpu_us"] > 0  # the event loop streamed every step's tokens
        assert b["tok_s"] == pytest.approx(b["batch"] / b["step_wall_us"] * 1e6)
    rows = report.rows_host(res)
    assert [r["load"] for r in rows][2:] == [
        "batch 1, prompt 8, streamed",
        "batch 3, prompt 8, streamed",
    ]
