"""Quest block scoring from compressed key summaries + per-KV-head top-K.

SPEC mechanism item 2. Each logical block j of request b and KV head h has two
summary rows: the element-wise min and max of its keys. They live in paged tensors
``sum_min`` / ``sum_max`` of shape ``[num_blocks, block_size, Hkv, D]``: logical
block j is at physical block ``summary_block_table[b, j // block_size]``, row
``j % block_size``.

Score (Quest's upper bound of q . k over the block), per query head::

    score_h(j) = sum_d max(q_d * kmin_d, q_d * kmax_d)

GQA aggregation: MAX over the g query heads of the KV head's group. A block is kept
when ANY head of the group rates it highly: the block is fetched once for the whole
group, and each head needs its own best blocks present, so the group's score must be
an upper bound for every member. A mean (or sum) would let several lukewarm heads
outvote the one head whose attention is concentrated on that block, and that head's
output would then miss its dominant keys.

Candidates are logical blocks ``0 .. num_candidates[b] - 1``. Result: ``topk_ids``
``[B, Hkv, k]`` int32, ranked best first; ties go to the LOWER block index;
padded with -1 when fewer than k candidates; ``num_valid`` ``[B]`` int32 =
``min(k, num_candidates[b])``.

Deterministic tie-break, shared by the reference and the kernel path
(:func:`select_topk`): each fp32 score is mapped to an order-preserving int32 and
packed with ``(2**32 - 1 - j)`` into one int64 key, so a single ``torch.topk`` over
the keys is an exact, total order (score descending, then index ascending); no
reliance on topk's unspecified order among equal values.

The kernel path = a Triton scoring kernel (grid ``(B * Hkv, cdiv(J, BLOCK_J))``, each
program reads its summary rows once and keeps the group max in registers) followed by
a Triton ranking kernel (:func:`select_topk_triton`: one program per row, the same
int64 keys through ``tl.topk``'s bitonic network; bit-identical ids to
:func:`select_topk`, which remains the path for rows longer than 16384 blocks).
Triton is imported lazily; CPU tensors use the reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from oasiskv_runtime.ops.common import lazy_kernels, next_pow2, on_device, use_triton

__all__ = ["score_topk", "score_topk_ref", "quest_scores_ref", "quest_scores", "minmax_mass_scores", "select_topk",
           "select_topk_triton"]

triton = None
tl = None


_next_pow2 = next_pow2


def _num_cols(num_candidates: torch.Tensor, max_candidates: Optional[int]) -> int:
    if max_candidates is not None:
        return int(max_candidates)
    return int(num_candidates.max().item()) if num_candidates.numel() else 0


def select_topk(scores: torch.Tensor, num_candidates: torch.Tensor, k: int
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k per row of ``scores [B, Hkv, J]`` (fp32), best first, ties -> lower index.

    Columns ``j >= num_candidates[b]`` must already hold ``-inf``. Returns
    ``(ids [B, Hkv, k] int32 padded with -1, num_valid [B] int32)``.
    """
    B, H, J = scores.shape
    dev = scores.device
    nc = num_candidates.to(dev, torch.int64)
    num_valid = nc.clamp(min=0, max=min(k, J)).to(torch.int32)
    out = torch.full((B, H, k), -1, dtype=torch.int32, device=dev)
    kk = min(k, J)
    if kk == 0:
        return out, num_valid
    s = scores.float()
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 == +0.0: same key
    s = torch.nan_to_num(s, nan=float("-inf"))
    bits = s.contiguous().view(torch.int32)
    okey = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone float -> signed int
    j = torch.arange(J, device=dev, dtype=torch.int64)
    key = (okey.to(torch.int64) << 32) | (0xFFFFFFFF - j)
    idx = key.topk(kk, dim=-1, largest=True, sorted=True).indices.to(torch.int32)
    pos = torch.arange(kk, device=dev)
    idx = torch.where(pos.view(1, 1, kk) < num_valid.view(B, 1, 1), idx, torch.full_like(idx, -1))
    out[:, :, :kk] = idx
    return out, num_valid


def _gather_summaries(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads,
                      max_candidates: Optional[int]):
    """The candidates' summary rows: ``(q [B, Hkv, g, D], mins [B, J, Hkv, D], maxs, ok [B, J])`` fp32, or None
    when there are no columns; columns beyond ``num_candidates`` read page 0 (masked by ``ok``)."""
    B, Hq, D = q.shape
    Hkv = int(num_kv_heads)
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} not a multiple of Hkv={Hkv}")
    BS = sum_min.shape[1]
    J = _num_cols(num_candidates, max_candidates)
    if J == 0:
        return None
    dev = q.device
    j = torch.arange(J, device=dev)
    nc = num_candidates.to(dev, torch.int64)
    ok = j.view(1, J) < nc.view(B, 1)  # [B, J]
    pages = summary_block_table.to(dev, torch.int64)[:, (j // BS).clamp_max(
        summary_block_table.shape[1] - 1)]
    pages = torch.where(ok, pages, torch.zeros_like(pages)).clamp_min(0)
    rows = (j % BS).view(1, J).expand(B, J)
    return q.float().view(B, Hkv, Hq // Hkv, D), sum_min[pages, rows].float(), sum_max[pages, rows].float(), ok


def _head_quest_bounds(qf: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, h: int) -> torch.Tensor:
    """Quest's bound ``sum_d max(q_d * min_d, q_d * max_d)`` of KV head ``h``'s query heads over the candidates:
    ``[B, g, J]`` from :func:`_gather_summaries`'s rows (one KV head at a time keeps the ``[B, g, J, D]`` temporary
    small)."""
    qh = qf[:, h].unsqueeze(2)  # [B, g, 1, D]
    return torch.maximum(qh * mn[:, :, h].unsqueeze(1), qh * mx[:, :, h].unsqueeze(1)).sum(-1)


def quest_scores_ref(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads,
                     max_candidates: Optional[int] = None) -> torch.Tensor:
    """fp32 group-max Quest scores ``[B, Hkv, J]``; ``-inf`` beyond num_candidates."""
    B, Hkv = q.shape[0], int(num_kv_heads)
    got = _gather_summaries(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads, max_candidates)
    if got is None:
        return torch.empty((B, Hkv, 0), dtype=torch.float32, device=q.device)
    qf, mn, mx, ok = got
    out = torch.empty((B, Hkv, ok.shape[1]), dtype=torch.float32, device=q.device)
    for h in range(Hkv):
        out[:, h] = _head_quest_bounds(qf, mn, mx, h).amax(dim=1)
    return out.masked_fill(~ok.unsqueeze(1), float("-inf"))


def quest_rank_scores(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads,
                      max_candidates: Optional[int] = None) -> torch.Tensor:
    """fp32 ``[B, Hkv, J]`` scores that share a KV head's selection among its query heads by RANK, not by the
    bound's value: each query head ranks the candidates by its own Quest bound, a block's score is minus its best
    rank over the group (ties: the higher group-max bound first, by a term under one rank), so top-K takes every
    head's best block before any head's second. Quest's group MAX compares bounds across heads, so a head with a
    large ``|q|`` or wide keys can fill the K with its blocks while another head's best block stays out.
    ``-inf`` beyond num_candidates. Plain PyTorch on every device, no host read (a CUDA graph can capture it)."""
    B, Hkv = q.shape[0], int(num_kv_heads)
    got = _gather_summaries(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads, max_candidates)
    if got is None:
        return torch.empty((B, Hkv, 0), dtype=torch.float32, device=q.device)
    qf, mn, mx, ok = got
    J = ok.shape[1]
    out = torch.empty((B, Hkv, J), dtype=torch.float32, device=q.device)
    cols = torch.arange(J, device=q.device, dtype=torch.float32)
    for h in range(Hkv):
        bound = _head_quest_bounds(qf, mn, mx, h).masked_fill(~ok.unsqueeze(1), float("-inf"))  # [B, g, J]
        order = bound.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(bound).scatter_(-1, order, cols.expand_as(bound))   # 0 = the head's best
        best = bound.amax(dim=1)                                                     # [B, J] Quest's group max
        lo = best.masked_fill(~ok, float("inf")).amin(-1, keepdim=True)
        hi = best.masked_fill(~ok, float("-inf")).amax(-1, keepdim=True)
        tie = (best - lo) / (hi - lo).clamp_min(1e-30) * 0.5                         # [0, 0.5]: under one rank
        out[:, h] = -rank.amin(dim=1) + tie.nan_to_num(0.0)
    return out.masked_fill(~ok.unsqueeze(1), float("-inf"))


def minmax_mass_scores(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads, scale: float,
                       max_candidates: Optional[int] = None) -> torch.Tensor:
    """fp32 ``[B, Hkv, J]`` scores estimating each block's log attention mass from its key min/max (the same
    summaries Quest reads), ``-inf`` beyond num_candidates. Per query head, a block's keys are taken as spread
    uniformly over ``[min, max]`` in each dimension, and the log of ``E[exp(scale * q . k)]`` under a Gaussian of
    that mean and variance is::

        est(j) = q . mid + scale / 2 * sum_d q_d^2 * (max_d - min_d)^2 / 12,   mid = (min + max) / 2

    (in logit units). Quest's bound ``q . mid + sum_d |q_d| (max_d - min_d) / 2`` adds every dimension's whole
    spread, so a block with one wide dimension outranks one whose keys point at the query; here the spread counts
    only as far as it raises the expected softmax weight. GQA: MAX over the group, as Quest's. Plain PyTorch on
    every device (no kernel: CUDA runs this too) and no host read, so a CUDA graph can capture it.
    """
    B, Hkv = q.shape[0], int(num_kv_heads)
    got = _gather_summaries(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads, max_candidates)
    if got is None:
        return torch.empty((B, Hkv, 0), dtype=torch.float32, device=q.device)
    qf, mn, mx, ok = got
    mid, var = (mn + mx) * 0.5, (mx - mn).square_().div_(12.0)                    # [B, J, Hkv, D]
    out = torch.empty((B, Hkv, ok.shape[1]), dtype=torch.float32, device=q.device)
    for h in range(Hkv):
        qh = qf[:, h]                                                                # [B, g, D]
        est = torch.bmm(qh, mid[:, :, h].transpose(1, 2)) + (0.5 * scale) * torch.bmm(
            qh.square(), var[:, :, h].transpose(1, 2))                               # [B, g, J]
        out[:, h] = est.amax(dim=1)
    return out.masked_fill(~ok.unsqueeze(1), float("-inf"))


def score_topk_ref(q, sum_min, sum_max, summary_block_table, num_candidates, k, num_kv_heads,
                   max_candidates: Optional[int] = None):
    """Plain-PyTorch reference of :func:`score_topk`."""
    s = quest_scores_ref(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads,
                         max_candidates)
    return select_topk(s, num_candidates, k)


@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _quest_score_kernel(
        Q, SMIN, SMAX, TABLE, NCAND, OUT, n_cols, n_pages,
        s_qb, s_qh, s_mb, s_mt, s_mh, s_xb, s_xt, s_xh, s_tb, s_ob, s_oh,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BS: tl.constexpr, BLOCK_J: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        nc = tl.load(NCAND + b)
        ok = (j < nc) & (j < n_cols)
        pg = j // BS
        page = tl.load(TABLE + b.to(tl.int64) * s_tb + pg, mask=ok & (pg < n_pages), other=0)
        ok = ok & (page >= 0)
        row = j % BS
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        page64 = page.to(tl.int64)
        m2 = ok[:, None] & d_ok[None, :]
        mn = tl.load(SMIN + (page64 * s_mb + row * s_mt + h * s_mh)[:, None] + d[None, :],
                     mask=m2, other=0.0).to(tl.float32)
        mx = tl.load(SMAX + (page64 * s_xb + row * s_xt + h * s_xh)[:, None] + d[None, :],
                     mask=m2, other=0.0).to(tl.float32)
        best = tl.full([BLOCK_J], float("-inf"), dtype=tl.float32)
        for gi in tl.static_range(G):
            qg = tl.load(Q + b.to(tl.int64) * s_qb + (h * G + gi) * s_qh + d, mask=d_ok,
                         other=0.0).to(tl.float32)
            sc = tl.sum(tl.maximum(qg[None, :] * mn, qg[None, :] * mx), 1)
            best = tl.maximum(best, sc)
        best = tl.where(ok, best, float("-inf"))
        tl.store(OUT + b.to(tl.int64) * s_ob + h * s_oh + j, best, mask=j < n_cols)

    @triton.jit
    def _rank_topk_kernel(S, NCAND, OUT, n_cols, k, s_sb, s_sh, s_ob, s_oh,
                          HKV: tl.constexpr, J_PAD: tl.constexpr, K_PAD: tl.constexpr):
        # One program per (request, kv head): the whole score row in registers, packed
        # into int64 keys (order-preserving score bits << 32 | 2**31 - 1 - j), then a
        # bitonic top-K_PAD (tl.topk) -> exact order: score desc, then index asc.
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        j = tl.arange(0, J_PAD)
        s = tl.load(S + b.to(tl.int64) * s_sb + h * s_sh + j, mask=j < n_cols,
                    other=float("-inf"))
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0
        s = tl.where(s != s, float("-inf"), s)  # NaN ranks last
        bits = s.to(tl.int32, bitcast=True)
        okey = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (okey.to(tl.int64) << 32) | (2147483647 - j).to(tl.int64)
        top = tl.topk(key, K_PAD)
        p = tl.arange(0, K_PAD)
        jj = 2147483647 - (top & 2147483647).to(tl.int32)
        nv = tl.minimum(tl.minimum(tl.load(NCAND + b), k), n_cols)
        ids = tl.where(p < nv, jj, -1)
        tl.store(OUT + b.to(tl.int64) * s_ob + h * s_oh + p, ids, mask=p < k)

    from types import SimpleNamespace
    return SimpleNamespace(score=_quest_score_kernel, rank=_rank_topk_kernel)


def _use_triton(backend: str, t: torch.Tensor) -> bool:
    return use_triton(backend, t, _kernels)


def quest_scores(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads,
                 max_candidates: Optional[int] = None, block_j: Optional[int] = None, *, backend: str = "auto"
                 ) -> torch.Tensor:
    """Group-max Quest scores ``[B, Hkv, J]`` fp32 (``-inf`` beyond candidates): the Triton kernel, or with
    ``backend="ref"`` (and ``"auto"`` off CUDA) :func:`quest_scores_ref`."""
    if not _use_triton(backend, q):
        return quest_scores_ref(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads,
                                max_candidates)
    B, Hq, D = q.shape
    Hkv = int(num_kv_heads)
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} not a multiple of Hkv={Hkv}")
    g = Hq // Hkv
    BS = sum_min.shape[1]
    if sum_min.stride(-1) != 1 or sum_max.stride(-1) != 1:
        raise ValueError("summaries need a unit stride on head_dim")
    J = _num_cols(num_candidates, max_candidates)
    out = torch.empty((B, Hkv, J), dtype=torch.float32, device=q.device)
    if J == 0 or B == 0:
        return out
    K = _kernels()
    if q.stride(-1) != 1:
        q = q.contiguous()
    table = summary_block_table.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    nc = num_candidates.to(device=q.device, dtype=torch.int32).contiguous()
    D_PAD = max(16, _next_pow2(D))
    if block_j is None:
        block_j = 32 if D_PAD >= 128 else 64
    grid = (B * Hkv, triton.cdiv(J, block_j))
    with on_device(q):
        K.score[grid](
            q, sum_min, sum_max, table, nc, out, J, table.shape[1],
            q.stride(0), q.stride(1),
            sum_min.stride(0), sum_min.stride(1), sum_min.stride(2),
            sum_max.stride(0), sum_max.stride(1), sum_max.stride(2),
            table.stride(0), out.stride(0), out.stride(1),
            HKV=Hkv, G=g, D=D, D_PAD=D_PAD, BS=BS, BLOCK_J=block_j,
            num_warps=4,
        )
    return out


MAX_TRITON_TOPK_COLS = 16384  # 256K tokens of 16-token blocks; beyond: torch.topk path


def select_topk_triton(scores: torch.Tensor, num_candidates: torch.Tensor, k: int, with_valid: bool = True
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same result as :func:`select_topk` (bit-identical ids), one Triton launch.

    Each (request, kv head) row is ranked by one program holding the row in registers
    (``tl.topk`` bitonic network over int64 keys). Rows longer than
    ``MAX_TRITON_TOPK_COLS`` go to :func:`select_topk`. ``with_valid=False``: ``num_valid`` is None (one op less
    per call for a caller that reads only the ids; the ids are ``-1`` padded either way).
    """
    B, H, J = scores.shape
    if J == 0 or k <= 0 or _next_pow2(J) > MAX_TRITON_TOPK_COLS or scores.dtype != torch.float32:
        return select_topk(scores, num_candidates, k)
    Kn = _kernels()
    dev = scores.device
    nc = num_candidates.to(device=dev, dtype=torch.int32).contiguous()
    num_valid = nc.clamp(min=0, max=min(k, J)) if with_valid else None
    J_PAD = max(16, _next_pow2(J))
    K_PAD = min(max(16, _next_pow2(k)), J_PAD)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if K_PAD < k:  # positions >= K_PAD (k > padded row length) stay -1
        out = torch.full((B, H, k), -1, dtype=torch.int32, device=dev)
    else:
        out = torch.empty((B, H, k), dtype=torch.int32, device=dev)
    nw = 4 if J_PAD <= 2048 else (8 if J_PAD <= 8192 else 16)
    with on_device(scores):
        Kn.rank[(B * H,)](scores, nc, out, J, k, scores.stride(0), scores.stride(1),
                          out.stride(0), out.stride(1), HKV=H, J_PAD=J_PAD, K_PAD=K_PAD,
                          num_warps=nw)
    return out, num_valid


def rank_topk(scores: torch.Tensor, num_candidates: torch.Tensor, k: int, *, backend: str = "auto",
              with_valid: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The top-``k`` candidate columns of each row, best first, ``-1`` padded: :func:`select_topk_triton` (one
    launch) or, with ``backend="ref"`` (and ``"auto"`` off CUDA), :func:`select_topk` (the same int32 ids)."""
    if _use_triton(backend, scores):
        return select_topk_triton(scores, num_candidates, k, with_valid=with_valid)
    return select_topk(scores, num_candidates, k)


def score_topk(q: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor,
               summary_block_table: torch.Tensor, num_candidates: torch.Tensor, k: int,
               num_kv_heads: int, *, max_candidates: Optional[int] = None,
               backend: str = "auto", rank: str = "triton") -> Tuple[torch.Tensor, torch.Tensor]:
    """Quest scores from the summaries, group-max over GQA heads, ranked top-k per KV head.

    ``q``: ``[B, Hq, D]`` (the draft token's query at this layer). ``max_candidates``
    (optional) is an upper bound of ``num_candidates`` known on the host; pass it to
    avoid a device->host sync (otherwise ``num_candidates.max()`` is read).
    ``rank`` (kernel path only): ``"triton"`` ranks with :func:`select_topk_triton`,
    ``"torch"`` with :func:`select_topk` (identical ids; torch.topk over int64 keys took
    ~310 us for 512 rows of 1-2K blocks on the H200).
    """
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    if rank not in ("triton", "torch"):
        raise ValueError(f"unknown rank {rank!r}")
    if not _use_triton(backend, q):
        return score_topk_ref(q, sum_min, sum_max, summary_block_table, num_candidates, k,
                              num_kv_heads, max_candidates)
    s = quest_scores(q, sum_min, sum_max, summary_block_table, num_candidates, num_kv_heads,
                     max_candidates)
    if rank == "triton":
        return select_topk_triton(s, num_candidates, k)
    return select_topk(s, num_candidates, k)
