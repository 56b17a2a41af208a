"""--device and what follows from it: EngineConfig.on_device is the one place that resolves the
device, the dtype and the weight format, and refuses what does not run there."""

import argparse

import pytest

from kvserve.config import add_engine_args, engine_config_from_args, make_engine_config


def test_auto_resolves_to_the_cpu_without_cuda_and_keeps_float32():
    cfg = make_engine_config().on_device(cuda_available=False)
    assert (cfg.device, cfg.model.dtype, cfg.model.quantization) == ("cpu", "float32", None)


def test_auto_resolves_to_cuda_with_bfloat16_dense_weights():
    cfg = make_engine_config().on_device(cuda_available=True)
    assert (cfg.device, cfg.model.dtype, cfg.model.quantization) == ("cuda", "bfloat16", "none")
    assert (
        make_engine_config(dtype="fp16", device="cuda:1").on_device(True).model.dtype == "float16"
    )
    assert make_engine_config(device="cpu").on_device(True).device == "cpu"  # asked for: kept


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantization": "gguf-mixed"},
        {"kv_cache_dtype": "int8"},
        {"speculative_config": {"method": "ngram"}},
        {"tensor_parallel_size": 2},
    ],
)
def test_auto_keeps_what_runs_on_cpus_only_on_the_cpu(kwargs):
    # a GPU machine asked for a CPU format or CPU ranks: auto picks the CPU instead of refusing
    assert make_engine_config(**kwargs).on_device(cuda_available=True).device == "cpu"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"device": "cuda"}, "sees no CUDA device"),
    ],
)
def test_cuda_without_cuda_says_how_to_fix_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_engine_config(**kwargs).on_device(cuda_available=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"quantization": "gguf"}, "runs on the CPU kernels"),
        ({"kv_cache_dtype": "int8"}, "int8 is read by the CPU kernels only"),
        ({"speculative_config": {"method": "ngram"}}, "speculative decoding does not run on cuda"),
    ],
)
def test_what_cuda_does_not_run_is_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_engine_config(device="cuda", **kwargs).on_device(cuda_available=True)


@pytest.mark.parametrize(
    "device", ["gpu", "cuda:x", "", "CUDA", None, 0, "cuda\ud800", "cuda:" + "9" * 30]
)
def test_unknown_devices_are_refused_at_construction(device):
    with pytest.raises(ValueError, match="choose auto, cpu, cuda or cuda:N"):
        make_engine_config(device=device)
    hand_built = make_engine_config()
    hand_built.device = device
    with pytest.raises(ValueError, match="choose auto, cpu, cuda or cuda:N"):
        hand_built.on_device(cuda_available=True)


@pytest.mark.parametrize(
    "value", [0, 0.01, 1.5, float("nan"), float("inf"), 2**64, True, "0.9", None]
)
def test_gpu_memory_utilization_is_a_share(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_engine_config(gpu_memory_utilization=value)
    hand_built = make_engine_config()  # an EngineConfig set by hand is checked where it is resolved
    hand_built.gpu_memory_utilization = value
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        hand_built.on_device(cuda_available=False)


def test_cli_flags_reach_the_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(
        p.parse_args(
            ["--device", "cuda", "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8"]
        )
    )
    assert (cfg.device, cfg.gpu_memory_utilization, cfg.cache.kv_cache_dtype) == (
        "cuda",
        0.5,
        "fp8",
    )
    resolved = cfg.on_device(cuda_available=True)
    assert resolved.cache.resolved_kv_dtype(resolved.model.dtype) == "fp8"
    default = engine_config_from_args(p.parse_args([]))
    assert (default.device, default.model.dtype) == ("auto", "auto")
