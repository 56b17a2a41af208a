"""Tensor parallelism on the default model: 2 processes with 1 thread each, gloo over 127.0.0.1.
SmolLM2-135M has 3 KV heads, so TP=2 is the uneven split (2 + 1 heads, 6 + 3 query heads).

TP=2 gives the greedy tokens of TP=1 on 8 prompts and logprobs within 1e-4 (float32 KV cache:
float16 KV rounds the tensor-parallel sums' last bits into visible differences); a killed rank
makes the next step raise RankLost at once, never a hang (with pipeline stages too).

Across machines, simulated here: node 1 is a separate `kvserve serve --nnodes 2 --node-rank 1`
process (or torchrun starts both ranks), meeting node 0 at 127.0.0.1 as it would at node 0's
address; the ranks then run the same steps as on one machine."""

import subprocess
import sys
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.runner import ranks
from kvserve.runner.ranks import free_port
from kvserve.runner.tensor_parallel import RankLost

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
    "Q: What is 17 * 23?\nA:",
    "Water boils at",
    "The quick brown fox",
    "import numpy as np\n",
]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


ENGINE = {
    "quantization": "none",
    "num_threads": 1,
    "max_model_len": 1024,
    "kv_cache_memory": "64MiB",
    "kv_cache_dtype": "float32",
}


def _llm(default_gguf, tp, **kwargs):
    return LLM(default_gguf, tensor_parallel_size=tp, **ENGINE, **kwargs)


@pytest.fixture(scope="module")
def tp1_outputs(default_gguf):
    return _llm(default_gguf, 1).generate(PROMPTS, PARAMS, use_tqdm=False)


def _assert_same(expected, got):
    """Greedy tokens equal, top-5 logprobs within 1e-4."""
    worst = 0.0
    for a, b in zip(expected, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (
            a.outputs[0].text,
            b.outputs[0].text,
        )
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert [t for t, _, _ in la.top] == [t for t, _, _ in lb.top]
            worst = max([worst] + [abs(x - y) for (_, _, x), (_, _, y) in zip(la.top, lb.top)])
    assert worst < 1e-4, worst


def test_tp2_gives_the_tokens_and_logprobs_of_tp1(default_gguf, tp1_outputs):
    llm = _llm(default_gguf, 2)
    try:
        assert llm.engine.runner.tp is not None and llm.engine.runner.layer_stack is None
        attn = llm.engine.runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (6, 2)  # rank 0's share of 9 / 3
        _assert_same(tp1_outputs, llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        assert llm.engine.scheduler.num_used_blocks == 0
    finally:
        llm.engine.close()
    assert all(
        p.poll() is not None for p in llm.engine.runner.tp.workers
    )  # closed: the ranks exited


def test_workers_wait_out_an_idle_engine(default_gguf, tp1_outputs, monkeypatch):
    """Waiting for the next step is not a stalled collective: ranks idle for longer than the step
    timeout (30 s; 2 s here) still run the next step."""
    monkeypatch.setattr(ranks, "STEP_TIMEOUT_S", 2.0)
    monkeypatch.setenv("KVSERVE_STEP_TIMEOUT_S", "2")  # the worker processes'
    llm = _llm(default_gguf, 2)
    try:
        time.sleep(4)
        _assert_same(tp1_outputs[:2], llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False))
        time.sleep(4)
        _assert_same(tp1_outputs[2:4], llm.generate(PROMPTS[2:4], PARAMS, use_tqdm=False))
    finally:
        llm.engine.close()


def test_a_rank_that_dies_while_starting_fails_the_start_and_the_next_engine_starts(
    default_gguf, tp1_outputs, monkeypatch
):
    """Rank 0 waits for its workers at the store before any group forms: one that exits meanwhile
    fails the start at once, naming it, and leaves no half-formed group behind."""
    with monkeypatch.context() as m:
        m.setattr(
            ranks,
            "spawn",
            lambda d, port, threads: [
                subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
            ],
        )
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=r"rank 1 \(pid \d+\) exited with code 3 while starting"):
            _llm(default_gguf, 2)
        assert time.monotonic() - t0 < 30
    llm = _llm(default_gguf, 2)
    try:
        _assert_same(tp1_outputs[:2], llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False))
    finally:
        llm.engine.close()


STALLED_WORKER = """import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False)
store.set("kvserve/arrived/1", "1")
time.sleep(120)"""


def test_a_rank_that_never_joins_fails_the_start_and_the_next_engine_starts(
    default_gguf, tp1_outputs, monkeypatch
):
    """A worker that reaches the store but never joins the groups: rank 0's rendezvous fails after
    the step timeout, and the half-counted group does not break the next engine's start."""
    with monkeypatch.context() as m:
        m.setattr(ranks, "STEP_TIMEOUT_S", 2.0)
        m.setattr(
            ranks,
            "spawn",
            lambda d, port, threads: [
                subprocess.Popen([sys.executable, "-c", STALLED_WORKER, str(port)])
            ],
        )
        with pytest.raises(RuntimeError, match="timeout"):
            _llm(default_gguf, 2)
    llm = _llm(default_gguf, 2)
    try:
        _assert_same(tp1_outputs[:2], llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False))
    finally:
        llm.engine.close()


def _node1(default_gguf, kind: str, port: int) -> subprocess.Popen:
    """Node 1 of 2: its own command, as it would run on the other machine."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve",
            "serve",
            "--model",
            default_gguf,
            f"--{kind}",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--threads",
            "1",
        ]
    )


@pytest.mark.parametrize("kind", ["tensor-parallel-size", "pipeline-parallel-size"])
def test_two_nodes_give_the_tokens_of_one_process(default_gguf, tp1_outputs, kind):
    port = free_port()
    node1 = _node1(default_gguf, kind, port)
    try:
        llm = LLM(
            default_gguf,
            **{kind.replace("-", "_"): 2},
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
            **ENGINE,
        )
        assert llm.engine.ranks.workers == []  # node 1 started its rank itself
        _assert_same(tp1_outputs, llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        llm.engine.close()
        assert node1.wait(30) == 0  # told to stop, it stopped
    finally:
        node1.kill()


def test_a_lost_node_stops_the_engine_with_a_clear_error(default_gguf):
    port = free_port()
    node1 = _node1(default_gguf, "tensor-parallel-size", port)
    try:
        llm = LLM(
            default_gguf,
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
            **ENGINE,
        )
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
        node1.kill()
        node1.wait()
        t0 = time.monotonic()
        with pytest.raises(RankLost, match="a rank is gone or stalled"):
            llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        llm.engine.close()
    finally:
        node1.kill()


def test_torchrun_starts_the_ranks(default_gguf, tp1_outputs):
    """`torchrun --nproc-per-node 2 -m kvserve generate ...`: rank 0 generates, rank 1 executes."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "kvserve",
        "generate",
        PROMPTS[0],
        "--model",
        default_gguf,
        "--tensor-parallel-size",
        "2",
        "--temperature",
        "0",
        "--max-tokens",
        str(PARAMS.max_tokens),
        "--ignore-eos",
        "--quantization",
        "none",
        "--threads",
        "1",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "64MiB",
        "--kv-cache-dtype",
        "float32",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == tp1_outputs[0].outputs[0].text + "\n"


@pytest.mark.parametrize("kind", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_killed_rank_stops_the_engine_at_once_with_a_clear_error(default_gguf, kind):
    """Tensor and pipeline parallelism share their ranks (runner/ranks.py): either way, a dead
    worker makes the next step raise RankLost naming it."""
    llm = LLM(
        default_gguf,
        quantization="none",
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory="64MiB",
        **{kind: 2},
    )
    worker = llm.engine.ranks.workers[0]
    worker.kill()
    worker.wait()
    t0 = time.monotonic()
    with pytest.raises(RankLost, match=r"rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    llm.engine.close()


def test_tensor_parallel_refuses_what_it_cannot_shard(default_gguf):
    with pytest.raises(ValueError, match="more than the model's 3 KV heads"):
        LLM(default_gguf, tensor_parallel_size=4, num_threads=1, kv_cache_memory="32MiB")
