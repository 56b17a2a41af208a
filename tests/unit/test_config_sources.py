"""Every default written once: the flags (add_engine_args + engine_config_from_args), a --config
file and LLM()'s keywords (make_engine_config) are all made from the config dataclasses' fields,
so the same settings give the same EngineConfig whichever way they come, and each flag's help
shows the default its field holds."""

import argparse
import json
from dataclasses import fields, replace

import pytest

from kvserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    add_engine_args,
    engine_config_from_args,
    engine_keywords,
    engine_knobs,
    make_engine_config,
    weight_format,
)
from kvserve.config_file import add_config_arg, parse_args_with_config

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}

# Non-default settings: {keyword: value}, as LLM() takes them. Each set must make sense on its
# own (tensor parallelism runs float weights and no speculative decoding).
SETTINGS = {
    "speculative": {
        "model": "/models/a.gguf",
        "max_num_batched_tokens": 256,
        "max_num_seqs": 8,
        "max_waiting": 99,
        "block_size": 32,
        "kv_cache_memory": "1GiB",
        "kv_cache_dtype": "int8",
        "dtype": "bfloat16",
        "quantization": "int8",
        "max_model_len": 2048,
        "enable_prefix_caching": False,
        "num_threads": 3,
        "seed": 7,
        "speculative_config": SPEC,
        "device": "cpu",
        "gpu_memory_utilization": 0.5,
    },
    "tensor parallel": {
        "tensor_parallel_size": 2,
        "quantization": "none",
        "max_num_seqs": 4,
        "kv_cache_memory": "512MiB",
        "dtype": "float16",
        "seed": 1,
    },
    "pipeline over two nodes": {
        "pipeline_parallel_size": 2,
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "node0",
        "master_port": 1234,
        "max_num_batched_tokens": 1000,
    },
    "lora": {
        "enable_lora": True,
        "lora_modules": ["a=/adapters/a", "b=/adapters/b"],
        "max_loras": 3,
        "max_lora_rank": 32,
    },
}

# The same settings on the command line.
ARGV = {
    "speculative": [
        "--model", "/models/a.gguf",
        "--max-num-batched-tokens", "256",
        "--max-num-seqs", "8",
        "--max-waiting", "99",
        "--block-size", "32",
        "--kv-cache-memory", "1GiB",
        "--kv-cache-dtype", "int8",
        "--dtype", "bfloat16",
        "--quantization", "int8",
        "--max-model-len", "2048",
        "--no-prefix-caching",
        "--threads", "3",
        "--seed", "7",
        "--speculative-config", json.dumps(SPEC),
        "--device", "cpu",
        "--gpu-memory-utilization", "0.5",
    ],
    "tensor parallel": [
        "--tensor-parallel-size", "2",
        "--quantization", "none",
        "--max-num-seqs", "4",
        "--kv-cache-memory", "512MiB",
        "--dtype", "float16",
        "--seed", "1",
    ],
    "pipeline over two nodes": [
        "--pipeline-parallel-size", "2",
        "--nnodes", "2",
        "--node-rank", "1",
        "--master-addr", "node0",
        "--master-port", "1234",
        "--max-num-batched-tokens", "1000",
    ],
    "lora": [
        "--enable-lora",
        "--lora-modules", "a=/adapters/a", "b=/adapters/b",
        "--max-loras", "3",
        "--max-lora-rank", "32",
    ],
}  # fmt: skip

# The same settings in a --config file: flag names or the fields' names, as a file may write them.
FILES = {
    "speculative": {
        "model": "/models/a.gguf",
        "max-num-batched-tokens": 256,
        "max_num_seqs": 8,
        "--max-waiting": 99,
        "block-size": 32,
        "kv-cache-memory": "1GiB",
        "kv_cache_dtype": "int8",
        "dtype": "bfloat16",
        "quantization": "int8",
        "max-model-len": 2048,
        "enable_prefix_caching": False,  # the field's name: no-prefix-caching: true
        "num_threads": 3,  # the field's name of --threads
        "seed": 7,
        "speculative-config": SPEC,  # a mapping, not JSON text
        "device": "cpu",
        "gpu-memory-utilization": 0.5,
    },
    "tensor parallel": {
        "tensor-parallel-size": 2,
        "quantization": "none",
        "max-num-seqs": 4,
        "kv-cache-memory": "512MiB",
        "dtype": "float16",
        "seed": 1,
    },
    "pipeline over two nodes": {
        "pipeline_parallel_size": 2,
        "nnodes": 2,
        "node-rank": 1,
        "master-addr": "node0",
        "master_port": 1234,
        "max_num_batched_tokens": 1000,
    },
    "lora": {
        "enable-lora": True,
        "lora-modules": ["a=/adapters/a", "b=/adapters/b"],  # a list, not flag text
        "max_loras": 3,
        "max-lora-rank": 32,
    },
}


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve generate")
    add_engine_args(p)
    add_config_arg(p)
    return p


def from_cli(argv: list[str]) -> EngineConfig:
    return engine_config_from_args(parse_args_with_config(_parser(), argv))


def from_file(path, settings: dict, as_json: bool = False) -> EngineConfig:
    if as_json:
        path.write_text(json.dumps(settings))
    else:
        import yaml

        path.write_text(yaml.safe_dump(settings))
    return from_cli(["--config", str(path)])


def test_the_defaults_are_the_same_from_every_source(tmp_path):
    kwargs = make_engine_config()
    assert from_cli([]) == kwargs
    assert from_file(tmp_path / "empty.yaml", {}) == kwargs
    assert from_file(tmp_path / "empty.json", {}, as_json=True) == kwargs
    # ... and they are the dataclasses' own, but for what on_device resolves (auto)
    assert kwargs.scheduler == SchedulerConfig()
    assert kwargs.cache == CacheConfig()
    assert kwargs.model == replace(ModelConfig(), dtype="auto")
    bare = EngineConfig()
    for name in ("speculative", "seed", "num_threads", "gpu_memory_utilization"):
        assert getattr(kwargs, name) == getattr(bare, name), name
    assert (kwargs.device, bare.device) == ("auto", "cpu")  # a hand-built config is resolved


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_same_settings_give_the_same_config_from_every_source(tmp_path, name):
    kwargs = make_engine_config(**SETTINGS[name])
    assert from_cli(ARGV[name]) == kwargs
    assert from_file(tmp_path / "c.yaml", FILES[name]) == kwargs
    assert from_file(tmp_path / "c.json", FILES[name], as_json=True) == kwargs
    assert kwargs != make_engine_config()
    # Each setting reached its field.
    for keyword, value in SETTINGS[name].items():
        k = engine_keywords()[keyword]
        section = {
            ModelConfig: kwargs.model,
            CacheConfig: kwargs.cache,
            SchedulerConfig: kwargs.scheduler,
            EngineConfig: kwargs,
        }.get(k.section)
        if section is None:  # NodesConfig: resolved into kwargs.distributed
            continue
        got = getattr(section, k.name)
        if keyword == "kv_cache_memory":
            value = {"1GiB": 2**30, "512MiB": 2**29}[value]
        elif keyword == "speculative_config":
            value = SpeculativeConfig(**value)
        elif keyword == "lora_modules":
            value = dict(item.split("=") for item in value)
        assert got == value, keyword


def test_the_nodes_flags_reach_the_layout():
    d = make_engine_config(**SETTINGS["pipeline over two nodes"]).distributed
    assert (d.world, d.rank, d.local_ranks, d.master_addr, d.master_port) == (
        2,
        1,
        1,
        "node0",
        1234,
    )


def test_every_flag_shows_its_fields_default_in_its_help(monkeypatch):
    knobs = {k.dest: k for k in engine_knobs() if k.knob.flag}
    p = _parser()
    actions = {a.dest: a for a in p._actions if a.dest in knobs}
    assert set(actions) == set(knobs)  # every flagged field has its flag, and no other
    help_text = " ".join(p.format_help().split())
    for dest, action in actions.items():
        k = knobs[dest]
        flag_help = " ".join((action.help % {"default": action.default}).split())
        assert flag_help in help_text, dest
        if k.knob.negate:
            assert action.default is False and k.field.default is True
            assert "(default: on)" in flag_help
            continue
        assert action.default == k.entry, dest  # the flag's default is the field's
        if "%(default)s" in action.help:
            assert f"(default: {k.entry}" in flag_help, dest
        else:  # a computed or absent default: the help says what it is
            assert "default" in flag_help.lower(), dest
    # The help follows the field: change the default there and --help says the new one.
    (seqs,) = [f for f in fields(SchedulerConfig) if f.name == "max_num_seqs"]
    assert "max requests running at once (default: 64)" in help_text
    monkeypatch.setattr(seqs, "default", 4096)
    changed = " ".join(_parser().format_help().split())
    assert "max requests running at once (default: 4096)" in changed


def test_the_keywords_are_the_fields():
    assert sorted(engine_keywords()) == sorted(
        [
            "model",
            "dtype",
            "packed_cache",
            "quantization",
            "lm_head_format",
            "max_model_len",
            "kv_cache_memory",
            "kv_cache_dtype",
            "block_size",
            "enable_prefix_caching",
            "num_blocks",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_waiting",
            "num_threads",
            "seed",
            "speculative_config",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "nnodes",
            "node_rank",
            "master_addr",
            "master_port",
            "device",
            "gpu_memory_utilization",
            "enable_lora",
            "lora_modules",
            "max_loras",
            "max_lora_rank",
            "async_scheduling",
        ]
    )
    assert make_engine_config(num_blocks=12).cache.num_blocks_override == 12  # no flag


@pytest.mark.parametrize(
    "keyword, closest",
    [("max_num_seq", "max_num_seqs"), ("kv_cache_mem", "kv_cache_memory"), ("threads", None)],
)
def test_an_unknown_keyword_names_the_closest_one(keyword, closest):
    with pytest.raises(ValueError, match=f"unknown engine keyword '{keyword}'") as e:
        make_engine_config(**{keyword: 1})
    if closest is not None:
        assert f"did you mean '{closest}'?" in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("max-num-seq: 3\n", "did you mean 'max-num-seqs'?"),
        ("enable_prefix_caching: 'no'\n", "enable-prefix-caching (--no-prefix-caching) takes true"),
        ("num_threads: many\n", "num-threads (--threads): invalid literal"),
    ],
)
def test_a_bad_field_name_in_a_file_says_what_to_write(tmp_path, capsys, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        parse_args_with_config(_parser(), ["--config", str(path)])
    assert message in capsys.readouterr().err


def test_tensor_parallel_forces_float_weights_where_the_config_is_resolved():
    built = make_engine_config(tensor_parallel_size=2)
    assert built.model.quantization == "none"
    by_hand = EngineConfig(tensor_parallel_size=2)  # no make_engine_config: on_device decides
    assert by_hand.model.quantization is None
    resolved = by_hand.on_device(cuda_available=False)
    assert resolved.model.quantization == "none"
    assert resolved.distributed.world == 2  # every rank on this machine
    with pytest.raises(ValueError, match="tensor parallelism runs float weights"):
        EngineConfig(model=ModelConfig(quantization="gguf"), tensor_parallel_size=2).on_device(
            False
        )
    assert weight_format(EngineConfig()) is None
    assert weight_format(EngineConfig(), on_cuda=True) == "none"


def test_the_context_length_is_the_cap_at_most_the_models_own():
    assert ModelConfig().context_len(8192) == 8192
    assert ModelConfig(max_model_len=1024).context_len(8192) == 1024
    assert ModelConfig(max_model_len=10**6).context_len(8192) == 8192
