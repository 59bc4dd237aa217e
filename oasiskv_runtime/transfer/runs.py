"""A sequence's rows in the full-KV pool as runs of consecutive pool rows, for copies by the copy engines.

A prefill chunk writes its tokens' KV to the pool and a later chunk reads the earlier ones back. The UVA kernels
(``ops.uva_gather``) do this on the SMs, one (block, head) tile per iteration, in the critical path of the step.
A request's blocks mostly come from the pool in consecutive ids, so the same rows are a few contiguous ranges of
the pool's ``[rows, Hkv, D]`` view: each is one ``cudaMemcpyAsync`` (``Tensor.copy_`` between a pinned host slice
and a device slice), done by a copy engine while the SMs compute, on a stream of its own. Plain Python (no
tensors) for the planning; :func:`copy_runs` applies a plan with ``copy_`` on any devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PoolRun", "pool_runs", "copy_runs"]


@dataclass(frozen=True)
class PoolRun:
    """``length`` consecutive rows: pool rows from ``pool_row`` (of the device tier when ``tier``) and buffer
    rows from ``buf_row``."""

    tier: bool
    pool_row: int
    buf_row: int
    length: int


def pool_runs(block_table: list[int], first_pos: int, num_tokens: int, first_buf_row: int, block_size: int,
              tier_first: int | None = None) -> list[PoolRun]:
    """Positions ``[first_pos, first_pos + num_tokens)`` of a sequence with this block table (pool block ids;
    ids from ``tier_first`` on are device-tier blocks) as maximal runs of consecutive rows within one part of the
    pool; buffer rows start at ``first_buf_row`` and advance with the position."""
    runs: list[PoolRun] = []
    pos, end = first_pos, first_pos + num_tokens
    while pos < end:
        j, off = divmod(pos, block_size)
        n = min(block_size - off, end - pos)
        block = block_table[j]
        tier = tier_first is not None and block >= tier_first
        row = (block - tier_first if tier else block) * block_size + off
        buf = first_buf_row + pos - first_pos
        last = runs[-1] if runs else None
        if last is not None and last.tier == tier and last.pool_row + last.length == row \
                and last.buf_row + last.length == buf:
            runs[-1] = PoolRun(tier, last.pool_row, last.buf_row, last.length + n)
        else:
            runs.append(PoolRun(tier, row, buf, n))
        pos += n
    return runs


def copy_runs(runs: list[PoolRun], pool: tuple[torch.Tensor, torch.Tensor],
              tier: tuple[torch.Tensor, torch.Tensor] | None, buf: tuple[torch.Tensor, torch.Tensor],
              to_pool: bool) -> None:
    """Copy K and V of every run between the pool (``[blocks, block_size, Hkv, D]`` K and V; ``tier``: the device
    tier's) and ``buf`` (``[rows, Hkv, D]`` K and V): into the pool when ``to_pool``, else out of it. Each run
    and tensor is one ``copy_`` (non-blocking: an asynchronous copy on the current stream between pinned host
    and device memory)."""
    flat = [None if part is None else [p.view(-1, *p.shape[2:]) for p in part] for part in (pool, tier)]
    for r in runs:
        part = flat[1] if r.tier else flat[0]
        if part is None:
            raise ValueError("a run in the device tier, and no tier given")
        ps, bs = slice(r.pool_row, r.pool_row + r.length), slice(r.buf_row, r.buf_row + r.length)
        for p, b in zip(part, buf):
            if to_pool:
                p[ps].copy_(b[bs], non_blocking=True)
            else:
                b[bs].copy_(p[ps], non_blocking=True)
