"""Dense causal attention over a request's whole context, read from where its full KV lives: prefill chunks in every
mode, and the decode rows of dense layers in the sparse modes.

Two paths with the same inputs and outputs: device ops only (CUDA: block ids uploaded once per step, the prefix read
by one gather launch or an index_select, no host sync), and the host-side reference path (the CPU's, bit-parity with
transformers' float32).
"""

from __future__ import annotations

import torch

from oasiskv_runtime.engine.attention.metadata import SeqSlice
from oasiskv_runtime.ops.attend import attend, attend_prefill, causal_allowed
from oasiskv_runtime.ops.common import host_list_to
from oasiskv_runtime.transfer.host_pool import HostKVPool
from oasiskv_runtime.transfer.paged_kv import PagedKVCache
from oasiskv_runtime.transfer.prefill_io import PrefillPoolIO


def attend_slice(s: SeqSlice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                 out: torch.Tensor, scale: float, device_path: bool, backend: str = "auto") -> None:
    """``s``'s rows of ``out``: its queries over its context ``ks, vs`` (``[context_len, Hkv, D]``, the step's rows
    last), causally; a draft row sees the context and itself."""
    rows = slice(s.query_start, s.query_start + s.num_query)
    if device_path:
        out[rows] = attend_prefill(q[rows], ks, vs, scale, backend=backend)
    else:
        allowed = causal_allowed(s.num_query, s.context_len, q.device) if s.num_query > 1 else None
        out[rows] = attend(q[rows], ks, vs, scale, allowed, backend=backend)
    if s.draft_row is not None:
        d = s.draft_row
        out[d:d + 1] = attend(q[d:d + 1], torch.cat([ks, k[d:d + 1]]), torch.cat([vs, v[d:d + 1]]), scale,
                              backend=backend)


class ContextAttention:
    """``pool``: the full-KV pool (host-pool modes), else None: the context is in ``device_cache``."""

    def __init__(self, device_cache: PagedKVCache, pool: HostKVPool | None, io: PrefillPoolIO | None, scale: float,
                 backend: str) -> None:
        self.dev, self.pool, self.io, self.scale, self.backend = device_cache, pool, io, scale, backend
        self.block_size = device_cache.block_size
        self.memo: dict = {}
        """Per-step device copies of block lists (one upload per step, not per layer); the owner clears it."""

    def pool_backend(self) -> str:
        """Gather backend for the pool: the kernel on CUDA; without kernels the reference reads the pinned pool on
        the host, so it must first wait for this stream's UVA writes to land."""
        if self.dev.k[0].is_cuda and self.backend == "ref":
            torch.cuda.current_stream(self.dev.k[0].device).synchronize()
            return "ref"
        return "auto"

    def _blocks(self, key: tuple, ids: list[int], device: torch.device) -> torch.Tensor:
        t = self.memo.get(key)
        if t is None:
            t = self.memo[key] = host_list_to(ids, torch.long, device)
        return t

    def context_kv(self, layer: int, s: SeqSlice, kc: torch.Tensor, vc: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[context_len, Hkv, D]`` keys and values of ``s`` by device ops: the tokens before this step's rows from
        where they live, then this step's rows ``kc``/``vc`` (already on the device: not read back)."""
        prefix = s.context_len - s.num_query
        read = self.io.take_read(layer, s.seq_id) if self.io is not None else None
        if read is not None:  # read ahead by the copy engine
            ks, vs = read
        else:
            blocks = self._blocks(("ctx", s.seq_id), s.block_table[:-(-prefix // self.block_size)], kc.device)
            if self.pool is None:
                ks = self.dev.k[layer].index_select(0, blocks).flatten(0, 1)[:prefix]
                vs = self.dev.v[layer].index_select(0, blocks).flatten(0, 1)[:prefix]
                return torch.cat([ks, kc]), torch.cat([vs, vc])
            ks, vs = self.pool.read(layer, blocks, prefix, s.context_len, backend=self.pool_backend())
        ks[prefix:] = kc
        vs[prefix:] = vc
        return ks, vs

    def attend(self, layer: int, s: SeqSlice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               device_path: bool) -> torch.Tensor:
        """``s``'s rows of ``out``, attending over its whole context; returns the context's keys
        (``[context_len, Hkv, D]`` on ``q``'s device)."""
        rows = slice(s.query_start, s.query_start + s.num_query)
        if device_path:
            if s.num_query == s.context_len:  # the chunk is the whole context: its own rows, nothing to read
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = self.context_kv(layer, s, k[rows], v[rows])
        else:
            if q.is_cuda and self.pool is not None:
                torch.cuda.current_stream(q.device).synchronize()  # UVA writes must land before the CPU reads
            if self.pool is None:
                ks, vs = self.dev.gather(layer, s.block_table, s.context_len)
            else:
                ks, vs = self.pool.read_host(layer, s.block_table, s.context_len)
            ks, vs = ks.to(q.device), vs.to(q.device)
        attend_slice(s, q, k, v, ks, vs, out, self.scale, device_path, self.backend)
        return ks

    def copy_tails(self, layer: int, tails: list[tuple[SeqSlice, int]], device_path: bool) -> None:
        """Each request's active block's earlier tokens (the prompt's tail) from the pool into its local device
        block ``(slice, local block)``: by a gather stream-ordered after this step's writes, or read on the host."""
        if not device_path and self.dev.k[0].is_cuda:
            torch.cuda.current_stream(self.dev.k[0].device).synchronize()
        for s, local in tails:
            j, used = s.context_len // self.block_size, s.context_len % self.block_size
            if not used:
                continue
            if device_path:
                hb = self._blocks(("tail", s.seq_id), [s.block_table[j]], self.dev.k[layer].device)
                tk, tv = self.pool.read(layer, hb, used, backend=self.pool_backend())
            else:
                tk, tv = self.pool.read_host(layer, s.block_table[j:j + 1], used)
            self.dev.k[layer][local, :used] = tk.to(self.dev.k[layer].device)
            self.dev.v[layer][local, :used] = tv.to(self.dev.v[layer].device)
