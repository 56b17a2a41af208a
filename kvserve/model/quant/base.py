"""Staging of fused shards: the base of the packed weight formats."""

from __future__ import annotations

import torch


class _PackedMethod:
    """Base for packed formats: each shard is converted to per-row parts at load time (so the
    float32 weight never exists whole); once every row of the layer is in, `pack` builds the
    kernel's layout and the staging is freed."""

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        layer.weight = None
        layer._staged = {}  # offset -> (parts, rows) of a shard not yet packed
        layer._dtype = dtype

    def load(self, layer, w, offset: int, whole: bool) -> None:
        parts = self._stage(layer, offset, self.rows(w), w.shape[0])
        if parts is not None:
            self.pack(
                layer, *(torch.cat(xs, 0) if xs[0] is not None else None for xs in zip(*parts))
            )

    @staticmethod
    def _stage(layer, offset: int, part, rows: int) -> list | None:
        """Keep one shard's part until the layer's rows are all in; then return the parts in row
        order (and free the staging), else None."""
        layer._staged[offset] = (part, rows)
        if sum(n for _, n in layer._staged.values()) != layer.out_features:
            return None
        parts = [layer._staged[o][0] for o in sorted(layer._staged)]
        del layer._staged
        return parts

    def rows(self, w):
        raise NotImplementedError

    def pack(self, layer, *parts):
        raise NotImplementedError

    @staticmethod
    def _run_2d(layer, x: torch.Tensor, kernel) -> torch.Tensor:
        """kernel(x as [rows, in_features]) -> [rows, out]; back to x's shape and dtype, plus the
        bias."""
        shape = x.shape
        y = kernel(x.reshape(-1, shape[-1])).to(x.dtype).reshape(*shape[:-1], layer.out_features)
        return y + layer.bias if layer.bias is not None else y
