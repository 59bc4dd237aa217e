"""One layer's selection (Algorithm 2) and transfer plan in one launch: the prefetch pipeline's middle stage.

Per (request, KV head) row of a layer, given the predicted top-K blocks of the next step:

1. Algorithm 2 (:func:`oasiskv_runtime.ops.select_rows.select_batched`): hits refresh their slot's
   recency, missing blocks are admitted up to the cap ``C`` into empty slots first, then into the least
   recently selected ones; the per-head map (``slot_map``) and the recency stamps (``last_sel``) of the row
   are rewritten in place.
2. The fixed-size transfer plan: ``c = max(1, min(K, C))`` entries per row, the admitted copies first
   (``src`` = the block's id in the primary pool, ``dst`` = the device block of the slot, ``head``), unused
   entries ``src = dst = -1``, so the UVA gather needs no host round trip to compact them. With per-request caps
   (``row_cap``: ``early_fetch_ratio``) the plan is as wide as the largest cap and compacted on the device instead:
   each row reserves its copies' range with an atomic add on a count the gather reads, so the gather walks the
   copies only, not every row's padding.
3. Device counters: admitted copies per layer (or into the initial-fill counter), deferred blocks per
   layer, admitted copies per request.

:func:`select_plan_ref` is the plain-PyTorch composition (``select_batched``, then a ``topk`` over the
admission mask and index arithmetic): ~70 small kernels per layer. Under a CUDA-graph replay each is a
dependent node of a few microseconds, and a decode step runs them for every layer: on the H200 at Qwen3-8B
shapes they added ~6.7 ms of GPU time per step at batch 24 (torch.profiler, ``bench_decode.py
--kernel-profile``). :func:`select_plan` runs the same plan as one Triton program per row: the row's ``K``
slots and ``P`` predictions in registers, membership and ranks by ``[K, P]`` / ``[K, K]`` comparisons
(no sort), the ``j``-th missing block placed in the slot whose eviction rank is ``j``.

Both give the same ``slot_map`` / ``last_sel`` rows, the same counters and the same set of (src, dst, head)
copies per row; only the order of a row's copies inside its ``c`` entries may differ (the kernel lists them
by eviction rank).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from oasiskv_runtime.ops.common import lazy_kernels, loads, next_pow2, on_device
from oasiskv_runtime.ops.select_rows import select_rows

__all__ = ["select_plan", "select_plan_ref"]

triton = None
tl = None


def _check(slot_map: torch.Tensor, last_sel: torch.Tensor, rows: torch.Tensor, pred: torch.Tensor,
           cap: int, row_cap: torch.Tensor | None = None, count: torch.Tensor | None = None) -> tuple[int, int, int]:
    if slot_map.dim() != 3 or last_sel.shape != slot_map.shape:
        raise ValueError(f"slot_map / last_sel must both be [R, Hkv, K], got {tuple(slot_map.shape)} and "
                         f"{tuple(last_sel.shape)}")
    n, (_, h, k) = rows.numel(), slot_map.shape
    if pred.dim() != 3 or pred.shape[0] != n or pred.shape[1] != h or pred.shape[2] > k:
        raise ValueError(f"pred must be [n={n}, Hkv={h}, P<={k}], got {tuple(pred.shape)}")
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    if row_cap is not None and (row_cap.shape != (n,) or row_cap.device != slot_map.device):
        raise ValueError(f"row_cap must be [n={n}] on {slot_map.device}, got {tuple(row_cap.shape)} on "
                         f"{row_cap.device}")
    if (row_cap is None) != (count is None) or (count is not None and (
            count.shape != () or count.dtype != torch.int32 or count.device != slot_map.device)):
        raise ValueError("row_cap and count go together (count: a 0-d int32 tensor on the tables' device, the "
                         "compacted plan's number of copies)")
    return n, h, k


def select_plan_ref(slot_map: torch.Tensor, last_sel: torch.Tensor, rows: torch.Tensor, pred: torch.Tensor,
                    cap: int, step: int | torch.Tensor, primary_table: torch.Tensor, slot_blocks: torch.Tensor,
                    fetched: torch.Tensor, deferred: torch.Tensor | None = None,
                    req_fetched: torch.Tensor | None = None, row_cap: torch.Tensor | None = None,
                    count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reference of :func:`select_plan` (same arguments and results)."""
    n, h, k = _check(slot_map, last_sel, rows, pred, cap, row_cap, count)
    caps = cap if row_cap is None else row_cap.long().clamp(0, cap).repeat_interleave(h)
    plan = select_rows(slot_map, last_sel, rows, pred, caps, step)
    new_map = plan.new_slot_blocks.view(n, h, k)
    c = max(1, min(k, cap))
    val, idx = torch.topk(plan.admit_mask.view(n, h, k).to(torch.int32), c, dim=-1)  # [n, h, c]
    valid = val > 0
    logical = new_map.gather(2, idx).clamp_min(0)
    bidx = torch.arange(n, device=idx.device)[:, None, None].expand_as(idx)
    hidx = torch.arange(h, device=idx.device)[None, :, None].expand_as(idx)
    src = torch.where(valid, primary_table[bidx, logical], torch.full_like(logical, -1))
    dst = torch.where(valid, slot_blocks[bidx, idx], torch.full_like(logical, -1))
    per_row = valid.sum((1, 2))
    fetched += per_row.sum()
    if deferred is not None:
        deferred += plan.num_deferred.sum()
    if req_fetched is not None:
        req_fetched.index_add_(0, rows, per_row)
    src, dst, hidx = src.flatten(), dst.flatten(), hidx.flatten()
    if row_cap is None:
        return src, dst, hidx
    order = torch.argsort((~valid).flatten().to(torch.int8), stable=True)  # the copies first, in row order
    count.copy_(valid.sum())
    return src[order], dst[order], hidx[order]


@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _select_plan_kernel(MAP, LS, ROWS, PRED, STEP, PRIM, SLOTB, SRC, DST, HEAD, FETCHED, DEFERRED, REQ, ROWCAP,
                            COUNT, cap, c, s_mr, s_mh, s_lr, s_lh, s_pb, s_ph, s_tb, s_sb,
                            H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, KP: tl.constexpr,
                            PP: tl.constexpr, CP: tl.constexpr, COUNT_STEP: tl.constexpr,
                            HAS_ROW_CAP: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // H
        hd = pid % H
        row = tl.load(ROWS + b).to(tl.int64)
        s = tl.arange(0, KP)
        p = tl.arange(0, PP)
        s_ok = s < K
        map_ptr = MAP + row * s_mr + hd * s_mh + s
        ls_ptr = LS + row * s_lr + hd * s_lh + s
        blocks = tl.load(map_ptr, mask=s_ok, other=-1).to(tl.int32)
        ls = tl.load(ls_ptr, mask=s_ok, other=-1).to(tl.int32)
        pred = tl.load(PRED + b * s_pb + hd * s_ph + p, mask=p < P, other=-1).to(tl.int32)
        valid = pred >= 0

        # Membership: residents are distinct and >= 0 where occupied, valid predictions are >= 0.
        eq = (blocks[:, None] == pred[None, :]) & valid[None, :] & s_ok[:, None]      # [KP, PP]
        slot_hit = tl.max(eq.to(tl.int32), axis=1) > 0                                # [KP]
        pred_hit = tl.max(eq.to(tl.int32), axis=0) > 0                                # [PP]
        missing = valid & (pred_hit == 0)
        mi = missing.to(tl.int32)
        num_missing = tl.sum(mi, axis=0)
        if HAS_ROW_CAP:  # this request's own cap, at most the plan's width
            n_admit = tl.minimum(num_missing, tl.maximum(tl.minimum(tl.load(ROWCAP + b).to(tl.int32), cap), 0))
        else:
            n_admit = tl.minimum(num_missing, cap)
        mrank = tl.cumsum(mi, axis=0) - 1                                             # rank among missing

        # Eviction rank of each slot: empty (0) < evictable (last selected + 2) < hit, ties by slot index
        # (a stable sort's order, as in select_batched); padding slots rank last.
        big = 2147483647
        key = tl.where(blocks >= 0, ls + 2, 0)
        key = tl.where(slot_hit, big - 1, key)
        key = tl.where(s_ok, key, big)
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (s[None, :] < s[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)                                     # [KP]
        take = (rank < n_admit) & s_ok
        # The missing block whose rank among missing equals the slot's eviction rank.
        pick = missing[None, :] & (mrank[None, :] == rank[:, None])                   # [KP, PP]
        placed = tl.sum(tl.where(pick, pred[None, :], 0), axis=1)
        new_blocks = tl.where(take, placed, blocks)
        step = tl.load(STEP).to(tl.int32)
        new_ls = tl.where(slot_hit | take, step, ls)
        tl.store(map_ptr, new_blocks.to(MAP.dtype.element_ty), mask=s_ok)
        tl.store(ls_ptr, new_ls.to(LS.dtype.element_ty), mask=s_ok)

        src = tl.load(PRIM + b * s_tb + tl.maximum(placed, 0), mask=take, other=-1)
        dst = tl.load(SLOTB + b * s_sb + s, mask=take, other=-1)
        if HAS_ROW_CAP:
            # A compacted plan: the row's copies at a range it reserves after every earlier reservation, so the
            # gather walks COUNT entries, not every row's cap (the rest stay -1 from the caller's fill).
            out = tl.atomic_add(COUNT, n_admit).to(tl.int64)
            tl.store(SRC + out + rank, src.to(SRC.dtype.element_ty), mask=take)
            tl.store(DST + out + rank, dst.to(DST.dtype.element_ty), mask=take)
            tl.store(HEAD + out + rank, (rank * 0 + hd).to(HEAD.dtype.element_ty), mask=take)
        else:
            # The plan: entry j < n_admit is the copy into the slot of eviction rank j; the rest are unused.
            out = pid.to(tl.int64) * c
            tl.store(SRC + out + rank, src.to(SRC.dtype.element_ty), mask=take)
            tl.store(DST + out + rank, dst.to(DST.dtype.element_ty), mask=take)
            j = tl.arange(0, CP)
            jm = j < c
            unused = jm & (j >= n_admit)
            tl.store(SRC + out + j, tl.full([CP], -1, SRC.dtype.element_ty), mask=unused)
            tl.store(DST + out + j, tl.full([CP], -1, DST.dtype.element_ty), mask=unused)
            tl.store(HEAD + out + j, tl.full([CP], 0, HEAD.dtype.element_ty) + hd, mask=jm)

        tl.atomic_add(FETCHED, n_admit.to(tl.int64))
        if COUNT_STEP:
            tl.atomic_add(DEFERRED, (num_missing - n_admit).to(tl.int64))
            tl.atomic_add(REQ + row, n_admit.to(tl.int64))

    return SimpleNamespace(select_plan=_select_plan_kernel)


def _triton_available() -> bool:
    return loads(_kernels)


def select_plan(slot_map: torch.Tensor, last_sel: torch.Tensor, rows: torch.Tensor, pred: torch.Tensor,
                cap: int, step: int | torch.Tensor, primary_table: torch.Tensor, slot_blocks: torch.Tensor,
                fetched: torch.Tensor, deferred: torch.Tensor | None = None,
                req_fetched: torch.Tensor | None = None, row_cap: torch.Tensor | None = None,
                count: torch.Tensor | None = None, *, backend: str = "auto"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 2 for one layer's rows, in place, and that layer's transfer plan.

    Args:
        slot_map, last_sel: ``[R, Hkv, K]`` int (one layer of the per-head map and of the recency stamps;
            strided views are fine, the last dimension contiguous). Rows ``rows`` are rewritten in place.
        rows: ``[n]`` state row of each request of the batch (distinct).
        pred: ``[n, Hkv, P]`` int, ``P <= K``: predicted blocks in rank order, ``-1`` padded.
        cap: admission cap ``C`` per row (and the plan's width); step: the step stamped into ``last_sel`` (int or
            0-d tensor).
        primary_table: ``[n, >= max block + 1]`` primary-pool block of each logical block of each request.
        slot_blocks: ``[n, K]`` device block of each working-set slot.
        fetched: 0-d int64 counter, += copies admitted. deferred (0-d) and req_fetched (``[R]``) int64
            counters, += blocks deferred and copies per request; both or neither (the initial fill).
        row_cap: ``[n]`` int (optional): each request's own cap for all its KV heads, clipped to ``[0, cap]``
            (``early_fetch_ratio``: a larger cap for requests in their first decode steps). With it the plan is
            compacted: its copies are the first ``count`` entries (``count``, a 0-d int32 tensor, is written; the
            order of rows among them is not fixed), every later entry ``src = dst = -1``: the plan stays as wide as
            ``cap`` for every row, and :func:`~oasiskv_runtime.ops.uva_gather.uva_gather` given ``count`` walks
            only the copies.
    Returns:
        ``(src, dst, head)``, each ``[n * Hkv * c]`` with ``c = max(1, min(K, cap))``: row ``(b, h)``'s
        entries at ``[(b * Hkv + h) * c, ... + c)``, unused ones with ``src = dst = -1`` (with ``row_cap``: the
        copies first, as above).
    ``backend``: ``"auto"`` (the Triton kernel on CUDA when Triton loads, else the reference), ``"triton"``,
    ``"ref"``.
    """
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    if (deferred is None) != (req_fetched is None):
        raise ValueError("deferred and req_fetched go together (both for a decode step, neither for a fill)")
    use_triton = backend == "triton" or (backend == "auto" and slot_map.is_cuda and _triton_available())
    if not use_triton:
        return select_plan_ref(slot_map, last_sel, rows, pred, cap, step, primary_table, slot_blocks, fetched,
                               deferred, req_fetched, row_cap, count)
    n, h, k = _check(slot_map, last_sel, rows, pred, cap, row_cap, count)
    dev = slot_map.device
    c = max(1, min(k, cap))
    if row_cap is None:
        src = torch.empty(n * h * c, dtype=torch.long, device=dev)
        dst = torch.empty_like(src)
        head = torch.empty_like(src)
    else:  # compacted: entries past the copies stay as filled here
        src = torch.full((n * h * c,), -1, dtype=torch.long, device=dev)
        dst = torch.full_like(src, -1)
        head = torch.zeros_like(src)
        count.zero_()
    if n == 0:
        return src, dst, head
    for t in (slot_map, last_sel, pred, primary_table, slot_blocks):
        if t.stride(-1) != 1:
            raise ValueError("select_plan needs a unit stride on the last dimension of its tables")
    if not isinstance(step, torch.Tensor):
        step = torch.full((), step, dtype=torch.long, device=dev)
    kp = max(16, next_pow2(k))
    count_step = deferred is not None
    with on_device(slot_map):
        _kernels().select_plan[(n * h,)](
            slot_map, last_sel, rows, pred, step, primary_table, slot_blocks, src, dst, head, fetched,
            deferred if count_step else fetched, req_fetched if count_step else fetched,
            row_cap if row_cap is not None else rows, count if count is not None else fetched, cap, c,
            slot_map.stride(0), slot_map.stride(1), last_sel.stride(0), last_sel.stride(1),
            pred.stride(0), pred.stride(1), primary_table.stride(0), slot_blocks.stride(0),
            H=h, K=k, P=pred.shape[2], KP=kp, PP=max(16, next_pow2(pred.shape[2])), CP=max(16, next_pow2(c)),
            COUNT_STEP=count_step, HAS_ROW_CAP=row_cap is not None, num_warps=8 if kp <= 128 else 16)
    return src, dst, head
