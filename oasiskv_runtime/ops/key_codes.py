"""Keys coded in a few bits within their block's min/max: the storage format and the score over it (issue #34).

``selection_score = "max_logit_b2"`` ranks blocks like the exact attention mass at 1/8 of the context
(docs/accuracy.md, "Keys coded in a few bits"; measured first as a study op that codes the full keys at every step,
:func:`~oasiskv_runtime.ops.split_quest.coded_max_logit_scores`, which needs every key on the device). This module is
the format the engine keeps on the device instead (``core/summaries.KeyCodes``), and the score that reads only those
codes and the min/max summaries:

* :func:`pack_codes`: a block's keys ``[n, block_size, Hkv, D]`` and its min/max ``[n, Hkv, D]`` -> ``uint8`` codes
  ``[n, block_size, Hkv, D * bits / 8]``, the KV cache's layout with a narrow last dimension (``bits / 16`` of a bf16
  key cache: 2 bits, 1/8). Each key dimension keeps the nearest of ``2**bits`` levels from min to max; ``8 / bits``
  codes a byte, the lowest bits first.
* :func:`coded_scores`: per candidate block, the largest ``q_i . k^_t`` over the GQA group's query heads ``i`` and the
  block's coded keys ``k^_t = lo + code_t * (hi - lo) / (2**bits - 1)``, with ``lo`` / ``hi`` read from the summary
  rows (addressed as Quest's scores address them) and the codes from a block table (addressed as the KV cache).

Codes are final only once a block is full (its min/max no longer move), which is when every candidate block is
(a selection ranks the full blocks before the active one). Plain PyTorch on every device, nothing read back to the
host when ``max_candidates`` is given (a CUDA graph captures it).
"""

from __future__ import annotations

from typing import Optional

import torch

from oasiskv_runtime.ops.attention_mass import candidate_blocks
from oasiskv_runtime.ops.score_topk import _gather_summaries

__all__ = ["CODE_BITS", "check_code_bits", "code_levels", "coded_scores", "level_step", "pack_codes", "unpack_codes"]

CODE_BITS = (1, 2, 4, 8)
"""Bits per key dimension the format packs (a divisor of 8)."""


def check_code_bits(bits: int, head_dim: int) -> None:
    """Raise unless ``head_dim`` keys of ``bits`` bits a dimension pack into whole bytes."""
    if bits not in CODE_BITS:
        raise ValueError(f"bits={bits} must be one of {', '.join(map(str, CODE_BITS))} (whole codes a byte)")
    if head_dim * bits % 8:
        raise ValueError(f"head_dim={head_dim} x bits={bits} is not a whole number of bytes")


def level_step(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """The spacing of the ``2**bits`` levels from ``lo`` to ``hi``: a coded key is ``lo + level * step``."""
    return (hi - lo) / float(2 ** bits - 1)


def code_levels(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels, step)``: each key dimension's nearest level ``0 .. 2**bits - 1`` between ``lo`` and ``hi`` (fp32,
    broadcast against ``keys``) and :func:`level_step`, so ``lo + levels * step`` is the coded key."""
    step = level_step(lo, hi, bits)
    pos = torch.where(step > 0, (keys - lo) / step.clamp_min(torch.finfo(step.dtype).tiny), 0.0)
    return pos.round_().clamp_(0, 2 ** bits - 1), step


def pack_codes(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """``keys`` ``[n, block_size, Hkv, D]`` of ``n`` full blocks, ``lo`` / ``hi`` ``[n, Hkv, D]`` their min/max ->
    ``uint8`` ``[n, block_size, Hkv, D * bits / 8]``."""
    D = keys.shape[-1]
    check_code_bits(bits, D)
    levels, _ = code_levels(keys.float(), lo.float().unsqueeze(1), hi.float().unsqueeze(1), bits)
    codes = levels.to(torch.uint8)                                                          # [n, bs, Hkv, D]
    per = 8 // bits
    codes = codes.view(*codes.shape[:-1], D // per, per).to(torch.int32)
    shifts = torch.arange(per, device=keys.device, dtype=torch.int32) * bits
    return (codes << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes`'s bytes ``[..., D * bits / 8]`` -> the levels ``[..., D]`` (``uint8``)."""
    check_code_bits(bits, packed.shape[-1] * 8 // bits)
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2 ** bits - 1)
    return codes.view(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def coded_scores(q: torch.Tensor, codes: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor,
                 block_table: torch.Tensor, summary_block_table: torch.Tensor, num_candidates: torch.Tensor,
                 num_kv_heads: int, bits: int, max_candidates: Optional[int] = None) -> torch.Tensor:
    """Each candidate block's largest logit over its coded keys, ``[B, Hkv, J]`` fp32, ``-inf`` beyond
    ``num_candidates``.

    ``q``: ``[B, Hq, D]``; ``codes``: ``[num_blocks, block_size, Hkv, D * bits / 8]`` one layer's codes, block
    ``block_table[b, j]`` holding logical block ``j``'s; ``sum_min`` / ``sum_max`` / ``summary_block_table``: the
    min/max summaries as :func:`~oasiskv_runtime.ops.score_topk.quest_scores` reads them; ``max_candidates``: ``J``,
    a host-side bound of ``num_candidates`` (read from the device when None)."""
    B, Hq, D = q.shape
    hkv = int(num_kv_heads)
    got = _gather_summaries(q, sum_min, sum_max, summary_block_table, num_candidates, hkv, max_candidates)
    if got is None:
        return torch.empty((B, hkv, 0), dtype=torch.float32, device=q.device)
    qf, lo, hi, ok = got                                                   # [B, Hkv, g, D], [B, J, Hkv, D] x 2
    bs = codes.shape[1]
    _, J, _, blocks = candidate_blocks(q, block_table, num_candidates, hkv, ok.shape[1])    # padding reads block 0
    step = level_step(lo, hi, bits)
    out = torch.empty((B, hkv, J), dtype=torch.float32, device=q.device)
    for h in range(hkv):  # one KV head at a time keeps the decoded keys [B, J, bs, D] small
        level = unpack_codes(codes[:, :, h][blocks], bits).float()                         # [B, J, bs, D]
        keys = lo[:, :, h].unsqueeze(2) + level * step[:, :, h].unsqueeze(2)
        logits = torch.bmm(qf[:, h], keys.view(B, J * bs, D).transpose(1, 2))                # [B, g, J * bs]
        out[:, h] = logits.view(B, -1, J, bs).amax(dim=3).amax(dim=1)
    return out.masked_fill_(~ok.view(B, 1, J), float("-inf"))
