"""Per-layer paged K and V tensors: a device KV cache, or (pinned) the host pool of the offloading modes."""

from __future__ import annotations

import torch

from oasiskv_runtime.transfer.host_memory import PinnedRegion


class PagedKVCache:
    """Per-layer K and V tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. On the device a layer's K and
    V are the two halves of one tensor ``pairs[layer]`` ``[2, num_blocks, ...]``, so a block's K and V bytes can be
    addressed as one store (the key codes, ``core/summaries.py``)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False,
                 zero: bool = True) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.region = None
        self.pairs: list[torch.Tensor] | None = None
        if pin_memory:  # one exact-size page-locked region, not 2 x layers power-of-two-rounded pinned tensors
            self.region = PinnedRegion(PinnedRegion.bytes_for(2 * num_layers, shape, dtype))
            self.k = [self.region.take(shape, dtype) for _ in range(num_layers)]
            self.v = [self.region.take(shape, dtype) for _ in range(num_layers)]
            return
        self.pairs = [self._alloc((2, *shape), dtype, device, zero) for _ in range(num_layers)]
        self.k = [pair[0] for pair in self.pairs]
        self.v = [pair[1] for pair in self.pairs]

    @staticmethod
    def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, zero: bool) -> torch.Tensor:
        # Device caches start zeroed: masked-out slots are multiplied by zero probabilities, and stale NaN bit
        # patterns would poison that product. Host pools are only ever read at written blocks, so they skip
        # the memset (a 64 GiB pool would otherwise take seconds and touch every page).
        if not zero:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [n] flat rows; k, v [n, Hkv, D]."""
        hkv, d = k.shape[1], k.shape[2]
        self.k[layer].view(-1, hkv, d).index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].view(-1, hkv, d).index_copy_(0, slots, v.to(self.v[layer].dtype))

    def gather(self, layer: int, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first ``num_tokens`` keys and values: [num_tokens, Hkv, D] each."""
        ids = torch.tensor(block_table[: -(-num_tokens // self.block_size)], device=self.k[layer].device)
        k = self.k[layer].index_select(0, ids).flatten(0, 1)[:num_tokens]
        v = self.v[layer].index_select(0, ids).flatten(0, 1)[:num_tokens]
        return k, v
