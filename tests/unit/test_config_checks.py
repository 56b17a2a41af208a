"""Start-up and configuration checks: a KV budget of nothing, or more than this machine's free
memory, is refused with one line that names the flag (or the --config key) and the fix; so is a
device this torch does not have. Never a traceback, never a start that fails later under load."""

import argparse
import subprocess
import sys

import pytest

from kvserve import config as cfg_mod
from kvserve.config import (
    CacheConfig,
    KVShape,
    SchedulerConfig,
    add_engine_args,
    kv_cache_size,
    make_engine_config,
    parse_size,
)
from kvserve.config_file import add_config_arg, parse_args_with_config

GiB = 2**30
SMOL = KVShape(30, 3, 64, 2)  # SmolLM2-135M's KV: 30 layers, 3 KV heads, head_dim 64, fp16


@pytest.mark.parametrize(
    "text, size",
    [("2GiB", 2 * GiB), ("1e9", 10**9), ("1.5e3KiB", 1536000), ("512", 512), (4096, 4096)],
)
def test_sizes_read_as_written(text, size):
    assert kv_cache_size(text) == size


@pytest.mark.parametrize(
    "text, match",
    [
        ("0", "above 0"),
        ("0GiB", "above 0"),
        (0, "above 0"),
        ("-1GiB", "cannot read"),
        ("nan", "cannot read"),
        ("1e999", "out of range"),
        (float("inf"), "out of range"),
        (True, "cannot read"),
        ("10 parsecs", "cannot read"),
    ],
)
def test_bad_kv_budgets_say_how_to_write_one(text, match):
    with pytest.raises(ValueError, match=match):
        kv_cache_size(text)
    with pytest.raises(ValueError, match="kv_cache_memory: "):
        make_engine_config(kv_cache_memory=text)


def test_parse_size_refuses_what_no_machine_has():
    with pytest.raises(ValueError, match="out of range"):
        parse_size("1e30")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve generate")
    add_engine_args(p)
    add_config_arg(p)
    return p


@pytest.mark.parametrize("value", ["0", "0GiB", "'-5'", "ten"])
def test_a_bad_config_file_value_is_one_line_naming_the_key(tmp_path, capsys, value):
    path = tmp_path / "tuned.yaml"
    path.write_text(f"kv-cache-memory: {value}\n")
    with pytest.raises(SystemExit) as exit_:
        parse_args_with_config(_parser(), ["--config", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and "usage" not in err, err
    assert err.startswith(f"kvserve generate: error: --config {path}: kv-cache-memory: "), err


def test_the_flag_itself_is_checked_as_the_file_is(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-cache-memory", "0"])
    assert "argument --kv-cache-memory: the KV cache needs memory" in capsys.readouterr().err
    path = tmp_path / "tuned.yaml"
    path.write_text("kv-cache-memory: 10TiB\nmax-num-seqs: 8\n")  # a size: checked at start
    args = parse_args_with_config(_parser(), ["--config", str(path)])
    assert (args.kv_cache_memory, args.max_num_seqs) == (10 * 2**40, 8)


def test_a_budget_beyond_available_memory_is_refused_naming_the_fix():
    cache = CacheConfig(kv_cache_memory=60 * GiB, ram_share=1.0)
    with pytest.raises(ValueError) as e:
        cache.check_fits(23 * GiB)
    msg = str(e.value)
    assert "--kv-cache-memory 60.00 GiB" in msg and "23.00 GiB available" in msg
    assert "below 23.00 GiB" in msg and "leave it out" in msg
    cache.check_fits(61 * GiB)  # it fits: nothing to say
    cache.check_fits(None)  # unknown: not checked
    CacheConfig(kv_cache_memory=60 * GiB).check_fits(1)  # not in this machine's RAM (cuda)


def test_this_machine_is_checked_for_its_ranks_share():
    # Two nodes, one rank each: 30 GiB of KV is 15 GiB here.
    two_nodes = make_engine_config(
        kv_cache_memory="30GiB", tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="h"
    ).on_device(cuda_available=False)
    assert two_nodes.cache.ram_share == 0.5
    two_nodes.cache.check_fits(16 * GiB)
    with pytest.raises(ValueError, match="this machine's ranks hold 15.00 GiB of it"):
        two_nodes.cache.check_fits(14 * GiB)
    # A draft model's cache takes a share of the budget: the two together are what is checked.
    drafted = CacheConfig(kv_cache_memory=10 * GiB, ram_share=1.0).share(0.75)
    assert drafted.kv_cache_memory == int(7.5 * GiB)
    with pytest.raises(ValueError, match="--kv-cache-memory 10.00 GiB .* below 9.00 GiB"):
        drafted.check_fits(9 * GiB)


def test_the_engine_start_checks_cpu_budgets_only(monkeypatch):
    monkeypatch.setattr(cfg_mod, "_meminfo_available", lambda: 4 * GiB)
    sched = SchedulerConfig()
    on_cpu = make_engine_config(kv_cache_memory="8GiB", device="cpu").on_device(False)
    with pytest.raises(ValueError, match="does not fit in memory"):
        on_cpu.cache.kv_groups(SMOL, [None] * SMOL.num_layers, sched)
    small = make_engine_config(kv_cache_memory="64MiB", device="cpu").on_device(False)
    assert small.cache.kv_groups(SMOL, [None] * SMOL.num_layers, sched)[0].num_blocks > 0
    on_gpu = make_engine_config(kv_cache_memory="8GiB", device="cuda").on_device(True)
    assert on_gpu.cache.ram_share is None
    assert on_gpu.cache.kv_groups(SMOL, [None] * SMOL.num_layers, sched)[0].num_blocks > 0


def test_a_missing_device_is_one_line_not_a_traceback():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    r = subprocess.run(
        [sys.executable, "-m", "kvserve", "generate", "hi", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "kvserve: --device cuda: this torch sees no CUDA device "
        "(torch.cuda.is_available() is False): install a CUDA build of torch, "
        "or run with --device cpu\n"
    ), r.stderr
