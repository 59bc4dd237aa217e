"""In-place update of the Quest key summaries (element-wise min / max per logical block).

SPEC mechanism item 2. ``sum_min`` / ``sum_max``: ``[num_blocks, block_size, Hkv, D]``
(contiguous; a summary "row" is one ``[Hkv, D]`` slice, flat index
``physical_block * block_size + row``, i.e. a row of ``sum_min.view(-1, Hkv, D)``).

``update_summaries(k_new [T, Hkv, D], rows [T] int64, reset [T] bool, sum_min, sum_max)``:
each token t folds its key into row ``rows[t]``. ``reset[t]`` marks the FIRST token of a
logical block: the row's previous content is stale (the physical row is being reused)
and is replaced. Semantics, for every touched row r::

    base    = +inf / -inf          if any token with reset hits r
            = old sum_min/sum_max  otherwise
    new_min = min(base, min_{t: rows[t] = r} k_new[t])   (same for max)

This is order independent, so a prefill chunk may send many tokens to one row (the
block's first token carries reset=True, the others False).

* :func:`update_summaries_ref` handles repeated rows: reset rows are first overwritten
  with a resetting token's key, then ``scatter_reduce_(amin / amax, include_self=True)``.
* the Triton kernel (one program per token, all Hkv * D lanes) assumes the rows are
  DISTINCT (decode: one new token per request). :func:`update_summaries` checks that
  (``assume_distinct=None``: one ``torch.unique`` and a host sync) and falls back to the
  reference when rows repeat; a decode caller that knows rows are distinct passes
  ``assume_distinct=True`` and the call stays asynchronous.
"""
from __future__ import annotations

from typing import Optional

import torch

from oasiskv_runtime.ops.common import lazy_kernels, loads, next_pow2, on_device

__all__ = ["update_summaries", "update_summaries_ref", "update_summaries_grouped", "update_summaries_runs",
           "update_summaries_runs_ref", "token_runs"]

triton = None
tl = None


_next_pow2 = next_pow2


def _check(k_new, rows, reset, sum_min, sum_max):
    if sum_min.shape != sum_max.shape or sum_min.dim() != 4:
        raise ValueError("sum_min/sum_max must be equal-shaped [num_blocks, block_size, Hkv, D]")
    if not (sum_min.is_contiguous() and sum_max.is_contiguous()):
        raise ValueError("sum_min/sum_max must be contiguous")
    Hkv, D = sum_min.shape[2], sum_min.shape[3]
    if k_new.dim() != 3 or k_new.shape[1:] != (Hkv, D):
        raise ValueError(f"k_new must be [T, {Hkv}, {D}], got {tuple(k_new.shape)}")
    T = k_new.shape[0]
    if rows.shape != (T,) or reset.shape != (T,):
        raise ValueError("rows and reset must be [T]")
    return T, Hkv, D


def _flat(k_new: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor, sum_min: torch.Tensor,
          sum_max: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row views of the summary tensors and the inputs on their device and dtypes."""
    hkv, d = k_new.shape[1], k_new.shape[2]
    fmin, fmax = sum_min.view(-1, hkv, d), sum_max.view(-1, hkv, d)
    dev = fmin.device
    return (fmin, fmax, k_new.to(device=dev, dtype=fmin.dtype), rows.to(dev, torch.int64),
            reset.to(dev, torch.bool))


def update_summaries_ref(k_new: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor,
                         sum_min: torch.Tensor, sum_max: torch.Tensor) -> None:
    """Plain-PyTorch reference; any number of tokens may hit the same row.

    Works on the touched rows only (gather, reduce, write back): a scatter_reduce over the whole paged
    tensor costs time proportional to the cache size, not to the tokens appended.
    """
    T, Hkv, D = _check(k_new, rows, reset, sum_min, sum_max)
    if T == 0:
        return
    fmin, fmax, k, rows, reset = _flat(k_new, rows, reset, sum_min, sum_max)
    dev = fmin.device
    uniq, inv = torch.unique(rows, return_inverse=True)
    cur_min, cur_max = fmin.index_select(0, uniq), fmax.index_select(0, uniq)       # [U, Hkv, D]
    # A row that a resetting token hits starts from that block's first key, not from stale contents.
    fresh = torch.zeros(uniq.numel(), dtype=torch.bool, device=dev).index_fill_(0, inv[reset], True)
    inf = torch.finfo(fmin.dtype).max
    cur_min = torch.where(fresh[:, None, None], torch.full_like(cur_min, inf), cur_min)
    cur_max = torch.where(fresh[:, None, None], torch.full_like(cur_max, -inf), cur_max)
    if uniq.numel() == T:  # decode: one token per row, no reduction among tokens needed
        order = torch.empty_like(inv).index_copy_(0, inv, torch.arange(T, device=dev))
        cur_min = torch.minimum(cur_min, k[order])
        cur_max = torch.maximum(cur_max, k[order])
    else:
        idx = inv.view(T, 1, 1).expand(T, Hkv, D)
        cur_min.scatter_reduce_(0, idx, k, reduce="amin", include_self=True)
        cur_max.scatter_reduce_(0, idx, k, reduce="amax", include_self=True)
    fmin.index_copy_(0, uniq, cur_min)
    fmax.index_copy_(0, uniq, cur_max)


def update_summaries_grouped(k_new: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor,
                             sum_min: torch.Tensor, sum_max: torch.Tensor) -> None:
    """:func:`update_summaries_ref`'s result (bit for bit: min and max are exact) with no host sync, for a
    prefill chunk on the GPU: no ``torch.unique`` and no boolean indexing, whose output sizes depend on the
    data. Tokens are put in row order by a stable sort; a token whose row differs from its predecessor's
    starts a group, and ``cummax`` over the group starts gives every token its group's first position
    (O(T log T); the first version compared every pair of tokens, [T, T] masks of 64 MiB per layer at 8K
    tokens). Each group reduces into its first position, and every token then writes its group's value
    (tokens of one row write identical values, so the write order does not matter)."""
    T, Hkv, D = _check(k_new, rows, reset, sum_min, sum_max)
    if T == 0:
        return
    fmin, fmax, k, rows, reset = _flat(k_new, rows, reset, sum_min, sum_max)
    dev = fmin.device
    srows, order = torch.sort(rows, stable=True)
    pos = torch.arange(T, device=dev)
    starts = torch.ones(T, dtype=torch.bool, device=dev)
    starts[1:] = srows[1:] != srows[:-1]
    first = torch.cummax(torch.where(starts, pos, 0), dim=0).values          # group start, sorted order
    fresh = torch.zeros(T, dtype=torch.uint8, device=dev).scatter_reduce_(
        0, first, reset[order].to(torch.uint8), reduce="amax").index_select(0, first).bool()
    inf = torch.finfo(fmin.dtype).max
    cur_min = torch.where(fresh[:, None, None], inf, fmin.index_select(0, srows))
    cur_max = torch.where(fresh[:, None, None], -inf, fmax.index_select(0, srows))
    idx = first.view(T, 1, 1).expand(T, Hkv, D)
    ks = k.index_select(0, order)
    cur_min.scatter_reduce_(0, idx, ks, reduce="amin", include_self=True)
    cur_max.scatter_reduce_(0, idx, ks, reduce="amax", include_self=True)
    fmin.index_copy_(0, srows, cur_min.index_select(0, first))
    fmax.index_copy_(0, srows, cur_max.index_select(0, first))


def token_runs(rows: list[int], reset: list[bool], width: int) -> tuple[list[int], list[int], list[bool]]:
    """The run layout :func:`update_summaries_runs` takes, from per-token ``rows`` / ``reset`` in which the tokens
    of one row are adjacent (a prefill chunk: a request's positions are consecutive, and each logical block has
    its own row) and at most ``width`` long, a resetting token first in its run.

    Returns ``(pad_idx, run_rows, run_reset)``: ``pad_idx`` has ``width`` token indices per run, the run's
    tokens then copies of its first (min and max are idempotent, so the copies change nothing)."""
    pad_idx: list[int] = []
    run_rows: list[int] = []
    run_reset: list[bool] = []
    i, n = 0, len(rows)
    while i < n:
        j = i + 1
        while j < n and rows[j] == rows[i]:
            j += 1
        if j - i > width or any(reset[i + 1:j]):
            raise ValueError(f"token_runs: run of row {rows[i]} at token {i} is {j - i} tokens long (at most "
                             f"{width}) or resets after its first token")
        pad_idx += list(range(i, j)) + [i] * (width - (j - i))
        run_rows.append(rows[i])
        run_reset.append(bool(reset[i]))
        i = j
    if len(set(run_rows)) != len(run_rows):
        raise ValueError("token_runs: a row's tokens are not adjacent")
    return pad_idx, run_rows, run_reset


def update_summaries_runs(k_new: torch.Tensor, pad_idx: torch.Tensor, run_rows: torch.Tensor,
                          run_reset: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor,
                          backend: str = "auto") -> None:
    """:func:`update_summaries_ref`'s result (bit for bit) for tokens laid out in runs (:func:`token_runs`).
    ``backend="ref"`` (:func:`update_summaries_runs_ref`): dense torch ops; ``"triton"``: one kernel launch
    (a program per run and lane block); ``"auto"``: the kernel on CUDA. Neither syncs with the host."""
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    if backend == "triton" or (backend == "auto" and sum_min.is_cuda and _triton_available()):
        _update_summaries_runs_triton(k_new, pad_idx, run_rows, run_reset, sum_min, sum_max)
        return
    update_summaries_runs_ref(k_new, pad_idx, run_rows, run_reset, sum_min, sum_max)


def _check_runs(k_new, pad_idx, run_rows, sum_min, sum_max) -> tuple[int, int, int]:
    if sum_min.shape != sum_max.shape or sum_min.dim() != 4:
        raise ValueError("sum_min/sum_max must be equal-shaped [num_blocks, block_size, Hkv, D]")
    R = run_rows.numel()
    hkv, d = sum_min.shape[2], sum_min.shape[3]
    if R and (k_new.dim() != 3 or k_new.shape[1:] != (hkv, d) or pad_idx.numel() % R):
        raise ValueError(f"k_new must be [T, {hkv}, {d}] and pad_idx a whole number of runs")
    return R, hkv, d


def _update_summaries_runs_triton(k_new, pad_idx, run_rows, run_reset, sum_min, sum_max) -> None:
    """The runs' update as one launch: program (run, lane block) folds the run's ``width`` tokens (pad copies
    included: min / max are idempotent) and writes the row once. Replaces ~13 torch ops per layer of a
    prefill-carrying step, whose host was the bottleneck on the H200."""
    R, hkv, d = _check_runs(k_new, pad_idx, run_rows, sum_min, sum_max)
    if R == 0:
        return
    if not (sum_min.is_contiguous() and sum_max.is_contiguous()):
        raise ValueError("sum_min/sum_max must be contiguous")
    K = _kernels()
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    if run_reset.dtype == torch.bool:
        run_reset = run_reset.view(torch.uint8)  # same bytes, no copy: the kernel reads a byte per run
    HD = hkv * d
    BLOCK = min(1024, _next_pow2(HD))
    grid = (R, triton.cdiv(HD, BLOCK))
    with on_device(sum_min):
        K.runs[grid](k_new, pad_idx, run_rows, run_reset, sum_min, sum_max, k_new.stride(0), k_new.stride(1), HD,
                     D=d, WIDTH=pad_idx.numel() // R, BLOCK=BLOCK, num_warps=4)


def update_summaries_runs_ref(k_new: torch.Tensor, pad_idx: torch.Tensor, run_rows: torch.Tensor,
                              run_reset: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor) -> None:
    """The plain-PyTorch runs update: the runs' tokens are gathered into a padded ``[runs, width, Hkv, D]``
    tensor, reduced by ``amin`` / ``amax`` over the width, merged with the old rows unless the run resets, and
    written once per row. Dense reductions only: no atomics, no sort and no host sync (the layout comes from the
    host, where the engine builds the step)."""
    R, hkv, d = _check_runs(k_new, pad_idx, run_rows, sum_min, sum_max)
    if R == 0:
        return
    fmin, fmax = sum_min.view(-1, hkv, d), sum_max.view(-1, hkv, d)
    kp = k_new.index_select(0, pad_idx).to(fmin.dtype).view(R, -1, hkv, d)
    fresh = run_reset.view(R, 1, 1)
    cur = kp.amin(1)
    fmin.index_copy_(0, run_rows, torch.where(fresh, cur, torch.minimum(fmin.index_select(0, run_rows), cur)))
    cur = kp.amax(1)
    fmax.index_copy_(0, run_rows, torch.where(fresh, cur, torch.maximum(fmax.index_select(0, run_rows), cur)))


@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _summary_update_kernel(KNEW, ROWS, RESET, SMIN, SMAX, s_kt, s_kh, HD,
                               D: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = off < HD
        r = tl.load(ROWS + t).to(tl.int64)
        rs = tl.load(RESET + t) != 0
        k = tl.load(KNEW + t.to(tl.int64) * s_kt + (off // D) * s_kh + off % D, mask=ok,
                    other=0.0).to(SMIN.dtype.element_ty)
        keep = ok & (rs == 0)
        old_mn = tl.load(SMIN + r * HD + off, mask=keep, other=0.0)
        old_mx = tl.load(SMAX + r * HD + off, mask=keep, other=0.0)
        new_mn = tl.where(rs, k, tl.minimum(old_mn, k))
        new_mx = tl.where(rs, k, tl.maximum(old_mx, k))
        tl.store(SMIN + r * HD + off, new_mn, mask=ok)
        tl.store(SMAX + r * HD + off, new_mx, mask=ok)

    @triton.jit
    def _summary_runs_kernel(KNEW, PAD, ROWS, RESET, SMIN, SMAX, s_kt, s_kh, HD,
                             D: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = off < HD
        lane = (off // D) * s_kh + off % D
        row = tl.load(ROWS + r).to(tl.int64)
        rs = tl.load(RESET + r) != 0
        t = tl.load(PAD + r * WIDTH).to(tl.int64)
        mn = tl.load(KNEW + t * s_kt + lane, mask=ok, other=0.0).to(SMIN.dtype.element_ty)
        mx = mn
        for w in tl.static_range(1, WIDTH):
            t = tl.load(PAD + r * WIDTH + w).to(tl.int64)
            k = tl.load(KNEW + t * s_kt + lane, mask=ok, other=0.0).to(SMIN.dtype.element_ty)
            mn = tl.minimum(mn, k)
            mx = tl.maximum(mx, k)
        keep = ok & (rs == 0)
        old_mn = tl.load(SMIN + row * HD + off, mask=keep, other=0.0)
        old_mx = tl.load(SMAX + row * HD + off, mask=keep, other=0.0)
        tl.store(SMIN + row * HD + off, tl.where(rs, mn, tl.minimum(old_mn, mn)), mask=ok)
        tl.store(SMAX + row * HD + off, tl.where(rs, mx, tl.maximum(old_mx, mx)), mask=ok)

    from types import SimpleNamespace
    return SimpleNamespace(update=_summary_update_kernel, runs=_summary_runs_kernel)


def _triton_available() -> bool:
    return loads(_kernels)


def _update_summaries_triton(k_new, rows, reset, sum_min, sum_max) -> None:
    T, Hkv, D = _check(k_new, rows, reset, sum_min, sum_max)
    if T == 0:
        return
    K = _kernels()
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    rows = rows.to(device=sum_min.device, dtype=torch.int64).contiguous()
    reset = reset.to(device=sum_min.device).contiguous()
    # a bool tensor's bytes as uint8 (no copy: the kernel reads a byte per token; decode steps call this per layer)
    reset = reset.view(torch.uint8) if reset.dtype == torch.bool else reset.to(torch.uint8)
    HD = Hkv * D
    BLOCK = min(2048, _next_pow2(HD))
    grid = (T, triton.cdiv(HD, BLOCK))
    with on_device(sum_min):
        K.update[grid](k_new, rows, reset, sum_min, sum_max, k_new.stride(0), k_new.stride(1), HD,
                       D=D, BLOCK=BLOCK, num_warps=4)


def update_summaries(k_new: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor,
                     sum_min: torch.Tensor, sum_max: torch.Tensor, *,
                     assume_distinct: Optional[bool] = None, backend: str = "auto") -> None:
    """Fold new keys into the block summaries in place (see the module docstring).

    The Triton kernel needs distinct ``rows``; with ``assume_distinct=None`` this is
    checked (a host sync) and repeated rows go to :func:`update_summaries_ref`. A caller that
    passes ``assume_distinct=False`` (rows may repeat: prefill) gets, on CUDA, the sync-free
    :func:`update_summaries_grouped`.
    """
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    if assume_distinct is False and backend == "auto" and sum_min.is_cuda:
        update_summaries_grouped(k_new, rows, reset, sum_min, sum_max)  # a prefill chunk: no host sync
        return
    use_triton = backend == "triton" or (
        backend == "auto" and sum_min.is_cuda and _triton_available())
    if use_triton and not assume_distinct:
        T = rows.shape[0]
        if T > 1 and torch.unique(rows).numel() != T:
            use_triton = False  # prefill chunk: several tokens per row -> scatter_reduce ref
    if not use_triton:
        update_summaries_ref(k_new, rows, reset, sum_min, sum_max)
        return
    _update_summaries_triton(k_new, rows, reset, sum_min, sum_max)
