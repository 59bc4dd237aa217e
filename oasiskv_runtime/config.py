"""One config tree for the runtime: model, cache, sparse, scheduler, engine.

Every field is validated here, in ``__post_init__``; the runtime reads no environment variables and no
argv. ``EngineConfig.from_overrides`` is the single place where flat keyword overrides (``LLM(...,
top_k_blocks=64)`` or CLI flags) are routed to the sub-config that owns them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

GATHER_CTAS = 32
"""Default grid of the UVA gather kernel: 32 CTAs keep enough PCIe reads in flight for the link (two 4 KiB tiles
each) while leaving the other SMs to the step's kernels (bench/NOTES.md, "Gather grid")."""
GATHER_COPIES = 1
"""Default copies each of the gather's CTAs has in flight. With 32 CTAs, 4 were 8-10% slower than 1 in decode
steps with every plan entry used (bench/NOTES.md, "The gather in one launch"); 16 CTAs x 4 matched 32 x 1."""
GATHER_HINTS = {
    "": ("", "", ""),
    "cg": (".cg", "", ""),  # loads cached in L2 only, not L1
    "cv": (".cv", "", ""),  # loads not cached: fetched again on every access
    "stream": ("", "evict_first", ".cs"),  # loads first to leave L2, stores streamed (evict-first)
}
"""Cache hints of the Triton UVA gather's host loads and device stores, by name: (load cache modifier, load
eviction policy, store cache modifier). "" leaves both to the hardware's defaults; the others exist to measure
whether the host reads' path through L1 / L2 is what slows the HBM-bound kernels beside the gather
(``bench/bench_kernels.py --only interference``; none changed it on an H200, bench/NOTES.md)."""


class Mode(str, Enum):
    """Engine modes: settings of one engine, so every comparison runs the same code on the same work."""

    DENSE = "dense"
    """Full KV in device memory, full attention (the vLLM baseline)."""
    SPARSE_RESIDENT = "sparse-resident"
    """Quest: full KV stays in device memory, attention over each head's top-K blocks."""
    FETCH_ON_DEMAND = "fetch-on-demand"
    """Retrieval: full KV on the host; predict with the current query, fetch missing blocks before attention."""
    PROXY_PREFETCH = "proxy-prefetch"
    """Prefetch for step t+1 predicted with step t's own query (the training-free baseline)."""
    OASISKV = "oasiskv"
    """Prefetch for step t+1 predicted with the draft token's query (look-ahead attention)."""

    @property
    def is_sparse(self) -> bool:
        return self is not Mode.DENSE

    @property
    def uses_host_pool(self) -> bool:
        """Full KV lives in host memory and only a working set is on the device."""
        return self in (Mode.FETCH_ON_DEMAND, Mode.PROXY_PREFETCH, Mode.OASISKV)

    @property
    def full_kv_on_device(self) -> bool:
        return self in (Mode.DENSE, Mode.SPARSE_RESIDENT)

    @property
    def prefetches(self) -> bool:
        """Selection for step t+1 happens during step t (off the critical path)."""
        return self in (Mode.PROXY_PREFETCH, Mode.OASISKV)

    @property
    def uses_draft(self) -> bool:
        return self is Mode.OASISKV

    @classmethod
    def parse(cls, value: str | Mode) -> Mode:
        if isinstance(value, Mode):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown mode {value!r}; choose one of: {names}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a dense decoder (Llama family, Qwen3)."""

    architecture: str
    """'llama' or 'qwen3'."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """HF rope parameters beyond theta, e.g. {'rope_type': 'llama3', 'factor': 8.0, ...}."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    """Human name of the model (preset name or path)."""
    random_weights: bool = False
    """True when weights are random (presets at real shapes): every report must say so."""

    def __post_init__(self) -> None:
        if self.architecture not in ("llama", "qwen3"):
            raise ValueError(f"unsupported architecture {self.architecture!r} (supported: llama, qwen3)")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model config {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        h, i, l = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim + self.num_heads * self.head_dim * h
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + emb + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x conventions)."""
        model_type = d.get("model_type", "")
        arch = {"llama": "llama", "qwen3": "qwen3", "mistral": "llama"}.get(model_type)
        if arch is None:
            archs = d.get("architectures") or []
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} {archs} in config.json "
                "(supported: llama, qwen3)")
        rope = dict(d.get("rope_parameters") or {})
        theta = float(d.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = d.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and its memory budgets."""

    block_size: int = 16
    """Tokens per KV block (also the granularity of sparse selection)."""
    kv_cache_bytes: int | None = None
    """Device bytes for KV blocks (and key summaries in sparse modes); the knob behind the HBM capacity wall.
    None: 2 GiB on CPU, 90% of free device memory after weights on CUDA."""
    host_kv_bytes: int | None = None
    """Host bytes for the full-KV pool of host-pool modes. None: 8 GiB on CPU; with CUDA 64 GiB, or half the
    available RAM where that is less (pinned as one region of exactly this size)."""
    device_tier: bool = False
    """Host-pool modes: once the host pool is full, keep further full-KV blocks in the device KV budget (a device
    tier, read by the same gathers device-to-device). The working sets use a small part of ``kv_cache_bytes``;
    the tier puts the rest to use, so more requests run at the same device budget as dense. Off by default: it
    changes no result where the host pool suffices, and prefill-decode (staged KV, prefix cache, remote KV)
    does not support it."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for f in ("kv_cache_bytes", "host_kv_bytes"):
            v = getattr(self, f)
            if v is not None and v <= 0:
                raise ValueError(f"{f} must be positive, got {v}")


@dataclass(frozen=True)
class SparseConfig:
    """OasisKV sparse decode settings (SPEC item 7 defaults)."""

    top_k_blocks: int = 128
    """Blocks per KV head in the working set (plus the local active block)."""
    fetch_ratio: float = 0.05
    """Per-step admission cap C = ceil(fetch_ratio * top_k_blocks) per head."""
    draft: str = "auto"
    """Draft source for oasiskv mode: auto (the model's shipped head behind the n-gram draft where one ships,
    else ngram; EngineConfig resolves it), ngram[:N], layerskip[:N], model:<path>, eagle3:<path>,
    oracle, or ngram[:N]+<one of those>."""
    sink_blocks: int = 0
    """Leading blocks always attended (attention sinks)."""
    dense_layers: tuple[int, ...] = ()
    """Layers that attend over the full context in sparse modes."""
    measure_recall: bool = False
    """Compute per-layer recall of the predicted top-K against the true next query's top-K."""
    fetch_on_demand_cap: bool = False
    """Apply the fetch cap in fetch-on-demand mode too (default: fetch every missing block, as retrieval does)."""
    disable_transfers: bool = False
    """Benchmark only: run prediction and selection but skip the host->device copies (an all-resident upper
    bound on step time; attention then reads stale slots, so outputs are meaningless)."""
    kernels: str = "auto"
    """'auto' (GPU kernels on CUDA, references on CPU), 'ref' (plain PyTorch everywhere), 'gpu'."""
    gather_ctas: int = GATHER_CTAS
    """CTAs of the UVA gather kernel that runs each layer's prefetch (0: one per copied block-head). Few CTAs
    leave the SMs to the step's own kernels while the copies stream over PCIe."""
    gather_copies: int = GATHER_COPIES
    """Copies each CTA of that gather has in flight at once (a power of two): a PCIe read stalls its CTA for
    microseconds, so with one at a time a small grid cannot keep the link busy."""

    gather_hint: str = ""
    """Cache hints of that gather's host loads and device stores, a key of :data:`GATHER_HINTS` ("": the
    hardware's defaults; "cg", "cv", "stream"). For A/B runs of what the prefetch costs the step's HBM-bound
    kernels (bench/NOTES.md)."""

    copy_engine_prefill: bool = True
    """Host-pool modes on CUDA: a prefill chunk's KV goes to the pool, and its prefix comes back from it, by
    ``cudaMemcpyAsync`` over runs of consecutive pool rows on two side streams (the copy engines, beside the
    step's compute; the reads one layer ahead), instead of UVA kernels on the SMs in the step's critical path.
    Sequences whose rows fall in too many runs keep the kernels. False: the UVA kernels (for A/B runs). On an
    H200 (Qwen3-8B shapes, 32K prompts in 8K chunks beside 28 decoding requests) prefill-carrying steps took
    483.8 ms with it against 524.2 without (``bench/profile_prefill.py --ab copy_engine_prefill``, bench/NOTES.md);
    ``tests/test_gpu_engine.py`` checks both give the same tokens and traffic."""

    link_gbps: float = 0.0
    """The per-step fetch budget from the link (the paper's C_token = B_link x T_decode), in GB/s: each decode
    step's cap becomes the (block, head) copies per request that this rate moves in one step's time (the
    shortest of the latest measured steps of its kind: decode-only, or carrying a prefill), shared by the step's
    requests, rounded down to a power of two, at most twice the last cap, never below ``fetch_cap`` nor above
    ``top_k_blocks``. 0: the fixed ``fetch_cap`` every step. Set it below the rate the prefetch reaches (an
    H200: ~43 GB/s): once the transfers set the step's time, a cap shrinks back only if this rate is below the
    one reached (``oasiskv_runtime.sparse.link_cap``)."""

    pipeline_priority: int = 0
    """CUDA priority of the prefetch pipeline's three background streams (prediction, selection, transfer): lower
    is higher, 0 is the default streams' (CUDA clamps it to the device's range). The idea: the block scheduler
    gives the pipeline's few CTAs the next free SMs before the main stream's kernels, so the link is not left idle
    behind a large GEMM. A captured graph keeps each node's priority (PyTorch instantiates graphs with per-node
    priorities). On an H200 at 16K x 64 / 128, -1 changed no step time (bench/NOTES.md), so the default is 0."""

    select_kernel: bool = True
    """The prefetch pipeline's selection and transfer plan as one fused kernel per layer (GPU kernels only;
    False: its plain-PyTorch composition, the reference, ~70 small kernels per layer; for A/B benchmarks)."""

    def __post_init__(self) -> None:
        if self.top_k_blocks <= 0:
            raise ValueError(f"top_k_blocks must be positive, got {self.top_k_blocks}")
        if not 0.0 < self.fetch_ratio <= 1.0:
            raise ValueError(f"fetch_ratio must be in (0, 1], got {self.fetch_ratio}")
        if self.sink_blocks < 0 or self.sink_blocks >= self.top_k_blocks:
            raise ValueError(f"sink_blocks must be in [0, top_k_blocks), got {self.sink_blocks}")
        if self.kernels not in ("auto", "ref", "gpu"):
            raise ValueError(f"kernels must be auto, ref or gpu, got {self.kernels!r}")
        if self.gather_copies < 1 or self.gather_copies & (self.gather_copies - 1):
            raise ValueError(f"gather_copies must be a power of two >= 1, got {self.gather_copies}")
        if not self.link_gbps >= 0:
            raise ValueError(f"link_gbps must be >= 0 (0: the fixed fetch cap), got {self.link_gbps}")
        if self.pipeline_priority > 0:
            raise ValueError(f"pipeline_priority must be <= 0 (lower is higher), got {self.pipeline_priority}")
        if self.gather_hint not in GATHER_HINTS:
            raise ValueError(f"gather_hint must be one of {sorted(GATHER_HINTS)}, got {self.gather_hint!r}")
        if self.gather_ctas < 0:
            raise ValueError(f"gather_ctas must be >= 0 (0: one CTA per copy), got {self.gather_ctas}")
        object.__setattr__(self, "dense_layers", tuple(int(x) for x in self.dense_layers))

    @property
    def fetch_cap(self) -> int:
        return max(1, math.ceil(self.fetch_ratio * self.top_k_blocks - 1e-9))


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; prompts longer than this are prefilled in chunks."""
    cuda_graphs: str = "auto"
    """Decode-only steps: 'auto' replays them from CUDA graphs on CUDA (eager on the CPU), 'off' always runs
    them eagerly, 'static' runs them eagerly on the graphs' static input layout (tests the layout on the CPU)."""
    fused_norm_rope: bool = True
    """Every step, every mode: RMSNorm, and the q/k norm with rotary, as one Triton kernel each on CUDA (~40 fewer
    kernels per decoder layer); False: their PyTorch composition (for A/B runs). The norm rounds as the
    composition does; rotary results may differ from it by one last bit (``oasiskv_runtime.ops.norm_rope``). The
    CPU always runs the composition."""

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.cuda_graphs not in ("auto", "off", "static"):
            raise ValueError(f"cuda_graphs must be auto, off or static, got {self.cuda_graphs!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Preset name, HF directory or .gguf file."""
    device: str = "cpu"
    dtype: str = "float32"
    mode: Mode = Mode.DENSE
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.sparse.draft == "auto":  # resolved once here, so the engine, PD's checks and reports see it
            from oasiskv_runtime.drafts import resolve_draft

            object.__setattr__(self, "sparse", dataclasses.replace(self.sparse,
                                                                   draft=resolve_draft("auto", self.model)))

    _SUBS = ("cache", "sparse", "scheduler")

    @classmethod
    def from_overrides(cls, model: str, device: str = "cpu", dtype: str = "float32", mode: str | Mode = "dense",
                       seed: int = 0, **overrides: Any) -> EngineConfig:
        """Route flat keyword overrides to the sub-config owning each name; unknown names are errors."""
        sub_types = {"cache": CacheConfig, "sparse": SparseConfig, "scheduler": SchedulerConfig}
        owner = {f.name: sub for sub, t in sub_types.items() for f in dataclasses.fields(t)}
        if "kv_cache_gb" in overrides:
            gb = overrides.pop("kv_cache_gb")
            if gb is not None:
                overrides["kv_cache_bytes"] = int(float(gb) * (1 << 30))
        per_sub: dict[str, dict[str, Any]] = {s: {} for s in sub_types}
        for key, value in overrides.items():
            if key not in owner:
                valid = ", ".join(sorted(list(owner) + ["kv_cache_gb"]))
                raise TypeError(f"unknown engine option {key!r}; valid options: {valid}")
            per_sub[owner[key]][key] = value
        return cls(model=model, device=device, dtype=dtype, mode=Mode.parse(mode), seed=seed,
                   **{s: t(**per_sub[s]) for s, t in sub_types.items()})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mode"] = self.mode.value
        return d
