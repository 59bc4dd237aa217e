"""The host-pool modes on vLLM (proxy-prefetch, oasiskv): one OasisKV core per worker process, shared by the layers.

vLLM makes one attention implementation per layer; the mechanism is multi-layer (one per-head map, one prediction
and transfer pipeline with per-layer events, one set of copy counters). :func:`runtime_for` gives every layer of an
engine the same :class:`HostPoolRuntime`, created on the first real step (when the KV cache's block count is
known); a layer's index is parsed from its name (``model.layers.7.self_attn.attn`` -> 7).

Where things live:

* **full KV, pinned host memory**: a ``transfer.host_pool.HostKVPool`` of ``blocks_per_row`` blocks
  (``max_model_len``'s) per state row: logical block ``j`` of the request in row ``r`` is pool block
  ``r * blocks_per_row + j`` (the core's ``primary_table``, :meth:`HostPoolRuntime.host_table`), independent of
  vLLM's physical blocks, which vLLM frees once a request decodes (working-set admission, ``vllm/kv_spec.py``).
  Written at every layer with the step's new K/V rows at their positions (``HostKVPool.write_rows``).
* **key summaries, on the device**: the same addressing (``[(rows + 1) * blocks_per_row, 1, Hkv, D]``, the scratch
  row included), rebuilt each step for the blocks it wrote into from vLLM's paged cache, as in sparse-resident
  (exact under rejected drafts).
* **key codes** (``selection_score`` ``max_logit_b1`` / ``_b2`` / ``_b4``), on the device: a code row per summary row
  (``KeyCodes.allocate``), written from the same runs of vLLM's paged cache right after their summaries.
* **working sets, on the device**: ``LOCAL_SLOTS + K`` blocks per state row in a ``PagedKVCache`` of our own
  (``vllm/batch.py``: two local slots for the active block, the K selection slots of the ``HeadMap``).
* **state rows**: a ``HeadMap`` row per running request, keyed by vLLM's request id (start / free / fill events from
  the KV connector, ``vllm/requests.py``), and found in the batch by the request's first physical block (a device
  table ``row_of_block``: no host round trip).

Per step and layer (``OasisKVImplMixin.forward``): pool write; ``pipeline.wait(layer)``; the step's token and draft
rows into the local slots; summaries; vLLM's own attention for prefill rows; ONE sparse attention call over the
working set for each decode request's ``[token, draft]``; ``pipeline.prefetch`` from the draft row's query
(oasiskv) or the token's (proxy-prefetch), at most ``fetch_cap`` admissions per request and KV head (with
``early_fetch_ratio``, ``early_cap`` in a request's first ``early_steps`` decode steps); for requests whose prefill
completes, ``pipeline.fill`` and their prompt tail into the local slot. With ``demand_fetch``, before the sparse
attention: the step's own top-K from the token's query, its misses fetched (``pipeline.demand_fetch``; with key
codes one read of them also scores the prefetch's query).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from oasiskv_runtime.config import DebugConfig, KernelConfig, Mode, SparseConfig
from oasiskv_runtime.core.batch import SummaryWrites
from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.core.pipeline import LookaheadPipeline
from oasiskv_runtime.core.predictor import Predictor
from oasiskv_runtime.core.prefill_feedback import PromptWindows, end_of_prefill, fill_scores
from oasiskv_runtime.core.stats import SparseStats
from oasiskv_runtime.core.summaries import KeyCodes, KeySummaries
from oasiskv_runtime.ops.common import host_list_to
from oasiskv_runtime.ops.sparse_attention import sparse_decode_attention
from oasiskv_runtime.transfer.engine import TransferEngine
from oasiskv_runtime.transfer.host_memory import available_host_bytes
from oasiskv_runtime.transfer.host_pool import HostKVPool
from oasiskv_runtime.transfer.paged_kv import PagedKVCache
from oasiskv_runtime.vllm.batch import (LOCAL_SLOTS, FillBatch, HostPoolBatch, StepPlan, fill_batch,
                                        host_pool_batch)
from oasiskv_runtime.vllm.options import VllmOptions, device_tier_rows, host_pool_rows
from oasiskv_runtime.vllm.requests import StepEvents

_LAYER_INDEX = re.compile(r"\.(\d+)(?:\.|$)")


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (vLLM's full-graph capture of a decode-only step)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM attention layer's name (exactly one integer component)."""
    found = _LAYER_INDEX.findall("." + layer_name)
    if len(found) != 1:
        raise ValueError(f"OasisKV cannot tell the layer index of attention layer {layer_name!r}")
    return int(found[0])


@dataclasses.dataclass
class _Step:
    """What one step's layers share (made by the first layer of the step)."""

    plan: StepPlan
    real: bool
    """The step came with connector events (a scheduled step) or is being captured for replays, not a warm-up or
    profiling forward."""
    captured: bool = False
    """Recorded into a full CUDA graph: its host part runs before every replay (:meth:`HostPoolRuntime.replay_step`),
    its device part is what the capture records."""
    decode: HostPoolBatch | None = None
    fill: FillBatch | None = None
    prefill_spans: dict | None = None
    """Per request in prefill this step (``attended_blocks`` / ``fill_window``): ``(a, b, n)``, its query rows
    ``a .. b - 1`` and its prompt's tokens once they are written (host ints, one host sync per such step)."""
    fallback: bool = False
    """Some decode-shaped rows may lack a working set: also attend vLLM's cache for them (chosen per row)."""
    req_rows: torch.Tensor | None = None
    """[R] every request's state row (-1: none, e.g. CUDA-graph padding)."""
    pool_rows: torch.Tensor | None = None
    """[num_tokens] each token row's flat pool row (-1: not written)."""
    summary_dest: torch.Tensor | None = None
    """[runs] the summary row each summary run rebuilds (made by the first layer that writes)."""
    next_scores: torch.Tensor | None = None
    """The current layer's block scores of the prefetch's query, made by its demand fetch (key codes), for its
    prefetch to rank."""
    num_tokens: int = 0
    ended: bool = False


class HostPoolRuntime:
    """The OasisKV core of one vLLM worker in a host-pool mode (all layers)."""

    def __init__(self, opts: VllmOptions, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, max_rows: int, scale: float, max_model_len: int,
                 tier_rows: int = 0) -> None:
        """``num_blocks``: vLLM's KV cache blocks; ``max_rows``: the pool's state rows in host memory
        (``max_num_seqs``, or fewer with ``host_pool_gb``: :func:`~oasiskv_runtime.vllm.options.host_pool_rows`);
        ``tier_rows``: more rows in device memory after them (``device_tier_gb``); ``scale``: the layers' attention
        scale (``minmax_mass`` ranks with it)."""
        self.opts, self.mode = opts, opts.parsed_mode
        if not self.mode.uses_host_pool:
            raise ValueError(f"mode {self.mode.value} keeps no host pool")
        bs, k = opts.block_size, opts.top_k_blocks
        self.num_layers, self.block_size, self.k_slots = num_layers, bs, k
        self.device, self.num_blocks = device, num_blocks
        self.blocks_per_row = -(-max_model_len // bs)
        """Pool blocks of one state row: a request's whole context (``max_model_len``)."""
        backend = opts.backend
        per_block = num_layers * 2 * bs * num_kv_heads * head_dim * dtype.itemsize
        """Bytes of one block of every layer, K and V (a summary block: min and max, a row each: 1 / bs of it)."""
        check_host_memory(max_rows * self.blocks_per_row * per_block, max_rows, max_model_len)
        bits = opts.sparse.code_bits
        if device.type == "cuda":
            rows = max_rows + tier_rows + 1
            summary_block = per_block // bs + KeyCodes.bytes_for(per_block, dtype.itemsize, bits)  # min/max, codes
            check_device_memory(rows * (k + LOCAL_SLOTS) * per_block + rows * self.blocks_per_row * summary_block,
                                tier_rows * self.blocks_per_row * per_block, free_device_bytes(device))
        host = PagedKVCache(num_layers, max_rows * self.blocks_per_row, bs, num_kv_heads, head_dim, dtype, "cpu",
                            pin_memory=device.type == "cuda", zero=False)
        # Rows [max_rows, max_rows + tier_rows) are the device tier: their pool blocks (row * blocks_per_row + j, as
        # every row's) run past the host part, into a device cache of their own (HostKVPool's tier addressing).
        tier = PagedKVCache(num_layers, tier_rows * self.blocks_per_row, bs, num_kv_heads, head_dim, dtype, device,
                            zero=False) if tier_rows else None
        self.pool = HostKVPool(host, tier, max_rows * self.blocks_per_row if tier_rows else None, backend)
        self.host_pool_rows, self.tier_rows = max_rows, tier_rows
        self.host_pool_bytes = sum(t.numel() * t.element_size() for t in host.k + host.v)
        """This worker's pinned pool: its KV heads only under tensor parallelism (each rank keeps its own)."""
        self.tier_bytes = 0 if tier is None else sum(t.numel() * t.element_size() for t in tier.k + tier.v)
        """This worker's device tier (beside vLLM's cache)."""
        max_rows += tier_rows
        self.scratch_row = max_rows
        """A row no request owns: decode-shaped rows whose request has no state row (never, with the connector's
        events) point there rather than at another request's row."""
        self.ws = PagedKVCache(num_layers, (max_rows + 1) * (k + LOCAL_SLOTS), bs, num_kv_heads, head_dim, dtype,
                               device)
        summary_rows = (max_rows + 1) * self.blocks_per_row
        mk = lambda: torch.zeros((summary_rows, 1, num_kv_heads, head_dim), dtype=dtype, device=device)  # noqa: E731
        summaries = KeySummaries([mk() for _ in range(num_layers)], [mk() for _ in range(num_layers)], backend)
        self.codes = KeyCodes.allocate(num_layers, summary_rows, bs, num_kv_heads, head_dim, bits, device,
                                       backend) if bits else None
        """Key codes (a ``max_logit_b*`` selection score): a row per summary row."""
        self.device_bytes = self.tier_bytes + sum(t.numel() * t.element_size() for t in self.ws.k + self.ws.v
                                                  + summaries.mins + summaries.maxs)
        self.device_bytes += self.codes.nbytes() if self.codes is not None else 0
        """Device memory beside vLLM's KV cache (outside its ``kv_cache_memory_bytes``): working sets, summaries, key
        codes, the device tier."""
        self.stats = SparseStats(num_layers, 2 * bs * head_dim * self.ws.k[0].element_size())
        self.head_map = HeadMap(max_rows + 1, num_layers, num_kv_heads, k, device,
                                attended_blocks=opts.sparse.attended)
        self.head_map.free_rows.remove(self.scratch_row)
        self.predictor = Predictor(summaries, num_kv_heads, k, opts.sink_blocks, backend, opts.selection_score,
                                   scale=scale, recent_blocks=opts.recent_blocks, codes=self.codes)
        background = device.type == "cuda" and backend == "auto"
        self.transfer = TransferEngine(self.pool, self.ws, num_layers, max_rows + 1, device, backend, background)
        self.kernels = KernelConfig(backend=backend)
        self.pipeline = LookaheadPipeline(self.head_map, self.predictor, self.transfer, self.stats, self.kernels,
                                          DebugConfig(measure_recall=opts.measure_recall))
        self.cap = opts.sparse.fetch_cap
        """Admissions per (request, KV head) and layer per step."""
        self.early_cap, self.early_steps = opts.sparse.early_cap, opts.early_steps
        """``early_fetch_ratio``: the cap of a request's first ``early_steps`` decode steps after its fill (0: off;
        in effect only where it exceeds :attr:`cap`: ``HeadMap.prefetch_caps``)."""
        self._row_blocks = torch.arange(self.blocks_per_row, device=device)
        self.row_of_block = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        """Physical block -> state row of the running request whose first block it is (-1: none)."""
        self.ready = torch.zeros(max_rows + 1, dtype=torch.bool, device=device)
        """Per state row: the request's working set is filled (its decode steps attend it)."""
        self.bound = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        """Per state row: the candidate count its last prediction ranked (see ``HostPoolBatch.gap_block``)."""
        self.first: dict[str, int] = {}
        """Running request id -> its first physical block."""
        self.prefilling: set[str] = set()
        """Requests started and not yet filled (their prefill runs)."""
        self.windows = PromptWindows(opts.fill_window) if opts.fill_window else None
        """``fill_window``: the last prompt rows of requests prefilled in chunks."""
        self.step_no = 0
        self.cur: _Step | None = None
        self._pending_ready: torch.Tensor | None = None
        self.full_graphs = False
        """vLLM may replay decode-only steps from full CUDA graphs (``VllmOptions.full_graphs`` and CUDA; set by
        :func:`runtime_for`)."""
        self.step_t = torch.zeros((), dtype=torch.long, device=device)
        """The step stamped into selections by a captured step (written before each replay; eager steps stamp
        ``step_no``)."""
        self.counts = {"steps": 0, "decode_request_steps": 0, "fills": 0, "fallback_steps": 0, "step_cap_blocks": 0,
                       "replayed_steps": 0, "eager_graph_steps": 0, "max_running_requests": 0}
        self._gap_rows = torch.zeros((), dtype=torch.long, device=device)
        """Rows whose last prediction could not rank the block before the active one (accumulated in place)."""
        self._cap_excess = torch.zeros((), dtype=torch.long, device=device)
        """Most blocks one step fetched beyond its cap (0 when every step stayed within it)."""
        self._fetched_before = torch.zeros((), dtype=torch.long, device=device)

    # ---- options changed on a running engine (A/B runs: llm.apply_model(configure)) -----------------------------
    def configure(self, mode: str | None = None, fetch_ratio: float | None = None,
                  measure_recall: bool | None = None) -> None:
        """``fetch_ratio`` sets the fixed cap; ``early_fetch_ratio``'s cap stays the option's, in effect while it
        exceeds the new one (``HeadMap.prefetch_caps`` compares them at every prefetch)."""
        if self.full_graphs and (mode is not None or fetch_ratio is not None):
            raise ValueError("with full CUDA graphs (cuda_graphs 'auto' / 'full' on CUDA) the predicting row and the "
                             "fetch cap are recorded in vLLM's captured graphs: start an engine per setting, or "
                             "cuda_graphs='off'")
        if mode is not None:
            m = Mode.parse(mode)
            if m not in (Mode.PROXY_PREFETCH, Mode.OASISKV):
                raise ValueError(f"a running host-pool engine switches between proxy-prefetch and oasiskv, not {mode}")
            self.mode = m
        if fetch_ratio is not None:
            self.cap = SparseConfig(top_k_blocks=self.k_slots, fetch_ratio=fetch_ratio).fetch_cap
        if measure_recall is not None:
            self.pipeline.debug = DebugConfig(measure_recall=measure_recall)
            self.pipeline.forget_recall()

    # ---- request lifecycle ----------------------------------------------------------------------------------
    def _free(self, req_id: str) -> None:
        first = self.first.pop(req_id, None)
        self.prefilling.discard(req_id)
        if self.windows is not None:
            self.windows.forget(req_id)
        row = self.pipeline.release(req_id)  # its copies counted, its map row freed
        if row is not None:
            self.ready[row] = False
        if first is not None and row is not None:
            # only if the block still points at this row (it may already be another request's first block)
            cur = self.row_of_block[first]
            self.row_of_block[first] = torch.where(cur == row, torch.full_like(cur, -1), cur)

    def apply(self, events: StepEvents) -> None:
        """A step's request events: frees, then starts (fills are read by :meth:`begin_step`). The KV connector
        applies them when vLLM binds a step's metadata, also for steps without a forward (the last finished
        requests reach the workers that way), and the step's first layer applies what is left. First, the rows
        filled by the last step are ready (before a free can hand one of them to a new request)."""
        if self._pending_ready is not None:  # last step's fills: those requests decode over their working sets now
            self.ready.index_fill_(0, self._pending_ready, True)
            self._pending_ready = None
        for req_id in events.free:
            self._free(req_id)
        for req_id, first in events.start:
            if req_id in self.first:
                self._free(req_id)
            row = self.head_map.row(req_id)
            self.first[req_id] = first
            self.prefilling.add(req_id)
            self.row_of_block[first] = row
            self.ready[row] = False

    # ---- addressing -----------------------------------------------------------------------------------------
    def host_table(self, rows: torch.Tensor) -> torch.Tensor:
        """``[B, blocks_per_row]`` int64: the pool block (= summary row) of each logical block of rows ``rows``."""
        return rows.long()[:, None] * self.blocks_per_row + self._row_blocks[None, :]

    def _known(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows >= 0) & (rows < self.scratch_row)

    def _or_scratch(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` with the scratch row where a request has none."""
        return torch.where(self._known(rows), rows, torch.full_like(rows, self.scratch_row))

    def _pool_rows(self, common: dict, req_rows: torch.Tensor, n: int) -> torch.Tensor:
        """Flat pool row of each of the step's first ``n`` token rows: its request's row slab at the token's
        position (from ``query_start_loc`` and ``seq_lens``, on the device); -1 for padding and rows vLLM does not
        write (``slot_mapping`` -1)."""
        qsl = common["query_start_loc"].long()
        seq = common["seq_lens"].long()
        r_n = seq.numel()
        qsl = qsl[:r_n + 1]
        t = torch.arange(n, device=qsl.device)
        req = torch.clamp(torch.searchsorted(qsl[1:], t, right=True), max=r_n - 1)
        pos = seq[req] - (qsl[req + 1] - t)
        row = req_rows[req]
        ok = (t < qsl[-1]) & self._known(row) & (pos >= 0) & (common["slot_mapping"][:n] >= 0)
        flat = row * (self.blocks_per_row * self.block_size) + pos
        return torch.where(ok, flat, torch.full_like(flat, -1))

    def _summary_dest(self, st: _Step, runs) -> torch.Tensor:
        """The summary row of each run: its request's row slab (the scratch row's for requests without one) at
        the run's logical block."""
        rows = self._or_scratch(st.req_rows[runs.reqs])
        return rows * self.blocks_per_row + torch.clamp(runs.logical, max=self.blocks_per_row - 1)

    # ---- per step ---------------------------------------------------------------------------------------------
    def _host_step(self, events: StepEvents, num_decodes: int) -> None:
        """A scheduled step's host part: last step's fills become ready, the connector's events, the counters."""
        self.step_no += 1
        self.counts["steps"] += 1
        self.apply(events)
        self.counts["max_running_requests"] = max(self.counts["max_running_requests"], len(self.first))
        if num_decodes:
            self.stats.begin_step(num_decodes)
            self.counts["decode_request_steps"] += num_decodes
            self.counts["step_cap_blocks"] = max(self.counts["step_cap_blocks"],
                                                 num_decodes * self._cap_per_request)

    @property
    def _cap_per_request(self) -> int:
        """Blocks one decode request may fetch per step: the cap per KV head and layer, for every head and layer.
        With ``early_fetch_ratio`` the larger of the fixed and the early cap for every request (a bound: whether a
        request is in its first ``early_steps`` is known on the device only)."""
        return self.head_map.slot_map.shape[2] * self.num_layers * max(self.cap, self.early_cap)

    def replay_step(self, events: StepEvents | None, num_decodes: int) -> None:
        """Before vLLM replays a captured step (from the KV connector's ``start_load_kv``): the host part the replay
        cannot run, then the step stamp the graph reads. ``num_decodes``: the step's decode requests (no padding)."""
        if self.cur is not None and not self.cur.ended:
            self._end_step()
        if self.transfer.background:
            # an eager step's copies (and their counting) may still run on the side streams: the replay's layers
            # read what they write, and its own counting updates the same counters
            self.transfer.wait_all()
            self.transfer.settle(self.kernels.pipeline_priority)
            self.transfer.forget()
        self.cur = None
        self._host_step(events if events is not None else StepEvents(), num_decodes)
        self.step_t.fill_(self.step_no)
        self.counts["replayed_steps"] += 1

    def begin_step(self, plan: StepPlan, events: StepEvents | None, common: dict) -> _Step:
        """The first layer of a step: apply the connector's events, map the decode rows to state rows, plan the
        working-set fills. ``common``: the builder's step tensors (query_start_loc, seq_lens, block_table,
        slot_mapping, num_tokens, max_seq_len). Under a full-graph capture only the device part runs (recorded for
        the replays, whose host part :meth:`replay_step` runs)."""
        if self.cur is not None and not self.cur.ended:
            self._end_step()
        captured = capturing()
        if captured:
            if not self.full_graphs:
                raise RuntimeError("OasisKV: a full CUDA graph is being captured but this runtime was made for "
                                   "piecewise graphs (cuda_graphs)")
            self.transfer.forget()  # a capture cannot wait on events recorded outside it
        elif self.transfer.background:
            # Last step's batch tensors are freed once this step's replace them, and their memory reused on this
            # stream: order it after every background job that read them (a GPU-side wait, not a host sync), as the
            # embedded engine does.
            self.transfer.wait_all()
        st = _Step(plan=plan, real=events is not None or captured, captured=captured,
                   num_tokens=common["num_tokens"])
        self.cur = st
        first_blocks = common["block_table"][:, 0].long()
        if not st.real:  # a warm-up / profiling forward: vLLM's cache serves the decode rows, nothing is kept
            st.req_rows = self.row_of_block[first_blocks]
            st.fallback = True
            return st
        if not captured:
            self._host_step(events, plan.num_real)
        st.req_rows = self.row_of_block[first_blocks]  # the step's starts applied
        st.pool_rows = self._pool_rows(common, st.req_rows, st.num_tokens)
        b = plan.batch
        if b is not None:
            rows = self._or_scratch(st.req_rows[:b.primary_table.shape[0]])  # the leading requests decode
            ready = self.ready[rows]
            st.decode = host_pool_batch(b, rows, ready, self.bound[rows], self.k_slots, self.block_size,
                                        self.step_t if captured else self.step_no, self.host_table(rows))
            self.bound[rows] = torch.where(ready, st.decode.next_bound, self.bound[rows])
            st.fallback = not captured and events.short_prefills > 0
            if self.opts.measure_recall:  # recall matches rows across steps by request: the first blocks identify them
                st.decode.batch.seq_ids = [int(x) for x in b.primary_table[:, 0].tolist()]
            self._gap_rows += ((st.decode.gap_block >= 0) & plan.real_rows).sum()
        fills = [] if captured else [r for r in events.fill if r in self.first]
        if fills:
            long = lambda xs: host_list_to(xs, torch.long, self.device)  # noqa: E731
            rows = long([self.head_map.rows[r] for r in fills])
            st.fill = fill_batch(common["query_start_loc"], common["seq_lens"], common["block_table"],
                                 long([self.first[r] for r in fills]), rows, self.k_slots, self.block_size,
                                 common["max_seq_len"], self.step_no, fills, self.host_table(rows))
            self.bound[rows] = st.fill.batch.next_candidates
            self.counts["fills"] += len(fills)
        if not captured and ((fills and self.head_map.attended is not None) or (
                self.windows is not None and self.prefilling
                and (plan.num_decodes < common["seq_lens"].numel() or events.short_prefills > 0))):
            st.prefill_spans = self._prefill_spans(common)  # (a step with prefill rows)
        self.prefilling.difference_update(fills)
        if st.fallback:
            self.counts["fallback_steps"] += 1
        return st

    def _prefill_spans(self, common: dict) -> dict:
        """Which of the step's requests are in prefill, and their rows (one host sync): by first block, as the
        device side finds them."""
        qsl = common["query_start_loc"].long()
        r = common["seq_lens"].numel()
        cols = torch.stack([common["block_table"][:, 0].long(), qsl[:r], qsl[1:r + 1], common["seq_lens"].long()])
        by_block = {self.first[q]: q for q in self.prefilling}
        return {by_block[f]: (a, b, n) for f, a, b, n in zip(*cols.tolist()) if f in by_block}

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> None:
        """Before the layer's attention: the step's K/V rows into the pool (their requests' rows at their
        positions), the wait for this layer's copies of the last step, the decode rows into their local slots, the
        touched blocks' summaries."""
        st = self.cur
        if st.real:
            n = st.num_tokens
            self.pool.write_rows(layer, key[:n], value[:n], st.pool_rows)
            self.pipeline.wait(layer)  # layer-local sync: this layer's copies issued during the last step
            d = st.decode
            if d is not None:
                src = d.local_src
                self.ws.write(layer, d.local_dst, key[src], value[src])
        runs = st.plan.runs
        if runs is not None:
            if st.summary_dest is None:
                st.summary_dest = self._summary_dest(st, runs)
            rows = k_cache.index_select(0, runs.blocks).flatten(0, 1)
            self.predictor.summaries.update(layer, rows, SummaryWrites(runs=(runs.pad_idx, st.summary_dest,
                                                                             runs.reset)))
            if self.codes is not None:  # each run's block coded within its own min/max: a partial block's codes
                # are rewritten by the step that fills it (the last write; a selection ranks full blocks only)
                self.codes.write(layer, st.summary_dest, rows.view(-1, self.block_size, *rows.shape[1:]))

    def decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, output: torch.Tensor) -> None:
        """Each decode request's ``[token, draft]`` over its working set in one call (rows without a working set:
        over vLLM's cache, when the step may have such rows)."""
        st = self.cur
        b = st.plan.batch
        n = b.q_rows.numel()
        qd = b.qd_rows()
        qs = query[qd].view(n, 2, *query.shape[1:])
        res = None
        d = st.decode
        if d is not None:
            core = d.batch
            if self.pipeline.debug.measure_recall:
                self.pipeline.record_recall(layer, core, qs[:, 0])
            if self.opts.demand_fetch:  # the step's own top-K misses, before attending
                pred_q = query[core.pred_rows() if self.mode is Mode.OASISKV else core.q_rows]
                st.next_scores = self.pipeline.demand_fetch(layer, core, qs[:, 0], pred_q,
                                                            self.opts.demand_fetch_cap or self.k_slots,
                                                            self.head_map.attended_ids(layer, core.state_rows))
            ids = self.head_map.block_ids(layer, core)                                   # [B, Hkv, K]
            gap = d.gap_block[:, None, None].expand(-1, ids.shape[1], 1)
            k_slots = ids.shape[2]
            ids = torch.cat([ids, gap.to(ids.dtype)], dim=2)
            # attended_blocks: the attention writes each slot's exp-sum, the record keeps the heaviest for the next
            # prediction (the embedded engine's; rows without a working set have empty slots: an empty record)
            slot_lse = self.head_map.lse_buffer(ids, qs.shape[2])
            res = sparse_decode_attention(qs, self.ws.k[layer], self.ws.v[layer], ids.int(),
                                          core.derived("local_block_i32", lambda: core.local_block.int()),
                                          core.derived("local_len_i32", lambda: core.local_len.int()), scale,
                                          key[b.draft_rows], value[b.draft_rows], backend=self.opts.backend,
                                          slot_lse=slot_lse)
            if slot_lse is not None:
                self.head_map.record_lse(layer, core.state_rows, slot_lse, k_slots, self.opts.backend)
        if st.fallback:
            dense = self._resident(qs, b, key, value, k_cache, v_cache, scale)
            res = dense if d is None else torch.where(d.ready[:, None, None, None], res, dense)
        output[b.q_rows] = res[:, 0].to(output.dtype)
        output[b.pred_rows()] = torch.where(b.has_draft[:, None, None], res[:, 1], res[:, 0]).to(output.dtype)

    def _resident(self, qs, b, key, value, k_cache, v_cache, scale) -> torch.Tensor:
        """Attention of rows without a working set over every full block of their context in vLLM's cache."""
        width = max(1, b.max_candidates)
        j = torch.arange(width, device=b.primary_table.device)
        table = b.primary_table[:, :width]
        if table.shape[1] < width:
            table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        ids = torch.where(j[None, :] < b.num_candidates.long()[:, None], table, torch.full_like(table, -1))
        ids = ids[:, None, :].expand(-1, k_cache.shape[2], -1)
        return sparse_decode_attention(qs, k_cache, v_cache, ids.int(), b.local_block.int(), b.local_len.int(), scale,
                                       key[b.draft_rows], value[b.draft_rows], backend=self.opts.backend)

    def after_attention(self, layer: int, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        scale: float) -> None:
        """After the layer's attention: the next step's prefetch, the fills, and at the last layer the step's end."""
        st = self.cur
        if not st.real:
            return
        d = st.decode
        if d is not None:
            core = d.batch
            rows = core.pred_rows() if self.mode is Mode.OASISKV else core.q_rows
            self.pipeline.prefetch(layer, core, query[rows], *self.head_map.prefetch_caps(
                core, self.cap, self.early_cap, self.early_steps), scores=st.next_scores)
            st.next_scores = None
        f = st.fill
        if self.windows is not None and st.prefill_spans:  # the last rows of chunks that do not complete a prompt
            done = set(f.batch.seq_ids) if f is not None else set()
            for req, (a, b, n) in st.prefill_spans.items():
                if req not in done:
                    self.windows.rows(layer, req, query[a:b], n - (b - a), False)
        if f is not None:
            scores = self._end_of_prefill(layer, query, k_cache, scale) if st.prefill_spans is not None else None
            self.pipeline.fill(layer, f.batch, query[f.batch.q_rows], scores)
            self.ws.k[layer].index_copy_(0, f.tail_dst, k_cache.index_select(0, f.tail_src).to(self.ws.k[layer].dtype))
            self.ws.v[layer].index_copy_(0, f.tail_dst, v_cache.index_select(0, f.tail_src).to(self.ws.v[layer].dtype))
        if layer == self.num_layers - 1:
            self._end_step()

    def _end_of_prefill(self, layer: int, query: torch.Tensor, k_cache: torch.Tensor,
                        scale: float) -> torch.Tensor | None:
        """The fill's requests at the end of their prefill (``core/prefill_feedback.py``): each one's prompt keys
        gathered from vLLM's paged cache seed its ``attended_blocks`` record; returns the fill's ``fill_window``
        scores (None without it)."""
        f, bs = self.cur.fill, self.block_size
        masses = []
        for i, req in enumerate(f.batch.seq_ids):
            a, b, n = self.cur.prefill_spans[req]
            last = query[b - 1:b] if self.windows is None else self.windows.rows(layer, req, query[a:b], n - (b - a),
                                                                                  True)
            keys = k_cache.index_select(0, f.table[i, :-(-n // bs)]).flatten(0, 1)[:n]
            m = end_of_prefill(self.head_map, layer, f.batch.state_rows[i:i + 1], last, keys, scale, bs,
                               self.opts.fill_window)
            if m is not None:
                masses.append(m.to(self.device))
        return fill_scores(masses, f.batch.max_next_candidates) if masses else None

    def _end_step(self) -> None:
        st = self.cur
        st.ended = True
        if not st.real:
            return
        if st.fill is not None:
            self._pending_ready = st.fill.batch.state_rows
        prio = self.kernels.pipeline_priority
        self.transfer.end_step(prio)
        if st.decode is not None:  # this step's copies against its cap, counted where end_step counts (no sync)
            limit = st.plan.real_rows.sum() * self._cap_per_request
            xs = self.transfer.streams(prio)[2] if self.transfer.background else None
            if xs is not None:
                limit.record_stream(xs)
            with self.transfer.on(xs):
                total = self.transfer.counters.fetched.sum()
                torch.maximum(self._cap_excess, total - self._fetched_before - limit, out=self._cap_excess)
                self._fetched_before.copy_(total)
        if st.captured and self.transfer.background:
            # a captured step ends joined (the replay is complete when the graph is), and its events stay inside it
            self.transfer.join(prio)
            self.transfer.forget()

    # ---- reporting ----------------------------------------------------------------------------------------------
    def run_stats(self) -> dict:
        """The embedded engine's traffic and recall figures (``SparseStats.run_stats``) and this front end's counts
        (a host sync)."""
        out = self.pipeline.run_stats()
        c = self.counts
        unit = self.stats.bytes_per_head_block
        out.update(mode=self.mode.value, fetch_cap=self.cap, steps=c["steps"],
                   decode_request_steps=c["decode_request_steps"], fills=c["fills"],
                   fallback_steps=c["fallback_steps"],
                   gap_rows=int(self._gap_rows), replayed_steps=c["replayed_steps"],
                   eager_graph_steps=c["eager_graph_steps"],
                   max_step_cap_bytes=c["step_cap_blocks"] * unit,
                   max_step_bytes_over_cap=int(self._cap_excess) * unit,
                   running_requests=len(self.first), max_running_requests=c["max_running_requests"],
                   kv_heads=self.head_map.slot_map.shape[2],
                   host_pool_rows=self.host_pool_rows, host_pool_bytes=self.host_pool_bytes,
                   device_tier_rows=self.tier_rows, device_tier_bytes=self.tier_bytes,
                   device_bytes=self.device_bytes)
        return out

    def reset_counters(self) -> None:
        self.pipeline.reset_counters()
        self._cap_excess.zero_()
        self._fetched_before.zero_()
        self._gap_rows.zero_()
        self.counts.update(steps=0, decode_request_steps=0, fills=0, fallback_steps=0, step_cap_blocks=0,
                           replayed_steps=0, eager_graph_steps=0, max_running_requests=len(self.first))


def free_device_bytes(device: torch.device) -> int:
    """What this process can still allocate on ``device``: the driver's free memory and what PyTorch's caching
    allocator holds unused (vLLM's profiling runs leave some there)."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_device_memory(state_bytes: int, tier_bytes: int, free_bytes: int) -> None:
    """Refuse device state the GPU cannot hold beside vLLM's cache (before allocating it): the arithmetic in the
    error. ``state_bytes``: working sets and summaries of every row; ``tier_bytes``: the device tier's rows."""
    if state_bytes + tier_bytes > free_bytes:
        gib = 1 << 30
        raise MemoryError(f"OasisKV needs {(state_bytes + tier_bytes) / gib:.1f} GiB of device memory beside vLLM's KV "
                          f"cache (working sets and summaries {state_bytes / gib:.1f} GiB, device tier "
                          f"{tier_bytes / gib:.1f} GiB) and the GPU has {free_bytes / gib:.1f} GiB free: lower "
                          f"device_tier_gb, kv_cache_memory_bytes, max_num_seqs or host_pool_gb (rows)")


def check_host_memory(pool_bytes: int, max_rows: int, max_model_len: int) -> None:
    """Refuse a pinned pool the host cannot hold (before allocating it): the arithmetic in the error."""
    avail = available_host_bytes()
    if avail is None:  # not Linux: no check
        return
    if pool_bytes > 0.9 * avail:
        gib = 1 << 30
        raise MemoryError(f"OasisKV's host pool needs {pool_bytes / gib:.1f} GiB ({max_rows} rows x "
                          f"max_model_len {max_model_len} tokens, full KV of every layer), and this host has "
                          f"{avail / gib:.1f} GiB available: set host_pool_gb (requests past its rows wait), or "
                          f"lower max_num_seqs or max_model_len")


_RUNTIMES: dict[int, tuple[Any, HostPoolRuntime]] = {}
"""Per engine config (by id; the config is kept alive beside its runtime): the process's runtime."""


def current_runtime() -> HostPoolRuntime | None:
    """This process's runtime, if a host-pool engine has run a step (the KV connector's worker side reads it)."""
    for _, rt in _RUNTIMES.values():
        return rt
    return None


def runtime_for(vllm_config: Any, opts: VllmOptions, k_cache: torch.Tensor, dtype: torch.dtype, scale: float
                ) -> HostPoolRuntime:
    """The shared runtime of the engine whose config is ``vllm_config`` (created on the first call, from a layer's
    K cache view ``[num_blocks, block_size, Hkv, D]``)."""
    entry = _RUNTIMES.get(id(vllm_config))
    if entry is not None and entry[0] is vllm_config:
        rt = entry[1]
        if rt.num_blocks != k_cache.shape[0]:
            raise RuntimeError(f"OasisKV: vLLM's KV cache changed from {rt.num_blocks} to {k_cache.shape[0]} blocks")
        return rt
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if pp != 1:
        raise NotImplementedError("OasisKV's host-pool modes on vLLM run without pipeline parallelism")
    if capturing():
        raise RuntimeError("OasisKV: the host-pool runtime would be made inside a CUDA-graph capture (no eager forward "
                           "ran first); run with cuda_graphs='off' and report this")
    num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    nb, _, hkv, d = k_cache.shape
    if dtype.itemsize != vllm_config.model_config.dtype.itemsize:
        raise NotImplementedError(f"OasisKV's host pool keeps KV in the model's dtype ({vllm_config.model_config.dtype}"
                                  f"); vLLM's cache is {dtype} (kv_cache_dtype): run without it")
    rt = HostPoolRuntime(opts, num_layers, hkv, d, nb, dtype, k_cache.device, host_pool_rows(vllm_config, opts), scale,
                         vllm_config.model_config.max_model_len, device_tier_rows(vllm_config, opts))
    rt.full_graphs = opts.full_graphs and k_cache.device.type == "cuda"
    if rt.full_graphs and getattr(vllm_config, "use_v2_model_runner", False):
        raise RuntimeError("OasisKV: full CUDA graphs in the host-pool modes need vLLM's V1 model runner (the V2 "
                           "runner replays full graphs outside the forward context the KV connector prepares them "
                           "in): set VLLM_USE_V2_MODEL_RUNNER=0 (engine_args does), or use cuda_graphs='off'")
    _RUNTIMES.clear()  # one engine per process at a time (in-process test engines come one after another)
    _RUNTIMES[id(vllm_config)] = (vllm_config, rt)
    return rt
