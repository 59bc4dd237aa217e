"""Dense paged attention over the full KV cache (reference implementation, used on CPU and as the
dense anchor). A GPU kernel slots in behind the same ``forward``."""

from __future__ import annotations

import torch

from oasiskv_runtime.engine.attention.metadata import SeqSlice, StepMetadata, written_rows
from oasiskv_runtime.engine.attention.prefill import ContextAttention
from oasiskv_runtime.ops.common import host_list_to
from oasiskv_runtime.ops.sparse_attention import sparse_decode_attention
from oasiskv_runtime.transfer.paged_kv import PagedKVCache


class DenseAttention:
    """Writes each step's KV into the paged cache, then attends causally over each request's context."""

    device_prefill: bool | None = None
    """Prefill rows attend without host round trips: block ids uploaded once per step (not once per layer, a
    blocking copy each), a chunk that is the whole sequence attends over its own rows, no [nq, nk] mask
    (:func:`attend_prefill`). None: on CUDA. The CPU path is the reference arithmetic (parity tests)."""

    def __init__(self, cache: PagedKVCache, scale: float, backend: str = "auto") -> None:
        """``backend``: the ops' ``"auto"`` (kernels / SDPA on CUDA) or ``"ref"`` (the references)."""
        self.cache, self.scale, self.backend = cache, scale, backend
        self.meta: StepMetadata | None = None
        self.context = ContextAttention(cache, None, None, scale, backend)

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
        self.context.memo = {}

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
        self.context.memo = {}
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
            self.context.attend(layer_idx, s, q, k, v, out, device_path)
        if self._paged is not None:
            # num_full: each request's loop ends at its own last block, not at the longest one's (or the
            # bucket's): at 1,024 requests of 128-1,344 tokens most of the table is padding
            r, ids, local, local_len, num_full = self._paged
            res = sparse_decode_attention(q[r][:, None], self.cache.k[layer_idx], self.cache.v[layer_idx], ids,
                                          local, local_len, self.scale, num_full=num_full, backend=self.backend)
            out[r] = res[:, 0]
        return out

    def end_step(self) -> None:
        self.meta = None
