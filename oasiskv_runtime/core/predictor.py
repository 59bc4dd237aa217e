"""Top-K prediction (SPEC items 1-2): score every candidate block of a request from its key summaries with a query,
take the best ``K`` per KV head, without reading any real key.

A block's score is Quest's upper bound of ``q . k`` over its keys, ``sum_d max(q_d * min_d, q_d * max_d)``, maxed
over the query heads of the KV head's group (GQA). The query is the draft token's (OasisKV's look-ahead, for the
next step), or the request's own (proxy-prefetch, sparse-resident, fetch-on-demand). Leading ``sink_blocks`` and
the ``recent_blocks`` before the active block of the step predicted for are always kept (they count in the K).

``selection_score="attention"`` ranks by the exact attention mass instead (:func:`block_attention_mass`, the top-K
no summary-based selection can beat): it reads the full keys through ``batch.primary_table``, so it needs them on
the device (sparse-resident); ``keys`` are the per-layer key caches that table indexes.
``selection_score="minmax_mass"`` ranks by an estimate of that mass from the same min/max summaries
(:func:`minmax_mass_scores`, attention's ``scale`` included), so it runs in every mode.
``selection_score="quest_rank"`` shares a KV head's selection among its query heads by each head's rank under its
own Quest bound (:func:`quest_rank_scores`) instead of the bounds' group max; summaries only, every mode.
``selection_score="gauss"`` ranks by the Gaussian log-mass of each block's key mean and variance
(:func:`gauss_mass_scores`), computed from the full keys like ``attention`` (a study of a ranking whose summaries the
engine does not keep): sparse-resident only.
``selection_score="quest_half"`` / ``"quest_quarter"`` / ``"max_logit"`` rank by Quest's bound over 2 / 4 / one-key
runs of each block's keys, the block's best run (:func:`split_quest_scores`): finer summaries with the same fetch unit,
computed from the full keys (a study): sparse-resident only.
``selection_score="max_logit_b1"`` / ``"_b2"`` / ``"_b4"`` rank by each block's largest logit over its keys coded in
1 / 2 / 4 bits per dimension within the block's min/max (:func:`coded_scores`), read from the codes the engine keeps
on the device (``codes``, :class:`KeyCodes`, addressed by ``batch.code_table``) and the min/max summaries: every
mode.
``summary_parts > 1`` (with ``quest``): the engine keeps that many summary rows per block (each for a run of
``block_size / parts`` keys) and a block scores its best run's bound, from the summaries alone: every mode.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.config import CODED_KEY_SCORES
from oasiskv_runtime.core.batch import DecodeBatch
from oasiskv_runtime.core.summaries import KeyCodes, KeySummaries
from oasiskv_runtime.ops.attended import keep_blocks_
from oasiskv_runtime.ops.attention_mass import block_attention_mass
from oasiskv_runtime.ops.gauss_mass import gauss_mass_scores
from oasiskv_runtime.ops.key_codes import coded_scores
from oasiskv_runtime.ops.split_quest import SPLIT_PARTS, split_quest_scores
from oasiskv_runtime.ops.score_topk import minmax_mass_scores, quest_rank_scores, quest_scores, rank_topk


class Predictor:
    def __init__(self, summaries: KeySummaries, num_kv_heads: int, k_slots: int, sink_blocks: int = 0,
                 backend: str = "auto", selection_score: str = "quest", keys: list[torch.Tensor] | None = None,
                 scale: float = 1.0, recent_blocks: int = 0, summary_parts: int = 1,
                 codes: KeyCodes | None = None) -> None:
        self.summaries, self.hkv, self.k_slots, self.codes = summaries, num_kv_heads, k_slots, codes
        self.summary_parts = summary_parts
        """Summary rows per logical block (``SparseConfig.summary_parts``): block ``j``'s are sub-blocks
        ``j * parts .. j * parts + parts - 1``, addressed like blocks; quest scores a block by its best one."""
        self.sink_blocks, self.recent_blocks, self.backend = sink_blocks, recent_blocks, backend
        self.selection_score, self.keys, self.scale = selection_score, keys, scale
        """``keys``: per layer ``[num_blocks, block_size, Hkv, D]`` (what ``primary_table`` indexes), read by the
        scores that read every key only (``attention``, ``gauss``, the split Quest bounds); attention's ``scale``,
        read by ``attention``, ``gauss`` and ``minmax_mass``."""

    def predict(self, layer: int, query: torch.Tensor, batch: DecodeBatch, next_step: bool,
                int32: bool = False, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Top-K logical blocks per KV head ``[B, Hkv, K]`` (``-1`` padded, best first) for queries
        ``[B, Hq, D]``, over this step's candidate blocks or (``next_step``) the next step's. ``int32``: keep the
        ranking's int32 ids (what the fused selection kernel reads); int64 otherwise (for indexing). ``keep``:
        ``[B, Hkv, M]`` logical blocks the ranking keeps whatever their score (``attended_blocks``; -1: none)."""
        if next_step:
            num_candidates, max_candidates = batch.next_candidates, batch.max_next_candidates
        else:
            num_candidates, max_candidates = batch.num_candidates, batch.max_candidates
        if self.selection_score == "attention":
            scores = block_attention_mass(query, self.keys[layer], batch.primary_table, num_candidates, self.hkv,
                                          self.scale, max_candidates)
        elif self.selection_score == "gauss":
            scores = gauss_mass_scores(query, self.keys[layer], batch.primary_table, num_candidates, self.hkv,
                                       self.scale, max_candidates)
        elif self.selection_score in SPLIT_PARTS:
            scores = split_quest_scores(query, self.keys[layer], batch.primary_table, num_candidates, self.hkv,
                                        SPLIT_PARTS[self.selection_score], max_candidates)
        elif self.selection_score in CODED_KEY_SCORES:
            scores = self._coded(layer, query, batch, num_candidates, max_candidates)
        elif self.selection_score == "quest_rank":
            sum_min, sum_max = self.summaries.read(layer)
            scores = quest_rank_scores(query, sum_min, sum_max, batch.summary_table, num_candidates, self.hkv,
                                       max_candidates)
        elif self.selection_score == "minmax_mass":
            sum_min, sum_max = self.summaries.read(layer)
            scores = minmax_mass_scores(query, sum_min, sum_max, batch.summary_table, num_candidates, self.hkv,
                                        self.scale, max_candidates)
        elif self.summary_parts > 1:
            scores = self._sub_block_quest(layer, query, batch, next_step, num_candidates, max_candidates)
        else:
            sum_min, sum_max = self.summaries.read(layer)
            scores = quest_scores(query, sum_min, sum_max, batch.summary_table, num_candidates, self.hkv,
                                  max_candidates, backend=self.backend)
        return self.rank(scores, num_candidates, int32=int32, keep=keep)

    def coded_pair(self, layer: int, query: torch.Tensor, next_query: torch.Tensor,
                   batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The coded-key scores of this step's candidates for ``query`` and of the next step's for ``next_query``
        (both ``[B, Hq, D]``) from one read of the codes, or None unless the selection score reads codes. What
        ``predict(layer, query, batch, False)`` and ``predict(layer, next_query, batch, True)`` score, ranked by
        :meth:`rank` with their own candidate counts (``batch.num_candidates`` / ``next_candidates``): for a step
        that ranks its own query and predicts the next one in the same layer (``demand_fetch``), the codes, its
        largest read, are read once instead of twice."""
        if self.selection_score not in CODED_KEY_SCORES:
            return None
        counts = torch.stack([batch.num_candidates.to(batch.next_candidates.dtype), batch.next_candidates])
        both = self._coded(layer, torch.stack([query, next_query], dim=1), batch, counts,
                           max(batch.max_candidates, batch.max_next_candidates))
        return both[0, :, :, :batch.max_candidates], both[1, :, :, :batch.max_next_candidates]

    def _coded(self, layer: int, query: torch.Tensor, batch: DecodeBatch, num_candidates: torch.Tensor,
               max_candidates: int | None) -> torch.Tensor:
        """Each candidate block's largest logit over its coded keys, from the stored codes and the min/max rows."""
        bits = CODED_KEY_SCORES[self.selection_score]
        if self.codes is None or self.codes.bits != bits or batch.code_table is None:
            raise ValueError(f"selection_score={self.selection_score!r} reads key codes of {bits} bits that this "
                             f"engine does not keep (it keeps them when it starts with that score)")
        sum_min, sum_max = self.summaries.read(layer)
        return coded_scores(query, self.codes.read(layer), sum_min, sum_max, batch.code_table, batch.summary_table,
                            num_candidates, self.hkv, bits, max_candidates, backend=self.backend)

    def _sub_block_quest(self, layer: int, query: torch.Tensor, batch: DecodeBatch, next_step: bool,
                         num_candidates: torch.Tensor, max_candidates: int | None) -> torch.Tensor:
        """Quest's bound of every candidate sub-block (``num_candidates * parts`` of them, summary rows addressed
        like blocks), a block's the best of its ``parts``: ``[B, Hkv, J]``, ``-inf`` beyond the candidates. The
        sub-block counts are made once per batch (on the device: CUDA graphs capture this)."""
        p = self.summary_parts
        sub = batch.derived("sub_candidates_next" if next_step else "sub_candidates", lambda: num_candidates * p)
        sum_min, sum_max = self.summaries.read(layer)
        scores = quest_scores(query, sum_min, sum_max, batch.summary_table, sub, self.hkv,
                              None if max_candidates is None else max_candidates * p, backend=self.backend)
        return scores.view(scores.shape[0], scores.shape[1], -1, p).amax(-1)

    def rank(self, scores: torch.Tensor, num_candidates: torch.Tensor, int32: bool = False,
             keep: torch.Tensor | None = None) -> torch.Tensor:
        """The top-K of block scores ``[B, Hkv, J]`` (``-inf`` beyond each request's ``num_candidates``), with the
        sink, recent and ``keep`` blocks kept: what :meth:`predict` returns for the scores it computes, and what a
        fill ranks scores made elsewhere with (``fill_window``). ``scores`` may be changed in place."""
        scores = keep_always(scores, num_candidates, self.sink_blocks, self.recent_blocks)
        if keep is not None:
            scores = keep_blocks_(scores, keep, backend=self.backend)
        ids, _ = rank_topk(scores, num_candidates, self.k_slots, backend=self.backend, with_valid=False)
        return ids if int32 else ids.long()


def keep_always(scores: torch.Tensor, num_candidates: torch.Tensor, sink_blocks: int,
                recent_blocks: int) -> torch.Tensor:
    """``scores`` ``[B, Hkv, J]`` with the first ``sink_blocks`` and the last ``recent_blocks`` candidates of each
    request (``num_candidates``: ``[B]``) raised to ``+inf``, so any ranking keeps them; columns beyond the candidates
    stay as they are. The mask is made on the device from the counts (no host read: CUDA graphs capture it)."""
    if not (sink_blocks or recent_blocks) or not scores.shape[-1]:
        return scores
    j = torch.arange(scores.shape[-1], device=scores.device).view(1, -1)
    nc = num_candidates.to(scores.device, torch.int64).view(-1, 1)
    keep = ((j < sink_blocks) | (j >= nc - recent_blocks)) & (j < nc)                 # [B, J]
    return scores.masked_fill(keep.unsqueeze(1), float("inf"))


def resident_block_ids(pred: torch.Tensor, primary_table: torch.Tensor) -> torch.Tensor:
    """Predicted logical blocks ``[B, Hkv, K]`` as the device blocks holding them (``primary_table``: ``[B, NB]``
    logical -> device block, the whole context resident: sparse-resident), ``-1`` kept."""
    return torch.where(pred >= 0, primary_table.gather(1, pred.clamp_min(0).flatten(1)).view_as(pred), pred)
