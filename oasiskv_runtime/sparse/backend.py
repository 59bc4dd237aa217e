"""Sparse attention backend: every sparse mode of the engine, one code path.

Per decode step and layer (SPEC mechanism items 1-5):

1. the step's new K/V go to the request's primary store (device blocks for sparse-resident, the host pool
   for host-pool modes), to the working set's local block, and into the compressed key summaries;
2. the attention set is chosen per KV head: sparse-resident and fetch-on-demand predict it now from the
   current query (fetch-on-demand also copies missing blocks before attending); proxy-prefetch and oasiskv
   attend over what the previous step prefetched;
3. one attention call covers the normal row and, in oasiskv, the draft row (look-ahead attention);
4. proxy-prefetch / oasiskv then predict the next step's top-K (from the current query, or from the draft's
   query) and run Algorithm 2 + the transfer for this layer, so step t+1's layer l only waits for step t's
   layer-l transfer.

Prefill is dense (over the primary store); at its end the working set is filled from the last prompt
token's (or the draft's) prediction without a cap.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from oasiskv_runtime.attention.dense import PagedKVCache
from oasiskv_runtime.attention.metadata import SeqSlice, StepMetadata, written_rows
from oasiskv_runtime.attention.ref import attend, attend_prefill, causal_allowed
from oasiskv_runtime.config import Mode, SparseConfig
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager, cdiv
from oasiskv_runtime.ops.score_topk import quest_scores, quest_scores_ref, select_topk, select_topk_triton
from oasiskv_runtime.ops.select_plan import select_plan
from oasiskv_runtime.ops.sparse_attention import sparse_decode_attention
from oasiskv_runtime.ops.summary_update import update_summaries, update_summaries_runs
from oasiskv_runtime.ops.common import host_list_to
from oasiskv_runtime.ops.uva_gather import (PoolTier, uva_gather, uva_gather_blocks, uva_gather_blocks_ref,
                                            uva_scatter_rows)
from oasiskv_runtime.sparse.link_cap import LinkCap
from oasiskv_runtime.sparse.selector_torch import select_rows
from oasiskv_runtime.sparse.stats import SparseStats
from oasiskv_runtime.transfer.engine import SyncTransferEngine, TransferPlan
from oasiskv_runtime.transfer.runs import copy_runs, pool_runs

MAX_COPY_RUNS = 64
"""A prefill sequence whose pool rows fall in more runs than this is read and written by the UVA kernels (each
run costs two ``cudaMemcpyAsync`` calls per layer on the host)."""


def _pad(rows: list[list[int]], fill: int, device: torch.device) -> torch.Tensor:
    width = max(1, max((len(r) for r in rows), default=1))
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


@dataclass
class DecodeBatch:
    """Tensors for this step's sparse-decode requests (built once per step)."""

    slices: list[SeqSlice]
    state_rows: torch.Tensor       # [B] row of each request in the per-request state tensors
    q_rows: torch.Tensor           # [B] flattened row of the normal token
    draft_rows: torch.Tensor       # [B] flattened row of the draft token (= q_rows when no draft)
    has_draft: torch.Tensor        # [B] bool
    local_block: torch.Tensor      # [B] device block holding the active (partial) block
    local_len: torch.Tensor        # [B] valid tokens in it, including this step's token
    num_candidates: torch.Tensor   # [B] full logical blocks before the active block (this step)
    next_candidates: torch.Tensor  # [B] the same for the next step
    summary_table: torch.Tensor    # [B, S] device blocks of the summary rows
    primary_table: torch.Tensor    # [B, NB] logical -> device block (sparse-resident) or host block
    slot_blocks: torch.Tensor | None  # [B, K] device block of each working-set slot (host-pool modes)
    local_rows: torch.Tensor | None   # [B] flat device row of this step's token in the local block
    max_candidates: int = 0           # host-side maxima, so kernels never read them back from the device
    max_next_candidates: int = 0
    separate_draft_rows: bool = False
    """Static layout (CUDA graphs): every request has its own draft row, used or not."""


class SparseAttention:
    def __init__(self, mode: Mode, cfg: SparseConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 block_size: int, device_cache: PagedKVCache, host_cache: PagedKVCache | None,
                 kv: KVCacheManager, scale: float, max_rows: int, device: torch.device) -> None:
        self.mode, self.cfg = mode, cfg
        self.num_layers, self.hkv, self.head_dim, self.bs = num_layers, num_kv_heads, head_dim, block_size
        self.dev_cache, self.host_cache, self.kv = device_cache, host_cache, kv
        self.scale, self.device = scale, device
        self.k_slots = cfg.top_k_blocks
        self.use_kernels = cfg.kernels == "gpu" or (cfg.kernels == "auto" and device.type == "cuda")
        self.primary = host_cache if mode.uses_host_pool else device_cache
        elem = device_cache.k[0].element_size()
        self.stats = SparseStats(num_layers, bytes_per_head_block=2 * block_size * head_dim * elem)
        self.dense_layers = set(cfg.dense_layers)
        prefetched = num_layers - len(self.dense_layers)
        self.link_cap = LinkCap(self.k_slots, num_kv_heads * prefetched * self.stats.bytes_per_head_block)
        self.step_cap = cfg.fetch_cap
        """This step's admission cap per (request, KV head) for the prefetch (:meth:`new_step`)."""
        if mode.uses_host_pool:
            shape = (max_rows, num_layers, num_kv_heads, self.k_slots)
            self.slot_map = torch.full(shape, -1, dtype=torch.long, device=device)
            """Per-head mapping (SPEC item 5): logical block held by each working-set slot, -1 empty."""
            self.last_sel = torch.full(shape, -1, dtype=torch.long, device=device)
            self.transfer = SyncTransferEngine(host_cache.k, host_cache.v, device_cache.k, device_cache.v,
                                               tier_first=kv.tier_first)
        # The asynchronous pipeline (SPEC item 3) runs on CUDA with the kernels: prediction, selection and
        # transfer of layer l go to three background streams ordered by events; step t+1's layer l waits only
        # for step t's layer-l transfer event. Counters stay on the device: no host round trip per layer.
        self.async_pipeline = bool(mode.uses_host_pool and self.use_kernels and device.type == "cuda")
        if self.async_pipeline:
            self._streams: dict[int, list[torch.cuda.Stream]] = {}
            """The pipeline's streams by ``cfg.pipeline_priority`` (an A/B benchmark may change it)."""
            self.xfer_done: list[torch.cuda.Event | None] = [None] * num_layers
            self.dev_fetched = torch.zeros(num_layers, dtype=torch.long, device=device)
            self.dev_deferred = torch.zeros(num_layers, dtype=torch.long, device=device)
            self.dev_initial = torch.zeros((), dtype=torch.long, device=device)
            self.dev_step_max = torch.zeros((), dtype=torch.long, device=device)
            """Most blocks fetched in one step (the host counter cannot see the device's per-step counts)."""
            self.dev_total_before = torch.zeros((), dtype=torch.long, device=device)
            self.dev_req_fetched = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.pool_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if self.async_pipeline else None
        """Prefill traffic of the pool by copy engines (``copy_engine_prefill``): reads, writes. None on the CPU,
        where the same copies run in order (the path's data flow is tested there)."""
        self._copy_reads: dict[int, tuple[list, int]] = {}
        """Prefill sequences whose prefix the read stream brings back: seq id -> (runs, context length)."""
        self._copy_writes: list = []
        self._read_bufs: dict[int, tuple] = {}
        self._kernel_write_rows: torch.Tensor | None = None
        self._write_event = None
        self.remote = None
        """Prefill-decode, decode side: ``oasiskv_runtime.pd.remote.RemoteKV``; host blocks it marks absent
        are read from the prefill peer before they are copied to the device (a cache miss)."""
        self.pending_prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Prefix-cache hits: key summaries of a request's shared first blocks, written at its first step."""
        self.rows: dict[int, int] = {}
        self.free_rows = list(range(max_rows))
        self.ready: set[int] = set()
        self.pending_pred: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        self.meta: StepMetadata | None = None

    def _tier(self, layer: int) -> PoolTier | None:
        """The device tier of the full-KV pool (``CacheConfig.device_tier``): block ids from ``kv.tier_first``
        on are blocks of the device cache."""
        if self.kv.tier_first is None:
            return None
        return PoolTier(self.dev_cache.k[layer], self.dev_cache.v[layer], self.kv.tier_first)

    def _primary_gather(self, layer: int, block_table: list[int], num_tokens: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first ``num_tokens`` keys and values from its primary store, read where it lives (the
        host-side reference path)."""
        if self.kv.tier_first is None:
            return self.primary.gather(layer, block_table, num_tokens)
        ids = torch.tensor(block_table[:cdiv(num_tokens, self.bs)], dtype=torch.long)
        return uva_gather_blocks_ref(self.host_cache.k[layer], self.host_cache.v[layer], ids, num_tokens,
                                     tier=self._tier(layer))

    # ---- request lifecycle ------------------------------------------------------------------------
    def _row(self, seq_id: int) -> int:
        if seq_id not in self.rows:
            if not self.free_rows:
                raise RuntimeError("sparse backend: more running requests than state rows")
            self.rows[seq_id] = self.free_rows.pop()
        return self.rows[seq_id]

    def free_request(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is None:
            return
        if self.async_pipeline:
            self.stats.per_request[seq_id]["fetched_blocks"] += int(self.dev_req_fetched[row])
            self.dev_req_fetched[row] = 0
        self.ready.discard(seq_id)
        self.pending_prefix.pop(seq_id, None)
        if self.remote is not None:
            self.remote.forget(seq_id)
        if self.mode.uses_host_pool:
            self.slot_map[row] = -1
            self.last_sel[row] = -1
        self.free_rows.append(row)

    # ---- prefill-decode hand-off ---------------------------------------------------------------------
    def _summary_row(self, summary_blocks: list[int], j: int) -> int:
        """Flat device row holding logical block ``j``'s key summary (``block_size`` rows per summary block)."""
        return summary_blocks[j // self.bs] * self.bs + j % self.bs

    def _summary_index(self, seq_id: int, num_blocks: int) -> torch.Tensor:
        table = self.kv.requests[seq_id].summary_blocks
        return torch.tensor([self._summary_row(table, j) for j in range(num_blocks)], dtype=torch.long,
                            device=self.device)

    def _write_summaries(self, seq_id: int, summary_min: torch.Tensor, summary_max: torch.Tensor) -> None:
        """Key summaries ``[L, n, Hkv, D]`` of a request's first n logical blocks into its summary rows."""
        idx = self._summary_index(seq_id, summary_min.shape[1])
        for layer in range(self.num_layers):
            for t, src in ((self.dev_cache.k[layer], summary_min), (self.dev_cache.v[layer], summary_max)):
                t.view(-1, self.hkv, self.head_dim)[idx] = src[layer].to(self.device, t.dtype)

    def export_request(self, seq_id: int, context_len: int, step: int) -> dict:
        """What a decode peer needs to continue a request prefilled here exactly as this engine would: the
        key summaries of every block, and per layer and KV head the working-set map filled at the end of
        prefill (the first decode step's blocks), with selection stamps relative to ``step``."""
        if not self.mode.uses_host_pool:
            raise ValueError(f"export_request needs a host-pool mode, not {self.mode.value}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        row = self.rows[seq_id]
        nb = cdiv(context_len, self.bs)
        idx = self._summary_index(seq_id, nb)
        flat = lambda t: t.view(-1, self.hkv, self.head_dim)  # noqa: E731
        last = self.last_sel[row]
        return {
            "summary_min": torch.stack([flat(self.dev_cache.k[l])[idx] for l in range(self.num_layers)]).cpu(),
            "summary_max": torch.stack([flat(self.dev_cache.v[l])[idx] for l in range(self.num_layers)]).cpu(),
            "slot_map": self.slot_map[row].to("cpu", copy=True),  # a copy: the row is reset on release
            "last_sel": torch.where(last >= 0, last - (step - 1), torch.full_like(last, -1)).cpu(),
            "top_k_blocks": self.k_slots,
        }

    def import_request(self, seq_id: int, context_len: int, state: dict, step: int) -> None:
        """Install a request prefilled by a peer (its prompt KV already in the host pool, at least the blocks
        of ``state["slot_map"]`` and the partial last block): summaries, the per-head map, the working set."""
        if not self.mode.uses_host_pool:
            raise ValueError(f"import_request needs a host-pool mode, not {self.mode.value}")
        if self.kv.tier_first is not None:
            raise ValueError("a request prefilled by a peer arrives in the host pool: not supported with a "
                             "device tier (device_tier)")
        if state["top_k_blocks"] != self.k_slots:
            raise ValueError(f"prefill peer selects {state['top_k_blocks']} blocks per head, this engine "
                             f"{self.k_slots}: both sides need the same top_k_blocks")
        if self.dense_layers:
            raise ValueError("dense_layers read every block of the context: not supported for a request "
                             "prefilled by a peer")
        bs, dev = self.bs, self.device
        row = self._row(seq_id)
        rb = self.kv.requests[seq_id]
        smap = state["slot_map"].to(dev)
        last = state["last_sel"].to(dev)
        self.slot_map[row] = smap
        self.last_sel[row] = torch.where(last >= 0, last + (step - 1), torch.full_like(last, -1))
        host_table = torch.tensor(rb.host_blocks, dtype=torch.long, device=dev)
        slot_blocks = torch.tensor(rb.ws_blocks[1:], dtype=torch.long, device=dev)
        used = context_len % bs
        self._write_summaries(seq_id, state["summary_min"], state["summary_max"])
        for layer in range(self.num_layers):
            h, k = (smap[layer] >= 0).nonzero(as_tuple=True)
            plan = TransferPlan(layer, host_table[smap[layer][h, k]], slot_blocks[k], h)
            self.transfer.submit(plan)
            if self.async_pipeline:
                self.dev_initial += plan.num_copies
            else:
                self.stats.initial_fill_blocks += plan.num_copies
            if used:
                hb, local = rb.host_blocks[context_len // bs], rb.ws_blocks[0]
                self.dev_cache.k[layer][local, :used] = self.host_cache.k[layer][hb, :used].to(dev)
                self.dev_cache.v[layer][local, :used] = self.host_cache.v[layer][hb, :used].to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.ready.add(seq_id)

    # ---- per step ---------------------------------------------------------------------------------
    def new_step(self, sched) -> None:
        """A step starts (before its graph key is taken): its prefetch cap, from ``link_gbps`` and the measured
        step times, or the fixed ``fetch_cap``."""
        if not self.mode.prefetches:  # the other modes never read it: keep their graph keys fixed
            return
        decode = sum(1 for s in sched.scheduled if s.is_decode)
        self.step_cap = self.link_cap.new_step(decode, decode == len(sched.scheduled), self.cfg.fetch_cap,
                                               self.cfg.link_gbps)

    def begin_step(self, meta: StepMetadata) -> None:
        self.meta = meta
        if self.async_pipeline:
            # Last step's batch tensors are about to be freed and their memory reused on this stream: order
            # this stream after every background job that read them (a GPU-side wait, not a host sync).
            cur = torch.cuda.current_stream(self.device)
            for ev in self.xfer_done:
                if ev is not None:
                    cur.wait_event(ev)
        for s in meta.seqs:
            if s.seq_id in self.pending_prefix:
                self._write_summaries(s.seq_id, *self.pending_prefix.pop(s.seq_id))
        self._copy_reads, self._copy_writes, self._read_bufs = {}, [], {}
        self._kernel_write_rows, self._write_event = None, None
        static = meta.extra.get("static")
        if static is not None:
            self._bind_static(meta, static)
            return
        self._step_arg = meta.step
        self._written = host_list_to(written_rows(meta.seqs), torch.long, meta.slot_mapping.device)
        distinct = all(s.num_query == 1 for s in meta.seqs)  # decode: one token per summary row
        self._sum_rows, self._reset, self._runs = self._summary_rows(meta, runs=not distinct)
        decode = [s for s in meta.seqs if s.num_query == 1 and s.seq_id in self.ready]
        self._decode_ids = {s.seq_id for s in decode}
        self._prefill = [s for s in meta.seqs if s.seq_id not in self._decode_ids]
        self.batch = self._decode_batch(decode) if decode else None
        self.stats.begin_step(len(decode))
        device_path = self.device_prefill if self.device_prefill is not None else self.device.type == "cuda"
        copy_engines = (self.cfg.copy_engine_prefill and self.mode.uses_host_pool and device_path
                        and (self.async_pipeline or self.device.type == "cpu"))
        if self._prefill and copy_engines:
            self._plan_pool_copies(meta)

    # ---- prefill traffic of the pool by copy engines (SparseConfig.copy_engine_prefill) -------------------
    def _plan_pool_copies(self, meta: StepMetadata) -> None:
        """This step's pool rows of each prefill sequence as runs (:func:`pool_runs`): the chunk's own rows to
        write, its prefix to read back; rows of decode requests, and of sequences in too many runs, stay with the
        kernels (``_kernel_write_rows``). Layer 0's reads are issued here."""
        bs, tf = self.bs, self.kv.tier_first
        kernel_rows = [s.query_start for s in meta.seqs if s.seq_id in self._decode_ids]
        for s in self._prefill:
            prefix = s.context_len - s.num_query
            writes = pool_runs(s.block_table, prefix, s.num_query, s.query_start, bs, tf)
            if len(writes) <= MAX_COPY_RUNS:
                self._copy_writes += writes
            else:
                kernel_rows += range(s.query_start, s.query_start + s.num_query)
            if prefix:
                reads = pool_runs(s.block_table, 0, prefix, 0, bs, tf)
                if len(reads) <= MAX_COPY_RUNS:
                    self._copy_reads[s.seq_id] = (reads, s.context_len)
        if not self._copy_writes:  # reads alone would need the streams joined too: keep the kernels for both
            self._copy_reads = {}
            return
        self._kernel_write_rows = host_list_to(sorted(kernel_rows), torch.long, meta.slot_mapping.device)
        # Both side streams start after everything before this step (the previous step ended joined with them).
        for st in self.pool_streams or ():
            st.wait_stream(torch.cuda.current_stream(self.device))
        self._issue_reads(0)

    def _on_side(self, i: int):
        """Work on side stream ``i`` (0: pool reads, 1: pool writes); in order on the CPU."""
        return torch.cuda.stream(self.pool_streams[i]) if self.pool_streams else contextlib.nullcontext()

    def _side_event(self, i: int):
        return self.pool_streams[i].record_event() if self.pool_streams else None

    def _wait_side(self, event, *tensors: torch.Tensor) -> None:
        """The current stream waits for ``event`` of a side stream and takes over ``tensors`` made there."""
        if event is None:
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        for t in tensors:
            t.record_stream(cur)

    def _pool_parts(self, layer: int) -> tuple[tuple, tuple | None]:
        tier = self._tier(layer)
        return (self.host_cache.k[layer], self.host_cache.v[layer]), (None if tier is None else tier[:2])

    def _issue_reads(self, layer: int) -> None:
        """Read layer ``layer``'s prefixes into fresh buffers on the read stream (once per layer and step)."""
        if layer >= self.num_layers or layer in self._read_bufs or not self._copy_reads:
            return
        pool, tier = self._pool_parts(layer)
        shape, dt = (self.hkv, self.head_dim), self.host_cache.k[layer].dtype
        bufs = {}
        with self._on_side(0):
            for seq_id, (runs, ctx) in self._copy_reads.items():
                buf = (torch.empty((ctx, *shape), dtype=dt, device=self.device),
                       torch.empty((ctx, *shape), dtype=dt, device=self.device))
                copy_runs(runs, pool, tier, buf, to_pool=False)
                bufs[seq_id] = buf
            self._read_bufs[layer] = (self._side_event(0), bufs)

    def _write_pool(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's new KV into the pool: prefill runs by the copy engine on the write stream, the rest (decode
        rows, sequences in too many runs) by the scatter kernel on this stream."""
        pool, tier = self._pool_parts(layer)
        if self.pool_streams:
            ws = self.pool_streams[1]
            ws.wait_stream(torch.cuda.current_stream(self.device))
            k.record_stream(ws)  # read there: kept until the copies are done
            v.record_stream(ws)
        with self._on_side(1):
            copy_runs(self._copy_writes, pool, tier, (k, v), to_pool=True)
            self._write_event = self._side_event(1)
        rows = self._kernel_write_rows
        if rows.numel():
            uva_scatter_rows(k[rows], v[rows], pool[0], pool[1], self.meta.slot_mapping[rows],
                             tier=self._tier(layer))

    def _pool_join(self) -> None:
        """At the end of a step that used the copy streams: the current stream waits for their copies, so the next
        step (and anything forked from its stream) sees the pool written."""
        if self._copy_writes and self.pool_streams:
            cur = torch.cuda.current_stream(self.device)
            for st in self.pool_streams:
                cur.wait_stream(st)

    # ---- the static layout of decode-only steps (engine/cuda_graphs.py) ------------------------------
    def graph_unsupported(self) -> str | None:
        """Why decode steps cannot run on the static layout / CUDA graphs now (None: they can)."""
        if self.remote is not None:
            return "prefill-decode remote KV (cache misses are checked on the host)"
        if self.cfg.measure_recall:
            return "measure_recall (recall is accumulated on the host)"
        if self.dense_layers:
            return "dense_layers (they read each request's whole context by its block list)"
        if self.device.type == "cuda" and not self.use_kernels:
            return "kernels='ref' on CUDA (the reference ops read back from the device)"
        return None

    def graph_ready(self, seq_ids: list[int]) -> bool:
        return self.graph_unsupported() is None and all(i in self.ready for i in seq_ids)

    def graph_key(self) -> tuple:
        """Python values a captured step bakes in besides the batch shape."""
        return (self.step_cap, self.cfg.disable_transfers, self.cfg.fetch_on_demand_cap, self.cfg.sink_blocks,
                self.cfg.gather_ctas, self.cfg.gather_copies, self.cfg.gather_hint, self.cfg.select_kernel,
                self.cfg.pipeline_priority)

    @property
    def streams(self) -> list[torch.cuda.Stream]:
        """The prediction, selection and transfer streams, at ``cfg.pipeline_priority``."""
        prio = self.cfg.pipeline_priority
        streams = self._streams.get(prio)
        if streams is None:
            streams = self._streams[prio] = [torch.cuda.Stream(self.device, priority=prio) for _ in range(3)]
        return streams

    def graph_fields(self, seqs, ctxs, tables, rows, has_draft, fields, static, max_blocks) -> dict:
        """Add this backend's per-request vectors to ``fields`` and update its per-request tables."""
        bs, host = self.bs, self.mode.uses_host_pool
        primary = static.table("primary", max_blocks, 0)
        summary = static.table("summary", cdiv(max_blocks, bs), 0, torch.int32)  # the score kernel's dtype
        slot_table = static.table("slots", self.k_slots, 0) if host else None
        sum_rows, reset = [], []
        for seq, ctx, table, row in zip(seqs, ctxs, tables, rows):
            rb = self.kv.requests[seq.seq_id]
            p = ctx - 1
            sum_rows.append(self._summary_row(rb.summary_blocks, p // bs))
            reset.append(int(p % bs == 0))
            primary.set(row, seq.seq_id, table)
            summary.set(row, seq.seq_id, rb.summary_blocks)
            if host:
                slot_table.set(row, seq.seq_id, rb.ws_blocks[1:])
        fields.update(self._decode_vectors([seq.seq_id for seq in seqs], ctxs))
        fields.update(sum_rows=sum_rows, reset=reset, has_draft=[int(d) for d in has_draft])
        # int32 candidate counts: the score and ranking kernels' dtype (converted once per step, not per layer)
        return {"reset": torch.bool, "has_draft": torch.bool, "num_candidates": torch.int32,
                "next_candidates": torch.int32}

    def _bind_static(self, meta: StepMetadata, st) -> None:
        """Point the step's state at the static buffers (every tensor the forward reads is persistent)."""
        v, t = st.vec, st.tables
        self._step_arg = v["step"][0] if self.async_pipeline else meta.step
        self._written = st.q_rows
        self._sum_rows, self._reset, self._runs = v["sum_rows"], v["reset"], None
        self._decode_ids = {s.seq_id for s in meta.seqs}
        self._prefill = []
        self.batch = DecodeBatch(
            slices=meta.seqs, state_rows=v["state_rows"], q_rows=st.q_rows, draft_rows=st.draft_rows,
            has_draft=v["has_draft"], local_block=v["local_block"], local_len=v["local_len"],
            num_candidates=v["num_candidates"], next_candidates=v["next_candidates"], summary_table=t["summary"],
            primary_table=t["primary"], slot_blocks=t.get("slots"), local_rows=v.get("local_rows"),
            max_candidates=st.block_bucket, max_next_candidates=st.block_bucket,
            separate_draft_rows=self.mode.uses_draft)
        self.stats.begin_step(len(meta.seqs))

    def graph_join(self) -> None:
        """Make the current stream wait for the background streams (a captured step must end joined)."""
        if self.async_pipeline and self.mode.prefetches:  # fetch-on-demand never forks onto them
            cur = torch.cuda.current_stream(self.device)
            for s in self.streams:
                cur.wait_stream(s)

    def graph_replayed(self) -> None:
        """Forget the per-layer transfer events. After a replay: it ended joined on the current stream, so later
        work there is ordered after every transfer. Before a capture: events recorded outside it cannot be
        waited on inside it, and the capture starts after a device synchronize, so nothing is outstanding."""
        if self.async_pipeline:
            self.xfer_done = [None] * self.num_layers
        # A capture re-runs the step that just ran eagerly, with the same metadata: its per-step tensors
        # (:meth:`_step_rows`) must be made again inside the capture, or the graph would read the eager run's
        # copies (outside its pool, never rewritten) on every replay.
        self._memo_meta = self._memo = None

    before_capture = graph_replayed

    def _summary_rows(self, meta: StepMetadata, runs: bool):
        """``(rows, reset, None)``: the flat summary row and reset flag of every written token (one row per
        logical block; each row at most once, decode); with ``runs`` (a prefill chunk in the step)
        ``(None, None, layout)``: the run layout of :func:`update_summaries_runs` instead."""
        bs, dev = self.bs, self.device
        if runs:
            pad_idx, run_rows, run_reset = self._summary_runs(meta.seqs)
            return None, None, (host_list_to(pad_idx, torch.long, dev), host_list_to(run_rows, torch.long, dev),
                                host_list_to(run_reset, torch.bool, dev))
        rows, reset = [], []
        for s in meta.seqs:
            table = self.kv.requests[s.seq_id].summary_blocks
            for p in range(s.context_len - s.num_query, s.context_len):
                rows.append(self._summary_row(table, p // bs))
                reset.append(p % bs == 0)
        return host_list_to(rows, torch.long, dev), host_list_to(reset, torch.bool, dev), None

    def _summary_runs(self, seqs: list[SeqSlice]) -> tuple[list[int], list[int], list[bool]]:
        """:func:`token_runs` of the step's written tokens, built a logical block at a time (a sequence's positions
        are consecutive and each block has its own summary row), not a token at a time: an 8K-token chunk is 512
        runs, and this runs on the host before the step's first launch."""
        bs = self.bs
        pad_idx: list[int] = []
        run_rows: list[int] = []
        run_reset: list[bool] = []
        i = 0  # the run's first token among the written rows (``written_rows`` order: by sequence, by position)
        for s in seqs:
            table = self.kv.requests[s.seq_id].summary_blocks
            p, end = s.context_len - s.num_query, s.context_len
            while p < end:
                j, off = divmod(p, bs)
                n = min(bs - off, end - p)
                pad_idx += range(i, i + n)
                pad_idx += [i] * (bs - n)
                run_rows.append(self._summary_row(table, j))
                run_reset.append(off == 0)
                i, p = i + n, p + n
        return pad_idx, run_rows, run_reset

    def _decode_vectors(self, seq_ids: list[int], ctxs: list[int]) -> dict[str, list[int]]:
        """Per-request decode-step values (eager batches and the static layout alike): state row, active block
        and its valid tokens, full blocks before it now and at the next step, and in host-pool modes the flat
        row this step's token takes in the local block."""
        bs, host = self.bs, self.mode.uses_host_pool
        out: dict[str, list[int]] = {k: [] for k in ("state_rows", "local_block", "local_len", "num_candidates",
                                                     "next_candidates")}
        if host:
            out["local_rows"] = []
        for seq_id, ctx in zip(seq_ids, ctxs):
            rb = self.kv.requests[seq_id]
            p = ctx - 1
            out["state_rows"].append(self._row(seq_id))
            out["local_len"].append(p % bs + 1)
            out["num_candidates"].append(p // bs)
            out["next_candidates"].append(ctx // bs)
            if host:
                out["local_block"].append(rb.ws_blocks[0])
                out["local_rows"].append(rb.ws_blocks[0] * bs + p % bs)
            else:
                out["local_block"].append(rb.device_blocks[p // bs])
        return out

    def _decode_batch(self, decode: list[SeqSlice]) -> DecodeBatch:
        dev, host = self.device, self.mode.uses_host_pool
        vec = self._decode_vectors([s.seq_id for s in decode], [s.context_len for s in decode])
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        return DecodeBatch(
            slices=decode,
            state_rows=t(vec["state_rows"]),
            q_rows=t([s.query_start for s in decode]),
            draft_rows=t([s.draft_row if s.draft_row is not None else s.query_start for s in decode]),
            has_draft=torch.tensor([s.draft_row is not None for s in decode], device=dev),
            local_block=t(vec["local_block"]),
            local_len=t(vec["local_len"]),
            num_candidates=t(vec["num_candidates"]).int(),  # the score and ranking kernels' dtype
            next_candidates=t(vec["next_candidates"]).int(),
            summary_table=_pad([self.kv.requests[s.seq_id].summary_blocks for s in decode], 0, dev).int(),
            primary_table=_pad([s.block_table for s in decode], 0, dev),
            slot_blocks=t([self.kv.requests[s.seq_id].ws_blocks[1:] for s in decode]) if host else None,
            local_rows=t(vec["local_rows"]) if host else None,
            max_candidates=max(vec["num_candidates"]),
            max_next_candidates=max(vec["next_candidates"]),
        )

    # ---- the layer --------------------------------------------------------------------------------
    def _step_rows(self, key: str, make) -> torch.Tensor:
        """A per-step index tensor every layer reads (made by the first layer's forward, so a captured step
        holds one copy of the ops that make it, not one per layer)."""
        memo = self._step_cache()
        if key not in memo:
            memo[key] = make()
        return memo[key]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, w = self.meta, self._written
        kw, vw = k[w], v[w]  # this step's written rows, read by the pool write, the local block and the summaries
        if self._copy_writes:
            self._write_pool(layer, k, v)
        elif self.mode.uses_host_pool and (k.is_cuda or self.kv.tier_first is not None):
            uva_scatter_rows(kw, vw, self.host_cache.k[layer], self.host_cache.v[layer],
                             self._step_rows("pool_rows", lambda: meta.slot_mapping[w]), tier=self._tier(layer))
        else:
            self.primary.write(layer, meta.slot_mapping[w].to(self.primary.k[layer].device), kw, vw)
        b = self.batch
        if self.async_pipeline and self.xfer_done[layer] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.xfer_done[layer])  # layer-local sync
        if b is not None and b.local_rows is not None:
            same = b.q_rows is w  # the static layout writes exactly the decode rows
            self.dev_cache.write(layer, b.local_rows, kw if same else k[b.q_rows], vw if same else v[b.q_rows])
        if self._runs is not None:
            update_summaries_runs(kw, *self._runs, self.dev_cache.k[layer], self.dev_cache.v[layer],
                                  backend="auto" if self.use_kernels else "ref")
        elif self._sum_rows.numel():  # decode rows only: one token per summary row
            update_summaries(kw, self._sum_rows, self._reset, self.dev_cache.k[layer], self.dev_cache.v[layer],
                             assume_distinct=True)
        self._issue_reads(layer + 1)  # the next layer's prefixes, while this one computes
        out = torch.empty_like(q)
        dense_layer = layer in self.dense_layers
        for s in self._prefill + (b.slices if (b is not None and dense_layer) else []):
            self._dense_seq(layer, s, q, k, v, out)
        if b is not None and not dense_layer:
            self._sparse_decode(layer, b, q, k, v, out)
        if b is not None and self.mode.prefetches:
            self._prefetch(layer, b, q[self._pred_rows(b)])
        self._init_finished_prefills(layer, q)
        return out

    device_prefill: bool | None = None
    """Prefill (and dense-layer) attention reads the context with device ops only: the chunk's own rows from
    this step's k/v, earlier tokens by one UVA gather launch from the pinned host pool (host-pool modes) or an
    index_select of the device cache, block ids uploaded once per step; no host sync and no host-side read of
    the pool. None: on CUDA. The host path below stays the CPU reference (bit-parity with transformers)."""

    def _use_device_prefill(self, q: torch.Tensor) -> bool:
        return self.device_prefill if self.device_prefill is not None else q.is_cuda

    def _step_cache(self) -> dict:
        """Per-step memo of the device tensors the prefill helpers build (one upload per step, not per layer)."""
        if getattr(self, "_memo_meta", None) is not self.meta:
            self._memo_meta, self._memo = self.meta, {}
        return self._memo

    def _pool_gather_backend(self) -> str:
        """``uva_gather_blocks`` backend for the host pool: the kernel on CUDA; without kernels the reference
        reads the pinned pool on the host, so it must first wait for this stream's UVA writes to land."""
        if self.device.type == "cuda" and not self.use_kernels:
            torch.cuda.current_stream(self.device).synchronize()
            return "ref"
        return "auto"

    def _context_kv(self, layer: int, s: SeqSlice, kc: torch.Tensor, vc: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[context_len, Hkv, D] keys and values of ``s``: the tokens before this step's rows read from the
        primary store, then this step's rows ``kc``/``vc`` (already on the device: not read back)."""
        prefix = s.context_len - s.num_query
        read = self._read_bufs.get(layer)
        if read is not None and s.seq_id in read[1]:  # read ahead by the copy engine
            ks, vs = read[1].pop(s.seq_id)
            self._wait_side(read[0], ks, vs)
            ks[prefix:] = kc
            vs[prefix:] = vc
            return ks, vs
        memo = self._step_cache()
        key = ("ctx", s.seq_id)
        blocks = memo.get(key)
        if blocks is None:
            blocks = memo[key] = host_list_to(s.block_table[:-(-prefix // self.bs)], torch.long, kc.device)
        if not self.mode.uses_host_pool:
            ks = self.dev_cache.k[layer].index_select(0, blocks).flatten(0, 1)[:prefix]
            vs = self.dev_cache.v[layer].index_select(0, blocks).flatten(0, 1)[:prefix]
            return torch.cat([ks, kc]), torch.cat([vs, vc])
        ks, vs = uva_gather_blocks(self.host_cache.k[layer], self.host_cache.v[layer], blocks, prefix,
                                   s.context_len, backend=self._pool_gather_backend(), tier=self._tier(layer))
        ks[prefix:] = kc
        vs[prefix:] = vc
        return ks, vs

    def _dense_seq_device(self, layer: int, s: SeqSlice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor) -> None:
        """:meth:`_dense_seq` without host round trips (see ``device_prefill``); a chunk that is the whole
        context attends over its own rows and reads nothing."""
        rows = slice(s.query_start, s.query_start + s.num_query)
        if s.num_query == s.context_len:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = self._context_kv(layer, s, k[rows], v[rows])
        out[rows] = attend_prefill(q[rows], ks, vs, self.scale)
        if s.draft_row is not None:
            d = s.draft_row
            kd, vd = torch.cat([ks, k[d:d + 1]]), torch.cat([vs, v[d:d + 1]])
            out[d:d + 1] = attend(q[d:d + 1], kd, vd, self.scale)

    def _dense_seq(self, layer: int, s: SeqSlice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor) -> None:
        """Causal attention over the full context from the primary store (prefill, and dense layers)."""
        if self._use_device_prefill(q):
            self._dense_seq_device(layer, s, q, k, v, out)
            return
        if q.is_cuda and self.mode.uses_host_pool:
            torch.cuda.current_stream(self.device).synchronize()  # UVA writes must land before the CPU reads
        ks, vs = self._primary_gather(layer, s.block_table, s.context_len)
        ks, vs = ks.to(q.device), vs.to(q.device)
        rows = slice(s.query_start, s.query_start + s.num_query)
        allowed = causal_allowed(s.num_query, s.context_len, q.device) if s.num_query > 1 else None
        out[rows] = attend(q[rows], ks, vs, self.scale, allowed)
        if s.draft_row is not None:
            d = s.draft_row
            kd, vd = torch.cat([ks, k[d:d + 1]]), torch.cat([vs, v[d:d + 1]])
            out[d:d + 1] = attend(q[d:d + 1], kd, vd, self.scale)

    def _predict(self, layer: int, query: torch.Tensor, b: DecodeBatch, next_step: bool) -> torch.Tensor:
        """Top-K logical blocks per KV head [B, Hkv, K] (-1 padded) from the summaries, over this step's
        candidate blocks or (``next_step``) the next step's."""
        sum_min, sum_max = self.dev_cache.k[layer], self.dev_cache.v[layer]
        if next_step:
            num_candidates, max_candidates = b.next_candidates, b.max_next_candidates
        else:
            num_candidates, max_candidates = b.num_candidates, b.max_candidates
        args = (query, sum_min, sum_max, b.summary_table, num_candidates, self.hkv, max_candidates)
        scores = quest_scores(*args) if self.use_kernels else quest_scores_ref(*args)
        if self.cfg.sink_blocks and scores.shape[-1]:
            sink = min(self.cfg.sink_blocks, scores.shape[-1])
            head = scores[..., :sink]
            scores[..., :sink] = torch.where(torch.isinf(head), head, torch.full_like(head, float("inf")))
        if self.use_kernels and scores.is_cuda:
            ids, _ = select_topk_triton(scores, num_candidates, self.k_slots, with_valid=False)
        else:
            ids, _ = select_topk(scores, num_candidates, self.k_slots)
        # The fused selection kernel reads the ranking's int32 ids as they are; every other reader indexes with them.
        to_plan = next_step and self.async_pipeline and self.cfg.select_kernel and not self.cfg.measure_recall
        return ids if to_plan else ids.long()

    def _pred_rows(self, b: DecodeBatch) -> torch.Tensor:
        """Per request, the row whose query predicts its next step's blocks: the draft's, else its own."""
        return self._step_rows("pred_rows", lambda: torch.where(b.has_draft, b.draft_rows, b.q_rows))

    def _sparse_decode(self, layer: int, b: DecodeBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor) -> None:
        # The normal and draft queries of each request, stacked, in one index op: [B, 2, Hq, D].
        qd_rows = self._step_rows("qd_rows", lambda: torch.stack([b.q_rows, b.draft_rows], dim=1).flatten())
        qs = q[qd_rows].view(b.q_rows.numel(), 2, *q.shape[1:])
        q_norm = qs[:, 0]
        if self.mode is Mode.SPARSE_RESIDENT:
            pred = self._predict(layer, q_norm, b, next_step=False)
            block_ids = torch.where(pred >= 0, b.primary_table.gather(1, pred.clamp_min(0).flatten(1)).view_as(pred),
                                    pred)
        else:
            if self.mode is Mode.FETCH_ON_DEMAND:
                pred = self._predict(layer, q_norm, b, next_step=False)
                cap = self.cfg.fetch_cap if self.cfg.fetch_on_demand_cap else self.k_slots
                self._select_and_fetch(layer, b, pred, cap)
            elif self.cfg.measure_recall:
                self._record_recall(layer, b, q_norm)
            smap = self.slot_map[b.state_rows, layer]                         # [B, Hkv, K]
            slots = self._step_rows("slots_i32", lambda: b.slot_blocks.int()[:, None, :])
            block_ids = torch.where(smap >= 0, slots.expand(smap.shape), -1)
        local_block = self._step_rows("local_block_i32", lambda: b.local_block.int())
        local_len = self._step_rows("local_len_i32", lambda: b.local_len.int())
        res = sparse_decode_attention(qs, self.dev_cache.k[layer], self.dev_cache.v[layer], block_ids.int(),
                                      local_block, local_len, self.scale, k[b.draft_rows], v[b.draft_rows],
                                      backend="auto" if self.use_kernels else "ref")
        if b.separate_draft_rows:  # every request has its own draft row: both outputs in one index op
            out[qd_rows] = res.flatten(0, 1)
            return
        out[b.q_rows] = res[:, 0]
        # Requests without a draft have draft_rows == q_rows: write their normal output again rather than
        # boolean-index (which would synchronise with the host).
        out[self._pred_rows(b)] = torch.where(b.has_draft[:, None, None], res[:, 1], res[:, 0])

    def _plan_and_fetch(self, layer: int, b: DecodeBatch, pred: torch.Tensor, cap: int, initial: bool,
                        stream: torch.cuda.Stream | None = None) -> None:
        """Algorithm 2 and a fixed-size transfer plan (at most ``cap`` copies per row) in one launch
        (:func:`select_plan`), so no host round trip is needed to compact the admitted slots; then one UVA
        gather for the layer, on ``stream`` when given (ordered after the plan)."""
        counters = ((self.dev_initial,) if initial else
                    (self.dev_fetched[layer], self.dev_deferred[layer], self.dev_req_fetched))
        src, dst, head = select_plan(self.slot_map[:, layer], self.last_sel[:, layer], b.state_rows, pred, cap,
                                     self._step_arg, b.primary_table, b.slot_blocks, *counters,
                                     backend="auto" if self.use_kernels and self.cfg.select_kernel else "ref")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in (src, dst, head):
                t.record_stream(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if self.remote is not None:
                self.remote.ensure(layer, src[src >= 0])  # a host round trip: prefill-decode cache misses only
            if not self.cfg.disable_transfers:
                uva_gather(self.host_cache.k[layer], self.host_cache.v[layer], self.dev_cache.k[layer],
                           self.dev_cache.v[layer], src, dst, head, programs=self.cfg.gather_ctas,
                           copies=self.cfg.gather_copies, hint=self.cfg.gather_hint,
                           tier=self._tier(layer))
            if stream is not None:
                self.xfer_done[layer] = stream.record_event()

    def _select_and_fetch(self, layer: int, b: DecodeBatch, pred: torch.Tensor, cap: int,
                          initial: bool = False) -> None:
        """Algorithm 2 on every (request, head) row of this layer, then one batched transfer."""
        if self.async_pipeline:
            self._plan_and_fetch(layer, b, pred, cap, initial)
            return
        # Algorithm 2 on every (request, head) row of this layer; rewrites the per-head map.
        plan = select_rows(self.slot_map[:, layer], self.last_sel[:, layer], b.state_rows, pred, cap, self._step_arg)
        rows, slot_blocks, primary = b.state_rows, b.slot_blocks, b.primary_table
        n, kk = rows.numel(), self.k_slots
        new_map = plan.new_slot_blocks.view(n, self.hkv, kk)
        bi, hi, si = plan.admit_mask.view(n, self.hkv, kk).nonzero(as_tuple=True)
        logical = new_map[bi, hi, si]
        if self.remote is not None:
            self.remote.ensure(layer, primary[bi, logical])
        if not self.cfg.disable_transfers:
            self.transfer.submit(TransferPlan(layer, primary[bi, logical], slot_blocks[bi, si], hi))
        per_request = torch.bincount(bi, minlength=n).tolist()
        self.stats.add_transfer(layer, [s.seq_id for s in b.slices], per_request,
                                plan.num_deferred.view(n, self.hkv).sum(1).tolist(), initial)

    def _prefetch(self, layer: int, b: DecodeBatch, pred_q: torch.Tensor) -> None:
        if not self.async_pipeline:
            pred = self._predict(layer, pred_q, b, next_step=True)
            self._remember_prediction(layer, b, pred)
            self._select_and_fetch(layer, b, pred, self.step_cap)
            return
        # predict -> select -> transfer on three streams; the transfer also waits for this layer's attention,
        # which still reads the slots it is about to overwrite.
        # A tensor made on one stream and read on another is marked with record_stream: otherwise its memory
        # could be handed to the producing stream's next allocation (the next layer's) while the consumer
        # still reads it. Eagerly the slow host hid this; a captured graph runs at GPU speed.
        s_pred, s_sel, s_xfer = self.streams
        attn_done = torch.cuda.current_stream(self.device).record_event()
        s_pred.wait_event(attn_done)
        pred_q.record_stream(s_pred)
        with torch.cuda.stream(s_pred):
            pred = self._predict(layer, pred_q, b, next_step=True)
            self._remember_prediction(layer, b, pred)
        s_sel.wait_stream(s_pred)
        pred.record_stream(s_sel)
        with torch.cuda.stream(s_sel):
            self._plan_and_fetch(layer, b, pred, self.step_cap, initial=False, stream=s_xfer)

    def _remember_prediction(self, layer: int, b: DecodeBatch, pred: torch.Tensor) -> None:
        """Keep this step's prediction for the next step's recall (with the requests it was made for)."""
        if self.cfg.measure_recall:
            self.pending_pred[layer] = (b.state_rows.clone(), pred, [x.seq_id for x in b.slices])

    def _record_recall(self, layer: int, b: DecodeBatch, q_true: torch.Tensor) -> None:
        """Recall of last step's prediction for this layer against the true query's top-K (SPEC item 1)."""
        prev = self.pending_pred.pop(layer, None)
        if prev is None:
            return
        prev_rows, prev_pred, prev_ids = prev
        true = self._predict(layer, q_true, b, next_step=False)
        match = (prev_rows[:, None] == b.state_rows[None, :]).nonzero(as_tuple=True)
        for i_prev, i_now in zip(*match):
            if prev_ids[int(i_prev)] != b.slices[int(i_now)].seq_id:
                continue  # the row now holds another request (the predicting one left, e.g. a warm-up's)
            if int(b.num_candidates[i_now]) <= self.k_slots:
                continue  # everything fits: recall is trivially 1 and would only inflate the average
            t, p = true[i_now], prev_pred[i_prev]                               # [Hkv, K]
            hits = (t[:, :, None] == p[:, None, :]).any(-1) & (t >= 0)
            self.stats.add_recall(layer, hits.sum().item(), (t >= 0).sum().item(), prev_ids[int(i_prev)])

    def _finished_prefill_batch(self, done: list[SeqSlice]) -> DecodeBatch:
        """The batch that fills the working sets of requests whose prefill completes this step (built once per
        step and reused by every layer; on CUDA uploaded without a host sync)."""
        memo = self._step_cache()
        fake = memo.get("finished")
        if fake is not None:
            return fake
        bs, dev = self.bs, self.device
        long = lambda xs: host_list_to(xs, torch.long, dev)  # noqa: E731
        pad = lambda rows: long([r + [0] * (max(1, *map(len, rows)) - len(r)) for r in rows])  # noqa: E731
        rows = long([self._row(s.seq_id) for s in done])
        qi = long([s.draft_row if (s.draft_row is not None and self.mode.uses_draft)
                   else s.query_start + s.num_query - 1 for s in done])
        ws = [self.kv.requests[s.seq_id].ws_blocks for s in done]
        n_cand = long([s.context_len // bs for s in done])
        fake = memo["finished"] = DecodeBatch(
            slices=done, state_rows=rows, q_rows=qi, draft_rows=qi, has_draft=torch.zeros_like(rows, dtype=torch.bool),
            local_block=long([w[0] for w in ws]), local_len=rows, num_candidates=n_cand, next_candidates=n_cand,
            summary_table=pad([self.kv.requests[s.seq_id].summary_blocks for s in done]),
            primary_table=pad([s.block_table for s in done]), slot_blocks=long([w[1:] for w in ws]),
            local_rows=None, max_next_candidates=max(s.context_len // bs for s in done))
        return fake

    def _copy_tail_blocks(self, layer: int, done: list[SeqSlice]) -> None:
        """The active block's earlier tokens (the prompt's tail) into each request's local slot, by device ops:
        the tail block is gathered from the pinned pool (UVA, stream-ordered after this step's writes) into a
        scratch tensor and its first ``used`` rows are copied into the slot."""
        memo = self._step_cache()
        for s in done:
            j, used = s.context_len // self.bs, s.context_len % self.bs
            if not used:
                continue
            key = ("tail", s.seq_id)
            hb = memo.get(key)
            if hb is None:
                hb = memo[key] = host_list_to([s.block_table[j]], torch.long, self.device)
            tk, tv = uva_gather_blocks(self.host_cache.k[layer], self.host_cache.v[layer], hb, used,
                                       backend=self._pool_gather_backend(), tier=self._tier(layer))
            local = self.kv.requests[s.seq_id].ws_blocks[0]
            self.dev_cache.k[layer][local, :used] = tk
            self.dev_cache.v[layer][local, :used] = tv

    def _init_finished_prefills(self, layer: int, q: torch.Tensor) -> None:
        done = [s for s in self._prefill if s.completes]
        if not done:
            return
        if not self.mode.uses_host_pool:
            return
        self._wait_side(self._write_event)  # the chunk's rows must be in the pool before the first fill reads them
        fake = self._finished_prefill_batch(done)
        rows = fake.state_rows
        pred = self._predict(layer, q[fake.q_rows], fake, next_step=True)
        # index_fill_, not `[rows, layer] = -1`: that assignment copies the -1 up as a pageable 0-dim tensor, a
        # host sync in the middle of the layer loop (2 per layer of every step that completes a prefill).
        self.slot_map[:, layer].index_fill_(0, rows, -1)
        self.last_sel[:, layer].index_fill_(0, rows, -1)
        self._select_and_fetch(layer, fake, pred, self.k_slots, initial=True)
        # The active block's earlier tokens (the prompt's tail) go into the local slot.
        if self._use_device_prefill(q):
            self._copy_tail_blocks(layer, done)
            return
        bs = self.bs
        if q.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        for s in done:
            j, used = s.context_len // bs, s.context_len % bs
            if used:
                tk, tv = self._primary_gather(layer, s.block_table[j:j + 1], used)
                local = self.kv.requests[s.seq_id].ws_blocks[0]
                self.dev_cache.k[layer][local, :used] = tk.to(self.device)
                self.dev_cache.v[layer][local, :used] = tv.to(self.device)

    def end_step(self) -> None:
        if self.meta is not None:
            for s in self.meta.seqs:
                if s.completes and s.seq_id not in self._decode_ids:
                    self._row(s.seq_id)
                    self.ready.add(s.seq_id)
        self.stats.end_step()
        self._pool_join()
        self._read_bufs = {}
        if self.async_pipeline:
            # On the transfer stream, which counts the fetches eagerly, after the current stream too (a graph
            # replay counts them there): ordered after this step's fetches, no host sync.
            xs = self.streams[2]
            xs.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(xs):
                total = self.dev_fetched.sum()
                torch.maximum(self.dev_step_max, total - self.dev_total_before, out=self.dev_step_max)
                self.dev_total_before.copy_(total)
        self.meta = None

    # ---- reporting --------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero the traffic and recall counters (benchmarks measure a window of steps)."""
        self.stats = SparseStats(self.num_layers, self.stats.bytes_per_head_block)
        self.link_cap.reset_counts()
        self.pending_pred.clear()
        if self.async_pipeline:
            torch.cuda.current_stream(self.device).wait_stream(self.streams[2])  # its counting is done
            for t in (self.dev_fetched, self.dev_deferred, self.dev_initial, self.dev_req_fetched,
                      self.dev_step_max, self.dev_total_before):
                t.zero_()

    def run_stats(self) -> dict:
        if self.async_pipeline:
            self.stats.fetched_by_layer = self.dev_fetched.tolist()
            self.stats.deferred_by_layer = self.dev_deferred.tolist()
            self.stats.initial_fill_blocks = int(self.dev_initial)
            self.stats.max_step_fetched = int(self.dev_step_max)
        out = self.stats.run_stats()
        if self.mode.prefetches:
            out["mean_fetch_cap"] = self.link_cap.mean_cap()
        return out

    def request_metrics(self, seq_id: int) -> dict:
        return self.stats.request_metrics(seq_id)
