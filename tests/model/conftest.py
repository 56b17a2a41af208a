"""Session fixtures for model tests: the default model, loaded once, ours and HF transformers'.

kv_model        kvserve LoadedModel (model, arch, tokenizer, path) of the default GGUF
hf_model        transformers LlamaForCausalLM of the same GGUF, float32, eval mode
default_gguf    path of the default model file
"""

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    # One thread: on a machine whose 2 cores are shared with other processes, 2 OpenMP threads
    # stall on barriers (measured 450-980 ms vs 85 ms per decode step of the default model).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from tests.conftest import default_model_or_skip

    return default_model_or_skip()


@pytest.fixture(scope="session")
def kv_model(default_gguf):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    return load_model(ModelConfig(model=default_gguf, quantization="none"))


@pytest.fixture(scope="session")
def hf_model(default_gguf):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF files
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32
    )
    return model.eval()
