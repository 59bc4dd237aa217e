"""Which request a row of vLLM's batch is, across steps: the identity the host-pool modes key their state by.

vLLM's attention metadata has no request ids: each step a builder sees ``query_start_loc``, ``seq_lens`` and a block
table, in an order the worker's input batch chooses (and reorders). What does identify a running request there is
its **first physical KV block**: with prefix caching off (``engine_args`` turns it off in the host-pool modes) no two
running requests share a block, and a request keeps its first block from its first scheduled chunk until it
finishes or is preempted (recompute preemption frees all of its blocks).

What the block table cannot tell is when that ownership starts and ends: a finished request's first block may be
the next request's first block. The scheduler knows, and vLLM hands the scheduler's view to the workers through the
KV connector's per-step metadata. :class:`RequestTracker` (scheduler side, no vLLM import) turns each
``SchedulerOutput`` into :class:`StepEvents`:

* ``start``: ``(request id, first block)`` of requests scheduled with no KV computed yet (new, or resumed after a
  preemption, which recomputes from token 0): the worker gives them a fresh state row;
* ``free``: requests finished or preempted since the last step: their state rows go back;
* ``fill``: requests whose prefill completes this step (the worker fills their working sets at every layer);
* ``short_prefills``: requests still in prefill this step with at most two query rows. vLLM sorts them among the
  decodes (a one- or two-token chunk looks like ``[token]`` / ``[token, draft]``); the worker cannot tell them
  apart on the host without reading the block table back, so this count tells it to also run the dense fallback
  for rows without a working set (decided per row on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONNECTOR_NAME = "OasisKVConnector"
"""The KV connector's class name (``kv_transfer_config.kv_connector``)."""
CONNECTOR_MODULE = "oasiskv_runtime.vllm.connector"
"""Its module (``kv_transfer_config.kv_connector_module_path``)."""


@dataclass
class StepEvents:
    """One scheduler step's request lifecycle, as the workers apply it (in this order: free, start, fill)."""

    start: list[tuple[str, int]] = field(default_factory=list)
    """(request id, first physical block) of requests starting from no computed KV."""
    free: list[str] = field(default_factory=list)
    """Requests finished or preempted since the previous step."""
    fill: list[str] = field(default_factory=list)
    """Requests whose prefill completes this step."""
    short_prefills: int = 0
    """Requests in prefill this step with at most two query rows (they sort among the decodes)."""

    def merge(self, later: StepEvents) -> StepEvents:
        """This step's events followed by a later step's (frees and starts accumulate; the fill and the short
        prefills are the later step's: a step without a forward fills nothing)."""
        return StepEvents(start=self.start + later.start, free=self.free + later.free, fill=list(later.fill),
                          short_prefills=later.short_prefills)


_CURRENT: RequestTracker | None = None
"""The scheduler process's tracker (the latest made: in-process test engines come one after another)."""


def decoding_since(req_id: str) -> int | None:
    """Tokens a running request had computed when its prefill completed (None: still in prefill, or unknown), from
    this process's tracker: the KV-cache manager of working-set admission asks (``vllm/kv_spec.py``)."""
    return None if _CURRENT is None else _CURRENT.decoding.get(req_id)


class RequestTracker:
    """Scheduler-side bookkeeping behind :class:`StepEvents` (plain Python: the connector feeds it vLLM's objects).

    ``on_alloc`` is called when the scheduler allocates blocks for a waiting request (new or resumed): it records
    the request's first block and how many tokens its prefill computes (``request.num_tokens``: the prompt, or for
    a resumed request the prompt and the outputs so far, all recomputed). ``step`` reads one ``SchedulerOutput``.
    """

    def __init__(self) -> None:
        self._alloc: dict[str, tuple[int, int]] = {}
        """Requests allocated but not yet seen scheduled: (first block, tokens their prefill computes)."""
        self.live: dict[str, int] = {}
        """Running requests -> first block."""
        self.prefill: dict[str, int] = {}
        """Running requests still in prefill -> tokens their prefill computes."""
        self.decoding: dict[str, int] = {}
        """Running requests past their prefill -> tokens their prefill computed."""
        global _CURRENT
        _CURRENT = self

    def holds(self, req_id: str) -> bool:
        """Whether the request holds (or was just given) a host-pool state row."""
        return req_id in self.live or req_id in self._alloc

    def held(self) -> int:
        """State rows held: running requests and those allocated this step."""
        return len(self.live.keys() | self._alloc.keys())

    def on_alloc(self, req_id: str, first_block: int | None, num_tokens: int) -> None:
        self._alloc[req_id] = (-1 if first_block is None else int(first_block), int(num_tokens))

    def _start(self, ev: StepEvents, req_id: str, block_ids: Any, num_computed: int, fallback_tokens: int) -> None:
        first, target = self._alloc.pop(req_id, (-1, fallback_tokens))
        groups = block_ids or ()
        if groups and groups[0]:
            first = int(groups[0][0])  # the scheduler output's own block list wins
        if first < 0:
            raise RuntimeError(f"OasisKV: request {req_id} was scheduled with no KV block")
        if num_computed:
            raise RuntimeError(f"OasisKV: request {req_id} starts with {num_computed} tokens already computed; the "
                               "host-pool modes need prefix caching off (engine_args sets enable_prefix_caching="
                               "False)")
        if req_id in self.live:  # restarted without a free in between (should not happen): free it first
            ev.free.append(req_id)
        self.live[req_id] = first
        self.prefill[req_id] = target
        self.decoding.pop(req_id, None)
        ev.start.append((req_id, first))

    def step(self, so: Any) -> StepEvents:
        """The events of one ``SchedulerOutput`` (vLLM 0.26 .. 0.32 field names)."""
        ev = StepEvents()
        gone = set(so.finished_req_ids) | set(getattr(so, "preempted_req_ids", None) or ())
        for req_id in sorted(gone):
            self._alloc.pop(req_id, None)
            self.prefill.pop(req_id, None)
            self.decoding.pop(req_id, None)
            if self.live.pop(req_id, None) is not None:
                ev.free.append(req_id)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            prompt = len(new.prompt_token_ids or ())
            self._start(ev, new.req_id, new.block_ids, new.num_computed_tokens, prompt)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
            if req_id in resumed:
                self._start(ev, req_id, cached.new_block_ids[i], cached.num_computed_tokens[i], 0)
        spec = so.scheduled_spec_decode_tokens or {}
        for req_id, n in so.num_scheduled_tokens.items():
            target = self.prefill.get(req_id)
            if target is None:
                continue
            if n <= 2:
                ev.short_prefills += 1
            if computed.get(req_id, 0) + n - len(spec.get(req_id, ())) >= target:
                ev.fill.append(req_id)
                self.decoding[req_id] = self.prefill.pop(req_id)
        return ev
