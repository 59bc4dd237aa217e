"""The look-ahead pipeline (SPEC items 3-4): per layer, predict -> select -> transfer, off the critical path.

During step t, once layer l's attention has read its working set, the pipeline scores the summaries with the
prediction query (the draft row's under OasisKV, the request's own under proxy-prefetch), runs Algorithm 2 against
the layer's per-head map, and copies the admitted blocks into the freed slots. On CUDA with the kernels the three
stages go to three background streams ordered by events (prediction of layer l+1 overlaps selection of l and
transfer of l-1, while attention and FFN run on the main stream), and step t+1's layer l waits only for step t's
layer-l copies (:meth:`wait`). Without streams (the CPU, or the reference ops) the same calls run in order: one
implementation of selection, transfer and counting, whatever the device.

Shapes: ``B`` requests, ``Hkv`` KV heads, ``K`` working-set slots per head; predictions ``[B, Hkv, K]`` logical
block ids, ``-1`` padded.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.config import DebugConfig, KernelConfig
from oasiskv_runtime.core.batch import DecodeBatch
from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.core.predictor import Predictor
from oasiskv_runtime.core.stats import SparseStats
from oasiskv_runtime.ops.select_plan import select_plan
from oasiskv_runtime.transfer.engine import TransferEngine, TransferPlan


class LookaheadPipeline:
    def __init__(self, head_map: HeadMap, predictor: Predictor, transfer: TransferEngine, stats: SparseStats,
                 kernels: KernelConfig, debug: DebugConfig) -> None:
        self.map, self.predictor, self.transfer, self.stats = head_map, predictor, transfer, stats
        self.kernels, self.debug = kernels, debug
        self.remote = None
        """Prefill-decode, decode side (``oasiskv_runtime.pd.remote.RemoteKV``): pool blocks it marks absent are
        read from the prefill peer before they are copied (a cache miss; a host round trip)."""
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        """Per layer, the last prediction and the requests it was made for (recall is scored a step later)."""

    @property
    def background(self) -> bool:
        return self.transfer.background

    @property
    def streams(self) -> list[torch.cuda.Stream]:
        return self.transfer.streams(self.kernels.pipeline_priority)

    def wait(self, layer: int) -> None:
        """Before layer ``layer`` reads its working set: wait for the copies issued for it a step ago, only."""
        if self.background:
            self.transfer.wait(layer)

    def fetch(self, layer: int, batch: DecodeBatch, pred: torch.Tensor, cap: int, initial: bool = False,
              stream: torch.cuda.Stream | None = None, demand: bool = False,
              row_cap: torch.Tensor | None = None) -> None:
        """Algorithm 2 on every (request, KV head) row of this layer (``cap`` admissions per row, the per-head map
        rewritten in place) and a fixed-size copy plan, in one launch (:func:`select_plan`: no host round trip to
        compact it; with ``row_cap`` compacted on the device), then one gather of the admitted blocks; on
        ``stream`` when given (ordered after the plan), where the layer's event is recorded. ``initial``: the working set's first fill, ``demand``: a prefetching
        mode's misses fetched on demand (``demand_fetch``); both counted apart. ``row_cap``: ``[B]`` each request's
        own cap, at most ``cap`` (``early_fetch_ratio``)."""
        c = self.transfer.counters
        if initial:
            counters = (c.initial,)
        elif demand:
            counters = (c.demand[layer],)
        else:
            counters = (c.fetched[layer], c.deferred[layer], c.req_fetched)
        # per-request caps: a compacted plan, whose number of copies the gather reads on the device
        count = None if row_cap is None else torch.empty((), dtype=torch.int32, device=pred.device)
        src, dst, head = select_plan(self.map.slot_map[:, layer], self.map.last_sel[:, layer], batch.state_rows, pred,
                                     cap, batch.step, batch.primary_table, batch.slot_blocks, *counters,
                                     row_cap=row_cap, count=count,
                                     backend=self.transfer.backend if self.kernels.select_kernel else "ref")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            for t in (src, dst, head) + ((count,) if count is not None else ()):
                t.record_stream(stream)
        with self.transfer.on(stream):
            if self.remote is not None:
                self.remote.ensure(layer, src[src >= 0])
            if not self.debug.disable_transfers:
                self.transfer.copy(layer, src, dst, head, ctas=self.kernels.gather_ctas,
                                   copies=self.kernels.gather_copies, hint=self.kernels.gather_hint, count=count)
        self.transfer.mark(layer, stream)

    def demand_fetch(self, layer: int, batch: DecodeBatch, query: torch.Tensor, pred_q: torch.Tensor | None, cap: int,
                     keep: torch.Tensor | None) -> torch.Tensor | None:
        """``demand_fetch``, before layer ``layer``'s attention: the step's own top-K from ``query`` ``[B, Hq, D]``
        (keeping ``keep``, ``attended_ids``' blocks), its misses fetched into the working set, at most ``cap`` per
        request and KV head. A block an accepted draft completed is not ranked (``DecodeBatch.before_gap``: the step
        attends it in its local slot). With key codes one read of them also scores ``pred_q``, the prefetch's query:
        returns those scores for :meth:`prefetch` (``scores``), else None."""
        batch = batch.before_gap()
        pair = None if pred_q is None else self.predictor.coded_pair(layer, query, pred_q, batch)
        if pair is None:
            pred, next_scores = self.predictor.predict(layer, query, batch, next_step=False, keep=keep), None
        else:
            step_scores, next_scores = pair
            pred = self.predictor.rank(step_scores, batch.num_candidates, keep=keep)
        self.fetch(layer, batch, pred, cap, demand=True)
        return next_scores

    def prefetch(self, layer: int, batch: DecodeBatch, pred_q: torch.Tensor, cap: int,
                 row_cap: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> None:
        """After layer ``layer``'s attention: predict the next step's top-K from ``pred_q`` ``[B, Hq, D]``, select
        (at most ``cap`` admissions per request and head, or ``row_cap``'s ``[B]``, each at most ``cap``) and
        copy. ``scores``: ``pred_q``'s block scores over the next step's candidates, when the step made them already
        (``Predictor.coded_pair``): ranked, not scored again."""
        keep = self.map.attended_ids(layer, batch.state_rows)  # None unless attended_blocks

        def predict(int32: bool = False) -> torch.Tensor:
            if scores is None:
                return self.predictor.predict(layer, pred_q, batch, next_step=True, int32=int32, keep=keep)
            return self.predictor.rank(scores, batch.next_candidates, int32=int32, keep=keep)

        if not self.background:
            pred = predict()
            self._remember(layer, batch, pred)
            self.fetch(layer, batch, pred, cap, row_cap=row_cap)
            return
        # The transfer also waits for this layer's attention, which still reads the slots it is about to overwrite.
        # A tensor made on one stream and read on another is marked with record_stream: otherwise its memory could
        # be handed to the producing stream's next allocation (the next layer's) while the consumer still reads it.
        s_pred, s_sel, s_xfer = self.streams
        s_pred.wait_event(torch.cuda.current_stream(s_pred.device).record_event())
        for t in (pred_q, keep, scores):
            if t is not None:
                t.record_stream(s_pred)
        int32 = self.kernels.select_kernel and not self.debug.measure_recall  # the fused kernel reads int32 ids
        with torch.cuda.stream(s_pred):
            pred = predict(int32)
            self._remember(layer, batch, pred)
        s_sel.wait_stream(s_pred)
        pred.record_stream(s_sel)
        with torch.cuda.stream(s_sel):
            self.fetch(layer, batch, pred, cap, stream=s_xfer, row_cap=row_cap)

    def fill(self, layer: int, batch: DecodeBatch, query: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Fill the working sets of requests whose prefill completes this step: predict the first decode step's
        top-K from ``query`` (the last prompt token's, or the draft's), or rank ``scores`` ``[B, Hkv, J]`` made by
        the caller (``fill_window``: the prompt's exact attention mass), and admit all of it (no cap)."""
        keep = self.map.attended_ids(layer, batch.state_rows)
        if scores is None:
            pred = self.predictor.predict(layer, query, batch, next_step=True, keep=keep)
        else:
            pred = self.predictor.rank(scores, batch.next_candidates, keep=keep)
        self.map.clear(layer, batch.state_rows)
        if layer == 0:
            self.map.stamp_start(batch.state_rows, batch.step)
        self.fetch(layer, batch, pred, self.map.k_slots, initial=True)

    # ---- requests and reports -------------------------------------------------------------------------------
    def release(self, seq_id) -> int | None:
        """A request leaves: its copies are counted (once the background counting is done), its map row freed.
        Returns the row it held (None: it had none)."""
        row = self.map.rows.get(seq_id)
        if row is not None:
            self.transfer.settle(self.kernels.pipeline_priority)
            self.stats.add_request_fetched(seq_id, self.transfer.counters.take_request(row))
        self.map.free(seq_id)
        if self.remote is not None:
            self.remote.forget(seq_id)
        return row

    def reset_counters(self) -> None:
        """Zero the copy and recall counters (benchmarks measure a window of steps)."""
        self.transfer.settle(self.kernels.pipeline_priority)  # the background counting is done
        self.stats.reset()
        self.forget_recall()
        self.transfer.counters.reset()

    def run_stats(self) -> dict:
        """Traffic and recall figures for reports (a host sync)."""
        self.transfer.settle(self.kernels.pipeline_priority)
        return self.stats.run_stats(self.transfer.counters.totals())

    # ---- prefill-decode hand-off ----------------------------------------------------------------------------
    def export(self, seq_id: int, summary_rows: torch.Tensor, step: int) -> dict:
        """What a peer needs to continue a request exactly as this side would: the key summaries of its blocks
        (flat rows ``summary_rows``) and its per-head map, stamps relative to ``step``."""
        mins, maxs = self.predictor.summaries.export(summary_rows)
        return {"summary_min": mins, "summary_max": maxs, **self.map.export(seq_id, step)}

    def install(self, seq_id: int, state: dict, summary_rows: torch.Tensor, pool_table: torch.Tensor,
                slot_blocks: torch.Tensor, step: int) -> None:
        """A request :meth:`export` made on a peer: its map and summaries, and its working set copied in now from
        the pool (``pool_table``: ``[NB]`` pool block of each logical block; ``slot_blocks``: ``[K]``)."""
        self.map.import_(seq_id, state, step)
        self.predictor.summaries.write(summary_rows, state["summary_min"], state["summary_max"])
        smap = state["slot_map"].to(pool_table.device)
        for layer in range(smap.shape[0]):
            h, k = (smap[layer] >= 0).nonzero(as_tuple=True)
            self.transfer.submit(TransferPlan(layer, pool_table[smap[layer][h, k]], slot_blocks[k], h))
            self.transfer.counters.initial += h.numel()

    # ---- recall of the prediction (DebugConfig.measure_recall) ------------------------------------------------
    def _remember(self, layer: int, batch: DecodeBatch, pred: torch.Tensor) -> None:
        if self.debug.measure_recall:
            self._pending[layer] = (batch.state_rows.clone(), pred, list(batch.seq_ids))

    def record_recall(self, layer: int, batch: DecodeBatch, q_true: torch.Tensor) -> None:
        """Recall of last step's prediction for this layer against the true query's top-K (SPEC item 1)."""
        prev = self._pending.pop(layer, None)
        if prev is None:
            return
        prev_rows, prev_pred, prev_ids = prev
        true = self.predictor.predict(layer, q_true, batch, next_step=False)
        match = (prev_rows[:, None] == batch.state_rows[None, :]).nonzero(as_tuple=True)
        for i_prev, i_now in zip(*match):
            if prev_ids[int(i_prev)] != batch.seq_ids[int(i_now)]:
                continue  # the row now holds another request (the predicting one left, e.g. a warm-up's)
            if int(batch.num_candidates[i_now]) <= self.map.k_slots:
                continue  # everything fits: recall is trivially 1 and would only inflate the average
            t, p = true[i_now], prev_pred[i_prev]                               # [Hkv, K]
            hits = (t[:, :, None] == p[:, None, :]).any(-1) & (t >= 0)
            self.stats.add_recall(layer, hits.sum().item(), (t >= 0).sum().item(), prev_ids[int(i_prev)])

    def forget_recall(self) -> None:
        self._pending.clear()
