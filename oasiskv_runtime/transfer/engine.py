"""Moving KV blocks from the full-KV pool into the device working sets. The transfer engine knows nothing about
why a block moves: it takes a plan (which pool block of which KV head goes into which device block), performs
the copies, and tells when they are done.

It owns what moving needs: the prefetch pipeline's background CUDA streams (at a priority), one event per layer
(step t+1's layer l waits only for step t's layer-l copies: layer-local sync, SPEC item 3) and the device-side
copy counters (no host round trip per layer). On the CPU, or with the reference ops, the same calls run in order
on the current stream: one code path, no second implementation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from oasiskv_runtime.config import GATHER_COPIES, GATHER_CTAS
from oasiskv_runtime.ops.uva_gather import uva_gather
from oasiskv_runtime.transfer.host_pool import HostKVPool
from oasiskv_runtime.transfer.paged_kv import PagedKVCache


@dataclass
class TransferPlan:
    """Copies for one layer: ``pool[src_blocks[i], :, heads[i]] -> device[dst_blocks[i], :, heads[i]]`` (K and V);
    entries with ``src = -1`` are unused slots of a fixed-size plan."""

    layer: int
    src_blocks: torch.Tensor
    """[n] pool block ids (int64)."""
    dst_blocks: torch.Tensor
    """[n] device block ids (int64)."""
    heads: torch.Tensor
    """[n] KV head of each copy (int64)."""


class TransferCounters:
    """(block, KV head) copies counted where they are planned, on the plan's device (``ops.select_plan`` adds to
    them): per layer and per request row for decode steps, one total for initial fills."""

    def __init__(self, num_layers: int, max_rows: int, device: torch.device) -> None:
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        self.fetched, self.deferred = z(num_layers), z(num_layers)
        """[L] copies admitted / predicted blocks deferred by the cap, per layer (decode steps)."""
        self.initial = z()
        """Copies of initial fills (the working set filled when a prefill completes)."""
        self.demand = z(num_layers)
        """[L] copies fetched on demand by prefetching modes with ``demand_fetch`` (the prefetch's misses)."""
        self.req_fetched = z(max_rows)
        """[R] copies per request state row, moved to the host when the request ends."""
        self.step_max, self._total_before = z(), z()
        """Most copies of one step (the host cannot see the per-step counts without a sync)."""

    def end_step(self) -> None:
        """Fold this step's copies into ``step_max`` (device ops on the current stream)."""
        total = self.fetched.sum()
        torch.maximum(self.step_max, total - self._total_before, out=self.step_max)
        self._total_before.copy_(total)

    def take_request(self, row: int) -> int:
        """A request row's copies, zeroed for the row's next owner (a host read)."""
        n = int(self.req_fetched[row])
        self.req_fetched[row] = 0
        return n

    def reset(self) -> None:
        for t in (self.fetched, self.deferred, self.initial, self.demand, self.req_fetched, self.step_max,
                  self._total_before):
            t.zero_()

    def totals(self) -> dict:
        """Host copies of the counters (a host sync)."""
        return {"fetched_by_layer": self.fetched.tolist(), "deferred_by_layer": self.deferred.tolist(),
                "initial_fill_blocks": int(self.initial), "max_step_fetched": int(self.step_max),
                "demand_by_layer": self.demand.tolist()}


class TransferEngine:
    """Copies from ``pool`` into ``device_cache``. ``background``: copies may run on side streams ordered by events
    (CUDA with the kernels); otherwise every call runs at once on the current stream. ``backend``: the ops'
    ``"auto"`` (kernels where the tensors are on CUDA) or ``"ref"``."""

    def __init__(self, pool: HostKVPool, device_cache: PagedKVCache, num_layers: int, max_rows: int,
                 device: torch.device, backend: str = "auto", background: bool = False) -> None:
        self.pool, self.dev = pool, device_cache
        self.device, self.backend, self.background = device, backend, background
        self.counters = TransferCounters(num_layers, max_rows, device)
        self._streams: dict[int, list[torch.cuda.Stream]] = {}
        self.done: list[torch.cuda.Event | None] = [None] * num_layers
        """Per layer: the event recorded after its last background copies (None: nothing outstanding)."""

    def streams(self, priority: int = 0) -> list[torch.cuda.Stream]:
        """Three background streams at a CUDA priority (lower is higher): prediction, selection, transfer."""
        streams = self._streams.get(priority)
        if streams is None:
            streams = self._streams[priority] = [torch.cuda.Stream(self.device, priority=priority)
                                                 for _ in range(3)]
        return streams

    def on(self, stream: torch.cuda.Stream | None):
        """Work on ``stream`` (None: the current stream, as on the CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def copy(self, layer: int, src: torch.Tensor, dst: torch.Tensor, heads: torch.Tensor, *, ctas: int, copies: int,
             hint: str = "", count: torch.Tensor | None = None) -> None:
        """One gather of a layer's copies on the current stream (``-1`` entries skipped; ``count``: a compacted
        plan's number of copies, read on the device)."""
        uva_gather(self.pool.k[layer], self.pool.v[layer], self.dev.k[layer], self.dev.v[layer], src, dst, heads,
                   backend=self.backend, programs=ctas, copies=copies, hint=hint, tier=self.pool.tier(layer),
                   count=count)

    def mark(self, layer: int, stream: torch.cuda.Stream | None) -> None:
        """Layer ``layer``'s copies so far were issued on ``stream``: the next step's layer waits for this point."""
        if stream is not None:
            self.done[layer] = stream.record_event()

    def submit(self, plan: TransferPlan) -> None:
        """A plan's copies now, on the current stream (the hand-off of a request prefilled elsewhere)."""
        if plan.src_blocks.numel():
            self.copy(plan.layer, plan.src_blocks, plan.dst_blocks, plan.heads, ctas=GATHER_CTAS, copies=GATHER_COPIES)

    def wait(self, layer: int) -> None:
        """The current stream waits for layer ``layer``'s outstanding copies only (layer-local sync)."""
        ev = self.done[layer]
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def wait_all(self) -> None:
        """The current stream waits for every layer's outstanding copies (a GPU-side wait, not a host sync)."""
        for layer in range(len(self.done)):
            self.wait(layer)

    def forget(self) -> None:
        """Drop the per-layer events (after a graph replay, which ended joined; before a capture, which cannot wait
        on events recorded outside it)."""
        self.done = [None] * len(self.done)

    def join(self, priority: int) -> None:
        """The current stream waits for everything issued on the background streams."""
        cur = torch.cuda.current_stream(self.device)
        for s in self.streams(priority):
            cur.wait_stream(s)

    def end_step(self, priority: int) -> None:
        """Count the step's copies: on the transfer stream, ordered after this step's copies and after the current
        stream (a graph replay counts them there); no host sync."""
        if not self.background:
            self.counters.end_step()
            return
        xs = self.streams(priority)[2]
        xs.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(xs):
            self.counters.end_step()

    def settle(self, priority: int) -> None:
        """The current stream waits for the counting of :meth:`end_step` (before counters are reset or read)."""
        if self.background:
            torch.cuda.current_stream(self.device).wait_stream(self.streams(priority)[2])
