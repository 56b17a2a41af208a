"""The target's first L layers plus its final norm and LM head, as a model of its own.

This is the self-speculative draft (kvserve/spec/draft_model.py): a token predicted from layer
L's hidden state, with no extra weights. The view shares every module with the target, so it
costs no memory beyond its own KV cache. Its layers are the target's first L layers with their
own attention windows.
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from kvserve.model.loader import LoadedModel


def first_layers(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """`loaded` cut after its first `num_layers` layers (1 <= num_layers < the model's layers)."""
    arch = loaded.arch
    if (
        isinstance(num_layers, bool)
        or not isinstance(num_layers, int)
        or not 1 <= num_layers < arch.num_layers
    ):
        raise ValueError(
            f"draft_layers must be an integer from 1 to {arch.num_layers - 1} (the model has "
            f"{arch.num_layers} layers), got {num_layers!r}"
        )
    view_arch = dataclasses.replace(
        arch, num_layers=num_layers, layer_windows=list(arch.layer_windows[:num_layers])
    )
    view = copy.copy(loaded.model)
    view._modules = dict(view._modules)  # its own module table: the target keeps all its layers
    view.layers = nn.ModuleList(list(loaded.model.layers)[:num_layers])
    view.arch = view_arch
    return dataclasses.replace(loaded, model=view, arch=view_arch)
