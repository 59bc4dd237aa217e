"""The OasisKV KV connector: vLLM's channel from the scheduler to the workers, used for request lifecycle.

``engine_args`` names it in ``kv_transfer_config`` (``kv_connector="OasisKVConnector"``,
``kv_connector_module_path="oasiskv_runtime.vllm.connector"``) in the host-pool modes. vLLM creates one instance in
the scheduler process (role SCHEDULER) and one per worker (role WORKER):

* scheduler side: :class:`~oasiskv_runtime.vllm.requests.RequestTracker` turns every ``SchedulerOutput`` into
  :class:`~oasiskv_runtime.vllm.requests.StepEvents` (requests that start, end, complete their prefill), sent with
  the step as the connector metadata. It never loads KV (``get_num_new_matched_tokens`` is 0) and never delays a
  block free; it defers a waiting request (``get_num_new_matched_tokens`` is None) while every state row of the
  host pool is held (``host_pool_gb``).
* worker side: ``bind_connector_metadata`` (called before every forward, also for steps without one) applies the
  starts and frees to the attention layers' shared state (``vllm/host_pool.py``) once it exists, and queues the
  rest (fills), which the state takes when its step starts (:meth:`take_events`).

The per-layer KV work (pool writes, waits, prefetch) is in the attention implementation, not in ``save_kv_layer`` /
``wait_for_layer_load``: vLLM calls ``save_kv_layer`` after the layer's attention, but the prefetch and the working
set fill run inside it and must see this step's rows in the pool (a block the step's token completes may be fetched
by the same layer's prefetch). See docs/vllm.md.

Written against vLLM 0.26 and 0.32 (the methods used here have the same signatures in both).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from oasiskv_runtime.vllm.options import VllmOptions, device_tier_rows, host_pool_rows
from oasiskv_runtime.vllm.requests import CONNECTOR_MODULE, RequestTracker, StepEvents

assert CONNECTOR_MODULE == __name__
logger = logging.getLogger(__name__)


class OasisKVConnectorMetadata(KVConnectorMetadata):
    def __init__(self, events: StepEvents) -> None:
        self.events = events


class OasisKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.tracker = RequestTracker() if role == KVConnectorRole.SCHEDULER else None
        self._queued: StepEvents | None = None
        self.rows = 0
        """Scheduler side: the pool's state rows, host and device tier (requests that may hold one at once; more
        wait)."""
        self.deferred = 0
        """Scheduler side: times a waiting request was deferred because every row was held."""
        if self.tracker is not None:
            opts = VllmOptions.from_vllm_config(vllm_config)
            self.rows = host_pool_rows(vllm_config, opts) + device_tier_rows(vllm_config, opts) \
                if opts is not None else 0

    # ---- worker side --------------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        events = getattr(connector_metadata, "events", None)
        if events is None:
            return
        self._queued = events if self._queued is None else self._queued.merge(events)
        from oasiskv_runtime.vllm.host_pool import current_runtime

        rt = current_runtime()
        if rt is not None and (self._queued.free or self._queued.start):
            # the lifecycle now, in order: a step without a forward (vLLM's last one, which only tells the workers
            # which requests finished) runs no layer that would apply it, and the queue would hold their rows
            rt.apply(self._queued)
            self._queued = StepEvents(fill=self._queued.fill, short_prefills=self._queued.short_prefills)

    def take_events(self) -> StepEvents | None:
        """The events bound since the last call (None: none were, e.g. a warm-up forward)."""
        events, self._queued = self._queued, None
        return events

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Called before every scheduled forward, replayed or not: where a full-graph step's host part runs."""
        prepare_replay(self, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # ---- scheduler side -----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Never loads KV (0); None (vLLM: not now, ask again next step) while every host-pool row is held, so a
        request waits in vLLM's queue until one is free."""
        if self.rows and not self.tracker.holds(request.request_id) and self.tracker.held() >= self.rows:
            if not self.deferred:
                logger.info("OasisKV: all %d rows of the pool are held; waiting requests start as rows free "
                            "(host_pool_gb and device_tier_gb set the rows)", self.rows)
            self.deferred += 1
            return None, False
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        first = None
        try:
            ids = blocks.get_block_ids()
            if ids and ids[0]:
                first = ids[0][0]
        except (AttributeError, IndexError, TypeError):
            pass
        self.tracker.on_alloc(request.request_id, first, request.num_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return OasisKVConnectorMetadata(self.tracker.step(scheduler_output))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def prepare_replay(connector: OasisKVConnector, forward_context: Any) -> None:
    """If vLLM is about to replay a full CUDA graph of a host-pool step (``cuda_graphs='full'``), run the step's
    host part the replay cannot: the connector's events, the counters, the step stamp
    (``HostPoolRuntime.replay_step``). A step whose events fill a working set (a request's final prefill chunk of one
    or two tokens looks like a decode row, so its step can be a uniform decode batch) is run eagerly instead: its
    runtime mode is set to NONE, and the forward takes the events as in any eager step."""
    from vllm.config import CUDAGraphMode

    from oasiskv_runtime.vllm.host_pool import current_runtime

    rt = current_runtime()
    if rt is None or not rt.full_graphs or getattr(forward_context, "cudagraph_runtime_mode", None) \
            != CUDAGraphMode.FULL:
        return
    events = connector._queued
    if events is not None and (events.fill or events.short_prefills):
        forward_context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        rt.counts["eager_graph_steps"] += 1
        return
    rt.replay_step(connector.take_events(), _num_decodes(forward_context))


def _num_decodes(forward_context: Any) -> int:
    """The step's decode requests without CUDA-graph padding (the builder's plan knows them on the host)."""
    metadata = getattr(forward_context, "attn_metadata", None)
    for meta in (metadata.values() if isinstance(metadata, dict) else ()):
        plan = getattr(meta, "plan", None)
        if plan is not None:
            return plan.num_real
    return 0


def connector_events() -> tuple[bool, StepEvents | None]:
    """In a worker: (whether an OasisKV connector runs in this process, the events bound since the last call).

    Events are handed out only while the step's metadata is bound (a scheduled step's forward); a forward outside
    that window (warm-up, profiling, a data-parallel padding run) gets None and leaves them queued."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return False, None
    group = get_kv_transfer_group()
    if not isinstance(group, OasisKVConnector):
        return False, None
    if not group.has_connector_metadata():
        return True, None
    return True, group.take_events()
