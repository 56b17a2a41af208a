"""What one more token row costs in a decode step, learned from the engine's own steps.

A decode-only step (no prompt tokens) of `rows` token rows takes about a + b * rows seconds: a is
the weights' pass and the step's fixed work, b the compute of one row. How large b is against a
depends on the CPU, its kernels and the context (docs/benchmarks.md), and a
step of many rows is compute-bound everywhere. `StepCostModel` fits a and b by exponentially
weighted least squares over the steps it is shown, so a draft token's price is measured on the
machine that pays it, never assumed per ISA.

`row_share(batch_rows)`: b B / (a + b B) for a step of B rows without drafts, the fraction of
the step's throughput one extra row costs. A draft whose chance of being accepted is below it
makes the batch slower (kvserve/spec/adaptive.py).
"""

from __future__ import annotations

DECAY = 0.98  # weight of the past per observed step (a window of ~50 steps)
MIN_SPREAD = 0.25  # weighted variance of `rows` below which the slope is not trusted yet
PRIOR_SHARE = 0.25  # row_share at batch 1 until the slope is known: between the two ISAs
MIN_SHARE = 0.02  # never treat a row as free (timer noise can fit b <= 0)


class StepCostModel:
    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """One decode-only step of `rows` token rows (drafts included) that took `seconds`."""
        if rows <= 0 or not seconds > 0:
            return
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None while the observed row counts are too alike to tell b."""
        if self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < MIN_SPREAD:
            return None
        b = (self._xy / self._w - mx * my) / var
        return my - b * mx, b

    def seconds(self, rows: int) -> float | None:
        """The expected seconds of a step of `rows` rows: the fit, or the mean step while the
        slope is unknown; None before any step."""
        if self._w <= 0:
            return None
        ab = self.fit()
        if ab is None:
            return self._y / self._w
        a, b = ab
        return max(a + b * max(1, rows), 1e-9)

    def mean_seconds_per_row(self) -> float | None:
        """The observed seconds over the observed rows (None before any step)."""
        return self._y / self._x if self._x > 0 else None

    def row_share(self, batch_rows: int) -> float:
        """The share of a step's throughput one more row costs, in a step of `batch_rows` rows."""
        B = max(1, batch_rows)
        ab = self.fit()
        if ab is None:
            share = PRIOR_SHARE * B / (1 + PRIOR_SHARE * (B - 1))  # a + b = 1, b = PRIOR_SHARE
        else:
            a, b = ab
            share = 1.0 if a <= 0 else max(b, 0.0) * B / (a + max(b, 0.0) * B)
        return min(1.0, max(MIN_SHARE, share))
