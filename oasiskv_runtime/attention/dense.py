"""Dense paged attention over the full KV cache (reference implementation, used on CPU and as the
dense anchor). A GPU kernel slots in behind the same ``forward``."""

from __future__ import annotations

import torch

from oasiskv_runtime.attention.metadata import StepMetadata
from oasiskv_runtime.attention.ref import attend_ref, causal_allowed


class PagedKVCache:
    """Per-layer K and V tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False,
                 zero: bool = True) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = [self._alloc(shape, dtype, device, pin_memory, zero) for _ in range(num_layers)]
        self.v = [self._alloc(shape, dtype, device, pin_memory, zero) for _ in range(num_layers)]

    @staticmethod
    def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, pin: bool,
               zero: bool) -> torch.Tensor:
        # Device caches start zeroed: masked-out slots are multiplied by zero probabilities, and stale NaN bit
        # patterns would poison that product. Host pools are only ever read at written blocks, so they skip
        # the memset (a 64 GiB pool would otherwise take seconds and touch every page).
        if not zero:
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
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


class DenseAttention:
    """Writes each step's KV into the paged cache, then attends causally over each request's context."""

    def __init__(self, cache: PagedKVCache, scale: float) -> None:
        self.cache = cache
        self.scale = scale
        self.meta: StepMetadata | None = None

    def begin_step(self, meta: StepMetadata) -> None:
        self.meta = meta
        self._write_rows = (meta.slot_mapping >= 0).nonzero().squeeze(1)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        rows = self._write_rows
        self.cache.write(layer_idx, meta.slot_mapping[rows], k[rows], v[rows])
        out = torch.empty_like(q)
        for s in meta.seqs:
            qs = slice(s.query_start, s.query_start + s.num_query)
            ks, vs = self.cache.gather(layer_idx, s.block_table, s.context_len)
            allowed = causal_allowed(s.num_query, s.context_len, q.device) if s.num_query > 1 else None
            out[qs] = attend_ref(q[qs], ks, vs, self.scale, allowed)
        return out

    def end_step(self) -> None:
        self.meta = None
