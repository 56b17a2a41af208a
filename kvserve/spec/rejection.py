"""Exact verification of speculative drafts: the rejection sampler.

A request brings k draft tokens d_j, the distributions q_j the draft drew them from (one-hot for
a deterministic draft such as n-gram lookup) and the target's logits at its k + 1 fed positions;
p_j is what the normal sampler would draw from at position j (process_logits, with the drafts
before j counted as generated). Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j));
at the first rejection a token is drawn from norm(max(0, p_j - q_j)), and when all k are accepted
a bonus token from p_{k+1} (Leviathan et al. 2023, Chen et al. 2023). So every emitted token
follows the target's distribution whatever was drafted; greedy requests emit the tokens of
decoding one at a time (argmax_rows, the greedy sampler's tie rule).

Deterministic drafts are verified with plain decoding's own randomness (one Exp(1) row per
emitted token, from the request's generator), so a seeded request gets the tokens it gets
without speculation, whatever was drafted. A seeded request's probabilistic drafts draw from its
own generator only; the rest of the batch shares the default one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.runner.sampler import (
    SamplerOutput,
    SamplingRow,
    argmax_rows,
    exponential_noise,
    process_logits,
    take_rows,
    token_logprobs,
)


@dataclass
class Drafts:
    """The draft tokens of B requests, padded to the longest: request b has counts[b] of them."""

    token_ids: torch.Tensor  # [B, K] int64, each row padded with 0 past its count
    counts: torch.Tensor  # [B] int64, 0..K
    probs: torch.Tensor | None = (
        None  # [B, K, V]: q at each draft position; None: one-hot (deterministic)
    )

    @classmethod
    def from_lists(
        cls,
        token_ids: list[list[int]],
        probs: list[torch.Tensor | None] | None = None,
        vocab: int | None = None,
    ) -> Drafts:
        """From per-request lists; `probs[b]` is [len(token_ids[b]), vocab] or None (one-hot)."""
        counts = [len(t) for t in token_ids]
        width = max(counts, default=0)
        ids = torch.zeros(len(token_ids), width, dtype=torch.long)
        for b, toks in enumerate(token_ids):
            ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        dense = None
        if probs is not None and any(p is not None for p in probs):
            assert vocab is not None, "vocab is needed to pad draft probabilities"
            dense = torch.zeros(len(token_ids), width, vocab)
            for b, (toks, p) in enumerate(zip(token_ids, probs)):
                if p is None:
                    dense[b, torch.arange(len(toks)), ids[b, : len(toks)]] = 1.0
                else:
                    dense[b, : len(toks)] = p
        return cls(ids, torch.tensor(counts, dtype=torch.long), dense)

    @property
    def first_rows(self) -> torch.Tensor:
        """[B] row of each request's first position in the flat target rows (k + 1 rows each)."""
        sizes = self.counts + 1
        return torch.cumsum(sizes, 0) - sizes

    def position_rows(self) -> torch.Tensor:
        """[B, K] target row of each draft position (clamped to the request's last row past its
        count)."""
        j = torch.arange(self.token_ids.shape[1])
        return self.first_rows.unsqueeze(1) + torch.minimum(
            j.unsqueeze(0), self.counts.unsqueeze(1)
        )

    def valid(self) -> torch.Tensor:
        """[B, K] True where a draft exists."""
        return torch.arange(self.token_ids.shape[1]).unsqueeze(0) < self.counts.unsqueeze(1)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B] how many leading entries of each row of `mask` [B, K] are True."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long)
    return mask.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(target_logits: torch.Tensor, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [B], next token [B]) at temperature 0: drafts are accepted while each
    equals the target's argmax, then the argmax at the first mismatch (or after the last draft)."""
    argmax = argmax_rows(target_logits)
    match = (argmax[drafts.position_rows()] == drafts.token_ids) & drafts.valid()
    num_accepted = _leading_true(match)
    return num_accepted, argmax[drafts.first_rows + num_accepted]


def _uniforms(drafts: Drafts, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """[B, K] U[0, 1): seeded requests draw counts[b] from their own generator, the rest share one
    op."""
    b, k = drafts.token_ids.shape
    if generators is None or all(g is None for g in generators):
        return torch.rand(b, k)
    u = torch.zeros(b, k)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[torch.tensor(shared)] = torch.rand(len(shared), k)
    for i, g in enumerate(generators):
        if g is not None:
            n = int(drafts.counts[i])
            u[i, :n] = torch.rand(n, generator=g)
    return u


def verify_one_hot(
    target_probs: torch.Tensor,
    drafts: Drafts,
    generators: list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [B], next token [B]) for deterministic drafts, each position sampled as
    plain decoding samples it (see the module doc). Rows as verify_sampled's."""
    b_count, vocab = drafts.token_ids.shape[0], target_probs.shape[1]
    firsts, counts = drafts.first_rows.tolist(), drafts.counts.tolist()
    num_accepted = torch.zeros(b_count, dtype=torch.long)
    next_token = torch.zeros(b_count, dtype=torch.long)
    gens = generators or [None] * b_count
    shared = [b for b in range(b_count) if gens[b] is None]
    if shared:  # no seed: every position's race at once (how many rows it draws is free)
        rows = torch.tensor(
            [firsts[b] + j for b in shared for j in range(counts[b] + 1)], dtype=torch.long
        )
        tokens = argmax_rows(
            target_probs[rows].div(exponential_noise([None] * len(rows), vocab))
        ).tolist()
        at = 0
        for b in shared:
            n = counts[b]
            row = tokens[at : at + n + 1]
            at += n + 1
            a = 0
            while a < n and row[a] == int(drafts.token_ids[b, a]):
                a += 1
            num_accepted[b], next_token[b] = a, row[a]
    for b in range(b_count):
        g = gens[b]
        if g is None:
            continue
        for j in range(counts[b] + 1):  # one row per emitted token, as plain decoding draws
            noise = exponential_noise([g], vocab)
            token = int(argmax_rows(target_probs[firsts[b] + j : firsts[b] + j + 1].div(noise)))
            if j < counts[b] and token == int(drafts.token_ids[b, j]):
                continue
            num_accepted[b], next_token[b] = j, token
            break
    return num_accepted, next_token


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: Drafts,
    generators: list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [B], next token [B]) by rejection sampling (see the module doc).

    `target_probs` [sum(counts + 1), V]: request b's k_b + 1 positions are consecutive rows.
    """
    vocab = target_probs.shape[1]
    rows = drafts.position_rows()
    p_draft = target_probs[rows, drafts.token_ids]
    if drafts.probs is None:
        accept = _uniforms(drafts, generators) < p_draft  # q(d) = 1
    else:
        q_draft = drafts.probs.gather(2, drafts.token_ids.unsqueeze(2)).squeeze(2)
        accept = _uniforms(drafts, generators) * q_draft < p_draft  # u < p / q
    num_accepted = _leading_true(accept & drafts.valid())

    dist = target_probs[drafts.first_rows + num_accepted]  # a copy: [B, V]
    rejected = (num_accepted < drafts.counts).nonzero().squeeze(1)
    if rejected.numel():
        at = num_accepted[rejected]
        if drafts.probs is None:
            q = torch.nn.functional.one_hot(drafts.token_ids[rejected, at], vocab).to(dist.dtype)
        else:
            q = drafts.probs[rejected, at]
        p = dist[rejected]
        residual = (p - q).clamp_(min=0.0)
        # p <= q everywhere would have accepted surely; only rounding can leave nothing: draw from p
        empty = residual.sum(dim=1) <= 0
        residual[empty] = p[empty]
        dist[rejected] = residual
    next_token = argmax_rows(dist.div_(exponential_noise(generators or [None] * len(dist), vocab)))
    return num_accepted, next_token


class RejectionSampler:
    """``RejectionSampler()(logits, rows, draft_token_ids, draft_probs=None) -> [SamplerOutput]``.

    `logits` [R, V] and `rows` (R SamplingRows) hold every request's k_b + 1 positions in a row:
    position j's SamplingRow carries the request's outputs followed by its first j drafts (what
    min_tokens and the penalties read) and the request's generator. Returns, per request, the
    accepted drafts then one more token, with the target's logprobs of each when asked for
    (as the normal sampler reports them: after penalties and temperature, before filtering).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> list[SamplerOutput]:
        firsts, pos = [], 0
        for toks in draft_token_ids:
            firsts.append(pos)
            pos += len(toks) + 1
        assert pos == len(rows) == logits.shape[0], "k + 1 logits rows per request"
        proc = process_logits(logits, rows)
        vocab = logits.shape[1]
        greedy = [proc.greedy[f] for f in firsts]
        accepted = [0] * len(firsts)
        nexts = [0] * len(firsts)

        g_req = [b for b, g in enumerate(greedy) if g]
        if g_req:
            g_rows = [firsts[b] + j for b in g_req for j in range(len(draft_token_ids[b]) + 1)]
            drafts = Drafts.from_lists([draft_token_ids[b] for b in g_req])
            num, nxt = verify_greedy(take_rows(proc.logits, g_rows), drafts)
            for b, a, t in zip(g_req, num.tolist(), nxt.tolist()):
                accepted[b], nexts[b] = a, t
        s_req = [b for b, g in enumerate(greedy) if not g]
        if s_req:
            # proc.probs holds the sampled rows in order: exactly these requests' positions
            probs = None if draft_probs is None else [draft_probs[b] for b in s_req]
            drafts = Drafts.from_lists([draft_token_ids[b] for b in s_req], probs, vocab)
            verify = verify_one_hot if drafts.probs is None else verify_sampled
            num, nxt = verify(proc.probs, drafts, [rows[firsts[b]].generator for b in s_req])
            for b, a, t in zip(s_req, num.tolist(), nxt.tolist()):
                accepted[b], nexts[b] = a, t

        tokens = [list(draft_token_ids[b][: accepted[b]]) + [nexts[b]] for b in range(len(firsts))]
        logprobs = self._logprobs(proc.logits, rows, firsts, tokens)
        return [SamplerOutput(t, lp) for t, lp in zip(tokens, logprobs)]

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, rows: list[SamplingRow], firsts: list[int], tokens: list[list[int]]
    ) -> list[list]:
        out = [[None] * len(t) for t in tokens]
        want = [b for b, f in enumerate(firsts) if rows[f].params.logprobs is not None]
        if not want:
            return out
        flat_rows = [firsts[b] + j for b in want for j in range(len(tokens[b]))]
        flat_tokens = [t for b in want for t in tokens[b]]
        n_top = max(rows[firsts[b]].params.logprobs for b in want)
        entries = iter(token_logprobs(take_rows(logits, flat_rows), flat_tokens, n_top))
        for b in want:
            keep = rows[firsts[b]].params.logprobs
            for j in range(len(tokens[b])):
                entry = next(entries)
                entry.top = entry.top[:keep]
                out[b][j] = entry
        return out
