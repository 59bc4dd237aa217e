"""Moving KV blocks host -> device. The transfer engine knows nothing about why a block moves: it takes a plan
(which host block of which head goes into which device block), performs the copies, and reports completion.

``SyncTransferEngine`` is the reference: copies run at once on the calling stream with batched index
operations (never one call per block). On CUDA the sparse backend instead issues one zero-copy gather
kernel (``ops.uva_gather``) per layer on a background stream and records an event per layer, which the next
step's layer waits on (layer-local sync, SPEC item 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv_runtime.ops.uva_gather import PoolTier, uva_gather_ref


@dataclass
class TransferPlan:
    """Copies for one layer: ``host[src_blocks[i], :, heads[i]] -> device[dst_blocks[i], :, heads[i]]`` (K and V)."""

    layer: int
    src_blocks: torch.Tensor
    """[n] host physical block ids (int64)."""
    dst_blocks: torch.Tensor
    """[n] device physical block ids (int64)."""
    heads: torch.Tensor
    """[n] KV head of each copy (int64)."""

    @property
    def num_copies(self) -> int:
        return int(self.src_blocks.numel())


class SyncTransferEngine:
    """``tier_first``: source ids from this one on are blocks of the device cache itself (the device tier of the
    full-KV pool, ``CacheConfig.device_tier``)."""

    def __init__(self, host_k: list[torch.Tensor], host_v: list[torch.Tensor], dev_k: list[torch.Tensor],
                 dev_v: list[torch.Tensor], tier_first: int | None = None) -> None:
        self.host_k, self.host_v, self.dev_k, self.dev_v = host_k, host_v, dev_k, dev_v
        self.tier_first = tier_first

    def submit(self, plan: TransferPlan) -> None:
        if plan.num_copies == 0:
            return
        l = plan.layer
        tier = None if self.tier_first is None else PoolTier(self.dev_k[l], self.dev_v[l], self.tier_first)
        # Batched index operations gather all copies in one op per part of the pool, one bulk transfer each.
        uva_gather_ref(self.host_k[l], self.host_v[l], self.dev_k[l], self.dev_v[l], plan.src_blocks,
                       plan.dst_blocks, plan.heads, tier=tier)

