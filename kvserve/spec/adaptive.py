"""Per-request draft length: speculate more while drafts are accepted, less (down to none) when not.

Each request keeps an exponential moving average of the fraction of its drafts accepted per
verification (starting at 1: try the full length first). Its next draft length is
floor(rate * (max_k + 1)), capped at max_k: full length at rate 1, none below 1 / (max_k + 1).
A request at length 0 decodes plainly for a cool-down of steps, then probes with one draft
token; each failed probe doubles the cool-down (up to MAX_COOLDOWN), an accepted one resets it.
So open-ended text, where lookups keep missing, soon costs nothing over plain decoding, and a
request that starts copying again soon speculates again. Only the request's own history counts:
its draft lengths do not depend on the rest of the batch.
"""
from __future__ import annotations

SMOOTHING = 0.3          # weight of the newest verification in the moving average
FIRST_COOLDOWN = 4       # plain decode steps before the first probe
MAX_COOLDOWN = 64


class AdaptiveDraftLength:
    """The draft length of one request, from its acceptance so far."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.rate = 1.0
        self.cooldown = FIRST_COOLDOWN
        self._wait = 0           # plain steps left before the next probe

    def next_length(self) -> int:
        """The number of draft tokens to propose for the next step (one call per decode step)."""
        k = min(self.max_k, int(self.rate * (self.max_k + 1)))
        if k > 0:
            return k
        if self._wait > 0:
            self._wait -= 1
            return 0
        return 1                 # a probe

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """The outcome of one verification of `num_drafts` > 0 draft tokens."""
        if num_drafts <= 0:
            return
        probing = int(self.rate * (self.max_k + 1)) == 0
        self.rate += SMOOTHING * (num_accepted / num_drafts - self.rate)
        if probing:
            if num_accepted > 0:
                self.rate = max(self.rate, 1.0 / (self.max_k + 1))   # back to speculating
                self.cooldown = FIRST_COOLDOWN
            else:
                self.cooldown = min(2 * self.cooldown, MAX_COOLDOWN)
        if int(self.rate * (self.max_k + 1)) == 0:
            self._wait = self.cooldown
