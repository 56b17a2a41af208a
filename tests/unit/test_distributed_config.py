"""Where the ranks of tensor/pipeline parallelism run (kvserve.config.resolve_distributed): one
machine, several given by flags, or torchrun's environment; bad values get a ValueError naming the
flag or variable."""

import os

import pytest

from kvserve.config import DEFAULT_MASTER_PORT, make_engine_config, resolve_distributed

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.2",
    "MASTER_PORT": "29400",
    "LOCAL_WORLD_SIZE": "1",
}


def test_one_machine_starts_every_rank_itself():
    d = resolve_distributed(4, env={})
    assert (d.world, d.rank, d.local_ranks, d.spawn, d.master_addr, d.master_port, d.torchrun) == (
        4,
        0,
        4,
        3,
        "127.0.0.1",
        None,
        False,
    )
    assert (
        resolve_distributed(1, env=TORCHRUN).world == 1
    )  # no ranks: torchrun's variables do not matter


def test_flags_give_each_node_its_share_of_the_ranks():
    d = resolve_distributed(4, nnodes=2, node_rank=1, master_addr="10.0.0.1", env={})
    assert (d.rank, d.local_ranks, d.spawn, d.master_addr, d.master_port) == (
        2,
        2,
        1,
        "10.0.0.1",
        DEFAULT_MASTER_PORT,
    )
    d = resolve_distributed(
        2, nnodes=2, node_rank=0, master_addr="node0.example", master_port=1234, env=TORCHRUN
    )
    assert (d.rank, d.local_ranks, d.spawn, d.master_port, d.torchrun) == (
        0,
        1,
        0,
        1234,
        False,
    )  # flags win


def test_torchrun_environment_names_this_process_rank():
    d = resolve_distributed(2, env=TORCHRUN)
    assert (d.rank, d.local_ranks, d.spawn, d.master_addr, d.master_port, d.torchrun) == (
        1,
        1,
        0,
        "10.0.0.2",
        29400,
        True,
    )


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"nnodes": 2}, {}, "needs --master-addr"),
        ({"nnodes": 3, "master_addr": "h"}, {}, "does not divide"),
        ({"nnodes": 5, "master_addr": "h"}, {}, "--nnodes must be an integer from 1 to 4"),
        (
            {"nnodes": 2, "node_rank": 2, "master_addr": "h"},
            {},
            "--node-rank must be an integer from 0 to 1",
        ),
        ({"nnodes": 2, "node_rank": 2**64, "master_addr": "h"}, {}, "--node-rank"),
        ({"nnodes": float("nan"), "master_addr": "h"}, {}, "--nnodes"),
        ({"nnodes": True, "master_addr": "h"}, {}, "--nnodes"),
        ({"nnodes": 2, "master_addr": "bad host"}, {}, "--master-addr"),
        ({"nnodes": 2, "master_addr": "\ud800"}, {}, "--master-addr"),
        ({"nnodes": 2, "master_addr": ""}, {}, "--master-addr"),
        ({"nnodes": 2, "master_addr": "h", "master_port": 70000}, {}, "--master-port"),
        ({}, {**TORCHRUN, "WORLD_SIZE": "3"}, "WORLD_SIZE=3 processes"),
        ({}, {**TORCHRUN, "RANK": "7"}, "RANK must be"),
        ({}, {**TORCHRUN, "RANK": "x"}, "RANK must be"),
        ({}, {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT is not"),
    ],
)
def test_bad_layouts_name_what_to_fix(kwargs, env, match):
    with pytest.raises(ValueError, match=match):
        resolve_distributed(4 if "nnodes" in kwargs else 2, env=env, **kwargs)


def test_nnodes_without_ranks_to_spread_is_refused():
    with pytest.raises(ValueError, match="give one of them > 1"):
        make_engine_config(nnodes=2, master_addr="h")


def test_threads_default_to_this_machines_cores_over_its_ranks():
    cores = len(os.sched_getaffinity(0))
    assert make_engine_config(tensor_parallel_size=2).num_threads == max(1, cores // 2)
    two_nodes = make_engine_config(tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="h")
    assert two_nodes.num_threads == cores and two_nodes.distributed.local_ranks == 1


def test_only_rank_0_runs_the_engine(monkeypatch):
    from kvserve import LLM

    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(
        ValueError, match="this process is rank 1 of 2: only rank 0 runs the engine"
    ):
        LLM(tensor_parallel_size=2)
