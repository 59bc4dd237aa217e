"""The per-step metadata object: built once per step by the model runner, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SeqSlice:
    """One request's rows in the flattened batch."""

    seq_id: int
    query_start: int
    """First row of this request in the flattened batch."""
    num_query: int
    """Rows computed this step (prefill chunk length, 1 for decode), excluding the draft row."""
    context_len: int
    """Tokens with KV once this step's rows are written."""
    block_table: list[int]
    """Device block per logical block (full-KV modes) or host block per logical block (host-pool modes)."""
    draft_row: int | None = None
    """Row of the draft token (oasiskv look-ahead), whose KV is never written to the cache."""
    completes: bool = True
    """The step computes the request's last pending token (a token is sampled)."""

    @property
    def is_decode(self) -> bool:
        return self.num_query == 1 and self.context_len > 1


def written_rows(seqs: list[SeqSlice]) -> list[int]:
    """Rows of the flattened batch whose KV is written (every computed row; draft rows are not), in order:
    the rows where ``slot_mapping >= 0``, known on the host (a ``nonzero`` on the device would wait for it)."""
    return [r for s in seqs for r in range(s.query_start, s.query_start + s.num_query)]


@dataclass
class StepMetadata:
    input_ids: torch.Tensor
    """[T] token ids, drafts included."""
    positions: torch.Tensor
    """[T]."""
    slot_mapping: torch.Tensor
    """[T] flat cache row (block * block_size + offset) each token's KV is written to; -1: not written."""
    seqs: list[SeqSlice]
    logits_indices: torch.Tensor
    """[S] rows whose logits are sampled (the last computed row of each completing request)."""
    step: int = 0
    extra: dict = field(default_factory=dict)
    sparse: Any = None
    """The sparse modes' inputs of this step (``engine.attention.sparse_step.SparseStep``), built with it."""
