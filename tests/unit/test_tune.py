"""kvserve tune's search (coordinate descent over a scripted score) and --config files."""

import math

import pytest

from kvserve.bench.tune import (
    NGRAM,
    Trial,
    coordinate_descent,
    server_flags,
    trial_table,
    write_yaml,
)
from kvserve.config_file import parse_args_with_config
from kvserve.server.launcher import build_parser


def _scored(score):
    calls = []

    def run(config):
        calls.append(config)
        g, err = score(config)
        return Trial(config, goodput=g, tokens_per_s=10 * g if err is None else math.nan, error=err)

    return run, calls


def test_coordinate_descent_finds_each_knobs_best_and_never_repeats_a_config():
    knobs = {"a": ["1", "2", "3"], "b": ["x", "y"]}
    best_b = {"x": 0.0, "y": 1.0}
    run, calls = _scored(
        lambda c: (int(c["a"]) * (2 if c["a"] == "2" else 1) + best_b[c["b"]], None)
    )
    best, trials = coordinate_descent(knobs, run)
    assert best.config == {"a": "2", "b": "y"}
    keys = [tuple(sorted(c.items())) for c in calls]
    assert (
        len(keys) == len(set(keys)) == len(trials) == 4
    )  # start, a=2, a=3, b=y (a=1/b=x are the start)


def test_failed_trials_lose_and_max_trials_stops():
    knobs = {"a": ["1", "2", "3"]}
    run, _ = _scored(
        lambda c: (math.nan, "server did not start") if c["a"] == "3" else (float(c["a"]), None)
    )
    best, trials = coordinate_descent(knobs, run)
    assert best.config == {"a": "2"} and trials[-1].error
    run, calls = _scored(lambda c: (float(c["a"]), None))
    best, trials = coordinate_descent(knobs, run, max_trials=2)
    assert len(calls) == 2 and best.config == {"a": "2"}


def test_goodput_then_throughput_decides():
    a = Trial({"k": "a"}, goodput=1.0, tokens_per_s=50.0)
    b = Trial({"k": "b"}, goodput=1.0, tokens_per_s=60.0)
    c = Trial({"k": "c"}, goodput=math.nan, tokens_per_s=99.0)
    assert max([a, b, c], key=Trial.key) is b


def test_written_yaml_is_loaded_by_serve(tmp_path):
    best = Trial(
        {
            "max-num-seqs": "16",
            "max-num-batched-tokens": "1024",
            "threads": "2",
            "kv-cache-dtype": "int8",
            "speculative-config": NGRAM,
        },
        goodput=2.0,
        tokens_per_s=100.0,
    )
    path = tmp_path / "tuned.yaml"
    write_yaml(path, best, "header line one\nline two")
    assert path.read_text().startswith("# header line one\n# line two\n")
    args = parse_args_with_config(build_parser(), ["--config", str(path)])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.threads, args.kv_cache_dtype) == (
        16,
        1024,
        2,
        "int8",
    )
    assert args.speculative_config == NGRAM
    # the command line wins over the file
    args = parse_args_with_config(build_parser(), ["--config", str(path), "--max-num-seqs", "8"])
    assert args.max_num_seqs == 8
    assert "speculative" not in " ".join(
        server_flags({"speculative-config": "none", "threads": "1"})
    )
    assert "*" in trial_table([best], best, list(best.config))


@pytest.mark.parametrize(
    "text,message",
    [
        ("max-num-seqs: [1, 2", "not valid YAML"),
        ("- 1\n- 2\n", "mapping"),
        ("no-such-flag: 3\n", "unknown flag 'no-such-flag'"),
        ("max-num-seqs: many\n", "max-num-seqs"),
        ("kv-cache-dtype: int3\n", "not one of"),
        ("no-access-log: 1\n", "true or false"),
        ("config: other.yaml\n", "unknown flag"),
    ],
)
def test_bad_config_files_are_refused_naming_the_problem(tmp_path, capsys, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_args_with_config(build_parser(), ["--config", str(path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_config_file_flag_spellings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "max_num_seqs: 4\n--port: 9001\nno-access-log: true\nspeculative-config: "
        "{method: ngram, num_speculative_tokens: 2, prompt_lookup_max: 3, prompt_lookup_min: 1}\n"
    )
    args = parse_args_with_config(build_parser(), ["--config", str(path)])
    assert (args.max_num_seqs, args.port, args.no_access_log) == (4, 9001, True)
    assert '"num_speculative_tokens": 2' in args.speculative_config
    missing = tmp_path / "missing.yaml"
    with pytest.raises(SystemExit):
        parse_args_with_config(build_parser(), ["--config", str(missing)])
