"""The loaded LoRA adapters and their batched application in the PyTorch forward.

LoRAManager holds at most `max_loras` adapters, each in a slot (name -> slot). Every targeted
base Linear gets a `lora` attribute (LoRALinear) holding, per slot, the adapter's matrices for
each of its parts (q/k/v of a fused qkv_proj, gate/up of gate_up_proj; a part the adapter does
not target adds nothing). The runner tells the shared LoRAStep, once per step, which adapter slot
each token of the flat batch uses (-1: the base model); each Linear then adds, per group of tokens
sharing a slot, scale * (x A^T) B^T to its output: one shrink and one expand matmul per group
and part, whatever the number of requests.
"""

from __future__ import annotations

import itertools

import torch

from kvserve.lora.adapter import TARGETS, LoRAAdapter, find_linear, load_adapter


class LoRAStep:
    """One step's token -> adapter slot indices (-1: base), and the tokens of each slot."""

    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.indices: torch.Tensor | None = None  # [T] int64
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, token rows) per slot in use

    def slot_of(self, key: str | None) -> int:
        """The slot of a sequence's adapter key (Sequence.lora_key); -1 for the base model."""
        return -1 if key is None else self.manager.slot_of_key(key)

    def set(self, indices: torch.Tensor) -> None:
        """The step's per-token slot indices [T] (ModelRunner.prepare sets them)."""
        self.indices = indices
        self.groups = [
            (int(slot), (indices == slot).nonzero().squeeze(1))
            for slot in torch.unique(indices).tolist()
            if slot >= 0
        ]


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bfloat16 (to nearest even), as a contiguous float32 tensor."""
    return t.to(torch.bfloat16).to(torch.float32).contiguous()


class LoRALinear:
    """The adapters of one base Linear: per slot, its parts' A^T stacked along the rank [in,
    sum of ranks] (one shrink matmul) and per part (output offset, width, rank offset, rank,
    B^T [r, width] scaled). Transposed so that the C layer stack reads both along rows."""

    def __init__(self, step: LoRAStep, shard_sizes: list[int]) -> None:
        self.step = step
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shard_sizes = shard_sizes
        self.slots: dict[int, tuple[torch.Tensor, list[tuple[int, int, int, int, torch.Tensor]]]]
        self.slots = {}

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`parts`: shard -> (A [r, in], B [out, r] already multiplied by the scale). Both are
        held as bfloat16 values (rounded once here, kept in float32 tensors): what the C layer
        stack stores, in half the bytes a step reads, and what this path multiplies, so the two
        paths take the same adapter."""
        a_all, plan, r0 = [], [], 0
        for shard, (a, b) in sorted(parts.items()):
            r = a.shape[0]
            a_all.append(a)
            plan.append((self.offsets[shard], self.shard_sizes[shard], r0, r, _bf16(b.t())))
            r0 += r
        self.slots[slot] = (_bf16(torch.cat(a_all, dim=0).t()), plan)

    def clear_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output of x) plus each token's adapter delta, in place."""
        groups = self.step.groups
        if not groups:
            return y
        if self.step.indices is None or x.shape[0] != self.step.indices.shape[0]:
            raise RuntimeError(
                f"LoRA step holds {0 if self.step.indices is None else self.step.indices.shape[0]}"
                f" token slots, the layer got {x.shape[0]} tokens"
            )
        for slot, rows in groups:
            entry = self.slots.get(slot)
            if entry is None:  # this adapter does not target this layer
                continue
            a_t, plan = entry
            shrunk = x.index_select(0, rows) @ a_t  # [k, sum of ranks]
            for offset, width, r0, r, b_t in plan:
                delta = shrunk[:, r0 : r0 + r] @ b_t  # [k, width]
                y[:, offset : offset + width].index_add_(0, rows, delta.to(y.dtype))
        return y


class LoRAManager:
    """The slots of loaded adapters (at most `max_loras`), installed on `model`'s Linears."""

    def __init__(self, model, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = getattr(model, "dtype", torch.float32)
        self.step = LoRAStep(self)
        model.lora_step = self.step  # the runner finds the step's context here
        self.adapters: list[LoRAAdapter | None] = [None] * max_loras
        self.keys: list[str | None] = [None] * max_loras
        self._slot_of: dict[str, int] = {}  # adapter name -> slot
        self._slot_of_key: dict[str, int] = {}
        self._generation = itertools.count()
        self.version = 0  # counts loads and unloads: the C layer stack rebuilds its table on change
        self.targets: dict[tuple[int, str], tuple[object, int]] = {}
        for layer in range(len(model.layers)):
            for module in TARGETS:
                found = find_linear(model, layer, module)
                if found is None:
                    continue
                linear, shard = found
                if getattr(linear, "lora", None) is None:
                    linear.lora = LoRALinear(self.step, list(linear.shard_sizes))
                self.targets[(layer, module)] = found

    # ---- what requests name ----
    def names(self) -> list[str]:
        return [a.name for a in self.adapters if a is not None]

    def get(self, name: str) -> LoRAAdapter | None:
        slot = self._slot_of.get(name)
        return None if slot is None else self.adapters[slot]

    def key_of(self, name: str) -> str | None:
        """The adapter's key for this load (a prefix-cache namespace no other load shares)."""
        slot = self._slot_of.get(name)
        return None if slot is None else self.keys[slot]

    def slot_of_key(self, key: str) -> int:
        slot = self._slot_of_key.get(key)
        if slot is None:
            raise KeyError(f"LoRA adapter {key.split('#')[0]!r} is not loaded")
        return slot

    # ---- loading ----
    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read, check and install the adapter at `path` under `name`; ValueError when the name is
        taken, every slot is in use, or the adapter is malformed (nothing is installed then)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError("a LoRA adapter needs a name (a non-empty string)")
        if name in self._slot_of:
            raise ValueError(f"LoRA adapter {name!r} is already loaded: unload it first")
        free = next((i for i, a in enumerate(self.adapters) if a is None), None)
        if free is None:
            raise ValueError(
                f"{self.max_loras} LoRA adapters are loaded (--max-loras {self.max_loras}): "
                f"unload one ({', '.join(self.names())}) or raise --max-loras"
            )
        adapter = load_adapter(name, path, self.model, self.max_rank, self.dtype)
        per_linear: dict[int, tuple[object, dict]] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            linear, shard = self.targets[(layer, module)]
            per_linear.setdefault(id(linear), (linear, {}))[1][shard] = (a, b * adapter.scaling)
        for linear, parts in per_linear.values():
            linear.lora.set_slot(free, parts)
        key = f"{name}#{next(self._generation)}"
        self.adapters[free], self.keys[free] = adapter, key
        self._slot_of[name], self._slot_of_key[key] = free, free
        self.version += 1
        return adapter

    def unload(self, name: str) -> None:
        """Remove the adapter (the caller checks no request uses it); KeyError if not loaded."""
        slot = self._slot_of.pop(name, None)
        if slot is None:
            raise KeyError(name)
        for linear, _ in self.targets.values():
            linear.lora.clear_slot(slot)
        self._slot_of_key.pop(self.keys[slot], None)
        self.adapters[slot], self.keys[slot] = None, None
        self.version += 1
