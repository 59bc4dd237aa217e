"""What a front end hands the core once per step: tensors only, built from the engine's own bookkeeping.

The embedded engine's model runner builds these (``engine/sparse_step.py``); a vLLM front end builds them from
vLLM's attention metadata. The core never reads an engine's KV manager: every block id it needs (working-set slots,
summary blocks, the full-KV table) arrives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch


@dataclass
class DecodeBatch:
    """This step's sparse-decode requests, ``B`` of them (or the requests whose working set is filled this step).

    Row ``i`` of every tensor is request ``seq_ids[i]``; rows index the flattened ``[T, H, D]`` q/k/v of the step.
    """

    seq_ids: list[int]
    state_rows: torch.Tensor
    """[B] int64: the request's row in the per-request state (``core.head_map.HeadMap``)."""
    q_rows: torch.Tensor
    """[B] int64: flattened row of the request's token."""
    draft_rows: torch.Tensor
    """[B] int64: flattened row of the draft token (the look-ahead row); ``q_rows`` where there is none."""
    has_draft: torch.Tensor
    """[B] bool."""
    local_block: torch.Tensor
    """[B] device block holding the active (partial) block."""
    local_len: torch.Tensor
    """[B] valid tokens in it, this step's token included."""
    num_candidates: torch.Tensor
    """[B] int32: full logical blocks before the active block this step (the blocks a prediction ranks)."""
    next_candidates: torch.Tensor
    """[B] int32: the same at the next step (what a prefetch for the next step ranks)."""
    summary_table: torch.Tensor
    """[B, S] int32: device block of each summary block (logical block ``j``'s summary is row
    ``summary_table[b, j // block_size] * block_size + j % block_size``; with ``summary_parts`` P, sub-block
    ``j * P + i``'s, addressed the same way)."""
    primary_table: torch.Tensor
    """[B, NB] int64: block of each logical block where the full KV lives (device cache, or the full-KV pool)."""
    slot_blocks: torch.Tensor | None = None
    """[B, K] int64: device block of each working-set slot (host-pool modes)."""
    local_rows: torch.Tensor | None = None
    """[B] int64: flat device row this step's token takes in the local block (host-pool modes)."""
    max_candidates: int = 0
    """Host-side maxima of the candidate counts, so no kernel reads them back from the device."""
    max_next_candidates: int = 0
    step: int | torch.Tensor = 0
    """The step stamped into selections (a 0-d device tensor on the static layout of CUDA graphs)."""
    separate_draft_rows: bool = False
    """Every request has its own draft row, used or not (the static layout)."""
    code_table: torch.Tensor | None = None
    """[B, NB] int64 (key codes, ``core/summaries.KeyCodes``): the code row of each logical block."""
    gap_block: torch.Tensor | None = None
    """[B] int64 (accepted drafts): the local device block holding the block before the active one where the last
    prediction could not rank it (an accepted draft completed it), attended besides the working set; else -1."""
    _memo: dict = field(default_factory=dict, repr=False)

    def derived(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor derived from this batch that every layer reads, made once per step by the first layer that
        asks (so a captured step holds one copy of the ops that make it, inside the graph)."""
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = make()
        return t

    def forget_derived(self) -> None:
        """Make derived tensors again (a CUDA-graph capture re-runs a step that just ran eagerly)."""
        self._memo.clear()

    def pred_rows(self) -> torch.Tensor:
        """Per request, the row whose query predicts its next step's blocks: the draft's, else its own."""
        return self.derived("pred_rows", lambda: torch.where(self.has_draft, self.draft_rows, self.q_rows))

    def active_code_rows(self) -> torch.Tensor:
        """[B] (key codes): the code row of each request's active block, logical block ``num_candidates``."""
        return self.derived("active_code_rows",
                            lambda: self.code_table.gather(1, self.num_candidates.long().unsqueeze(1)).squeeze(1))

    def before_gap(self) -> "DecodeBatch":
        """This batch without the block before the active one as a candidate of the step where ``gap_block`` holds it
        in a local slot: the step attends it there, so a ranking of the step's own query (``demand_fetch``) must not
        admit it as well (it would be attended twice). The batch itself when it has no gap column."""
        if self.gap_block is None:
            return self
        return self.derived("before_gap", lambda: replace(
            self, num_candidates=self.num_candidates - (self.gap_block >= 0).to(self.num_candidates.dtype), _memo={}))

    def qd_rows(self) -> torch.Tensor:
        """[2B]: each request's token row then its draft row, interleaved (one index op stacks both queries)."""
        return self.derived("qd_rows", lambda: torch.stack([self.q_rows, self.draft_rows], dim=1).flatten())


@dataclass
class SummaryWrites:
    """Where this step's written tokens (``written`` rows of k, in order) fold into the key summaries: one
    summary row per token when no row repeats (decode), else runs of a block's tokens (a prefill chunk)."""

    rows: torch.Tensor | None = None
    """[n] flat summary row of each written token (decode)."""
    reset: torch.Tensor | None = None
    """[n] bool: the token starts its block (the row is overwritten, not folded)."""
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """``(pad_idx, run_rows, run_reset)`` of :func:`oasiskv_runtime.ops.summary_update.update_summaries_runs`."""


def summary_row(summary_blocks: list[int], j: int, block_size: int) -> int:
    """Flat device row holding logical block ``j``'s key summary (``block_size`` rows per summary block)."""
    return summary_blocks[j // block_size] * block_size + j % block_size


def summary_rows(summary_blocks: list[int], num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
    """``[num_blocks]`` flat rows of logical blocks ``0 .. num_blocks - 1``'s summaries (a whole request's)."""
    return torch.tensor([summary_row(summary_blocks, j, block_size) for j in range(num_blocks)], dtype=torch.long,
                        device=device)
