"""The KV pools: one preallocated K and one V pool per layer, sized by the layer's KV group.

Zero-filled: masked padding in the batched decode attention reads unwritten slots, and garbage
there could be NaN (0 * NaN = NaN). On the GPU each pool holds one block more than the
scheduler's: the scratch block that the padding rows of a captured decode graph write to
(runner/cuda_graphs.py). int8 pools hold rows of int8 values and a float32 scale (ops/kv_int8.py).
"""

from __future__ import annotations

import math

import torch

from kvserve.config import KVGroup
from kvserve.ops import kv_int8


def layer_groups(num_blocks: int | list[KVGroup], num_layers: int) -> tuple[list[KVGroup], list]:
    """The KV groups (one of every layer for a block count) and each layer's group."""
    if isinstance(num_blocks, int):
        num_blocks = [KVGroup(None, tuple(range(num_layers)), num_blocks)]
    if sorted(i for g in num_blocks for i in g.layers) != list(range(num_layers)):
        raise ValueError(f"the KV groups must hold each of the model's {num_layers} layers once")
    layer_group = [0] * num_layers
    for g, group in enumerate(num_blocks):
        for layer in group.layers:
            layer_group[layer] = g
    return num_blocks, layer_group


def kv_pools(
    arch,
    kv_groups: list[KVGroup],
    layer_group: list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K pool, V pool) of every layer, [blocks (+1 on the GPU), block_size, kv heads, head_dim]."""
    on_gpu = device.type == "cuda"
    pools = []
    for layer in range(arch.num_layers):
        shape = (
            kv_groups[layer_group[layer]].num_blocks + on_gpu,
            block_size,
            arch.num_kv_heads,
            arch.head_dim,
        )
        if dtype == torch.int8:
            shape = kv_int8.pool_shape(*shape)
        if on_gpu:
            pools.append((_device_zeros(shape, dtype, device), _device_zeros(shape, dtype, device)))
        else:
            pools.append((_lazy_zeros(shape, dtype), _lazy_zeros(shape, dtype)))
    return pools


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc (numpy): a large pool gets kernel-zeroed pages that cost RAM only once
    written, where torch.zeros would touch every page (and hold all of it in RSS at once)."""
    import numpy as np

    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _device_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on a device, filled as bytes (fp8 has no fill kernel everywhere)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.zeros(nbytes, dtype=torch.uint8, device=device).view(dtype).view(shape)
