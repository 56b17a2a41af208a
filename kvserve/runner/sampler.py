"""Batched token sampling: logits processors, greedy/random sampling and logprobs.

One call turns the logits of N requests (one row each) into N tokens. The stages run in
vLLM's order and each one is skipped when no row of the batch uses it:

1. min_tokens: eos ids (unless ignore_eos) and stop_token_ids are set to -inf while the
   request has produced fewer than min_tokens tokens.
2. repetition penalty over prompt + output tokens (positive logits divided, negative ones
   multiplied), then presence and frequency penalties over output tokens.
3. greedy rows (temperature < 1e-5) take the argmax. The others are divided by their
   temperature, then filtered by min_p, top_k and top_p (one sort for both), and sampled.

Sampling is the exponential race ``argmax(probs / q)`` with ``q ~ Exp(1)``, which draws
from ``probs`` exactly. A row with its own generator (a seeded request) draws its ``q``
only from that generator, so its tokens do not depend on which other rows share the
batch or where it sits in it; rows without one share the default generator in one op.

Logprobs (when ``params.logprobs`` is set) are ``log_softmax`` of the logits after
min_tokens and penalties, and after temperature for sampled rows (greedy rows: no
temperature), but before min_p/top_k/top_p. They describe the distribution the model
proposed, not the truncated one we drew from, so a token outside the nucleus still gets a
finite logprob.

``process_logits`` runs the stages up to the draw and returns the distributions; the sampler
draws from them, and so does the speculative verifier (kvserve/spec/rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, [N] int64 (a 0-d tensor for a 1-d x), by torch's rule:
    the first maximum, a NaN counting as the largest. Every greedy choice and exponential race
    takes it. A CPU float32 tensor goes through numpy, whose argmax gives the same index about 8
    times faster than torch's CPU argmax over a vocabulary-sized row (docs/benchmarks.md)."""
    a = _numpy_of(x)
    if a is not None:
        return torch.from_numpy(np.asarray(np.argmax(a, axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


def argmax_list(x: torch.Tensor) -> list[int]:
    """argmax_rows of a 2-d x as a list of ints (a greedy step's tokens), without the tensor
    round trip: microseconds a step when the batch is one row."""
    a = _numpy_of(x)
    return a.argmax(axis=-1).tolist() if a is not None else x.argmax(dim=-1).tolist()


def _numpy_of(x: torch.Tensor) -> np.ndarray | None:
    """x as the numpy array the argmaxes take (a CPU float32 tensor), else None (torch's)."""
    return x.detach().numpy() if x.is_cpu and x.dtype == torch.float32 else None


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows `rows` of x, to read: x itself when they are all of its rows in order (a batch-1
    verification's logits, which indexing would copy every step), else a copy."""
    if len(rows) == x.shape[0] and all(r == i for i, r in enumerate(rows)):
        return x
    return x[torch.tensor(rows, dtype=torch.long, device=x.device)]


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded per request by the runner when params.seed is set
    eos_token_ids: set[int]
    constrained: bool = False  # a grammar masks this row: it decides when EOS may come
    beam_candidates: int = 0  # a beam: how many top tokens to return with their logprobs

    @property
    def num_logprobs(self) -> int | None:
        """Top-N logprobs to return for this row (None: none)."""
        return self.beam_candidates or self.params.logprobs


@dataclass
class TokenLogprobs:
    """Logprobs of one generated position."""

    token_id: int
    logprob: float
    rank: int  # rank of the chosen token (1 = most likely)
    top: list[tuple[int, float]]  # top-N (token_id, logprob), N = params.logprobs, best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass
class ProcessedLogits:
    """One batch of logits after every stage that shapes the distribution a row draws from.

    `logits`: after min_tokens and penalties, and after temperature for sampled rows (greedy rows
    take its argmax; logprobs are its log_softmax). `probs`: the distribution each sampled row
    draws from (min_p, top_k and top_p applied, softmax), its rows those of `sampled_rows`, in
    order; None when every row is greedy. The speculative verifier (kvserve/spec/rejection.py)
    reads the same object, so both sample from exactly the same distributions.
    """

    logits: torch.Tensor  # [N, V]
    greedy: list[bool]  # per row: temperature < 1e-5
    sampled_rows: list[int]  # the rows that are not greedy
    probs: torch.Tensor | None  # [len(sampled_rows), V]


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> ProcessedLogits:
    """Run the logits processors of the module doc over `logits` (never modified in place)."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per request"
    params = [r.params for r in rows]
    greedy = [p.temperature < _GREEDY_EPS for p in params]
    needs_edit = _needs_min_tokens(rows) or any(_has_penalty(p) for p in params)

    logits = logits.float()
    if needs_edit:
        logits = logits.clone()  # never modify the caller's tensor
        _apply_min_tokens(logits, rows)
        _apply_penalties(logits, rows)
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    if not sampled_rows:
        return ProcessedLogits(logits, greedy, sampled_rows, None)
    temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    if any(t != 1.0 for t in temps):
        t = torch.tensor(temps, device=logits.device).unsqueeze(1)
        logits = logits.div_(t) if needs_edit else logits.div(t)  # ours, else a new tensor
    # From here `logits` is only read: it may be the caller's tensor.
    s_params = [params[i] for i in sampled_rows]
    filtered = any(p.min_p > 0 or p.top_k > 0 or p.top_p < 1.0 for p in s_params)
    if len(sampled_rows) < len(rows):
        sub = logits[torch.tensor(sampled_rows, device=logits.device)]  # a copy
    else:  # every row sampled: the filters below write a copy (logprobs read `logits`)
        sub = logits.clone() if filtered else logits
    if filtered:
        _apply_min_p(sub, s_params)
        _apply_top_k_top_p(sub, s_params)
    return ProcessedLogits(logits, greedy, sampled_rows, sub.softmax(dim=-1))


class Sampler:
    """Stateless: ``Sampler()(logits[N, V], rows) -> SamplerOutput``."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        proc = process_logits(logits, rows)
        tokens = _greedy_and_sample(proc, rows)
        want_logprobs = any(r.num_logprobs is not None for r in rows)
        logprobs = (
            _logprobs(proc.logits, [r.num_logprobs for r in rows], tokens)
            if want_logprobs
            else [None] * len(rows)
        )
        return SamplerOutput(tokens.tolist(), logprobs)


# ---------------------------------------------------------------- logits processors


def is_plain_greedy(p: SamplingParams) -> bool:
    """A row with these parameters takes the argmax of its logits as they are (once its
    min_tokens are out): greedy, no penalty, no logprobs."""
    return p.temperature < _GREEDY_EPS and not _has_penalty(p) and p.logprobs is None


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _needs_min_tokens(rows: list[SamplingRow]) -> bool:
    return any(len(r.output_token_ids) < r.params.min_tokens for r in rows)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Ban eos (unless ignore_eos) and stop_token_ids until min_tokens tokens exist."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) >= r.params.min_tokens:
            continue
        banned = set(r.params.stop_token_ids)
        if not r.params.ignore_eos and not r.constrained:
            banned |= r.eos_token_ids
        banned = [t for t in banned if 0 <= t < vocab]
        row_idx += [i] * len(banned)
        tok_idx += banned
    if row_idx:
        dev = logits.device
        logits[torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)] = float("-inf")


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float tensor: how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    lengths = torch.tensor([len(t) for t in token_lists])
    flat = [t for toks in token_lists for t in toks]
    if flat:
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths).to(device)
        toks = torch.tensor(flat, device=device)
        counts.index_put_((rows, toks), torch.ones_like(toks, dtype=counts.dtype), accumulate=True)
    return counts


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition penalty (prompt + output), then presence/frequency penalties (output).

    Each penalty runs only over the rows that set it.
    """
    vocab, dev = logits.shape[1], logits.device

    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        idx = torch.tensor(rep, device=dev)
        seen = (
            _token_counts(
                [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], vocab, dev
            )
            > 0
        )
        pen = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=dev).unsqueeze(
            1
        )
        sub = logits[idx]
        penalized = torch.where(sub > 0, sub / pen, sub * pen)
        logits[idx] = torch.where(seen, penalized, sub)

    pf = [
        i
        for i, r in enumerate(rows)
        if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if pf:
        idx = torch.tensor(pf, device=dev)
        counts = _token_counts([rows[i].output_token_ids for i in pf], vocab, dev)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pf], device=dev).unsqueeze(1)
        pres = torch.tensor([rows[i].params.presence_penalty for i in pf], device=dev).unsqueeze(1)
        logits[idx] -= freq * counts + pres * (counts > 0).float()


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    use = [i for i, p in enumerate(params) if p.min_p > 0]
    if not use:
        return
    idx = torch.tensor(use, device=logits.device)
    sub = logits[idx]
    probs = sub.softmax(dim=-1)
    min_p = torch.tensor([params[i].min_p for i in use], device=logits.device).unsqueeze(1)
    sub.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    logits[idx] = sub


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """top_k then top_p with a single ascending sort of the rows that use either.

    top_k keeps every token at least as likely as the k-th (ties at the boundary stay);
    top_p keeps the smallest set of most likely tokens whose mass reaches top_p.
    """
    use = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if not use:
        return
    dev, vocab = logits.device, logits.shape[1]
    idx = torch.tensor(use, device=dev)
    sorted_logits, order = logits[idx].sort(dim=-1)  # ascending

    ks = [params[i].top_k for i in use]
    if any(0 < k < vocab for k in ks):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=dev)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))

    ps = [params[i].top_p for i in use]
    if any(p < 1.0 for p in ps):
        p = torch.tensor(ps, device=dev).unsqueeze(1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))

    logits[idx] = sorted_logits.scatter(1, order, sorted_logits)


# ---------------------------------------------------------------- sampling


def exponential_noise(
    generators: list[torch.Generator | None], vocab: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[len(generators), vocab] Exp(1) noise, one row per entry; a row with a generator draws only
    from it (one row per sampled token: the speculative verifier draws the same way)."""
    q = torch.empty(len(generators), vocab, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        return q.exponential_()
    if shared:
        q[torch.tensor(shared, device=device)] = torch.empty(
            len(shared), vocab, device=device
        ).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return q


def _greedy_and_sample(proc: ProcessedLogits, rows: list[SamplingRow]) -> torch.Tensor:
    """Argmax for greedy rows, a draw from `proc.probs` for the rest. Returns [N] token ids."""
    logits = proc.logits
    if proc.probs is None:
        return argmax_rows(logits)
    dev = logits.device
    tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
    g_idx = [i for i, g in enumerate(proc.greedy) if g]
    if g_idx:
        gi = torch.tensor(g_idx, device=dev)
        tokens[gi] = argmax_rows(logits[gi])
    q = exponential_noise([rows[i].generator for i in proc.sampled_rows], logits.shape[1], dev)
    race = torch.div(proc.probs, q, out=q)  # probs / q, in the noise's memory
    if len(proc.sampled_rows) == len(rows):
        return argmax_rows(race)
    tokens[torch.tensor(proc.sampled_rows, device=dev)] = argmax_rows(race)
    return tokens


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask) -> None:
    """Structured output: set to -inf, in logits[rows[k]], every token whose bit is clear in row k
    of `bitmask` (int32 words; bit j of word j // 32 set: token j allowed). In place."""
    import numpy as np

    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    blocked = torch.from_numpy(bits[:, : logits.shape[1]] == 0).to(logits.device)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(blocked, float("-inf"))  # every row constrained: no gather/scatter
        return
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(blocked, float("-inf"))


def token_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprobs]:
    """Logprob, rank and top-`num_top` of each row's target token under the raw logits (prompt
    logprobs: how likely the model found each prompt token, nothing applied to the logits)."""
    lp = logits.float().log_softmax(dim=-1)
    target = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, target)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top_lp, top_ids = lp.topk(num_top, dim=-1) if num_top else (lp[:, :0], lp[:, :0].long())
    return [
        TokenLogprobs(t, c, r, list(zip(ids, vals)))
        for t, c, r, ids, vals in zip(
            targets, chosen.squeeze(1).tolist(), ranks, top_ids.tolist(), top_lp.tolist()
        )
    ]


def _logprobs(
    logits: torch.Tensor, num_top: list[int | None], tokens: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Chosen-token logprob, its rank and the top-N (num_top[i]) for every row that asked for
    logprobs."""
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    use = [i for i, n in enumerate(num_top) if n is not None]
    n_top = min(max(num_top[i] for i in use), logits.shape[-1])
    chosen = tokens[torch.tensor(use, device=tokens.device)].tolist()
    for i, entry in zip(use, token_logprobs(take_rows(logits, use), chosen, n_top)):
        entry.top = entry.top[: num_top[i]]
        out[i] = entry
    return out
