"""Exact block scores: the softmax attention mass each candidate block gets from a step's query (issue #34).

Quest (:mod:`score_topk`) ranks a block by an upper bound of ``q . k`` from its key summaries, without reading a
key. This op reads every key of every candidate block, so its top-K is the best any block selection of that size
can do for the step (the ceiling a study compares the predictions against), at the cost of a dense attention's
reads. It backs ``SparseConfig.selection_score = "attention"`` (sparse-resident, where the whole KV is on the
device), a study setting rather than one to deploy, so it has no kernel: the same plain PyTorch on every device.
It reads nothing back to the host (shapes come from host ints), so a CUDA graph can capture it.

Per request ``b``, KV head ``h`` and candidate block ``j`` (logical blocks ``0 .. num_candidates[b] - 1``: the
full blocks before the active one, the blocks a selection ranks)::

    mass_h(j) = sum over the query heads i of h's GQA group, over the tokens t of block j, of
                softmax_t'(scale * q_i . k_t')[t]      (t' over every token of every candidate block)

The softmax is attention's own (the same ``scale``), restricted to the candidates: the active block is attended in
every selection, so it is left out of what a selection competes for. Summing over the group, like Quest's group max,
scores a block for every head that shares it (it is selected once for the group); a sum weighs heads by how much of
their attention the block holds, so ranking by it maximises the group's total attention mass kept.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["block_attention_mass", "candidate_blocks", "prompt_block_mass", "score_candidate_blocks", "slot_mass",
           "working_set_mass"]


def candidate_blocks(q: torch.Tensor, block_table: torch.Tensor, num_candidates: torch.Tensor, num_kv_heads: int,
                     max_candidates: int | None) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """What a scorer reading every candidate block's keys needs: ``(g, J, ok, blocks)``, the GQA group size, the
    candidate width (``max_candidates``, or read from the device when None), ``ok`` ``[B, J]`` (column ``j`` is a
    candidate of request ``b``) and ``blocks`` ``[B, J]`` int64, the cache block of each (block 0 for padding)."""
    B, Hq, _ = q.shape
    hkv = int(num_kv_heads)
    if Hq % hkv:
        raise ValueError(f"Hq={Hq} not a multiple of Hkv={hkv}")
    J = int(max_candidates) if max_candidates is not None else int(num_candidates.max()) if B else 0
    dev = q.device
    j = torch.arange(J, device=dev)
    ok = j.view(1, J) < num_candidates.to(dev, torch.int64).view(B, 1)                      # [B, J]
    blocks = block_table.to(dev, torch.int64)[:, j.clamp_max(block_table.shape[1] - 1)]
    blocks = torch.where(ok, blocks, torch.zeros_like(blocks)).clamp_min(0)              # padding reads block 0
    return Hq // hkv, J, ok, blocks


def score_candidate_blocks(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           num_candidates: torch.Tensor, num_kv_heads: int, max_candidates: int | None,
                           score: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-block scores from every key of every candidate block, ``[B, Hkv, J]`` fp32, ``-inf`` beyond
    ``num_candidates``: the frame the scorers that read keys share (this module's mass, ``gauss``, split Quest).

    ``score(qh, keys, ok)`` gives one KV head's ``[B, J]`` scores from its group's queries ``qh`` ``[B, g, D]`` and
    its candidates' keys ``keys`` ``[B, J, block_size, D]`` (both fp32; padding columns hold block 0's keys), with
    ``ok`` ``[B, J]`` the candidate mask. One KV head at a time keeps the gathered keys small."""
    B, _, D = q.shape
    hkv, dev = int(num_kv_heads), q.device
    g, J, ok, blocks = candidate_blocks(q, block_table, num_candidates, hkv, max_candidates)
    out = torch.empty((B, hkv, J), dtype=torch.float32, device=dev)
    if J == 0 or B == 0:
        return out
    qf = q.float().view(B, hkv, g, D)
    for h in range(hkv):
        out[:, h] = score(qf[:, h], k_cache[:, :, h][blocks].float(), ok)
    return out.masked_fill_(~ok.view(B, 1, J), float("-inf"))


def block_attention_mass(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         num_candidates: torch.Tensor, num_kv_heads: int, scale: float,
                         max_candidates: int | None = None) -> torch.Tensor:
    """Attention mass per candidate block, ``[B, Hkv, J]`` fp32 in ``[0, g]``, ``-inf`` beyond ``num_candidates``.

    ``q``: ``[B, Hq, D]`` the step's query; ``k_cache``: ``[num_blocks, block_size, Hkv, D]`` one layer's keys;
    ``block_table``: ``[B, NB]`` the cache block holding each logical block; ``num_candidates``: ``[B]``;
    ``max_candidates``: ``J``, a host-side bound of ``num_candidates`` (read from the device when None).
    """
    def mass(qh: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        B, J, bs, D = keys.shape
        logits = torch.bmm(qh, keys.view(B, J * bs, D).transpose(1, 2)).mul_(scale)       # [B, g, J * bs]
        token_ok = ok.view(B, 1, J, 1).expand(B, 1, J, bs).reshape(B, 1, J * bs)
        # A request without candidates has an all -inf row (NaN after the softmax): masked by the caller.
        probs = torch.softmax(logits.masked_fill_(~token_ok, float("-inf")), dim=-1)
        return probs.view(B, -1, J, bs).sum(dim=(1, 3))

    return score_candidate_blocks(q, k_cache, block_table, num_candidates, num_kv_heads, max_candidates, mass)


def working_set_mass(q: torch.Tensor, k_cache: torch.Tensor, block_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention mass per working-set slot, ``[B, Hkv, K]`` fp32 in ``[0, g]``, ``-inf`` for an empty slot.

    ``q``: ``[B, Hq, D]`` the step's query; ``k_cache``: ``[num_blocks, block_size, Hkv, D]`` one layer's keys;
    ``block_ids``: ``[B, Hkv, K]`` the cache block in each KV head's slot (``-1``: empty). The same definition as
    :func:`block_attention_mass`, with the softmax over what the step attended of the context (each KV head's own
    slots) instead of every candidate: what the step's attention gave each block it read (``attended_blocks``).
    """
    B, Hq, D = q.shape
    hkv, K = block_ids.shape[1], block_ids.shape[2]
    bs, dev = k_cache.shape[1], q.device
    if B == 0 or K == 0:
        return torch.empty((B, hkv, K), dtype=torch.float32, device=dev)
    g = Hq // hkv
    ids = block_ids.to(dev, torch.int64)
    present = ids >= 0
    heads = torch.arange(hkv, device=dev).view(1, hkv, 1)
    keys = k_cache[ids.clamp_min(0), :, heads].float().reshape(B, hkv, K * bs, D)      # [B, Hkv, K * bs, D]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.float().view(B, hkv, g, D), keys).mul_(scale)
    tok_ok = present.view(B, hkv, 1, K, 1).expand(B, hkv, 1, K, bs).reshape(B, hkv, 1, K * bs)
    probs = torch.softmax(logits.masked_fill_(~tok_ok, float("-inf")), dim=-1)  # a head with no slot: NaN, masked
    return probs.view(B, hkv, g, K, bs).sum(dim=(2, 4)).masked_fill_(~present, float("-inf"))


def slot_mass(slot_lse: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """:func:`working_set_mass` from the per-slot log-sum-exps the sparse attention writes (its ``slot_lse``,
    ``[B, Hkv, g, N]``): ``[B, Hkv, n]`` fp32 in ``[0, g]``, ``-inf`` for an empty slot; ``n`` (default N) keeps the
    first n slots (a step that appended other blocks to the table, e.g. an accepted draft's gap block, leaves them
    out of the softmax as the definition does). The sum over a slot's tokens is the attention's own, so the decode
    step gets its feedback without a second read of the working set's keys."""
    lse = slot_lse if n is None else slot_lse[..., :n]
    present = lse[:, :, 0] > float("-inf")  # a slot's block is listed for the whole GQA group
    mass = torch.exp(lse - torch.logsumexp(lse, dim=-1, keepdim=True)).sum(dim=2)  # a head with no slot: NaN
    return mass.masked_fill_(~present, float("-inf"))


def prompt_block_mass(q: torch.Tensor, keys: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Attention mass of a prompt's last rows on each of its full blocks, ``[Hkv, n // block_size]`` fp32 in
    ``[0, W * g]`` (``fill_window``: what fills a working set when a prefill completes).

    ``q``: ``[W, Hq, D]`` the queries of the prompt's last ``W`` tokens (positions ``n - W .. n - 1``); ``keys``:
    ``[n, Hkv, D]`` the prompt's keys, all of them (the prefill has them on the device). Each row's softmax is its
    causal attention's over every key (the partial last block included), and a full block's mass is summed over its
    tokens, the rows and each KV head's GQA group: the rows' summed attention, SnapKV's observation window scored per
    block. Plain PyTorch, one KV head at a time (``[W, g, n]`` logits at once)."""
    W, Hq = q.shape[:2]
    n, hkv = keys.shape[0], keys.shape[1]
    if W > n or Hq % hkv:
        raise ValueError(f"{W} rows of {Hq} heads over {n} keys of {hkv} KV heads: need W <= n and Hq % Hkv == 0")
    g, j = Hq // hkv, n // block_size
    pos = torch.arange(n - W, n, device=q.device).view(W, 1, 1)
    masked = torch.arange(n, device=q.device).view(1, 1, n) > pos                          # [W, 1, n]: the future
    out = torch.empty((hkv, j), dtype=torch.float32, device=q.device)
    for h in range(hkv):
        logits = torch.einsum("wgd,td->wgt", q[:, h * g:(h + 1) * g].float(), keys[:, h].float()).mul_(scale)
        probs = torch.softmax(logits.masked_fill_(masked, float("-inf")), dim=-1)
        out[h] = probs[..., :j * block_size].reshape(W * g, j, block_size).sum(dim=(0, 2))
    return out
