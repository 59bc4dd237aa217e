"""The plug-in's options, and the one channel that carries them to vLLM's worker processes.

They travel inside vLLM's own config, ``VllmConfig.additional_config["oasiskv"]`` (a plain dict: vLLM pickles the
config to the engine-core and worker processes, folds it into its compile-cache hash, and takes it on the command
line as ``--additional-config '{"oasiskv": {...}}'``). No environment variable is read.

This module imports no vLLM: ``engine_args`` and the tests use it on machines without vLLM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

from oasiskv_runtime.config import CODED_KEY_SCORES, EngineConfig, Mode, SparseConfig

CONFIG_KEY = "oasiskv"
"""Key of our options in ``additional_config``."""

VLLM_MODES = (Mode.DENSE, Mode.SPARSE_RESIDENT, Mode.PROXY_PREFETCH, Mode.OASISKV)
"""Modes the vLLM front end accepts (``fetch-on-demand`` is an embedded-engine baseline only)."""

VLLM_SCORES = ("quest", "minmax_mass")
"""Block rankings the vLLM front end runs in every mode: the ones that read only the per-block summaries."""

VLLM_HOST_POOL_SCORES = VLLM_SCORES + tuple(CODED_KEY_SCORES)
"""And in the host-pool modes: the key codes' (``max_logit_b1`` / ``_b2`` / ``_b4``), kept beside the host pool's
summaries (sparse-resident reads vLLM's own blocks and keeps no codes)."""

_SPECS = EngineConfig.options()


def _default(name: str):
    return _SPECS[name].default


@dataclass(frozen=True)
class VllmOptions:
    """OasisKV settings of one vLLM engine: the embedded engine's options of the same names (defaults, valid values
    and meanings from ``EngineConfig.options()``), plus the mode."""

    mode: str = Mode.SPARSE_RESIDENT.value
    """``dense`` (plain vLLM: the plug-in stays out), ``sparse-resident``, ``proxy-prefetch`` or ``oasiskv``."""
    top_k_blocks: int = _default("top_k_blocks")
    fetch_ratio: float = _default("fetch_ratio")
    block_size: int = _default("block_size")
    """Also vLLM's KV block size (``engine_args`` sets it): vLLM's kernels take multiples of 16."""
    sink_blocks: int = _default("sink_blocks")
    recent_blocks: int = _default("recent_blocks")
    attended_blocks: int = _default("attended_blocks")
    """Host-pool modes: each decode step records per KV head the working-set blocks its attention weighed most, and
    the next prediction keeps this many of them (the embedded engine's option; counted in ``top_k_blocks``).
    Sparse-resident on vLLM keeps no per-request state between steps and refuses it."""
    attended_share: float = _default("attended_share")
    """``attended_blocks`` as a share of ``top_k_blocks`` (the embedded engine's option)."""
    fill_window: int = _default("fill_window")
    """Host-pool modes: when a prefill completes, fill the working set with the top-K blocks by the exact attention
    mass of the prompt's last N rows (read from vLLM's paged cache; one host sync on such a step), as the embedded
    engine's option does."""
    early_fetch_ratio: float = _default("early_fetch_ratio")
    """Host-pool modes: a request's first ``early_steps`` decode steps after its prefill admit up to
    ``ceil(early_fetch_ratio * top_k_blocks)`` blocks per KV head and layer instead of ``fetch_ratio``'s cap (the
    embedded engine's option, the same core caps: ``HeadMap.prefetch_caps``; 0: off). Sparse-resident fetches
    nothing and refuses it."""
    early_steps: int = _default("early_steps")
    """How many of a request's first decode steps get ``early_fetch_ratio``'s cap (the embedded engine's option)."""
    selection_score: str = _default("selection_score")
    """``quest`` or ``minmax_mass`` (both read the per-block summaries; ``attention`` and ``gauss`` are
    embedded-engine study settings); in the host-pool modes also ``max_logit_b1`` / ``_b2`` / ``_b4`` (the key codes,
    written where the summaries are rebuilt, in device memory beside vLLM's cache: ``bits / 16`` of a 16-bit KV's
    key and value bytes of each state row)."""
    demand_fetch: bool = _default("demand_fetch")
    """Host-pool modes: before a decode step attends, rank with the step's own query and fetch the blocks of that
    top-K the prefetch missed (the embedded engine's option; with the key codes one read of them scores the step's
    query and the prefetch's)."""
    demand_fetch_cap: int = _default("demand_fetch_cap")
    """``demand_fetch``: at most this many misses per request, layer and KV head (0: every one)."""
    summary_parts: int = _default("summary_parts")
    """1 only: summary rows per block other than one run on the embedded engine only for now (refused here)."""
    backend: str = _default("backend")
    measure_recall: bool = _default("measure_recall")
    """Host-pool modes: recall of each layer's prediction against the true next query's top-K (host round trips)."""
    cuda_graphs: str = _default("cuda_graphs")
    """``auto`` (= ``full``): vLLM replays decode-only steps from full CUDA graphs, attention included (measured on the
    H200 in every mode); in the host-pool modes the KV connector runs a replay's host part (the step's request
    events, its stamp) before it, and a step that fills a working set runs eagerly; they need vLLM's V1 model runner
    (``engine_args`` asks for it; with ``auto`` and an environment asking for V2 they stay piecewise). ``off``:
    vLLM's piecewise graphs only (our attention eager between them), in every mode."""
    admission: str = "working-set"
    """Host-pool modes: ``working-set``: once a request's prefill completes, vLLM's paged cache keeps only its first
    block and its last two (``vllm/kv_spec.py``), so vLLM admits requests by what they hold on the device; ``full``:
    vLLM keeps every block of every request (its own admission; for A/B runs, and EAGLE-3 drafts)."""
    host_pool_gb: float = 0.0
    """Host-pool modes: GiB of pinned host memory for the full-KV pool (all ranks of the host together). The pool has
    a row of ``max_model_len`` tokens per running request: ``min(max_num_seqs, host_pool_gb / row)`` rows; when they
    are all taken, new requests wait in vLLM's queue (the KV connector defers them) instead of the start failing.
    0: ``max_num_seqs`` rows (refused at start if the host cannot hold them). ``engine_args`` sets 80% of the
    host's available memory."""
    device_tier_gb: float = 0.0
    """Host-pool modes with ``host_pool_gb``: GiB of device memory (all GPUs of the engine together, beside vLLM's
    cache: outside ``kv_cache_memory_bytes``) for more full-KV rows than the host pool holds, the device tier (the
    embedded engine's ``device_tier``). A request takes a free row of either part and runs the same way (a tier row's
    blocks reach its working set device to device). Where the host's RAM caps the rows, this is where more requests
    go: working-set admission leaves most of a device KV budget unused. 0: no tier."""

    def __post_init__(self) -> None:
        mode = Mode.parse(self.mode)
        if mode not in VLLM_MODES:
            names = ", ".join(m.value for m in VLLM_MODES)
            raise ValueError(f"mode {mode.value!r} does not run on vLLM; choose one of: {names}")
        object.__setattr__(self, "mode", mode.value)
        for f in fields(self):
            if f.name not in ("mode", "cuda_graphs", "admission", "host_pool_gb", "device_tier_gb"):
                _SPECS[f.name].validate(getattr(self, f.name))
        if self.summary_parts != 1:
            raise ValueError(f"summary_parts={self.summary_parts}: summary_parts runs on the embedded engine only for "
                             "now (vLLM's plug-in keeps one summary row per block)")
        self.sparse  # noqa: B018 - the engine's own checks across these options (sinks + recent window < K)
        if self.selection_score not in VLLM_HOST_POOL_SCORES:
            raise ValueError(f"selection_score {self.selection_score!r} does not run on vLLM; choose one of: "
                             f"{', '.join(VLLM_HOST_POOL_SCORES)} (attention, gauss and the split Quest bounds read "
                             f"every key, quest_rank was measured under quest: embedded-engine study settings)")
        if self.selection_score not in VLLM_SCORES and self.parsed_mode is Mode.SPARSE_RESIDENT:
            raise ValueError(f"selection_score {self.selection_score!r} reads key codes, which the vLLM front end "
                             f"keeps in the host-pool modes (proxy-prefetch, oasiskv) only; sparse-resident there "
                             f"ranks vLLM's own blocks by {', '.join(VLLM_SCORES)}")
        if self.cuda_graphs not in ("auto", "full", "off"):
            raise ValueError(f"cuda_graphs on vLLM is auto, full or off, got {self.cuda_graphs!r} (static is the "
                             f"embedded engine's CPU test layout)")
        if self.admission not in ("working-set", "full"):
            raise ValueError(f"admission is working-set or full, got {self.admission!r}")
        for name, zero in (("host_pool_gb", "max_num_seqs rows"), ("device_tier_gb", "no device tier")):
            gb = getattr(self, name)
            if not isinstance(gb, (int, float)) or isinstance(gb, bool) or gb < 0:
                raise ValueError(f"{name} is a number of GiB >= 0 (0: {zero}), got {gb!r}")
        if self.device_tier_gb > 0 and not self.parsed_mode.uses_host_pool:
            raise ValueError(f"device_tier_gb is for the host-pool modes (proxy-prefetch, oasiskv), not {self.mode}: "
                             f"the other modes keep every request's KV in vLLM's cache")
        if self.device_tier_gb > 0 and self.host_pool_gb <= 0:
            raise ValueError("device_tier_gb adds rows once the host pool's are all held: set host_pool_gb too (0 "
                             "gives the host pool max_num_seqs rows, and the tier none)")
        if (self.attended_blocks or self.attended_share) and self.parsed_mode is Mode.SPARSE_RESIDENT:
            name = "attended_blocks" if self.attended_blocks else "attended_share"
            raise ValueError(f"{name} is for the host-pool modes on vLLM (proxy-prefetch, oasiskv), not "
                             f"{self.mode}: sparse-resident there keeps no per-request record between steps")
        if self.enabled:  # the engine's per-mode rules (fill_window, early_fetch_ratio, demand_fetch: prefetching)
            self.sparse.check_mode(self.parsed_mode)
        if self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16 (vLLM's kernels), got {self.block_size}")

    @cached_property
    def sparse(self) -> SparseConfig:
        """The embedded engine's algorithm section with these options: its checks, its ``fetch_cap`` and
        ``early_cap``."""
        return SparseConfig(top_k_blocks=self.top_k_blocks, fetch_ratio=self.fetch_ratio, sink_blocks=self.sink_blocks,
                            recent_blocks=self.recent_blocks, selection_score=self.selection_score,
                            attended_blocks=self.attended_blocks, attended_share=self.attended_share,
                            fill_window=self.fill_window, early_fetch_ratio=self.early_fetch_ratio,
                            early_steps=self.early_steps, demand_fetch=self.demand_fetch,
                            demand_fetch_cap=self.demand_fetch_cap)

    @property
    def parsed_mode(self) -> Mode:
        return Mode(self.mode)

    @property
    def full_graphs(self) -> bool:
        """Whether vLLM may replay decode-only steps from full CUDA graphs with these options: unless ``cuda_graphs``
        is off, and in the host-pool modes unless ``measure_recall`` (recall is accumulated on the host)."""
        if not self.enabled or self.cuda_graphs == "off":
            return False
        return self.parsed_mode is Mode.SPARSE_RESIDENT or not self.measure_recall

    @property
    def working_set_admission(self) -> bool:
        """vLLM's cache frees a decoding request's middle blocks (host-pool modes with ``admission='working-set'``)."""
        return self.parsed_mode.uses_host_pool and self.admission == "working-set"

    @property
    def enabled(self) -> bool:
        """The plug-in's attention backend runs (any mode but dense)."""
        return self.parsed_mode is not Mode.DENSE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "VllmOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown OasisKV option(s) {unknown} in additional_config[{CONFIG_KEY!r}]; "
                             f"known: {sorted(known)}")
        return cls(**values)

    def host_pool_rows(self, max_num_seqs: int, max_model_len: int, bytes_per_token: int) -> int:
        """State rows of the host pool (requests that can hold one at a time): ``max_num_seqs``, or fewer when
        ``host_pool_gb`` holds fewer rows of ``max_model_len`` tokens (``bytes_per_token``: all layers, K and V, all
        KV heads of the host). The scheduler (which defers requests past it) and every worker compute the same."""
        if self.host_pool_gb <= 0:
            return max_num_seqs
        return min(max_num_seqs, self._rows_of("host_pool_gb", "host pool", max_model_len, bytes_per_token))

    def device_tier_rows(self, max_num_seqs: int, max_model_len: int, bytes_per_token: int) -> int:
        """Rows of the device tier (``device_tier_gb``), after the host pool's: together at most ``max_num_seqs``."""
        if self.device_tier_gb <= 0:
            return 0
        rows = self._rows_of("device_tier_gb", "device tier", max_model_len, bytes_per_token)
        return max(0, min(rows, max_num_seqs - self.host_pool_rows(max_num_seqs, max_model_len, bytes_per_token)))

    def _rows_of(self, name: str, what: str, max_model_len: int, bytes_per_token: int) -> int:
        """Rows of ``max_model_len`` tokens that option ``name``'s GiB hold (at least one, or a clear error)."""
        gb = getattr(self, name)
        row = -(-max_model_len // self.block_size) * self.block_size * bytes_per_token
        rows = int(gb * (1 << 30) // row)
        if rows < 1:
            raise MemoryError(f"OasisKV's {what} of {gb:.1f} GiB holds no request: one row is max_model_len "
                              f"{max_model_len} tokens x {bytes_per_token} bytes per token = {row / (1 << 30):.2f} "
                              f"GiB; raise {name} or lower max_model_len")
        return rows

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "VllmOptions | None":
        """Our options from a ``VllmConfig`` (None: the plug-in was not asked for)."""
        extra = getattr(vllm_config, "additional_config", None)
        if not isinstance(extra, dict) or CONFIG_KEY not in extra:
            return None
        values = extra[CONFIG_KEY]
        if not isinstance(values, dict):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {type(values).__name__}")
        return cls.from_dict(values)


def kv_bytes_per_token(vllm_config: Any) -> int:
    """Bytes of one token's full KV in the host pool: K and V of every layer and every KV head of the model (all
    tensor-parallel ranks of the host together), in the model's dtype (the pool's; fp8 KV caches are not supported)."""
    mc = vllm_config.model_config
    layers = mc.get_num_layers(vllm_config.parallel_config)
    return layers * mc.get_total_num_kv_heads() * mc.get_head_size() * 2 * mc.dtype.itemsize


def host_pool_rows(vllm_config: Any, opts: VllmOptions) -> int:
    """:meth:`VllmOptions.host_pool_rows` for an engine's config."""
    return opts.host_pool_rows(*_sizes(vllm_config))


def device_tier_rows(vllm_config: Any, opts: VllmOptions) -> int:
    """:meth:`VllmOptions.device_tier_rows` for an engine's config."""
    return opts.device_tier_rows(*_sizes(vllm_config))


def _sizes(vllm_config: Any) -> tuple[int, int, int]:
    return (vllm_config.scheduler_config.max_num_seqs, vllm_config.model_config.max_model_len,
            kv_bytes_per_token(vllm_config))
