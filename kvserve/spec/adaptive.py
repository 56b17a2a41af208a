"""Per-request draft length: as many drafts as pay for the rows they add, none when they do not.

Each request keeps its acceptance rate alpha: the chance that a draft token is accepted given
that the ones before it were (verification stops at the first rejection, so a verification of
k drafts with n accepted counts n successes, plus one failure when n < k; both sums decay by
DECAY per verification, so the rate follows the text being written). Draft j (1-based) is
accepted with probability alpha^j and then saves one step's worth of a token; it costs one
token row, a share p of the step's throughput (kvserve/spec/step_cost.py, measured on this
machine). So the draft length is the largest k <= max_k with alpha^k > p: every draft kept is
expected to make the batch faster. A CPU where rows are dear (AVX2) drafts fewer tokens at the
same acceptance than one where they are cheap (AVX-512 VNNI), and a large batch, where every row
costs its full share, stops drafting by itself.

A request at length 0 decodes plainly for a cool-down of steps, then probes with one draft
token (unless a draft costs a whole step or more, as a draft model as large as the target does:
then no acceptance can pay, and it never drafts); each failed probe doubles the cool-down (up to
MAX_COOLDOWN), an accepted one resets it.
Only the request's own history and the step cost count: its drafts never change its greedy
tokens (verification is exact), only how many steps they take.
"""

from __future__ import annotations

DECAY = 0.7  # weight of the past per verification
PRIOR = (4.0, 5.0)  # (successes, trials) before any verification: alpha 0.8, tried first
FIRST_COOLDOWN = 4  # plain decode steps before the first probe
MAX_COOLDOWN = 64


class AdaptiveDraftLength:
    """The draft length of one request, from its acceptance so far and the price of a row."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.successes, self.trials = PRIOR
        self.cooldown = FIRST_COOLDOWN
        self._wait = 0  # plain steps left before the next probe
        self._idle = False  # the last length was 0
        self._probing = False  # the last length was a probe

    @property
    def alpha(self) -> float:
        return self.successes / self.trials

    def worth(self, row_share: float) -> int:
        """The largest k <= max_k with alpha^k > row_share (0: no draft pays for its row)."""
        k, p = 0, self.alpha
        while k < self.max_k and p > row_share:
            k += 1
            p *= self.alpha
        return k

    def gain_per_step(self, price: float) -> float:
        """What drafting saves per step, in steps, at the larger of this request's acceptance
        and the prior's (the rate a catch-up is bought for): sum over j <= max_k of
        alpha^j - price where positive."""
        a = max(self.alpha, PRIOR[0] / PRIOR[1])
        gain, p = 0.0, a
        for _ in range(self.max_k):
            if p <= price:
                break
            gain += p - price
            p *= a
        return gain

    def next_length(self, row_share: float = 0.0) -> int:
        """The number of draft tokens to propose for the next step (one call per decode step);
        row_share: what one more row costs of the step's throughput (0: rows are free)."""
        self._probing = False
        if row_share >= 1.0:  # a draft costs a step or more: even one always accepted cannot pay
            return 0
        k = self.worth(row_share)
        if k > 0:
            self._idle = False
            return k
        if not self._idle:  # just dropped to plain decoding: pause before probing
            self._idle = True
            self._wait = self.cooldown
        if self._wait > 0:
            self._wait -= 1
            return 0
        self._probing = True
        return 1  # a probe

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """The outcome of one verification of `num_drafts` > 0 draft tokens."""
        if num_drafts <= 0:
            return
        self.successes = DECAY * self.successes + num_accepted
        self.trials = DECAY * self.trials + num_accepted + (1 if num_accepted < num_drafts else 0)
        if self._probing:
            if num_accepted > 0:  # probe again next step until the rate says to draft
                self.cooldown = FIRST_COOLDOWN
            else:
                self.cooldown = min(2 * self.cooldown, MAX_COOLDOWN)
                self._wait = self.cooldown
