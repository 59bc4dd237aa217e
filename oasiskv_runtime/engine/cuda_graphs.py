"""CUDA graphs for decode-only steps (issue #4: the eager sparse step was bound by Python and kernel launches).

A decode-only step (every scheduled request computes exactly one token) runs through a *static layout*: its
per-step inputs live in persistent device buffers, so the same kernels can be replayed from a captured
CUDA graph with new values:

- rows ``0..B-1`` are the requests' tokens; in draft modes rows ``B..2B-1`` are their look-ahead rows (a
  request without a draft gets its own token there; that row's output is never used);
- small per-request vectors (token, position, cache slot, the backend's block counts...) go up in ONE
  pinned, non-blocking copy into a per-batch-size flat buffer;
- per-request block tables (host/device blocks, summary blocks, working-set slots) are kept by request in
  device tables that only receive the entries that changed since the last step (a table only grows while a
  request runs), then gathered into the batch's rows with ``index_select(out=...)``.

Graphs are keyed by (padded batch size, candidate-block bucket, the backend's baked-in settings). The batch is
padded up to the next of ``BATCH_BUCKETS`` (as vLLM does), so a batch that shrinks and grows as requests come and
go replays a few graphs instead of capturing one per size. Padding rows compute as a scratch request at position
0 whose blocks no real request reads (``KVCacheManager.add_scratch_request``): everything they write lands there,
and with no candidate blocks they predict, select and fetch nothing, so no counter moves. The block bucket
rounds the longest context up to ``BLOCK_BUCKET`` blocks (scoring kernels mask columns past each request's own
count). A key is captured the second time it runs (its first run is eager on the static buffers: the warm-up that
compiles kernels); keys seen once are never captured. Everything the graph reads is a persistent buffer; nothing inside it talks to
the host. A step that also prefills is split: its decode requests run here, its prefill chunks eagerly after
(see ``DecodeGraphs.plan``).

A draft that reads the target's hidden states (EAGLE-3) gets them as graph outputs too; for it, steps that mix
decode and prefill are not split (it observes a step as one part).

``cuda_graphs``: ``auto`` (capture on CUDA), ``off`` (the eager engine), ``static`` (the static layout
without capture: how the CPU tests check this path against the eager one, token for token).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from oasiskv_runtime.engine.attention.metadata import SeqSlice, StepMetadata
from oasiskv_runtime.engine.kv_cache_manager import cdiv, token_slot
from oasiskv_runtime.engine.sequence import Sequence
from oasiskv_runtime.ops.common import host_list_to
from oasiskv_runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4) + tuple(range(8, 1025, 8))
"""Batch sizes graphs are captured for; a decode batch is padded up to the next one (larger batches: exact)."""
BLOCK_BUCKET = 256
"""Candidate blocks are rounded up to a multiple of this (4,096 tokens at block size 16) per graph key."""
CAPTURE_SIGHTS = 2
"""A key is captured when a decode part with it has run this many times (the first runs warm kernels up)."""
MIXED_SIGHTS = 3
"""A step that also prefills is split once its decode part's key has come this many times (see ``plan``)."""
MAX_GRAPHS = 64
"""Captured graphs kept (least recently used evicted); they share one memory pool."""


class RowTable:
    """A device table ``[rows, width]``: row r holds one request's list (e.g. its host blocks), padded with
    ``fill``. ``set`` records only what changed since the row's last update; ``flush`` uploads it all in one
    copy and one ``index_copy_``."""

    def __init__(self, num_rows: int, width: int, fill: int, dtype: torch.dtype, device: torch.device) -> None:
        self.width, self.fill = width, fill
        self.buf = torch.full((num_rows, width), fill, dtype=dtype, device=device)
        self.held: list[tuple[int | None, int]] = [(None, 0)] * num_rows
        self._idx: list[int] = []
        self._val: list[int] = []

    def set(self, row: int, owner: int, values: list[int], length: int | None = None) -> None:
        """Row ``row`` holds ``values[:length]`` for request ``owner`` (entries past it: ``fill``)."""
        n = len(values) if length is None else length
        if n > self.width:
            raise ValueError(f"table row of {n} entries exceeds the table width {self.width}")
        old_owner, old_n = self.held[row]
        if old_owner == owner and n >= old_n:
            start, new = old_n, values[old_n:n]
        else:
            start, new = 0, values[:n] + [self.fill] * max(0, old_n - n)
        if new:
            base = row * self.width + start
            self._idx.extend(range(base, base + len(new)))
            self._val.extend(new)
        self.held[row] = (owner, n)

    def forget(self, row: int) -> None:
        self.held[row] = (None, self.held[row][1])

    def flush(self) -> None:
        if not self._idx:
            return
        dev = self.buf.device
        idx = host_list_to(self._idx, torch.long, dev)
        val = host_list_to(self._val, self.buf.dtype, dev)
        self.buf.view(-1).index_copy_(0, idx, val)
        self._idx, self._val = [], []


@dataclass
class StaticBatch:
    """The static inputs of one decode step, handed to the attention backend in ``StepMetadata.extra``."""

    size: int
    """Rows in the batch (B): the step's requests, then padding rows up to the graph's batch size."""
    block_bucket: int
    """Candidate blocks every graph-side kernel is sized for (>= every request's count this step)."""
    vec: dict[str, torch.Tensor]
    """Per-request vectors by name (persistent buffers of this batch size)."""
    tables: dict[str, torch.Tensor]
    """Per-request tables gathered into batch order, ``[B, width]`` (persistent buffers)."""
    q_rows: torch.Tensor
    """``arange(B)``: the requests' token rows."""
    draft_rows: torch.Tensor
    """``arange(B, 2B)`` in draft modes (else ``q_rows``)."""


class StaticInputs:
    """Persistent device buffers of the static layout, per batch size, and the per-request tables."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device, self.max_rows = device, max_rows
        self.rows: dict[int, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.tables: dict[str, RowTable] = {}
        self._flat: dict[tuple, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._typed: dict[tuple, torch.Tensor] = {}
        self._gathered: dict[tuple, torch.Tensor] = {}
        self._arange: dict[tuple[int, int], torch.Tensor] = {}

    def row(self, seq_id: int) -> int:
        r = self.rows.get(seq_id)
        if r is None:
            if not self.free_rows:
                raise RuntimeError("static decode inputs: more running requests than rows")
            r = self.rows[seq_id] = self.free_rows.pop()
        return r

    def forget(self, seq_id: int) -> None:
        r = self.rows.pop(seq_id, None)
        if r is None:
            return
        for t in self.tables.values():
            t.forget(r)
        self.free_rows.append(r)

    def table(self, name: str, width: int, fill: int, dtype: torch.dtype = torch.long) -> RowTable:
        t = self.tables.get(name)
        if t is None:
            t = self.tables[name] = RowTable(self.max_rows, width, fill, dtype, self.device)
        return t

    def arange(self, start: int, stop: int) -> torch.Tensor:
        key = (start, stop)
        t = self._arange.get(key)
        if t is None:
            t = self._arange[key] = torch.arange(start, stop, dtype=torch.long, device=self.device)
        return t

    def upload(self, size: int, fields: dict[str, list[int]], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """All ``fields`` in one copy into this batch size's flat buffer; returns persistent views (fields
        with a dtype in ``dtypes`` are converted into persistent buffers of that dtype)."""
        names = tuple(fields)
        lens = tuple(len(fields[n]) for n in names)
        key = (size, names, lens)
        entry = self._flat.get(key)
        if entry is None:
            flat = torch.empty(sum(lens), dtype=torch.long, device=self.device)
            views, at = {}, 0
            for n, ln in zip(names, lens):
                views[n] = flat[at:at + ln]
                at += ln
            entry = self._flat[key] = (flat, views)
        flat, views = entry
        data: list[int] = []
        for n in names:
            data.extend(fields[n])
        flat.copy_(host_list_to(data, torch.long, self.device))
        out = dict(views)
        for n, dt in dtypes.items():
            typed = self._typed.get((key, n))
            if typed is None:
                typed = self._typed[(key, n)] = torch.empty(views[n].shape, dtype=dt, device=self.device)
            typed.copy_(views[n])
            out[n] = typed
        return out

    def gather(self, size: int, name: str, rows: torch.Tensor) -> torch.Tensor:
        """This step's rows of table ``name`` in batch order, into a persistent ``[size, width]`` buffer."""
        t = self.tables[name]
        t.flush()
        out = self._gathered.get((size, name))
        if out is None:
            out = self._gathered[(size, name)] = torch.empty((size, t.width), dtype=t.buf.dtype, device=self.device)
        torch.index_select(t.buf, 0, rows, out=out)
        return out


@dataclass
class _Graph:
    graph: object
    hidden: torch.Tensor
    captured: dict[int, torch.Tensor]
    """Layer outputs a draft reads (``runner.capture_layers``): graph outputs like ``hidden``."""
    draft_kv: list
    """The backend's per-layer K/V of the draft rows (``accept_drafts``): graph outputs like ``hidden``."""


class DecodeGraphs:
    """Runs decode-only steps on the static layout and, on CUDA, replays them from captured graphs."""

    def __init__(self, runner, capture: bool) -> None:
        self.runner = weakref.proxy(runner)  # the runner owns this object: no cycle keeps an engine's memory alive
        self.capture = capture
        cfg = runner.config
        self.block_size = cfg.cache.block_size
        self.uses_draft = cfg.mode.uses_draft
        self.max_blocks = cdiv(runner.kv.max_model_len, self.block_size) + 1
        self.max_requests = cfg.scheduler.max_num_seqs
        self.static = StaticInputs(runner.device, self.max_requests + 1)  # + the padding rows' scratch request
        self.pad_seq: Sequence | None = Sequence([0], SamplingParams(max_tokens=1))
        if not runner.kv.add_scratch_request(self.pad_seq):
            self.pad_seq = None  # no blocks to spare: exact batch sizes
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.sights: dict[tuple, int] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled_reason: str | None = None
        self.num_replays = 0
        self.num_captures = 0
        self.num_static_eager = 0
        self.num_split_steps = 0
        self.num_padded_rows = 0
        self.prepare_seconds = 0.0
        self.last_hidden: torch.Tensor | None = None
        """The last run's hidden states of every row of the static layout (draft rows included)."""

    def forget(self, seq_id: int) -> None:
        self.static.forget(seq_id)

    def plan(self, sched) -> tuple[list, tuple] | None:
        """The part of a step to run on the static layout (its decode requests) and its graph key, or None.

        A decode-only step always runs on it. A step that also prefills is split (decode part here, the
        prefill chunks eagerly after it) once the decode part's graph exists or its key keeps coming back
        (``MIXED_SIGHTS``): splitting costs a second pass over the weights, which pays only with a replay, and
        only for a backend whose eager decode part is expensive (``graph_split_mixed``: the sparse modes; dense
        decode rows ride along in the prefill forward at almost no cost: measured on the H200, splitting made
        dense 2-20% slower in prefill-heavy runs)."""
        if self.disabled_reason is not None:
            return None
        decode = [s for s in sched.scheduled if s.is_decode]
        if not decode or len(decode) > self.max_requests:
            return None
        be = self.runner.backend
        ready = getattr(be, "graph_ready", None)
        if ready is not None and not ready([s.seq.seq_id for s in decode]):
            return None
        longest = max(s.seq.num_computed_tokens + 1 for s in decode)
        bucket = min(cdiv(max(1, longest // self.block_size), BLOCK_BUCKET) * BLOCK_BUCKET, self.max_blocks)
        key = (self.padded_size(len(decode)), bucket, tuple(be.graph_key()),
               self.runner.config.kernels.fused_norm_rope)  # the model's kernels are baked into a capture
        mixed = len(decode) < len(sched.scheduled)
        if mixed and (self.runner.capture_layers or not getattr(be, "graph_split_mixed", True)):
            return None  # a draft reading hidden states (EAGLE-3) observes a step as one part, not two
        if mixed and self.capture and key not in self.graphs:
            self.sights[key] = self.sights.get(key, 0) + 1
            if self.sights[key] < MIXED_SIGHTS:
                return None
        return decode, key

    def padded_size(self, n: int) -> int:
        """The batch size a decode step of ``n`` requests runs at (graphs are captured per padded size)."""
        if self.pad_seq is None:
            return n
        return next((b for b in BATCH_BUCKETS if b >= n), n)

    def _prepare(self, seqs: list, drafts: dict[int, int], step: int, key: tuple) -> StepMetadata:
        real = len(seqs)
        seqs = seqs + [self.pad_seq] * (key[0] - real)
        bs, n = self.block_size, len(seqs)
        runner, static = self.runner, self.static
        ids, pos, slots, rows, has_draft = [], [], [], [], []
        d_ids, d_pos = [], []
        tables, ctxs, slices = [], [], []
        for i, seq in enumerate(seqs):
            p = seq.num_computed_tokens
            tok = seq.token_at(p)
            table = runner.primary_table(seq)
            ids.append(tok)
            pos.append(p)
            slots.append(token_slot(table, p, bs))
            rows.append(static.row(seq.seq_id))
            d = drafts.get(seq.seq_id)
            has_draft.append(d is not None)
            d_ids.append(tok if d is None else d)
            d_pos.append(p + 1)
            tables.append(table)
            ctxs.append(p + 1)
            if i < real:  # the step's requests; padding rows have none (nothing per request is kept for them)
                slices.append(SeqSlice(seq.seq_id, i, 1, p + 1, table,
                                       n + i if (d is not None and self.uses_draft) else None, True))
        fields = {"input_ids": ids + (d_ids if self.uses_draft else []),
                  "positions": pos + (d_pos if self.uses_draft else []),
                  "slot_mapping": slots + ([-1] * n if self.uses_draft else []),
                  "table_rows": rows, "step": [step]}
        inputs = runner.sparse_inputs or runner.backend  # the sparse modes' inputs, or the dense backend's table
        dtypes = inputs.graph_fields(seqs, ctxs, tables, rows, has_draft, fields, static, self.max_blocks)
        vec = static.upload(n, fields, dtypes)
        gathered = {name: static.gather(n, name, vec["table_rows"]) for name in static.tables}
        batch = StaticBatch(n, key[1], vec, gathered, static.arange(0, n),
                            static.arange(n, 2 * n) if self.uses_draft else static.arange(0, n))
        meta = StepMetadata(input_ids=vec["input_ids"], positions=vec["positions"],
                            slot_mapping=vec["slot_mapping"], seqs=slices, logits_indices=batch.q_rows,
                            step=step, extra={"static": batch})
        if runner.sparse_inputs is not None:
            meta.sparse = runner.sparse_inputs.static_step(meta, batch)
        return meta

    def run(self, decode: list, drafts: dict[int, int],
            key: tuple) -> tuple[StepMetadata, torch.Tensor, dict[int, torch.Tensor]]:
        """Run the decode requests ``decode`` (from :meth:`plan`); returns the step's metadata, the hidden
        states of their token rows and the layer outputs of ``runner.capture_layers`` (all rows of the static
        layout, which ``meta.seqs`` indexes; valid until the next replay)."""
        runner, be = self.runner, self.runner.backend
        t0 = time.perf_counter()
        meta = self._prepare([s.seq for s in decode], drafts, runner.step_index, key)
        self.num_padded_rows += key[0] - len(decode)
        be.begin_step(meta)
        self.prepare_seconds += time.perf_counter() - t0
        entry = self.graphs.get(key) if self.capture else None
        if entry is not None:
            self.graphs.move_to_end(key)
            entry.graph.replay()
            be.graph_replayed()
            hidden, captured = entry.hidden, entry.captured
            if entry.draft_kv:  # what the replay computed for the draft rows, as an eager forward leaves it
                be.draft_kv = list(entry.draft_kv)
            self.num_replays += 1
        else:
            hidden, captured = runner.model(meta.input_ids, meta.positions, be, runner.capture_layers)
            be.graph_join()
            self.num_static_eager += 1
            if self.capture:
                self.sights[key] = self.sights.get(key, 0) + 1
                if self.sights[key] >= CAPTURE_SIGHTS:
                    self._capture(key, meta)
        be.end_step()
        self.last_hidden = hidden
        return meta, hidden[:len(decode)], captured

    def _capture(self, key: tuple, meta: StepMetadata) -> None:
        runner, be = self.runner, self.runner.backend
        graph = torch.cuda.CUDAGraph()
        be.before_capture()
        eager_kv = getattr(be, "draft_kv", None)  # this step's (the eager run's); a capture computes nothing
        if eager_kv is not None:
            be.draft_kv = []
        try:
            # The capture stream belongs to the current device: make it the engine's (e.g. cuda:1).
            with torch.cuda.device(runner.device), torch.cuda.graph(graph, pool=self.pool):
                hidden, captured = runner.model(meta.input_ids, meta.positions, be, runner.capture_layers)
                be.graph_join()
        except Exception as e:  # noqa: BLE001 - the step already ran eagerly; fall back for good
            self.disabled_reason = f"CUDA graph capture failed: {type(e).__name__}: {e}"
            log.warning("%s; decode steps stay eager", self.disabled_reason)
            torch.cuda.synchronize(runner.device)
            return
        finally:
            be.graph_replayed()
            if eager_kv is not None:
                captured_kv, be.draft_kv = be.draft_kv, eager_kv
        self.graphs[key] = _Graph(graph, hidden, captured, captured_kv if eager_kv is not None else [])
        self.num_captures += 1
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)

    def reset_counters(self) -> None:
        self.num_replays = self.num_captures = self.num_static_eager = self.num_split_steps = 0
        self.num_padded_rows = 0
        self.prepare_seconds = 0.0

    def stats(self) -> dict:
        runs = self.num_replays + self.num_static_eager
        return {"graph_replays": self.num_replays, "graph_captures": self.num_captures,
                "static_eager_steps": self.num_static_eager, "split_steps": self.num_split_steps,
                "graph_padding_rows": self.num_padded_rows, "graphs_disabled": self.disabled_reason,
                # Host time to lay out a step on the static buffers before its replay (the GPU waits meanwhile).
                "graph_prepare_ms_per_step": self.prepare_seconds * 1e3 / runs if runs else None}
