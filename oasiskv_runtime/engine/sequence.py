"""A request's token state. Plain Python: the scheduler and block bookkeeping never see tensors."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from oasiskv_runtime.sampling_params import SamplingParams


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class SequenceTimes:
    """Wall-clock timestamps (seconds, time.perf_counter) for latency metrics."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    """One request. ``all_token_ids[:num_computed_tokens]`` have KV in the cache; the rest are pending.

    Prefill and decode are the same thing here: a step computes some pending tokens and, when it computes
    the last one, samples the next token. Preemption by recompute resets ``num_computed_tokens`` to 0 and keeps
    the generated tokens, which are recomputed as part of the prompt.
    """

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 arrival: float | None = None) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.times = SequenceTimes(arrival=time.perf_counter() if arrival is None else arrival)
        self.draft_token_id: int | None = None
        """Draft for the token after the last one (oasiskv look-ahead); set by the engine each step."""
        self.num_draft_correct = 0
        self.num_draft_checked = 0
        self.forced_output_ids: list[int] | None = None
        """Teacher forcing: output tokens are taken from here instead of sampled (recall measurement)."""
        self.reference_output_ids: list[int] | None = None
        """A reference run's continuation (e.g. dense's) that the ``oracle`` draft proposes while this request's
        outputs follow it; outputs are sampled as usual (accuracy of a perfect look-ahead)."""
        self.text = ""
        self.stage_kv = False
        """Prefill-decode: keep the prompt's KV staged in the host pool when the request finishes here."""
        self.error: str | None = None
        """Why the request was aborted (finish reason "error"), e.g. its prefill peer died."""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, pos: int) -> int:
        """Token at position ``pos`` without building ``all_token_ids`` (a copy of the whole context)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True until the whole prompt (and any recomputed output) has KV."""
        return self.num_pending_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
