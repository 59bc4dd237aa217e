"""The OasisKV KV connector: vLLM's channel from the scheduler to the workers, used for request lifecycle.

``engine_args`` names it in ``kv_transfer_config`` (``kv_connector="OasisKVConnector"``,
``kv_connector_module_path="oasiskv_runtime.vllm.connector"``) in the host-pool modes. vLLM creates one instance in
the scheduler process (role SCHEDULER) and one per worker (role WORKER):

* scheduler side: :class:`~oasiskv_runtime.vllm.requests.RequestTracker` turns every ``SchedulerOutput`` into
  :class:`~oasiskv_runtime.vllm.requests.StepEvents` (requests that start, end, complete their prefill), sent with
  the step as the connector metadata. It never loads KV (``get_num_new_matched_tokens`` is 0) and never delays a
  block free.
* worker side: ``bind_connector_metadata`` (called before every forward, also for steps without one) queues the
  events; the attention layers' shared state (``vllm/host_pool.py``) takes them when its step starts
  (:meth:`take_events`).

The per-layer KV work (pool writes, waits, prefetch) is in the attention implementation, not in ``save_kv_layer`` /
``wait_for_layer_load``: vLLM calls ``save_kv_layer`` after the layer's attention, but the prefetch and the working
set fill run inside it and must see this step's rows in the pool (a block the step's token completes may be fetched
by the same layer's prefetch). See docs/vllm.md.

Written against vLLM 0.26 and 0.32 (the methods used here have the same signatures in both).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from oasiskv_runtime.vllm.requests import CONNECTOR_MODULE, RequestTracker, StepEvents

assert CONNECTOR_MODULE == __name__


class OasisKVConnectorMetadata(KVConnectorMetadata):
    def __init__(self, events: StepEvents) -> None:
        self.events = events


class OasisKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.tracker = RequestTracker() if role == KVConnectorRole.SCHEDULER else None
        self._queued: StepEvents | None = None

    # ---- worker side --------------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        events = getattr(connector_metadata, "events", None)
        if events is not None:
            self._queued = events if self._queued is None else self._queued.merge(events)

    def take_events(self) -> StepEvents | None:
        """The events bound since the last call (None: none were, e.g. a warm-up forward)."""
        events, self._queued = self._queued, None
        return events

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # ---- scheduler side -----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
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
