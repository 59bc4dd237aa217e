"""Prefill traffic of the full-KV pool by the copy engines (``KernelConfig.copy_engine_prefill``).

A prefill chunk writes its tokens' KV to the pool and reads its prefix (the earlier chunks) back. Laid out as runs
of consecutive pool rows (:func:`pool_runs`), each is one ``cudaMemcpyAsync`` on one of two side streams (reads,
writes), beside the step's compute, the reads a layer ahead. Sequences whose rows fall in too many runs, and decode
rows, keep the UVA kernels on the main stream. On the CPU the same copies run in order (the data flow is tested
there). Knows nothing about attention: it is handed which rows to move.
"""

from __future__ import annotations

import contextlib

import torch

from oasiskv_runtime.ops.common import host_list_to
from oasiskv_runtime.transfer.host_pool import HostKVPool
from oasiskv_runtime.transfer.runs import copy_runs, pool_runs

MAX_COPY_RUNS = 64
"""A prefill sequence whose pool rows fall in more runs than this is read and written by the UVA kernels (each
run costs two ``cudaMemcpyAsync`` calls per layer on the host)."""


class PrefillPoolIO:
    def __init__(self, pool: HostKVPool, num_layers: int, device: torch.device, side_streams: bool) -> None:
        self.pool, self.num_layers, self.device = pool, num_layers, device
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if side_streams else None
        """(reads, writes); None on the CPU, where the copies run in order."""
        self.reset()

    def reset(self) -> None:
        self.reads: dict[int, tuple[list, int]] = {}
        """Sequences whose prefix the read stream brings back: seq id -> (runs, context length)."""
        self.writes: list = []
        self._bufs: dict[int, tuple] = {}
        self._kernel_rows: torch.Tensor | None = None
        self.write_event = None

    @property
    def active(self) -> bool:
        """This step's pool writes go by the copy engines (planned by :meth:`plan`)."""
        return bool(self.writes)

    def plan(self, prefill: list, kernel_rows: list[int]) -> None:
        """This step's rows of each prefill sequence (objects with ``seq_id``, ``block_table``, ``context_len``,
        ``num_query``, ``query_start``) as runs: the chunk's own rows to write, its prefix to read back; rows in
        ``kernel_rows`` (decode requests), and sequences in too many runs, stay with the kernels. Issues layer 0's
        reads."""
        bs, tf = self.pool.block_size, self.pool.tier_first
        kernel_rows = list(kernel_rows)
        for s in prefill:
            prefix = s.context_len - s.num_query
            writes = pool_runs(s.block_table, prefix, s.num_query, s.query_start, bs, tf)
            if len(writes) <= MAX_COPY_RUNS:
                self.writes += writes
            else:
                kernel_rows += range(s.query_start, s.query_start + s.num_query)
            if prefix:
                reads = pool_runs(s.block_table, 0, prefix, 0, bs, tf)
                if len(reads) <= MAX_COPY_RUNS:
                    self.reads[s.seq_id] = (reads, s.context_len)
        if not self.writes:  # reads alone would need the streams joined too: keep the kernels for both
            self.reads = {}
            return
        self._kernel_rows = host_list_to(sorted(kernel_rows), torch.long, self.device)
        # Both side streams start after everything before this step (the previous step ended joined with them).
        for st in self.streams or ():
            st.wait_stream(torch.cuda.current_stream(self.device))
        self.issue_reads(0)

    def _on_side(self, i: int):
        """Work on side stream ``i`` (0: reads, 1: writes); in order on the CPU."""
        return torch.cuda.stream(self.streams[i]) if self.streams else contextlib.nullcontext()

    def _event(self, i: int):
        return self.streams[i].record_event() if self.streams else None

    def wait(self, event, *tensors: torch.Tensor) -> None:
        """The current stream waits for ``event`` of a side stream and takes over ``tensors`` made there."""
        if event is None:
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        for t in tensors:
            t.record_stream(cur)

    def issue_reads(self, layer: int) -> None:
        """Read layer ``layer``'s prefixes into fresh buffers on the read stream (once per layer and step)."""
        if layer >= self.num_layers or layer in self._bufs or not self.reads:
            return
        pool, tier = self.pool.parts(layer)
        shape, dt = pool[0].shape[2:], pool[0].dtype
        bufs = {}
        with self._on_side(0):
            for seq_id, (runs, ctx) in self.reads.items():
                buf = (torch.empty((ctx, *shape), dtype=dt, device=self.device),
                       torch.empty((ctx, *shape), dtype=dt, device=self.device))
                copy_runs(runs, pool, tier, buf, to_pool=False)
                bufs[seq_id] = buf
            self._bufs[layer] = (self._event(0), bufs)

    def take_read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A sequence's context buffers ``[context_len, Hkv, D]`` read ahead for this layer (the prefix filled; the
        chunk's own rows are the caller's to fill), or None when it is not read by the copy engines."""
        read = self._bufs.get(layer)
        if read is None or seq_id not in read[1]:
            return None
        ks, vs = read[1].pop(seq_id)
        self.wait(read[0], ks, vs)
        return ks, vs

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """This layer's new KV ``[T, Hkv, D]`` into the pool: prefill runs by the copy engine on the write stream,
        the rest (decode rows, sequences in too many runs) by the scatter kernel on this stream."""
        pool, tier = self.pool.parts(layer)
        if self.streams:
            ws = self.streams[1]
            ws.wait_stream(torch.cuda.current_stream(self.device))
            k.record_stream(ws)  # read there: kept until the copies are done
            v.record_stream(ws)
        with self._on_side(1):
            copy_runs(self.writes, pool, tier, (k, v), to_pool=True)
            self.write_event = self._event(1)
        rows = self._kernel_rows
        if rows.numel():
            self.pool.write_rows(layer, k[rows], v[rows], slot_mapping[rows])

    def join(self) -> None:
        """At the end of a step that used the side streams: the current stream waits for their copies, so the next
        step (and anything forked from its stream) sees the pool written."""
        if self.writes and self.streams:
            cur = torch.cuda.current_stream(self.device)
            for st in self.streams:
                cur.wait_stream(st)
