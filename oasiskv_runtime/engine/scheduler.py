"""Continuous batching with chunked prefill and preemption by recompute. No torch.

``schedule()`` returns which requests compute how many pending tokens this step. Running requests go
first (oldest first); a request that cannot get blocks preempts the newest running request, which frees all
its blocks and later recomputes its tokens. Waiting requests are admitted in arrival order while the
token budget, the sequence limit and the KV blocks allow: a request is admitted only when its whole pending context
fits with a small reserve (``KVCacheManager.can_admit``), not just its first prefill chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from oasiskv_runtime.config import SchedulerConfig
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager
from oasiskv_runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    """Pending tokens computed this step (a prefill chunk, or 1 for decode)."""

    @property
    def completes(self) -> bool:
        """This step computes the sequence's last pending token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """A decode entry: one new token after a computed context, sampled at the end of the step (what the CUDA
        graphs run on the static layout)."""
        return self.num_tokens == 1 and self.completes and self.seq.num_computed_tokens >= 1


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.kv.check_fits_alone(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_ids.append(seq.seq_id)
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_pending_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not self.kv.allocate(seq, n):
                if not queue:
                    self._preempt(seq, out)
                    seq = None
                    break
                self._preempt(queue.pop(), out)
            if seq is None:
                break
            kept.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.running = kept
        # Admit waiting requests only when nobody was preempted this step: otherwise we would re-admit the
        # victim at once and thrash.
        reserved = [0, 0]  # blocks running requests still need for their pending prompts
        for s in self.running if self.waiting and not out.preempted_ids else ():  # only read when admitting
            dev, host = self.kv.pending_needs(s)
            reserved[0] += dev
            reserved[1] += host
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not out.preempted_ids:
            seq = self.waiting[0]
            n = min(seq.num_pending_tokens, budget)
            # With others running, wait until the whole context fits next to what they still need (they will
            # free blocks); alone, a request always starts (check_fits_alone guaranteed it can run).
            if self.running and not self.kv.can_admit(seq, (reserved[0], reserved[1])):
                break
            if not self.kv.allocate(seq, n):
                break
            dev, host = self.kv.pending_needs(seq)
            reserved[0] += dev
            reserved[1] += host
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)
