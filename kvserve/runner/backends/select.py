"""select_backend: how this runner's steps run, decided once at start.

worker rank (tensor or pipeline)   its own loop runs the model (runner/worker.py)
--tensor-parallel-size N           TensorParallelBackend
--pipeline-parallel-size N         PipelineParallelBackend
cuda                               CudaBackend: Triton attention, CUDA graphs for decodes
cpu                                LayerStackBackend when CLayerStack takes the model and its
                                   KV pools, else TorchForward naming what declined; with
                                   --enable-lora either adds the adapters' deltas (the C stack
                                   from its LoRA table, the PyTorch forward in the Linears)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.config import KVGroup
from kvserve.runner.backends.base import StepBackend
from kvserve.runner.backends.cuda import CudaBackend
from kvserve.runner.backends.layer_stack import LayerStackBackend
from kvserve.runner.backends.pipeline_parallel import PipelineParallelBackend
from kvserve.runner.backends.tensor_parallel import TensorParallelBackend
from kvserve.runner.backends.torch_cpu import TorchForward
from kvserve.runner.layer_stack import CLayerStack

WORKER = "a worker rank: rank 0 sends its steps"
ONE_WINDOW = "the C layer stack takes one attention window for every layer"


def select_backend(
    model,
    arch,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    kv_groups: list[KVGroup],
    device: torch.device,
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    prepare: Callable,
    tp=None,
    pp=None,
    worker: bool = False,
) -> tuple[StepBackend, str | None]:
    """The backend every step of this runner takes, and the reason a faster path declined with
    the setting that gets it back ("to get the C layer stack back: ..."), or None where the
    fastest path for the device runs. `tp`/`pp`: rank 0's TensorParallelGroup / PipelineGroup;
    `worker`: a worker rank's runner, whose own loop runs the model; `prepare`:
    ModelRunner.prepare (pipeline stages flatten each micro-batch). LoRA adapters (--enable-lora)
    take every path: the C layer stack from its LoRA table, the PyTorch forward in the Linears."""
    if worker:
        return TorchForward(model, kv_caches, WORKER), None
    if tp is not None:
        backend = TensorParallelBackend(tp, model, kv_caches, arch.vocab_size)
        return backend, f"{backend.declined}; to get it back: --tensor-parallel-size 1"
    if pp is not None:
        backend = PipelineParallelBackend(pp, model, kv_caches, arch.vocab_size, prepare)
        return backend, None if backend.declined is None else _get_back(backend.fix)
    if device.type == "cuda":
        backend = CudaBackend.build(
            model,
            kv_caches,
            kv_groups,
            device,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_kv_heads=arch.num_kv_heads,
        )
        return backend, None
    windows = {arch.window_of(i) for i in range(arch.num_layers)}
    if len(kv_groups) != 1 or len(windows) != 1:
        return TorchForward(model, kv_caches, ONE_WINDOW), _get_back(None)
    stack, refusal = CLayerStack.build_with_reason(model, kv_caches)
    if stack is not None:
        return LayerStackBackend(stack, kv_caches), None
    return TorchForward(model, kv_caches, refusal.why), _get_back(refusal.fix)


def _get_back(fix: str | None) -> str:
    if fix is None:
        return "no setting brings the C layer stack back for this model"
    return f"to get the C layer stack back: {fix}"
