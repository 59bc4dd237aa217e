"""Quest's bound over sub-blocks of each candidate block (issue #34, a study setting).

What is left of oasiskv's loss at a tight budget is the ranking (docs/accuracy.md): Quest's bound from a block's key
min/max ranks worse than the block's true attention mass, and halving the block size (block size 8) gains 6-8 points
for Quest, but also halves every fetch. This op asks whether the finer summaries alone carry that gain with the
fetch unit unchanged: each block of ``block_size`` keys is split into ``parts`` runs of ``block_size / parts``
consecutive keys, Quest's bound is taken over each run's own min/max, and the block scores the largest of its runs'
bounds. ``parts = 1`` is Quest's score; ``parts = block_size`` is each block's largest logit (``max_t q . k_t``, no
bound left); anything between is what summaries ``parts`` times as large would rank by.

Those summaries are not among the ones the engine keeps, so the op computes them from the keys of every candidate
block at every step: it backs ``SparseConfig.selection_score = "quest_half"`` (2 parts), ``"quest_quarter"`` (4) and
``"max_logit"`` (``block_size``), sparse-resident only, where the whole KV is on the device. Like ``attention`` and
``gauss`` it reads a dense attention's keys: plain PyTorch on every device, nothing read back to the host when
``max_candidates`` is given (a CUDA graph can capture it).

Per request ``b``, KV head ``h`` and candidate block ``j`` with runs ``r`` (min ``lo_r``, max ``hi_r`` per dimension)::

    score_h(j) = max over the query heads i of h's group, over r, of  sum_d max(q_id * lo_rd, q_id * hi_rd)
               = max_i max_r  (q_i+ . hi_r + q_i- . lo_r)        (q+ / q-: q's positive / negative parts)

GQA: the group's maximum, as Quest.

On the issue's points (H100, 1/8 of 2K / 4K) ``max_logit`` ranks nearly as the exact attention mass does, while two
or four runs stay far under it: what a block's min/max loses is the keys' positions inside the box, not its width.
:func:`coded_max_logit_scores` asks how few bits of that position suffice: each key coded per dimension in ``bits``
bits within its block's own min/max (``2**bits`` levels from min to max, the nearest taken), the block scored by
its largest logit over the coded keys. ``bits`` bits per key and dimension is ``bits / 16`` of a bf16 key cache, a
summary the engine keeps on the device beside the min/max for ``selection_score = "max_logit_b1"`` / ``"_b2"`` /
``"_b4"`` (``ops/key_codes.py``, ``core/summaries.KeyCodes``); this op, which codes the full keys at every step, is
the reference the stored codes are tested against::

    k^_td = lo_d + round((k_td - lo_d) / step_d) * step_d,   step_d = (hi_d - lo_d) / (2**bits - 1)
    score_h(j) = max over i of h's group, over the block's keys t, of  q_i . k^_t
"""

from __future__ import annotations

import torch

from oasiskv_runtime.ops.attention_mass import score_candidate_blocks
from oasiskv_runtime.ops.key_codes import code_levels

__all__ = ["SPLIT_PARTS", "coded_max_logit_scores", "split_quest_scores"]

SPLIT_PARTS = {"quest_half": 2, "quest_quarter": 4, "max_logit": 0}
"""``selection_score`` -> sub-blocks per block (0: one per key, ``block_size``)."""



def split_quest_scores(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                       num_candidates: torch.Tensor, num_kv_heads: int, parts: int,
                       max_candidates: int | None = None) -> torch.Tensor:
    """Quest's bound over ``parts`` equal runs of each candidate block's keys, the largest run's per block,
    ``[B, Hkv, J]`` fp32, ``-inf`` beyond ``num_candidates``.

    ``q``: ``[B, Hq, D]`` the step's query; ``k_cache``: ``[num_blocks, block_size, Hkv, D]`` one layer's keys;
    ``block_table``: ``[B, NB]`` the cache block holding each logical block; ``parts``: a divisor of ``block_size``
    (0: ``block_size``, one key per run); ``max_candidates``: ``J``, a host-side bound of ``num_candidates`` (read
    from the device when None)."""
    bs = k_cache.shape[1]
    parts = parts or bs
    if parts < 1 or bs % parts:
        raise ValueError(f"parts={parts} must divide the block size {bs}")

    def best_run_bound(qh: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        B, J, _, D = keys.shape
        runs = keys.view(B, J, parts, bs // parts, D)
        lo, hi = runs.amin(dim=3).view(B, J * parts, D), runs.amax(dim=3).view(B, J * parts, D)
        bound = torch.bmm(qh.clamp_min(0), hi.transpose(1, 2)) + torch.bmm(qh.clamp_max(0), lo.transpose(1, 2))
        return bound.view(B, -1, J, parts).amax(dim=3).amax(dim=1)                       # [B, g, J*parts] -> [B, J]

    return score_candidate_blocks(q, k_cache, block_table, num_candidates, num_kv_heads, max_candidates,
                                  best_run_bound)


def coded_max_logit_scores(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           num_candidates: torch.Tensor, num_kv_heads: int, bits: int,
                           max_candidates: int | None = None) -> torch.Tensor:
    """Each candidate block's largest logit over its keys coded in ``bits`` bits per dimension within the block's
    own min/max (the module doc), ``[B, Hkv, J]`` fp32, ``-inf`` beyond ``num_candidates``. Arguments as
    :func:`split_quest_scores`; ``bits >= 1``."""
    if bits < 1:
        raise ValueError(f"bits={bits} must be >= 1")

    def coded_max(qh: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        B, J, bs, D = keys.shape
        lo = keys.amin(dim=2, keepdim=True)                                                  # [B, J, 1, D]
        levels, step = code_levels(keys, lo, keys.amax(dim=2, keepdim=True), bits)
        coded = (lo + levels * step).view(B, J * bs, D)
        logits = torch.bmm(qh, coded.transpose(1, 2))                                       # [B, g, J * bs]
        return logits.view(B, -1, J, bs).amax(dim=3).amax(dim=1)

    return score_candidate_blocks(q, k_cache, block_table, num_candidates, num_kv_heads, max_candidates, coded_max)
