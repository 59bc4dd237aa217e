"""Dense paged attention over the full KV cache (reference implementation, used on CPU and as the
dense anchor). A GPU kernel slots in behind the same ``forward``."""

from __future__ import annotations

import torch

from oasiskv_runtime.attention.metadata import SeqSlice, StepMetadata, written_rows
from oasiskv_runtime.attention.ref import attend, attend_prefill, causal_allowed
from oasiskv_runtime.ops.common import host_list_to


class PagedKVCache:
    """Per-layer K and V tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False,
                 zero: bool = True) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.region = None
        if pin_memory:  # one exact-size page-locked region, not 2 x layers power-of-two-rounded pinned tensors
            from oasiskv_runtime.transfer.host_memory import PinnedRegion

            self.region = PinnedRegion(PinnedRegion.bytes_for(2 * num_layers, shape, dtype))
            self.k = [self.region.take(shape, dtype) for _ in range(num_layers)]
            self.v = [self.region.take(shape, dtype) for _ in range(num_layers)]
            return
        self.k = [self._alloc(shape, dtype, device, zero) for _ in range(num_layers)]
        self.v = [self._alloc(shape, dtype, device, zero) for _ in range(num_layers)]

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


class DenseAttention:
    """Writes each step's KV into the paged cache, then attends causally over each request's context."""

    device_prefill: bool | None = None
    """Prefill rows attend without host round trips: block ids uploaded once per step (not once per layer, a
    blocking copy each), a chunk that is the whole sequence attends over its own rows, no [nq, nk] mask
    (:func:`attend_prefill`). None: on CUDA. The CPU path is the reference arithmetic (parity tests)."""

    def __init__(self, cache: PagedKVCache, scale: float) -> None:
        self.cache = cache
        self.scale = scale
        self.meta: StepMetadata | None = None
        self._ctx_ids: dict[int, torch.Tensor] = {}

    def begin_step(self, meta: StepMetadata) -> None:
        self.meta = meta
        static = meta.extra.get("static")
        if static is not None:
            self._bind_static(meta, static)
            return
        self._write_rows = host_list_to(written_rows(meta.seqs), torch.long, meta.slot_mapping.device)
        self._paged = None
        if meta.input_ids.is_cuda:
            # On CUDA, decode rows of all requests go through one paged attention launch (the sparse kernel
            # with every block listed), prefill rows through SDPA.
            decode = [s for s in meta.seqs if s.num_query == 1 and s.context_len > 1 and s.draft_row is None]
            if decode:
                self._paged = self._paged_batch(decode, meta.input_ids.device)
            self._per_seq = [s for s in meta.seqs if s not in decode]
        else:
            self._per_seq = meta.seqs
        self._ctx_ids = {}

    # ---- the static layout of decode-only steps (engine/cuda_graphs.py) ------------------------------
    graph_split_mixed = False
    """Steps that also prefill are not split: the decode rows cost almost nothing inside the prefill forward."""

    def graph_key(self) -> tuple:
        return ()

    def graph_fields(self, seqs, ctxs, tables, rows, has_draft, fields, static, max_blocks) -> dict:
        """Each request's full blocks (its table up to the active block) and its active block."""
        bs = self.cache.block_size
        ids = static.table("dense_ids", max_blocks, -1, torch.int32)
        local, local_len, num_full = [], [], []
        for seq, ctx, table, row in zip(seqs, ctxs, tables, rows):
            j = (ctx - 1) // bs
            ids.set(row, seq.seq_id, table, j)
            local.append(table[j])
            local_len.append((ctx - 1) % bs + 1)
            num_full.append(j)
        fields.update(local_block=local, local_len=local_len, dense_num_full=num_full)
        # the kernel's int32, converted once per step here, not once per layer by its wrapper
        return dict.fromkeys(("local_block", "local_len", "dense_num_full"), torch.int32)

    def _bind_static(self, meta: StepMetadata, st) -> None:
        self._write_rows = st.q_rows
        self._ctx_ids = {}
        if meta.input_ids.is_cuda:
            hkv = self.cache.k[0].shape[2]
            ids = st.tables["dense_ids"][:, None, :st.block_bucket].expand(-1, hkv, -1)
            self._paged = (st.q_rows, ids, st.vec["local_block"], st.vec["local_len"], st.vec["dense_num_full"])
            self._per_seq = []
        else:  # the CPU reference path, as in eager steps
            self._paged = None
            self._per_seq = meta.seqs

    def graph_join(self) -> None:
        pass

    before_capture = graph_replayed = graph_join

    def _paged_batch(self, decode: list[SeqSlice], device: torch.device) -> tuple:
        bs = self.cache.block_size
        n = max((s.context_len - 1) // bs for s in decode)
        full = [s.block_table[: (s.context_len - 1) // bs] for s in decode]
        # host_list_to, not torch.tensor(..., device=): each of those is a pageable copy and a stream sync.
        ids = host_list_to([f + [-1] * (n - len(f)) for f in full] if n else [[-1] for _ in decode], torch.int32,
                           device)
        hkv = self.cache.k[0].shape[2]
        local = host_list_to([s.block_table[(s.context_len - 1) // bs] for s in decode], torch.int32, device)
        local_len = host_list_to([(s.context_len - 1) % bs + 1 for s in decode], torch.int32, device)
        rows = host_list_to([s.query_start for s in decode], torch.long, device)
        num_full = host_list_to([len(f) for f in full], torch.int32, device)
        return rows, ids[:, None, :].expand(-1, hkv, -1).contiguous(), local, local_len, num_full

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        rows = self._write_rows
        self.cache.write(layer_idx, meta.slot_mapping[rows], k[rows], v[rows])
        out = torch.empty_like(q)
        device_path = self.device_prefill if self.device_prefill is not None else q.is_cuda
        for s in self._per_seq:
            qs = slice(s.query_start, s.query_start + s.num_query)
            if device_path:
                self._attend_seq_device(layer_idx, s, q, k, v, out)
                continue
            ks, vs = self.cache.gather(layer_idx, s.block_table, s.context_len)
            allowed = causal_allowed(s.num_query, s.context_len, q.device) if s.num_query > 1 else None
            out[qs] = attend(q[qs], ks, vs, self.scale, allowed)
            if s.draft_row is not None:  # a look-ahead row in a dense layer sees the context and itself
                d = s.draft_row
                out[d:d + 1] = attend(q[d:d + 1], torch.cat([ks, k[d:d + 1]]), torch.cat([vs, v[d:d + 1]]),
                                      self.scale)
        if self._paged is not None:
            from oasiskv_runtime.ops.sparse_attention import sparse_decode_attention

            # num_full: each request's loop ends at its own last block, not at the longest one's (or the
            # bucket's): at 1,024 requests of 128-1,344 tokens most of the table is padding
            r, ids, local, local_len, num_full = self._paged
            res = sparse_decode_attention(q[r][:, None], self.cache.k[layer_idx], self.cache.v[layer_idx], ids,
                                          local, local_len, self.scale, num_full=num_full)
            out[r] = res[:, 0]
        return out

    def _attend_seq_device(self, layer: int, s: SeqSlice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor) -> None:
        """The per-sequence path of :meth:`forward` with device ops only (same inputs, same outputs)."""
        qs = slice(s.query_start, s.query_start + s.num_query)
        if s.num_query == s.context_len:  # the chunk is the whole context: its own rows, no gather
            ks, vs = k[qs], v[qs]
        else:
            ids = self._ctx_ids.get(s.seq_id)
            if ids is None:
                nb = -(-s.context_len // self.cache.block_size)
                ids = self._ctx_ids[s.seq_id] = host_list_to(s.block_table[:nb], torch.long, q.device)
            ks = self.cache.k[layer].index_select(0, ids).flatten(0, 1)[:s.context_len]
            vs = self.cache.v[layer].index_select(0, ids).flatten(0, 1)[:s.context_len]
        out[qs] = attend_prefill(q[qs], ks, vs, self.scale)
        if s.draft_row is not None:
            d = s.draft_row
            out[d:d + 1] = attend(q[d:d + 1], torch.cat([ks, k[d:d + 1]]), torch.cat([vs, v[d:d + 1]]), self.scale)

    def end_step(self) -> None:
        self.meta = None
