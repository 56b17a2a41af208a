"""Where a request goes: the replica most likely to hold its prompt's prefix in its KV cache, else
the least loaded one.

A request's routing key is its prompt as text (a completion's prompt; a chat's messages, role and
content in order). The key is cut into blocks of BLOCK_CHARS characters, and each block is named by
a hash chained over the blocks before it, as the engine's prefix cache names its token blocks: two
prompts share their first n block hashes exactly when they share their first n blocks of text.
Each replica remembers the block hashes of the prompts it was sent (an LRU of at most
`max_blocks` hashes), standing for what its prefix cache probably holds.

`prefix` policy: among healthy replicas, the one that remembers the longest run of the request's
leading blocks wins when that run is at least `min_match_blocks` long and the replica's load
(requests in flight) is at most the least loaded replica's, L, plus max(balance_slack,
balance_ratio x L); otherwise the least loaded replica wins (ties go round robin). A prefix every
request shares (a system prompt) must not pull all traffic to the first replica that saw it: the
slack is small, so the second replica soon takes a request and holds that prefix too. The
`least_loaded` and `random` policies exist to compare against. Pure Python: no I/O, no locks (the
router calls it from one event loop).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field

BLOCK_CHARS = 64  # about 16 tokens of English text: one KV block of the engine
POLICIES = ("prefix", "least_loaded", "random")


def block_hashes(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = 256) -> list[bytes]:
    """Chained hashes of the full blocks of `text` (at most max_blocks, from the start)."""
    out: list[bytes] = []
    parent = b""
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0
    routed: int = 0  # requests sent here
    prefix_routed: int = 0  # ... of which for a remembered prefix
    failures: int = 0  # requests that failed on the replica's side (connection lost)
    last_error: str | None = None
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """How many of the leading `hashes` this replica remembers (a chained hash implies all
        before it)."""
        lo, hi = 0, len(hashes)
        while lo < hi:  # the run is a prefix: binary search its end
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self.blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def remember(self, hashes: list[bytes], max_blocks: int) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > max_blocks:
            self.blocks.popitem(last=False)


class Router:
    def __init__(
        self,
        urls: list[str],
        policy: str = "prefix",
        min_match_blocks: int = 1,
        balance_slack: int = 1,
        balance_ratio: float = 0.25,
        max_blocks: int = 100_000,
        seed: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {list(POLICIES)}")
        if not urls:
            raise ValueError(
                "the router needs at least one replica (--replica URL or --data-parallel-size N)"
            )
        if len(set(urls)) != len(urls):
            raise ValueError(
                f"a replica is given twice: {sorted(u for u in set(urls) if urls.count(u) > 1)}"
            )
        self.replicas = [Replica(u) for u in urls]
        self.policy = policy
        self.min_match_blocks = min_match_blocks
        self.balance_slack = balance_slack
        self.balance_ratio = balance_ratio
        self.max_blocks = max_blocks
        self._rng = random.Random(seed)
        self._next = 0
        self.handed_over_tokens = (
            0  # prefill/decode disaggregation: KV tokens the decode replicas adopted
        )

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def _least_loaded(self, candidates: list[Replica]) -> Replica:
        low = min(r.in_flight for r in candidates)
        tied = [r for r in candidates if r.in_flight == low]
        self._next += 1
        return tied[self._next % len(tied)]

    def choose(self, key: str, exclude: tuple[Replica, ...] = ()) -> tuple[Replica | None, int]:
        """(the replica for a request whose prompt text is `key`, the prompt blocks it remembers);
        (None, 0) when no healthy replica is left. Records the choice (routed, remembered
        blocks)."""
        candidates = [r for r in self.healthy() if r not in exclude]
        if not candidates:
            return None, 0
        hashes = block_hashes(key)
        matched = 0
        if self.policy == "random":
            choice = self._rng.choice(candidates)
        elif self.policy == "least_loaded":
            choice = self._least_loaded(candidates)
        else:
            low = min(r.in_flight for r in candidates)
            best = max(candidates, key=lambda r: (r.matched_blocks(hashes), -r.in_flight))
            matched = best.matched_blocks(hashes)
            slack = max(self.balance_slack, math.ceil(self.balance_ratio * low))
            if matched >= self.min_match_blocks and best.in_flight <= low + slack:
                choice = best
            else:
                choice, matched = self._least_loaded(candidates), 0
        choice.routed += 1
        choice.prefix_routed += matched > 0
        choice.remember(hashes, self.max_blocks)
        return choice, matched

    def stats(self) -> dict:
        return {
            "policy": self.policy,
            "replicas": [
                {
                    "url": r.url,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "routed": r.routed,
                    "prefix_routed": r.prefix_routed,
                    "failures": r.failures,
                    "last_error": r.last_error,
                }
                for r in self.replicas
            ],
        }


def routing_key(path: str, body: dict) -> str:
    """The text a request's prompt starts with: a chat's messages (role, then content, in order)
    or a completion's prompt (token ids as their decimal text)."""
    if path.endswith("/chat/completions"):
        parts = []
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else ():
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text, in order
                content = "".join(
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text", ""), str)
                )
            parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return (
        prompt
        if isinstance(prompt, str)
        else " ".join(map(str, prompt))
        if isinstance(prompt, list)
        else ""
    )
