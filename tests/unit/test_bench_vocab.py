"""The benchmarks read a model's vocabulary size without loading it: a GGUF file's tokenizer
metadata or a Hugging Face directory's config.json."""

import json

import pytest

from kvserve.bench.datasets import gguf_vocab_size


def test_vocab_size_of_a_hugging_face_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    assert gguf_vocab_size(str(tmp_path)) == 49152


@pytest.mark.parametrize("config", [None, "{not json", json.dumps({"vocab_size": 0})])
def test_a_directory_without_a_vocab_size_says_to_pass_one(tmp_path, config):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(SystemExit, match="--vocab-size"):
        gguf_vocab_size(str(tmp_path))


def test_vocab_size_of_the_default_gguf():
    from tests.conftest import default_model_or_skip

    assert gguf_vocab_size(default_model_or_skip()) == 49152
