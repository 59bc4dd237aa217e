"""Top-K prediction (SPEC items 1-2): score every candidate block of a request from its key summaries with a query,
take the best ``K`` per KV head, without reading any real key.

A block's score is Quest's upper bound of ``q . k`` over its keys, ``sum_d max(q_d * min_d, q_d * max_d)``, maxed
over the query heads of the KV head's group (GQA). The query is the draft token's (OasisKV's look-ahead, for the
next step), or the request's own (proxy-prefetch, sparse-resident, fetch-on-demand). Leading ``sink_blocks`` are
always kept.

``selection_score="attention"`` ranks by the exact attention mass instead (:func:`block_attention_mass`, the top-K
no summary-based selection can beat): it reads the full keys through ``batch.primary_table``, so it needs them on
the device (sparse-resident); ``keys`` are the per-layer key caches that table indexes.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.core.batch import DecodeBatch
from oasiskv_runtime.core.summaries import KeySummaries
from oasiskv_runtime.ops.attention_mass import block_attention_mass
from oasiskv_runtime.ops.score_topk import quest_scores, rank_topk


class Predictor:
    def __init__(self, summaries: KeySummaries, num_kv_heads: int, k_slots: int, sink_blocks: int = 0,
                 backend: str = "auto", selection_score: str = "quest", keys: list[torch.Tensor] | None = None,
                 scale: float = 1.0) -> None:
        self.summaries, self.hkv, self.k_slots = summaries, num_kv_heads, k_slots
        self.sink_blocks, self.backend = sink_blocks, backend
        self.selection_score, self.keys, self.scale = selection_score, keys, scale
        """``keys``: per layer ``[num_blocks, block_size, Hkv, D]`` (what ``primary_table`` indexes) and attention's
        ``scale``, read by ``selection_score="attention"`` only."""

    def predict(self, layer: int, query: torch.Tensor, batch: DecodeBatch, next_step: bool,
                int32: bool = False) -> torch.Tensor:
        """Top-K logical blocks per KV head ``[B, Hkv, K]`` (``-1`` padded, best first) for queries
        ``[B, Hq, D]``, over this step's candidate blocks or (``next_step``) the next step's. ``int32``: keep the
        ranking's int32 ids (what the fused selection kernel reads); int64 otherwise (for indexing)."""
        if next_step:
            num_candidates, max_candidates = batch.next_candidates, batch.max_next_candidates
        else:
            num_candidates, max_candidates = batch.num_candidates, batch.max_candidates
        if self.selection_score == "attention":
            scores = block_attention_mass(query, self.keys[layer], batch.primary_table, num_candidates, self.hkv,
                                          self.scale, max_candidates)
        else:
            sum_min, sum_max = self.summaries.read(layer)
            scores = quest_scores(query, sum_min, sum_max, batch.summary_table, num_candidates, self.hkv,
                                  max_candidates, backend=self.backend)
        if self.sink_blocks and scores.shape[-1]:
            sink = min(self.sink_blocks, scores.shape[-1])
            head = scores[..., :sink]
            scores[..., :sink] = torch.where(torch.isinf(head), head, torch.full_like(head, float("inf")))
        ids, _ = rank_topk(scores, num_candidates, self.k_slots, backend=self.backend, with_valid=False)
        return ids if int32 else ids.long()


def resident_block_ids(pred: torch.Tensor, primary_table: torch.Tensor) -> torch.Tensor:
    """Predicted logical blocks ``[B, Hkv, K]`` as the device blocks holding them (``primary_table``: ``[B, NB]``
    logical -> device block, the whole context resident: sparse-resident), ``-1`` kept."""
    return torch.where(pred >= 0, primary_table.gather(1, pred.clamp_min(0).flatten(1)).view_as(pred), pred)
