"""The full-KV store of the host-pool modes: a (pinned) host pool, and optionally a device tier after it.

Block ids below ``tier_first`` are blocks of the host pool; ids from ``tier_first`` on are blocks of the device
cache itself (``CacheConfig.device_tier``: once the host pool is full, further full-KV blocks come from the device
KV budget the working sets leave free). Every read and write here takes either kind of id, so the paths above
never ask where a block lives. Knows nothing about why a block is read or written.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.ops.uva_gather import (PoolTier, uva_gather_blocks, uva_gather_blocks_ref,
                                            uva_scatter_rows)
from oasiskv_runtime.transfer.paged_kv import PagedKVCache


class HostKVPool:
    """``host``: per-layer ``[num_host_blocks, block_size, Hkv, D]`` K and V (pinned on CUDA); ``device``: the
    device cache whose blocks serve as the tier (ids ``tier_first + j``), or None without a tier; ``backend``: the
    ops' ``"auto"`` or ``"ref"`` for its writes."""

    def __init__(self, host: PagedKVCache, device: PagedKVCache | None = None, tier_first: int | None = None,
                 backend: str = "auto") -> None:
        if (device is None) != (tier_first is None):
            raise ValueError("a device tier needs both the device cache and tier_first")
        self.host, self.device, self.tier_first, self.backend = host, device, tier_first, backend
        self.block_size = host.block_size

    @property
    def k(self) -> list[torch.Tensor]:
        return self.host.k

    @property
    def v(self) -> list[torch.Tensor]:
        return self.host.v

    def tier(self, layer: int) -> PoolTier | None:
        """Layer ``layer``'s device tier for the ops (None: no tier)."""
        if self.tier_first is None:
            return None
        return PoolTier(self.device.k[layer], self.device.v[layer], self.tier_first)

    def parts(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """``((host K, host V), (tier K, tier V) or None)`` of a layer (copy-engine runs address each part)."""
        tier = self.tier(layer)
        return (self.host.k[layer], self.host.v[layer]), (None if tier is None else (tier.k, tier.v))

    def write_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """``k, v: [n, Hkv, D]`` into flat pool rows ``rows: [n]`` (block * block_size + offset; -1 skipped): one
        UVA scatter on CUDA, ordered on the current stream; the reference elsewhere."""
        uva_scatter_rows(k, v, self.host.k[layer], self.host.v[layer], rows, tier=self.tier(layer),
                         backend=self.backend)

    def read(self, layer: int, blocks: torch.Tensor, num_tokens: int, out_rows: int | None = None,
             backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first ``num_tokens`` keys and values from its pool blocks ``blocks`` (on the target device)
        as ``[out_rows or num_tokens, Hkv, D]`` tensors there, by device ops (:func:`uva_gather_blocks`)."""
        return uva_gather_blocks(self.host.k[layer], self.host.v[layer], blocks, num_tokens, out_rows,
                                 backend=backend, tier=self.tier(layer))

    def read_host(self, layer: int, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same read done where the pool lives (the host-side reference path: callers synchronise first)."""
        if self.tier_first is None:
            return self.host.gather(layer, block_table, num_tokens)
        ids = torch.tensor(block_table[:-(-num_tokens // self.block_size)], dtype=torch.long)
        return uva_gather_blocks_ref(self.host.k[layer], self.host.v[layer], ids, num_tokens,
                                     tier=self.tier(layer))
