"""Step backends: how one step of the model runs, one module per path, behind StepBackend
(base.py), chosen once at start by select_backend (select.py). The runner (model_runner.py)
holds what every backend shares; it is the only room that enters here."""

from kvserve.runner.backends.base import StepBackend, StepBatch
from kvserve.runner.backends.cuda import CudaBackend
from kvserve.runner.backends.layer_stack import LayerStackBackend
from kvserve.runner.backends.pipeline_parallel import PipelineParallelBackend
from kvserve.runner.backends.select import select_backend
from kvserve.runner.backends.tensor_parallel import TensorParallelBackend
from kvserve.runner.backends.torch_cpu import TorchForward

__all__ = [
    "CudaBackend",
    "LayerStackBackend",
    "PipelineParallelBackend",
    "StepBackend",
    "StepBatch",
    "TensorParallelBackend",
    "TorchForward",
    "select_backend",
]
