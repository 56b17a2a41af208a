"""kvserve: an LLM inference and serving engine."""

from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the model code: import it only when asked for.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
