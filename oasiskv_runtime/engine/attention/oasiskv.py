"""The embedded engine's attention backend for every sparse mode: an adapter from the engine's step (``meta.sparse``,
built by the model runner) to the OasisKV core (``oasiskv_runtime/core``). Per decode step and layer:

1. the step's new K/V go to the full-KV store (device blocks for sparse-resident, the pool for host-pool modes), the
   working set's local block and the key summaries (and with ``max_logit_b2`` the key codes of the blocks they fill);
2. sparse-resident and fetch-on-demand predict each KV head's attention set now (fetch-on-demand copies the missing
   blocks first); proxy-prefetch and oasiskv attend over what the previous step prefetched (``pipeline.wait``);
3. one attention call covers the normal row and, in oasiskv, the draft row (look-ahead attention);
4. proxy-prefetch / oasiskv hand the layer to the pipeline (predict the next step's top-K, select, copy).

Prefill is dense over the full-KV store; at its end the working set is filled from the last prompt token's (or the
draft's) prediction without a cap.
"""

from __future__ import annotations

import dataclasses

import torch

from oasiskv_runtime.config import CODED_KEY_SCORES, EngineConfig, Mode
from oasiskv_runtime.core.batch import DecodeBatch, SummaryWrites, summary_rows
from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.core.link_cap import LinkCap
from oasiskv_runtime.core.pipeline import LookaheadPipeline
from oasiskv_runtime.core.predictor import Predictor, resident_block_ids
from oasiskv_runtime.core.prefill_feedback import PromptWindows, end_of_prefill, fill_scores
from oasiskv_runtime.core.stats import SparseStats
from oasiskv_runtime.core.summaries import KeyCodes, KeySummaries
from oasiskv_runtime.engine.attention.metadata import SeqSlice, StepMetadata
from oasiskv_runtime.engine.attention.prefill import ContextAttention
from oasiskv_runtime.engine.attention.sparse_step import SparseStep
from oasiskv_runtime.ops.sparse_attention import sparse_decode_attention
from oasiskv_runtime.transfer.engine import TransferEngine
from oasiskv_runtime.transfer.host_pool import HostKVPool
from oasiskv_runtime.transfer.paged_kv import PagedKVCache
from oasiskv_runtime.transfer.prefill_io import PrefillPoolIO


FIXED_AT_START = {"accept_drafts": "it sizes each working set's local blocks",
                  "attended_blocks": "it sizes the record of each head's most attended blocks",
                  "attended_share": "it sizes the record of each head's most attended blocks",
                  "fill_query": "the step builder reads it once",
                  "summary_parts": "it sets the summaries' layout"}
"""Algorithm options :meth:`OasisKVAttention.configure` refuses to change, and why."""


class OasisKVAttention:
    device_prefill: bool | None = None
    """Prefill (and dense-layer) attention reads the context with device ops only (no host sync, no host-side read
    of the pool). None: on CUDA. The host path stays the CPU reference (bit-parity with transformers)."""

    def __init__(self, config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 device_cache: PagedKVCache, pool: HostKVPool | None, scale: float, max_rows: int) -> None:
        self.mode, self.device = config.mode, torch.device(config.device)
        self.sparse, self.kernels, self.debug = config.sparse, config.kernels, config.debug
        self.num_layers, self.dev_cache, self.pool, self.scale = num_layers, device_cache, pool, scale
        backend = self.kernels.backend
        k_slots = self.sparse.top_k_blocks
        self.stats = SparseStats(num_layers, 2 * device_cache.block_size * head_dim * device_cache.k[0].element_size())
        self.head_map = HeadMap(max_rows, num_layers, num_kv_heads, k_slots, self.device, self.mode.uses_host_pool,
                                self.sparse.attended)
        self.windows = PromptWindows(self.sparse.fill_window) if self.sparse.fill_window else None
        """``fill_window``: the last prompt rows of requests prefilled in chunks."""
        bits = self.sparse.code_bits
        self.codes = KeyCodes.in_cache(device_cache.pairs, bits, backend) if bits else None
        """Key codes (``selection_score = "max_logit_b2"``): kept in blocks of the device cache, as the summaries."""
        self.predictor = Predictor(KeySummaries(device_cache.k, device_cache.v, backend), num_kv_heads, k_slots,
                                   self.sparse.sink_blocks, backend, self.sparse.selection_score, device_cache.k,
                                   scale, self.sparse.recent_blocks, self.sparse.summary_parts, self.codes)
        self.pipeline = self.io = None
        if self.mode.uses_host_pool:
            # The pipeline's streams and per-layer events exist on CUDA with the kernels; elsewhere the same calls
            # run in order on the current stream.
            background = self.device.type == "cuda" and backend == "auto"
            transfer = TransferEngine(pool, device_cache, num_layers, max_rows, self.device, backend, background)
            self.pipeline = LookaheadPipeline(self.head_map, self.predictor, transfer, self.stats, self.kernels,
                                              self.debug)
            self.io = PrefillPoolIO(pool, num_layers, self.device, side_streams=background)
        self.context = ContextAttention(device_cache, pool, self.io, scale, backend)
        prefetched = num_layers - self.sparse.dense_layers
        self.link_cap = LinkCap(k_slots, num_kv_heads * prefetched * self.stats.bytes_per_head_block)
        self.step_cap = self.sparse.fetch_cap
        """This step's admission cap per (request, KV head) for the prefetch (:meth:`new_step`)."""
        self.step: SparseStep | None = None
        self.draft_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        """With ``accept_drafts``: each layer's K/V of the decode batch's draft rows this step ([B, Hkv, D] each),
        kept until the step's tokens are sampled (:meth:`commit_drafts`)."""

    @property
    def summaries(self) -> KeySummaries:
        return self.predictor.summaries

    @property
    def background(self) -> bool:
        return self.pipeline is not None and self.pipeline.background

    def configure(self, **options) -> None:
        """Change sparse / kernel / debug options between steps (A/B benchmarks on one engine)."""
        specs = EngineConfig.options()
        by_section: dict[str, dict] = {}
        for key, value in options.items():
            section = specs[key].section if key in specs else None
            if section not in ("sparse", "kernels", "debug"):
                raise ValueError(f"{key} cannot change on a running engine")
            kept = self.codes.bits if self.codes is not None else 0
            if key == "selection_score" and CODED_KEY_SCORES.get(value, kept) != kept:
                raise ValueError(f"selection_score={value!r} reads key codes of {CODED_KEY_SCORES[value]} bits, which "
                                 f"are kept from the start only: start an engine with it")
            if key in FIXED_AT_START and value != getattr(self.sparse, key):
                raise ValueError(f"{key} is fixed when the engine starts ({FIXED_AT_START[key]}): start an engine "
                                 f"per setting")
            by_section.setdefault(section, {})[key] = value
        for section, changes in by_section.items():  # one replace per section: options that check each other
            new = dataclasses.replace(getattr(self, section), **changes)  # (demand_fetch_cap needs demand_fetch)
            if section == "sparse":
                new.check_mode(self.mode)
                if new.attended != self.sparse.attended:  # (top_k_blocks with attended_share)
                    raise ValueError(f"the blocks attention feedback keeps are fixed when the engine starts "
                                     f"({FIXED_AT_START['attended_blocks']}): {self.sparse.attended} -> {new.attended}")
            setattr(self, section, new)
        self.predictor.sink_blocks, self.predictor.recent_blocks = self.sparse.sink_blocks, self.sparse.recent_blocks
        self.predictor.selection_score = self.sparse.selection_score
        if self.pipeline is not None:
            self.pipeline.kernels, self.pipeline.debug = self.kernels, self.debug
        self.step_cap = self.sparse.fetch_cap
        if (self.windows.window if self.windows is not None else 0) != self.sparse.fill_window:
            self.windows = PromptWindows(self.sparse.fill_window) if self.sparse.fill_window else None

    # ---- request lifecycle ------------------------------------------------------------------------------------
    def free_request(self, seq_id: int) -> None:
        if self.windows is not None:
            self.windows.forget(seq_id)
        if self.pipeline is not None:
            self.pipeline.release(seq_id)
        else:
            self.head_map.free(seq_id)

    # ---- prefill-decode hand-off ------------------------------------------------------------------------------
    def _hand_off_rows(self, op: str, blocks, context_len: int) -> torch.Tensor:
        """The flat summary rows of a handed-off request's blocks (after checking the mode can hand off)."""
        if not self.mode.uses_host_pool:
            raise ValueError(f"{op} needs a host-pool mode, not {self.mode.value}")
        if self.sparse.summary_parts > 1:
            raise ValueError(f"{op}: summary_parts={self.sparse.summary_parts} does not run with prefill-decode "
                             "hand-off yet (it carries one summary per block)")
        bs = self.dev_cache.block_size
        return summary_rows(blocks.summary_blocks, -(-context_len // bs), bs, self.device)

    def export_request(self, seq_id: int, blocks, context_len: int, step: int) -> dict:
        """What a decode peer needs to continue a request prefilled here (``blocks``: its ``RequestBlocks``): the
        key summaries of every block and the per-head map filled at the end of prefill, stamps relative to
        ``step``."""
        rows = self._hand_off_rows("export_request", blocks, context_len)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        state = self.pipeline.export(seq_id, rows, step)
        if self.codes is not None:  # the full blocks' key codes (the peer keeps only some of their keys)
            state["codes"] = self.codes.export(self._code_rows(blocks, context_len))
        return state

    def _code_rows(self, blocks, context_len: int) -> torch.Tensor:
        """The code rows of a request's full blocks (whose codes are final: the partial last block's are written
        by the decode steps that fill it, on either side)."""
        full = context_len // self.dev_cache.block_size
        return torch.tensor(blocks.code_rows[:full], dtype=torch.long, device=self.device)

    def import_request(self, seq_id: int, blocks, context_len: int, state: dict, step: int) -> None:
        """Install a request prefilled by a peer (its prompt KV already in the pool, at least the blocks of
        ``state["slot_map"]`` and the partial last block): summaries, the per-head map, the working set."""
        rows = self._hand_off_rows("import_request", blocks, context_len)
        if self.pool.tier_first is not None:
            raise ValueError("a request prefilled by a peer arrives in the host pool: not supported with a "
                             "device tier (device_tier)")
        if self.sparse.dense_layers:
            raise ValueError("dense_layers read every block of the context: not supported for a request "
                             "prefilled by a peer")
        long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        if self.codes is not None and "codes" not in state:
            raise ValueError(f"selection_score={self.sparse.selection_score!r} needs the prefill peer's key codes; "
                             "the hand-off carries none (does the peer run the same selection_score?)")
        self.pipeline.install(seq_id, state, rows, long(blocks.host_blocks), long(blocks.slot_blocks), step)
        if self.codes is not None:
            self.codes.install(self._code_rows(blocks, context_len), state["codes"])
        tail = [(SeqSlice(seq_id, 0, 0, context_len, blocks.host_blocks),
                 blocks.local_block(context_len - 1, self.dev_cache.block_size))]
        for layer in range(self.num_layers):  # the partial last block into the local block
            self.context.copy_tails(layer, tail, device_path=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.head_map.ready.add(seq_id)

    # ---- per step -------------------------------------------------------------------------------------------------
    def new_step(self, sched) -> None:
        """A step starts (before its graph key is taken): its prefetch cap, from ``link_gbps`` and the measured step
        times, or the fixed ``fetch_cap``."""
        if not self.mode.prefetches:  # the other modes never read it: keep their graph keys fixed
            return
        decode = sum(1 for s in sched.scheduled if s.is_decode)
        self.step_cap = self.link_cap.new_step(decode, decode == len(sched.scheduled), self.sparse.fetch_cap,
                                               self.sparse.link_gbps)

    def begin_step(self, meta: StepMetadata) -> None:
        if self.background:
            # Last step's batch tensors are freed once this step's replace them, and their memory reused on this
            # stream: order it after every background job that read them (a GPU-side wait, not a host sync).
            self.pipeline.transfer.wait_all()
        self.meta, step = meta, meta.sparse
        self.step, self.context.memo = step, {}
        if step.decode is not None:  # (a split step's prefill part keeps its decode part's, still to be committed)
            self.draft_kv = []
        for rows, mins, maxs in step.summary_imports:
            self.summaries.write(rows, mins, maxs)
        self.stats.begin_step(len(step.decode_slices))
        if self.io is not None:
            self.io.reset()
            device_path = self._use_device_prefill(meta.input_ids)
            if step.prefill and self.kernels.copy_engine_prefill and device_path and \
                    (self.background or self.device.type == "cpu"):
                self.io.plan(step.prefill, [s.query_start for s in step.decode_slices])

    def _use_device_prefill(self, t: torch.Tensor) -> bool:
        return self.device_prefill if self.device_prefill is not None else t.is_cuda

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step, meta = self.step, self.meta
        w = step.written
        kw, vw = k[w], v[w]  # this step's written rows: the pool write, the local block and the summaries read them
        if self.io is not None and self.io.active:
            self.io.write(layer, k, v, meta.slot_mapping)
        elif self.pool is not None:
            rows = self.context.memo.get("pool_rows")
            if rows is None:  # made once per step, by the first layer (inside a captured graph too)
                rows = self.context.memo["pool_rows"] = meta.slot_mapping[w]
            self.pool.write_rows(layer, kw, vw, rows)
        else:
            self.dev_cache.write(layer, meta.slot_mapping[w], kw, vw)
        b = step.decode
        if self.pipeline is not None:
            self.pipeline.wait(layer)  # layer-local sync
        if b is not None and b.local_rows is not None:
            same = b.q_rows is w  # the static layout writes exactly the decode rows
            self.dev_cache.write(layer, b.local_rows, kw if same else k[b.q_rows], vw if same else v[b.q_rows])
        self.summaries.update(layer, kw, step.writes)
        if self.codes is not None and b is not None:  # the active block's codes (final at the step that fills it)
            self.codes.write(layer, b.active_code_rows(), self.dev_cache.k[layer][b.local_block])
        if self.io is not None:
            self.io.issue_reads(layer + 1)  # the next layer's prefixes, while this one computes
        out = torch.empty_like(q)
        dense_layer = layer < self.sparse.dense_layers
        device_path = self._use_device_prefill(q)
        fill_mass = {}  # fill_window: per request whose prefill completes, its last rows' mass on each block
        feedback = self.head_map.attended is not None or self.windows is not None
        for i, s in enumerate(step.prefill + (step.decode_slices if dense_layer else [])):
            ks = self.context.attend(layer, s, q, k, v, out, device_path)
            if self.codes is not None and i < len(step.prefill) and step.prefill_codes[i] is not None:
                first, rows = step.prefill_codes[i]  # the blocks this chunk fills, coded before any prediction reads them
                bs = self.dev_cache.block_size
                self.codes.write(layer, rows, ks[first * bs:(first + rows.numel()) * bs].unflatten(0, (-1, bs)))
            # (the fill's requests are step.prefill's that complete: a 1-token last chunk included)
            if feedback and i < len(step.prefill):
                scores = self._end_of_prefill(layer, s, q, ks, not dense_layer, step.fill is not None)
                if scores is not None:
                    fill_mass[s.seq_id] = scores
        # the queries that predict the next step's blocks (prefetching modes), read before the attention too
        pred_q = q[b.pred_rows()] if b is not None and self.mode.prefetches else None
        next_scores = None
        if b is not None and not dense_layer:
            next_scores = self._sparse_decode(layer, b, q, k, v, out, pred_q)
        if pred_q is not None:
            self.pipeline.prefetch(layer, b, pred_q, *self.head_map.prefetch_caps(
                b, self.step_cap, self.sparse.early_cap, self.sparse.early_steps), scores=next_scores)
        if step.fill is not None:
            self.io.wait(self.io.write_event)  # the chunk's rows must be in the pool before the first fill reads them
            self.pipeline.fill(layer, step.fill, q[step.fill.q_rows],
                               fill_scores([fill_mass[i] for i in step.fill.seq_ids],
                                           step.fill.max_next_candidates) if fill_mass else None)
            self.context.copy_tails(layer, step.fill_tails, device_path)
        return out

    def _end_of_prefill(self, layer: int, s: SeqSlice, q: torch.Tensor, ks: torch.Tensor, seed: bool,
                        fills: bool) -> torch.Tensor | None:
        """A prefill chunk: with ``fill_window`` its last rows are kept for the next chunk; if it completes the
        prompt (its request's whole context attended), ``attended_blocks``' seed (``seed``: a sparse layer) and,
        when the step fills (``fills``), its ``fill_window`` scores (``core/prefill_feedback.py``)."""
        end = s.query_start + s.num_query
        last = q[end - 1:end]
        if self.windows is not None:
            last = self.windows.rows(layer, s.seq_id, q[s.query_start:end], s.context_len - s.num_query, s.completes)
        seed = seed and self.head_map.attended is not None
        if not s.completes or not (seed or (fills and self.windows is not None)):
            return None
        row = torch.tensor([self.head_map.row(s.seq_id)], device=self.device)
        return end_of_prefill(self.head_map, layer, row, last, ks[:s.context_len], self.scale,
                              self.dev_cache.block_size, self.sparse.fill_window if fills else 0, seed=seed)

    def _sparse_decode(self, layer: int, b: DecodeBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, pred_q: torch.Tensor | None) -> torch.Tensor | None:
        """The decode rows' sparse attention; returns the next step's block scores when it made them here (a
        ``demand_fetch`` over key codes scores the step's query and the prefetch's, ``pred_q``, from one read of the
        codes), for this layer's prefetch to rank."""
        # The normal and draft queries of each request, stacked, in one index op: [B, 2, Hq, D].
        qd_rows = b.qd_rows()
        qs = q[qd_rows].view(b.q_rows.numel(), 2, *q.shape[1:])
        q_norm = qs[:, 0]
        keep = self.head_map.attended_ids(layer, b.state_rows)  # None unless attended_blocks
        next_scores = None
        if self.mode is Mode.SPARSE_RESIDENT:
            logical = self.predictor.predict(layer, q_norm, b, next_step=False, keep=keep)
            block_ids = resident_block_ids(logical, b.primary_table)
        else:
            if self.debug.measure_recall and self.mode is not Mode.FETCH_ON_DEMAND:  # what the prefetch held
                self.pipeline.record_recall(layer, b, q_norm)
            if self.mode is Mode.FETCH_ON_DEMAND:
                pred = self.predictor.predict(layer, q_norm, b, next_step=False, keep=keep)
                cap = self.sparse.fetch_cap if self.sparse.fetch_on_demand_cap else self.sparse.top_k_blocks
                self.pipeline.fetch(layer, b, pred, cap)
            elif self.sparse.demand_fetch:  # the prefetch's misses of the step's own top-K, before attending
                next_scores = self.pipeline.demand_fetch(layer, b, q_norm, pred_q, self.sparse.demand_fetch_cap
                                                         or self.sparse.top_k_blocks, keep)
            block_ids = self.head_map.block_ids(layer, b)
        n_slots = block_ids.shape[2]
        if b.gap_block is not None:  # a block an accepted draft completed, still in its local slot
            gap = b.derived("gap_i32", lambda: b.gap_block.int()[:, None, None].expand(-1, block_ids.shape[1], 1))
            block_ids = torch.cat([block_ids.int(), gap], dim=2)
        kd, vd = k[b.draft_rows], v[b.draft_rows]
        if self.sparse.accept_drafts:  # kept until the step's tokens are sampled (commit_drafts)
            self.draft_kv.append((kd, vd))
        # attended_blocks: the attention writes each slot's exp-sum for the next prediction's record
        slot_lse = self.head_map.lse_buffer(block_ids, q.shape[1])
        res = sparse_decode_attention(qs, self.dev_cache.k[layer], self.dev_cache.v[layer], block_ids.int(),
                                      b.derived("local_block_i32", lambda: b.local_block.int()),
                                      b.derived("local_len_i32", lambda: b.local_len.int()), self.scale,
                                      kd, vd, backend=self.kernels.backend, slot_lse=slot_lse)
        if slot_lse is not None:  # what this step's attention gave each block it read, for the next prediction
            self.head_map.record_lse(layer, b.state_rows, slot_lse, n_slots, self.kernels.backend,
                                     logical if self.mode is Mode.SPARSE_RESIDENT else None)
        if b.separate_draft_rows:  # every request has its own draft row: both outputs in one index op
            out[qd_rows] = res.flatten(0, 1)
            return next_scores
        out[b.q_rows] = res[:, 0]
        # Requests without a draft have draft_rows == q_rows: write their normal output again rather than
        # boolean-index (which would synchronise with the host).
        out[b.pred_rows()] = torch.where(b.has_draft[:, None, None], res[:, 1], res[:, 0])
        return next_scores

    def commit_drafts(self, index: torch.Tensor, slots: torch.Tensor, local_rows: torch.Tensor | None,
                      writes: SummaryWrites) -> None:
        """Keep the KV of accepted drafts (``accept_drafts``), after the step that computed them: ``index`` [n]
        picks them in the step's decode batch; each goes, in every layer, to its full-KV slot (``slots``: pool rows
        in host-pool modes, else device slots), in host-pool modes to its row of the local block, and into its
        block's key summary. A rejected draft's KV is never written, so nothing of it stays in a summary."""
        for layer, (kd, vd) in enumerate(self.draft_kv):
            kd, vd = kd.index_select(0, index), vd.index_select(0, index)
            if self.pool is not None:
                self.pool.write_rows(layer, kd, vd, slots)
            else:
                self.dev_cache.write(layer, slots, kd, vd)
            if local_rows is not None:
                self.dev_cache.write(layer, local_rows, kd, vd)
            self.summaries.update(layer, kd, writes)
        self.draft_kv = []

    def end_step(self) -> None:
        step = self.step
        if step is not None and not step.static:
            decode = {s.seq_id for s in step.decode_slices}
            for s in step.prefill:
                if s.completes and s.seq_id not in decode:
                    self.head_map.row(s.seq_id)
                    self.head_map.ready.add(s.seq_id)
        if self.io is not None:
            self.io.join()
            self.io.reset()
        if self.pipeline is not None:
            self.pipeline.transfer.end_step(self.kernels.pipeline_priority)
        self.meta = self.step = None

    # ---- the static layout of decode-only steps (engine/cuda_graphs.py) ---------------------------------------------
    def graph_unsupported(self) -> str | None:
        """Why decode steps cannot run on the static layout / CUDA graphs now (None: they can)."""
        if self.pipeline is not None and self.pipeline.remote is not None:
            return "prefill-decode remote KV (cache misses are checked on the host)"
        if self.debug.measure_recall:
            return "measure_recall (recall is accumulated on the host)"
        if self.sparse.dense_layers:
            return "dense_layers (they read each request's whole context by its block list)"
        if self.device.type == "cuda" and self.kernels.backend == "ref":
            return "backend='ref' on CUDA (the reference ops read back from the device)"
        return None

    def graph_ready(self, seq_ids: list[int]) -> bool:
        return self.graph_unsupported() is None and all(i in self.head_map.ready for i in seq_ids)

    def graph_key(self) -> tuple:
        """Python values a captured step bakes in besides the batch shape."""
        k = self.kernels
        sp = self.sparse
        return (self.step_cap, self.debug.disable_transfers, sp.fetch_on_demand_cap, sp.sink_blocks, sp.recent_blocks,
                sp.attended, sp.selection_score, sp.accept_drafts, sp.demand_fetch, sp.demand_fetch_cap,
                sp.early_cap, sp.early_steps,
                k.gather_ctas, k.gather_copies, k.gather_hint, k.select_kernel, k.pipeline_priority)

    def graph_join(self) -> None:
        """Make the current stream wait for the background streams (a captured step must end joined)."""
        if self.background and self.mode.prefetches:  # fetch-on-demand never forks onto them
            self.pipeline.transfer.join(self.kernels.pipeline_priority)

    def graph_replayed(self) -> None:
        """Forget the per-layer copy events (after a replay, which ended joined on the current stream; before a
        capture, which cannot wait on events recorded outside it). A capture re-runs the step that just ran eagerly,
        with the same inputs: the tensors made from them once per step must be made again inside the capture, or
        the graph would read the eager run's copies (outside its pool, never rewritten) on every replay."""
        if self.pipeline is not None:
            self.pipeline.transfer.forget()
        if self.step is not None and self.step.decode is not None:
            self.step.decode.forget_derived()
        self.context.memo = {}

    before_capture = graph_replayed

    # ---- reporting ----------------------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero the traffic and recall counters (benchmarks measure a window of steps)."""
        self.link_cap.reset_counts()
        if self.pipeline is not None:
            self.pipeline.reset_counters()
        else:
            self.stats.reset()

    def run_stats(self) -> dict:
        out = self.pipeline.run_stats() if self.pipeline is not None else self.stats.run_stats()
        if self.mode.prefetches:
            out["mean_fetch_cap"] = self.link_cap.mean_cap()
        return out

    def request_metrics(self, seq_id: int) -> dict:
        return self.stats.request_metrics(seq_id)
