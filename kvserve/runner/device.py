"""Where the engine runs: whether CUDA is there, and how much GPU memory the KV cache may take."""

from __future__ import annotations

import torch

from kvserve.config import SchedulerConfig

# Headroom kept out of the KV cache on a GPU besides the step's activations (the CUDA context's
# workspaces, cuBLAS, Triton, captured decode graphs).
GPU_HEADROOM_BYTES = 1 << 30


def cuda_available(requested: str) -> bool:
    """torch.cuda.is_available(), asked only when the device is not cpu (asking initializes
    CUDA)."""
    return requested != "cpu" and torch.cuda.is_available()


def activation_bytes(arch, sched: SchedulerConfig, dtype_bytes: int) -> int:
    """An upper estimate of one step's transient tensors: the hidden states, q/k/v, the MLP's
    gate/up/down of max_num_batched_tokens tokens (a few alive at once), and float32 logits of
    every running request with the sampler's copies of them."""
    tokens = sched.max_num_batched_tokens
    per_token = (
        6 * arch.hidden_size
        + 3 * arch.intermediate_size
        + 2 * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    ) * dtype_bytes
    logits = sched.max_num_seqs * arch.vocab_size * 4 * 4
    return tokens * per_token + logits


def cuda_kv_budget(device: str, utilization: float, reserve: int) -> int:
    """Bytes the KV cache may take on `device`: `utilization` of the GPU's memory, less what is
    already held there (weights, the CUDA context, other processes) and `reserve`."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    budget = int(total * utilization) - (total - free) - reserve - GPU_HEADROOM_BYTES
    if budget <= 0:
        raise ValueError(
            f"{device}: {utilization:.0%} of its {total / 2**30:.1f} GiB leaves no room for a "
            f"KV cache ({(total - free) / 2**30:.1f} GiB are in use): raise "
            f"--gpu-memory-utilization or lower --max-num-batched-tokens/--max-num-seqs"
        )
    return budget
