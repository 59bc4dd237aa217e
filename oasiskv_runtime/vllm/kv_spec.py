"""Admission by working set: vLLM's paged cache keeps a decoding request's first block and its last two blocks only.

In the host-pool modes the full KV of a request lives in the pinned host pool (``vllm/host_pool.py``), addressed by
the request's state row, and its decode steps attend the working set the runtime keeps on the device. vLLM's own
paged cache is still where a prefill writes and attends (dense, chunk by chunk, over everything before it), so a
request needs its whole prompt there until its prefill completes; after that, its decode steps read only:

* the block of the step's token and the block before it (the summary rebuild of the blocks a step writes, the
  prompt tail copied into the working set when the prefill completes);
* its first block, by which the runtime finds the request's row in a step's batch (``vllm/requests.py``).

:class:`OasisKVAttentionSpec` is vLLM's ``FullAttentionSpec`` (same layout, same sizing: a request whose prompt is
``max_model_len`` long must fit for its prefill) with its own manager, :class:`OasisKVManager`, which frees the
other blocks of a request once its prefill is complete: vLLM's scheduler then admits requests by what they hold
(prefill: the prompt; decode: three blocks), not by their whole context. This is how vLLM's sliding-window and
R-SWA managers free blocks outside their windows (``remove_skipped_blocks``, called before every allocation with the
tokens whose steps have completed; freed blocks become the null block in the request's table).

Which requests have completed their prefill is the scheduler-side KV connector's knowledge (it sends the fill
events, ``RequestTracker``); the manager asks it (:func:`oasiskv_runtime.vllm.requests.decoding_since`), in the
same process. A resumed (preempted) request recomputes from token 0 and is in prefill again until its fill.

vLLM's attention layers make the spec (``Attention.get_kv_cache_spec``); :func:`register` wraps that method so a
layer running the OasisKV backend in a host-pool mode with ``admission='working-set'`` returns this spec, and
registers the spec with vLLM's ``KVCacheSpecRegistry``. Draft-model layers (EAGLE-3) run vLLM's own backend and keep
``FullAttentionSpec``; ``engine_args`` turns working-set admission off with an EAGLE-3 draft (its layers would share
the group's manager and attend their whole context).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from oasiskv_runtime.vllm.requests import decoding_since

KEPT_HEAD_BLOCKS = 1
"""Leading blocks a decoding request keeps (its first block identifies it in a step's batch)."""
KEPT_TAIL_BLOCKS = 2
"""Blocks a decoding request keeps up to its last computed token: that token's block and the one before it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OasisKVAttentionSpec(FullAttentionSpec):
    """vLLM's full-attention spec whose manager frees a request's middle blocks once its prefill completes."""


class OasisKVManager(FullAttentionManager):
    """``FullAttentionManager`` that frees blocks ``[KEPT_HEAD_BLOCKS, last - KEPT_TAIL_BLOCKS + 1)`` of a decoding
    request, ``last`` being the block of its last processed token (prefix caching is off in the host-pool modes)."""

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        since = decoding_since(request_id)
        if since is None or processed_computed_tokens < since:
            return  # in prefill (or its last chunk still running): every block is attended
        end = processed_computed_tokens // self.block_size - KEPT_TAIL_BLOCKS + 1
        self._remove_blocks_in_range(request_id, KEPT_HEAD_BLOCKS, end)


def _uses_working_set(layer: Any, vllm_config: Any) -> bool:
    from oasiskv_runtime.vllm.ngram import is_proposer_path
    from oasiskv_runtime.vllm.options import VllmOptions

    if not getattr(getattr(layer, "attn_backend", None), "oasiskv", False):
        return False
    opts = VllmOptions.from_vllm_config(vllm_config)
    if opts is None or not opts.working_set_admission:
        return False
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if method == "custom_class" and is_proposer_path(getattr(spec, "model", None)):
        method = "ngram"  # our n-gram proposer: no model, no KV
    if method not in (None, "ngram"):
        raise ValueError(f"OasisKV admission='working-set' frees a decoding request's blocks in vLLM's cache, where a "
                         f"{method} draft model's layers attend their whole context: use admission='full' with it "
                         f"(engine_args(admission='auto') does)")
    return True


def _wrap(get_kv_cache_spec):
    @functools.wraps(get_kv_cache_spec)
    def wrapped(self, vllm_config):
        spec = get_kv_cache_spec(self, vllm_config)
        if type(spec) is FullAttentionSpec and _uses_working_set(self, vllm_config):
            spec = OasisKVAttentionSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
        return spec

    wrapped.oasiskv = True
    return wrapped


def register() -> None:
    """Register the spec and its manager with vLLM, and make OasisKV layers emit it (idempotent)."""
    from vllm.model_executor.layers.attention.attention import Attention

    KVCacheSpecRegistry._ensure_registered()  # vLLM's own specs first: the registry fills itself only when empty
    KVCacheSpecRegistry.register(OasisKVAttentionSpec, OasisKVManager, uniform_type_base_spec=FullAttentionSpec)
    if not getattr(Attention.get_kv_cache_spec, "oasiskv", False):
        Attention.get_kv_cache_spec = _wrap(Attention.get_kv_cache_spec)
