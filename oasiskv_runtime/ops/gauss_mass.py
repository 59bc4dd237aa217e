"""Gaussian log-mass block scores from each candidate block's key mean and variance (issue #34, a study setting).

The offline scorer study (``bench/scorer_study.py``, docs/accuracy.md) found that ranking blocks by the log of the
attention mass a block would get if its keys were Gaussian, with the block's own mean and per-dimension variance,
keeps nearly as many needle blocks as the exact top-K (:mod:`attention_mass`) while Quest's bound keeps half. Those
two statistics are not among the per-block summaries the engine keeps (key min/max), so this op computes them from
the keys of every candidate block at every step: it backs ``SparseConfig.selection_score = "gauss"``
(sparse-resident only, where the whole KV is on the device) to test the ranking on real generations before anyone
adds a key sum and sum of squares to the summaries. Like ``attention``, it reads a dense attention's keys: a study
setting, not one to deploy; plain PyTorch on every device, and nothing read back to the host when
``max_candidates`` is given (a CUDA graph can capture it).

Per request ``b``, KV head ``h`` and candidate block ``j`` (logical blocks ``0 .. num_candidates[b] - 1``, each
full: ``block_size`` tokens), with ``mu`` and ``var`` the mean and (population) variance of the block's keys per
dimension::

    log sum_t exp(scale * q . k_t) ~ log(block_size) + scale * q . mu + scale^2 / 2 * sum_d q_d^2 var_d

Every candidate has ``block_size`` tokens, so the constant is dropped, and the rest is divided by ``scale``
(logit units, as :func:`~oasiskv_runtime.ops.score_topk.minmax_mass_scores`, whose variance is this one's for keys
spread uniformly over the block's min/max box)::

    est_i(j) = q_i . mu_j + scale / 2 * sum_d q_id^2 var_jd

GQA: MAX over the query heads ``i`` of the group (the study's aggregation, and Quest's).
"""

from __future__ import annotations

import torch

from oasiskv_runtime.ops.attention_mass import score_candidate_blocks

__all__ = ["gauss_mass_scores"]


def gauss_mass_scores(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                      num_candidates: torch.Tensor, num_kv_heads: int, scale: float,
                      max_candidates: int | None = None) -> torch.Tensor:
    """Gaussian log-mass per candidate block (logit units), ``[B, Hkv, J]`` fp32, ``-inf`` beyond
    ``num_candidates``.

    ``q``: ``[B, Hq, D]`` the step's query; ``k_cache``: ``[num_blocks, block_size, Hkv, D]`` one layer's keys;
    ``block_table``: ``[B, NB]`` the cache block holding each logical block; ``num_candidates``: ``[B]``;
    ``max_candidates``: ``J``, a host-side bound of ``num_candidates`` (read from the device when None).
    """
    def gauss(qh: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        var, mu = torch.var_mean(keys, dim=2, correction=0)                               # [B, J, D] each
        est = torch.bmm(qh, mu.transpose(1, 2)) + (0.5 * scale) * torch.bmm(qh.square(), var.transpose(1, 2))
        return est.amax(dim=1)                                                           # [B, g, J] -> [B, J]

    return score_candidate_blocks(q, k_cache, block_table, num_candidates, num_kv_heads, max_candidates, gauss)
