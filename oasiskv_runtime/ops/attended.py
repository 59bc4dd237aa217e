"""Attention feedback (``attended_blocks``) in one launch each: the record a decode step leaves, and the keep the next
prediction applies.

* :func:`attended_topk`: from the per-slot log-sum-exps the sparse attention writes (``slot_lse`` ``[B, Hkv, g, N]``)
  and the logical block behind each slot (``[B, Hkv, >= n]``), the ``m`` blocks that held the most of the step's
  attention per request and KV head, most first (``[B, Hkv, m]`` int64, ``-1`` past the blocks present): the mass is
  :func:`oasiskv_runtime.ops.attention_mass.slot_mass`'s (each query head's softmax over the first ``n`` slots,
  summed over the GQA group).
* :func:`keep_blocks_`: raise the scores of named logical blocks to ``+inf`` in place, so any top-K keeps them (a
  name that is ``-1``, past the columns or no candidate (``-inf``) is ignored).

Each has a plain-PyTorch reference beside it (``*_ref``); ``backend="auto"`` runs Triton on CUDA tensors. In PyTorch
the record is ~10 small kernels and the keep ~8; at 36 layers and two of each per step (the decode and the
prefetch's prediction) they were most of what the feedback cost a graph replay (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from oasiskv_runtime.ops.attention_mass import slot_mass
from oasiskv_runtime.ops.common import lazy_kernels, next_pow2, on_device, use_triton

__all__ = ["attended_topk", "attended_topk_ref", "heaviest_blocks", "keep_blocks_", "keep_blocks_ref_"]


def heaviest_blocks(mass: torch.Tensor, logical: torch.Tensor, m: int) -> torch.Tensor:
    """``[B, Hkv, m]`` int64: the ``m`` blocks of ``logical`` (``[B, Hkv, n]``) with the most ``mass`` (``[B, Hkv,
    n]``, ``-inf`` empty), most first, ``-1`` past the present ones: what a record of ``attended_blocks`` holds."""
    top, idx = mass.topk(min(m, mass.shape[-1]), dim=-1)
    ids = torch.where(torch.isfinite(top), logical.long().gather(-1, idx), -1)
    if ids.shape[-1] < m:
        ids = torch.nn.functional.pad(ids, (0, m - ids.shape[-1]), value=-1)
    return ids


def attended_topk_ref(slot_lse: torch.Tensor, logical: torch.Tensor, m: int, n: int | None = None) -> torch.Tensor:
    """The reference of :func:`attended_topk` (module docstring)."""
    n = slot_lse.shape[-1] if n is None else n
    return heaviest_blocks(slot_mass(slot_lse, n), logical[..., :n], m)


def keep_blocks_ref_(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The reference of :func:`keep_blocks_` (module docstring); returns ``scores``."""
    if not keep.shape[-1] or not scores.shape[-1]:
        return scores
    ok = (keep >= 0) & (keep < scores.shape[-1])
    idx = keep.long().clamp(0, scores.shape[-1] - 1)
    cand = scores.gather(-1, idx) > float("-inf")  # a column past the request's candidates stays out
    raise_to = torch.full(idx.shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    raise_to.masked_fill_(ok & cand, float("inf"))
    return scores.scatter_reduce_(-1, idx, raise_to, reduce="amax")


@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _attended_topk_kernel(LSE, LOG, OUT, n, N, s_lb, s_lh, s_ob, s_oh,
                              HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, N_PAD: tl.constexpr,
                              M: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        gi = tl.arange(0, G_PAD)
        j = tl.arange(0, N_PAD)
        j_ok = j < n
        ok = (gi < G)[:, None] & j_ok[None, :]
        row = (b * HKV + h).to(tl.int64) * G + gi
        lse = tl.load(LSE + row[:, None] * N + j[None, :], mask=ok, other=float("-inf"))
        mx = tl.max(lse, 1)
        mx = tl.where(mx > float("-inf"), mx, 0.0)
        e = tl.exp(lse - mx[:, None])                                        # an empty slot: 0
        tot = tl.sum(e, 1)
        mass = tl.sum(e / tl.where(tot > 0, tot, 1.0)[:, None], 0)           # [N_PAD]
        # a slot's block is listed for the whole group: the first head's exp-sum says whether it is present
        present = tl.max(tl.where((gi == 0)[:, None], lse, float("-inf")), 0) > float("-inf")
        mass = tl.where(present & j_ok, mass, float("-inf"))
        ids = tl.load(LOG + b.to(tl.int64) * s_lb + h * s_lh + j, mask=j_ok, other=-1).to(tl.int64)
        out = OUT + b.to(tl.int64) * s_ob + h * s_oh
        for i in tl.static_range(M):
            best = tl.max(mass, 0)
            at = tl.min(tl.where(mass == best, j, N_PAD), 0)                # the first of equal masses
            pick = tl.sum(tl.where(j == at, ids, 0), 0)
            tl.store(out + i, tl.where(best > float("-inf"), pick, -1))
            mass = tl.where(j == at, float("-inf"), mass)

    @triton.jit
    def _keep_blocks_kernel(S, KEEP, J, M, s_sb, s_sh, s_kb, s_kh, HKV: tl.constexpr, M_PAD: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        i = tl.arange(0, M_PAD)
        k = tl.load(KEEP + b.to(tl.int64) * s_kb + h * s_kh + i, mask=i < M, other=-1).to(tl.int64)
        ok = (i < M) & (k >= 0) & (k < J)
        ptr = S + b.to(tl.int64) * s_sb + h * s_sh + k
        cur = tl.load(ptr, mask=ok, other=float("-inf"))
        tl.store(ptr, tl.full([M_PAD], float("inf"), tl.float32).to(S.dtype.element_ty),
                 mask=ok & (cur > float("-inf")))

    return _attended_topk_kernel, _keep_blocks_kernel


def attended_topk(slot_lse: torch.Tensor, logical: torch.Tensor, m: int, n: int | None = None, *,
                  backend: str = "auto") -> torch.Tensor:
    """``[B, Hkv, m]`` int64: per request and KV head the ``m`` logical blocks of ``logical`` (``[B, Hkv, >= n]``)
    whose slots held the most of the step's attention (``slot_lse``: ``[B, Hkv, g, N]`` fp32 contiguous, the sparse
    attention's per-slot log-sum-exps; the first ``n`` slots, default N), most first, ``-1`` past the present ones."""
    B, hkv, g, N = slot_lse.shape
    n = N if n is None else n
    if not 0 <= n <= N or logical.shape[:2] != (B, hkv) or logical.shape[-1] < n:
        raise ValueError(f"slot_lse {tuple(slot_lse.shape)}, logical {tuple(logical.shape)}, n {n}: need n <= N "
                         f"and logical [B, Hkv, >= n]")
    if not use_triton(backend, slot_lse, _kernels) or B == 0 or m == 0 or n == 0:
        return attended_topk_ref(slot_lse, logical, m, n)
    if slot_lse.dtype != torch.float32 or not slot_lse.is_contiguous() or logical.stride(-1) != 1:
        raise ValueError("slot_lse must be contiguous float32 and logical unit-stride in its last dim")
    out = torch.empty((B, hkv, m), dtype=torch.int64, device=slot_lse.device)
    kern, _ = _kernels()
    with on_device(slot_lse):
        kern[(B * hkv,)](slot_lse, logical, out, n, N, logical.stride(0), logical.stride(1), out.stride(0),
                         out.stride(1), HKV=hkv, G=g, G_PAD=next_pow2(g), N_PAD=next_pow2(n), M=m, num_warps=1)
    return out


def keep_blocks_(scores: torch.Tensor, keep: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``scores`` ``[B, Hkv, J]`` with the logical blocks ``keep`` ``[B, Hkv, M]`` names raised to ``+inf`` in place
    (``-1`` and blocks past the columns ignored; a block that is no candidate keeps its ``-inf``, so it is never
    ranked); returns ``scores``."""
    if keep.shape[:2] != scores.shape[:2]:
        raise ValueError(f"keep {tuple(keep.shape)} does not match scores {tuple(scores.shape)} in [B, Hkv]")
    B, hkv, J = scores.shape
    M = keep.shape[-1]
    if not use_triton(backend, scores, _kernels) or not (B and M and J):
        return keep_blocks_ref_(scores, keep)
    if scores.stride(-1) != 1 or keep.stride(-1) != 1:
        raise ValueError("scores and keep must be unit-stride in their last dim")
    _, kern = _kernels()
    with on_device(scores):
        kern[(B * hkv,)](scores, keep, J, M, scores.stride(0), scores.stride(1), keep.stride(0), keep.stride(1),
                         HKV=hkv, M_PAD=next_pow2(M), num_warps=1)
    return scores
