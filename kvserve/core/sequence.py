"""One sequence's state as the scheduler sees it (a user request with n > 1 or beam
search has several): its tokens, its progress, its status.

A sequence's known tokens are `prompt_token_ids + output_token_ids` (`all_token_ids`).
`num_computed_tokens` of them already have their KV in the cache; the scheduler advances
it when it schedules a chunk, and resets it to 0 when it preempts the sequence (recompute:
the prompt it then recomputes is the prompt plus the outputs so far).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from kvserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """A prompt, its sampling parameters, and everything generated for it so far.

    `max_tokens` is the resolved output cap (the engine resolves `SamplingParams.max_tokens=None`
    to the room left in the context; the scheduler does so too when handed None). `fork_of`
    names the sequence whose blocks this one shares: an n > 1 sibling (the prompt's blocks), or
    the beam it branches from (every block before its last token). `stop_reason` is the stop
    token id that finished it, when one did. `spec_token_ids` are draft tokens the engine
    proposed to follow its known tokens; the scheduler feeds them (after the last sampled
    token) for verification at its next decode step.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        fork_of: str | None = None,
        lora_key: str | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.max_tokens = sampling_params.max_tokens if max_tokens is None else max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.fork_of = fork_of
        # The LoRA adapter it runs with (the manager's key of one load of it), None: the base.
        self.lora_key = lora_key

        self.status = SequenceStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | None = None
        self.spec_token_ids: list[
            int
        ] = []  # draft tokens to verify next step (speculative decoding)
        # Beam search (kvserve/engine/beam_search.py): a held sequence is not scheduled (its beam
        # waits for the others of its sequence); beam_candidates top tokens come back per step.
        self.held = False
        self.beam_candidates = 0
        self._all_token_ids = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def replace_last_output_token(self, token_id: int) -> None:
        """Swap the last output token for another (beam search picks a token other than the one
        sampled). Only while that token is not computed: its KV is not in the cache yet."""
        if not self.output_token_ids or self.num_computed_tokens >= self.num_tokens:
            raise ValueError(f"{self.seq_id}: no uncomputed output token to replace")
        self.output_token_ids[-1] = token_id
        self._all_token_ids[-1] = token_id

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (the scheduler's list: read, do not modify)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length", "abort", or None while the sequence is unfinished."""
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
