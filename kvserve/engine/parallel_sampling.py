"""Fan-out: one user request becomes the scheduler sequences that serve it.

n samples (n > 1, best_of): sibling sequences "<id>#<i>", each with its own derived seed; the
first computes the prompt and the others fork its KV blocks (shared by refcount, copy-on-write).
Beam search: one sequence per beam, grown and pruned each round by BeamRun (beam_search.py);
BeamGroups knows which request each beam serves and moves the rounds on.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.core.scheduler import Scheduler
from kvserve.core.sequence import Sequence
from kvserve.engine.beam_search import BeamRun
from kvserve.engine.output_processor import OutputProcessor, RequestState
from kvserve.runner.model_runner import SampledToken
from kvserve.sampling_params import SamplingParams


def sample_sequences(
    request_id: str, prompt: list[int], params: SamplingParams, eos_token_ids: set[int], **common
) -> list[Sequence]:
    """The n sequences of a sampled request (the request id itself when n == 1). `common`:
    max_tokens, arrival_time, priority, cache_salt."""
    seqs: list[Sequence] = []
    for i in range(params.n):
        seqs.append(
            Sequence(
                seq_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(prompt),
                sampling_params=params.child(i) if params.n > 1 else params,
                eos_token_ids=eos_token_ids,
                fork_of=seqs[0].seq_id if seqs else None,
                **common,
            )
        )
    return seqs


def beam_run(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    eos_token_ids: set[int],
    max_tokens: int,
    **common,
) -> BeamRun:
    """The beams of a beam-search request; `common`: arrival_time, priority, cache_salt."""

    def new_sequence(seq_id, tokens, seq_params, seq_max_tokens, fork_of):
        return Sequence(
            seq_id=seq_id,
            prompt_token_ids=tokens,
            sampling_params=seq_params,
            max_tokens=seq_max_tokens,
            fork_of=fork_of,
            **common,
        )

    return BeamRun(request_id, prompt, params, eos_token_ids, max_tokens, new_sequence)


class BeamGroups:
    """The running beam sequences, by sequence id, and the request each serves."""

    def __init__(self):
        self.by_seq: dict[str, RequestState] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.by_seq

    def get(self, seq_id: str) -> RequestState | None:
        return self.by_seq.get(seq_id)

    def add(self, state: RequestState) -> None:
        for seq in state.beam.seqs:
            self.by_seq[seq.seq_id] = state

    def drop(self, state: RequestState, scheduler: Scheduler) -> None:
        """Abort every beam of `state` (its samples are outputs only, not sequences)."""
        for seq in state.beam.seqs:
            scheduler.abort_sequence(seq.seq_id)
            self.by_seq.pop(seq.seq_id, None)
        state.beam.seqs = []

    def advance(
        self,
        sampled: dict[str, list[SampledToken]],
        scheduler: Scheduler,
        processor: OutputProcessor,
        forget: Callable[[str], None],
        now: float,
    ) -> list[RequestState]:
        """Hand each beam's candidates to its request; a request whose beams all reported takes
        its next beams (forks, continuations, aborts). Returns the requests whose search ended
        (their completions filled in)."""
        ready: dict[str, RequestState] = {}
        for seq_id, toks in sampled.items():
            state = self.by_seq.get(seq_id)
            if state is None or state.request_id not in processor.requests:
                continue
            seq = scheduler.sequences.get(seq_id)
            if seq is None:  # the scheduler finished it (its last round): the search ends too
                seq = next(s for s in state.beam.seqs if s.seq_id == seq_id)
            if state.beam.report(seq, toks[0].logprobs.top):
                ready[state.request_id] = state
        done = []
        for state in ready.values():
            processor.first_token(state, now)
            added, dropped = state.beam.advance()
            for seq in dropped:
                scheduler.abort_sequence(seq.seq_id)
                self.by_seq.pop(seq.seq_id, None)
                forget(seq.seq_id)
            for seq in added:
                scheduler.add_sequence(seq)
                self.by_seq[seq.seq_id] = state
            if state.beam.search.done:
                processor.finish_beams(state)
                done.append(state)
        return done

    def clear(self) -> None:
        self.by_seq.clear()
