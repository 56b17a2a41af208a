"""The multiturn workload of `kvserve bench throughput`: conversation builder, round prompts,
figures. No model: the engine's outputs are stand-ins."""

import argparse
from types import SimpleNamespace

import pytest

from kvserve.bench.datasets import (
    Conversation,
    add_dataset_args,
    load_requests,
    multiturn_conversations,
    multiturn_prompt,
)

# A synthetic "text stream" with no repeats, so windows can be traced back to their start.
STREAM = list(range(1000, 6000))


def test_conversations_are_deterministic_for_a_seed():
    a = multiturn_conversations(6, turns=3, system_len=40, question_len=7, seed=3, stream=STREAM)
    assert a == multiturn_conversations(
        6, turns=3, system_len=40, question_len=7, seed=3, stream=STREAM
    )
    assert a != multiturn_conversations(
        6, turns=3, system_len=40, question_len=7, seed=4, stream=STREAM
    )


def test_conversation_lengths_and_windows_of_the_stream():
    convs = multiturn_conversations(
        5, turns=4, system_len=33, question_len=9, seed=0, stream=STREAM
    )
    assert len(convs) == 5 and all(isinstance(c, Conversation) for c in convs)
    for c in convs:
        assert len(c.system_ids) == 33
        assert len(c.questions) == 4 and all(len(q) == 9 for q in c.questions)
        # Every piece is a contiguous window of the stream (wrapping at its end).
        for piece in [c.system_ids, *c.questions]:
            start = STREAM.index(piece[0])
            assert piece == [STREAM[(start + i) % len(STREAM)] for i in range(len(piece))]


def test_system_prompts_are_distinct_even_on_a_repetitive_stream():
    convs = multiturn_conversations(
        8, turns=2, system_len=50, question_len=5, seed=1, stream=STREAM
    )
    assert len({tuple(c.system_ids) for c in convs}) == 8
    # A stream that repeats every 10 tokens has only 10 distinct windows: 10 conversations fit,
    # 11 do not.
    short = list(range(10)) * 30
    convs = multiturn_conversations(
        10, turns=1, system_len=20, question_len=3, seed=0, stream=short
    )
    assert len({tuple(c.system_ids[:20]) for c in convs}) == 10
    with pytest.raises(SystemExit):
        multiturn_conversations(11, turns=1, system_len=20, question_len=3, seed=0, stream=short)
    with pytest.raises(ValueError):
        multiturn_conversations(2, turns=0, system_len=20, question_len=3, seed=0, stream=STREAM)


def test_conversations_from_the_real_text():
    from kvserve.bench.datasets import text_stream

    convs = multiturn_conversations(16, turns=4, system_len=1000, question_len=50, seed=0)
    stream = set(text_stream())
    assert len({tuple(c.system_ids) for c in convs}) == 16
    assert all(
        len(c.system_ids) == 1000 and [len(q) for q in c.questions] == [50] * 4 for c in convs
    )
    assert all(t in stream for c in convs for t in c.system_ids)


def test_round_prompt_is_the_chat_history():
    system, q = [1, 2, 3], [[10, 11], [20], [30, 31, 32]]
    a = [[100, 101, 102], [200, 201]]
    assert multiturn_prompt(system, q, []) == [1, 2, 3, 10, 11]
    assert multiturn_prompt(system, q, a[:1]) == [1, 2, 3, 10, 11, 100, 101, 102, 20]
    assert multiturn_prompt(system, q, a) == [
        1,
        2,
        3,
        10,
        11,
        100,
        101,
        102,
        20,
        200,
        201,
        30,
        31,
        32,
    ]
    with pytest.raises(ValueError):
        multiturn_prompt(system, q, a + [[300]])  # every question already answered
    # Pure: the inputs are left as they were.
    assert (
        system == [1, 2, 3]
        and q == [[10, 11], [20], [30, 31, 32]]
        and a == [[100, 101, 102], [200, 201]]
    )


def test_each_round_prompt_extends_the_previous_one():
    """What makes the prefix cache pay: round t+1's prompt starts with round t's prompt and
    answer."""
    conv = multiturn_conversations(
        1, turns=4, system_len=30, question_len=6, seed=2, stream=STREAM
    )[0]
    answers: list[list[int]] = []
    prev = None
    for t in range(4):
        p = multiturn_prompt(conv.system_ids, conv.questions, answers)
        assert len(p) == 30 + 6 * (t + 1) + 5 * t
        if prev is not None:
            assert (
                p[: len(prev) + 5] == prev + answers[-1] and p[len(prev) + 5 :] == conv.questions[t]
            )
        answers.append([7, 7, 7, 7, t])
        prev = p


def _parser(multiturn: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_dataset_args(p, multiturn=multiturn)
    p.add_argument("--seed", type=int, default=0)
    return p


def test_dataset_flags_only_where_offered():
    args = _parser(True).parse_args(
        ["--dataset", "multiturn", "--prefix-len", "64", "--question-len", "16"]
    )
    assert (args.dataset, args.turns, args.prefix_len, args.question_len, args.num_prompts) == (
        "multiturn",
        4,
        64,
        16,
        None,
    )
    with pytest.raises(SystemExit):  # serve keeps the old choices
        _parser(False).parse_args(["--dataset", "multiturn"])
    with pytest.raises(SystemExit, match="rounds"):
        load_requests(args, "unused.gguf")


def test_multiturn_refuses_peers(capsys):
    from kvserve.bench import throughput

    args = SimpleNamespace(dataset="multiturn", peer=["hf"], only_peers=False, turns=2)
    assert throughput.main(args, []) == 2
    err = capsys.readouterr().err
    assert "--peer" in err and "kvserve generated" in err


def test_asked_tokens_and_cache_figures():
    from kvserve.bench.throughput import cache_figures, multiturn_asked, ttfts

    convs = [Conversation([0] * 10, [[1] * 3, [2] * 3]), Conversation([0] * 20, [[1] * 4, [2] * 4])]
    # conv 1: 13 + (10+6+5) = 34; conv 2: 24 + (20+8+5) = 57
    assert multiturn_asked(convs, output_len=5) == (34 + 57, 4 * 5)
    metrics = lambda a, f: SimpleNamespace(arrival_time=a, first_token_time=f)  # noqa: E731
    outs = [
        SimpleNamespace(metrics=metrics(1.0, 1.5)),
        SimpleNamespace(metrics=metrics(2.0, 2.25)),
        SimpleNamespace(metrics=metrics(0.0, 1.0)),
        SimpleNamespace(metrics=None),
    ]
    assert ttfts(outs) == [0.5, 0.25, 1.0]
    f = cache_figures([0.5, 0.25, 1.0], prompt_tokens=200, cached_tokens=50)
    assert f == {
        "ttft_median_s": 0.5,
        "ttft_mean_s": pytest.approx(1.75 / 3),
        "cached_prompt_tokens": 50,
        "hit_rate": 0.25,
    }
    assert cache_figures([], 0, 0) == {
        "ttft_median_s": None,
        "ttft_mean_s": None,
        "cached_prompt_tokens": 0,
        "hit_rate": None,
    }


def test_report_shows_ttft_hit_rate_and_turns(tmp_path):
    from kvserve.bench.metrics import throughput_report
    from kvserve.bench.report import build_page

    machine = {
        "cpu": "test cpu",
        "cores": 2,
        "simd": [],
        "memory_gib": 8,
        "os": "linux",
        "python": "3.11",
    }

    def turn(t, rate):
        return {
            "turn": t,
            "requests": 2,
            "prompt_tokens": 100,
            "output_tokens": 16,
            "elapsed_s": 1.0,
            "ttft_median_s": 0.2,
            "ttft_mean_s": 0.25,
            "cached_prompt_tokens": int(rate * 100),
            "hit_rate": rate,
        }

    run = {
        "engine": "kvserve",
        "config": {"prefix_caching": True},
        "ttft_median_s": 0.125,
        "ttft_mean_s": 0.2,
        "cached_prompt_tokens": 40,
        "hit_rate": 0.2,
        "per_turn": [turn(1, 0.0), turn(2, 0.4)],
        "metrics": throughput_report(4, 200, 32, 32, 2.0),
    }
    res = {
        "kind": "throughput",
        "command": "kvserve bench throughput --dataset multiturn",
        "date": "2026-01-01",
        "machine": machine,
        "versions": {"kvserve": "0.1.0"},
        "load_avg_before": 0.1,
        "workload": {
            "dataset": "multiturn",
            "num_requests": 4,
            "prompt_tokens": 200,
            "max_tokens_total": 32,
            "conversations": 2,
            "turns": 2,
        },
        "runs": [run],
    }
    page = build_page([(tmp_path / "throughput-multiturn.json", res)], tmp_path)
    assert "| multiturn, 4 requests |" in page
    assert "(TTFT p50 0.125 s, prefix cache hit rate 20.0%)" in page
