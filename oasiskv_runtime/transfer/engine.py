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
    def __init__(self, host_k: list[torch.Tensor], host_v: list[torch.Tensor], dev_k: list[torch.Tensor],
                 dev_v: list[torch.Tensor]) -> None:
        self.host_k, self.host_v, self.dev_k, self.dev_v = host_k, host_v, dev_k, dev_v

    def submit(self, plan: TransferPlan) -> None:
        if plan.num_copies == 0:
            return
        l = plan.layer
        dev = self.dev_k[l].device
        src, heads = plan.src_blocks.to(self.host_k[l].device), plan.heads.to(self.host_k[l].device)
        # Advanced indexing gathers all copies in one op: [n, block_size, D].
        k = self.host_k[l][src, :, heads].to(dev, non_blocking=True)
        v = self.host_v[l][src, :, heads].to(dev, non_blocking=True)
        dst, hd = plan.dst_blocks.to(dev), plan.heads.to(dev)
        self.dev_k[l][dst, :, hd] = k
        self.dev_v[l][dst, :, hd] = v

