"""One config tree for the runtime: the engine (model, device, dtype, mode) and its sections: cache (memory
budgets), sparse (the OasisKV algorithm a user chooses), kernels (A/B switches of how it runs), debug
(measurement switches), scheduler (batching limits), pd (prefill-decode).

Every option is declared once, here: default, valid values, a one-line meaning (``EngineConfig.options()``, which
oasisbench validates its flags and suites with), and it is checked in ``__post_init__``. The runtime reads no
environment variables and no argv. ``EngineConfig.from_overrides`` routes flat keyword overrides (``LLM(...,
top_k_blocks=64)`` or CLI flags) to the section that owns each; ``to_dict`` / ``from_dict`` round-trip a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

GATHER_CTAS = 32
"""Default grid of the UVA gather kernel: 32 CTAs keep enough PCIe reads in flight for the link (two 4 KiB tiles
each) while leaving the other SMs to the step's kernels (docs/benchmarks.md, "Gather, link and interference")."""
GATHER_COPIES = 1
"""Default copies each of the gather's CTAs has in flight. With 32 CTAs, 4 were 8-10% slower than 1 in decode
steps with every plan entry used (docs/benchmarks.md, "Gather, link and interference"); 16 CTAs x 4 matched 32 x 1."""
GATHER_HINTS = {
    "": ("", "", ""),
    "cg": (".cg", "", ""),  # loads cached in L2 only, not L1
    "cv": (".cv", "", ""),  # loads not cached: fetched again on every access
    "stream": ("", "evict_first", ".cs"),  # loads first to leave L2, stores streamed (evict-first)
}
"""Cache hints of the Triton UVA gather's host loads and device stores, by name: (load cache modifier, load
eviction policy, store cache modifier). "" leaves both to the hardware's defaults; the others exist to measure
whether the host reads' path through L1 / L2 is what slows the HBM-bound kernels beside the gather
(``bench/bench_kernels.py --only interference``; none changed it on an H200: docs/benchmarks.md, "Interference")."""


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


# ---- engine options: one declaration each (default, check, one-line doc), validated here and nowhere else ------

@dataclass(frozen=True)
class OptionSpec:
    """What a user may set: its section, default, what a valid value is, and what it means (one line)."""

    name: str
    section: str
    default: Any
    doc: str
    expect: str
    """What a valid value is, in words (the error message's "must be ...")."""
    check: Callable[[Any], bool] | None = None

    def validate(self, value: Any) -> None:
        if self.check is not None and not self.check(value):
            raise ValueError(f"{self.name} must be {self.expect}, got {value!r}")


def _opt(default: Any, doc: str, expect: str = "", check: Callable[[Any], bool] | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "expect": expect, "check": check})


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _pow2(v: Any) -> bool:
    return _int(v) and v > 0 and not v & (v - 1)


def _validate(cfg: Any) -> None:
    """Every field's declared check (the sections' ``__post_init__`` add the checks that span fields)."""
    for f in dataclasses.fields(cfg):
        check = f.metadata.get("check")
        value = getattr(cfg, f.name)
        if check is not None and not check(value):
            raise ValueError(f"{f.name} must be {f.metadata['expect']}, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and its memory budgets."""

    block_size: int = _opt(16, "Tokens per KV block, also the granularity of sparse selection.",
                           "a positive power of two", _pow2)
    kv_cache_bytes: int | None = _opt(
        None, "Device bytes for KV blocks and key summaries: the HBM capacity wall (None: 2 GiB on CPU, 90% of free "
        "device memory on CUDA).", "positive (bytes)", lambda v: v is None or (_int(v) and v > 0))
    host_kv_bytes: int | None = _opt(
        None, "Host bytes of the full-KV pool of host-pool modes, pinned on CUDA (None: 8 GiB on CPU; on CUDA 64 GiB, "
        "or half the available RAM where that is less).", "positive (bytes)",
        lambda v: v is None or (_int(v) and v > 0))
    device_tier: bool = _opt(
        False, "Host-pool modes: once the host pool is full, keep further full-KV blocks in the device KV budget the "
        "working sets leave free (not with prefill-decode).", "true or false", lambda v: isinstance(v, bool))

    def __post_init__(self) -> None:
        _validate(self)


SELECTION_SCORES = ("quest", "minmax_mass", "attention", "gauss", "quest_rank", "quest_half", "quest_quarter",
                    "max_logit", "max_logit_b1", "max_logit_b2", "max_logit_b4")
"""What ranks candidate blocks (``SparseConfig.selection_score``)."""

FULL_KEY_SCORES = ("attention", "gauss", "quest_half", "quest_quarter", "max_logit")
"""Study rankings that read every candidate block's keys at every step (the full KV must be on the device)."""

CODED_KEY_SCORES = {"max_logit_b1": 1, "max_logit_b2": 2, "max_logit_b4": 4}
"""Rankings from keys coded in a few bits per dimension (``selection_score`` -> bits), which the embedded engine keeps
on the device beside the summaries (``core/summaries.KeyCodes``, ``ops/key_codes.py``): every mode."""

SUMMARY_SCORES = tuple(s for s in SELECTION_SCORES if s not in FULL_KEY_SCORES)
"""Rankings from the key summaries (what ``summary_parts`` changes)."""


@dataclass(frozen=True)
class SparseConfig:
    """The OasisKV algorithm: what a user chooses (SPEC item 7 defaults)."""

    top_k_blocks: int = _opt(128, "Blocks per KV head in the working set, plus the local active block.",
                             "positive", lambda v: _int(v) and v > 0)
    fetch_ratio: float = _opt(0.05, "Per-step admission cap C = ceil(fetch_ratio * top_k_blocks) per KV head.",
                              "in (0, 1]", lambda v: _num(v) and 0.0 < v <= 1.0)
    draft: str = _opt("auto", "Draft of oasiskv's look-ahead row: auto (the model's shipped head behind the n-gram "
                      "draft where one ships, else ngram), ngram[:N[:M]] (M: the shortest suffix match that proposes), "
                      "layerskip[:N], model:<path>, eagle3:<path>, oracle, or ngram[:N]+<one of those>.",
                      "a draft source name",
                      lambda v: isinstance(v, str) and bool(v))
    sink_blocks: int = _opt(0, "Leading blocks every prediction keeps (attention sinks).",
                            "in [0, top_k_blocks)", lambda v: _int(v) and v >= 0)
    recent_blocks: int = _opt(0, "The last N full blocks before the active block, which every prediction keeps (a "
                              "recent window; counted in top_k_blocks, like sink_blocks).",
                              "an integer >= 0 (sink_blocks + recent_blocks < top_k_blocks)",
                              lambda v: _int(v) and v >= 0)
    attended_blocks: int = _opt(
        0, "The N blocks that held the most of a step's attention (a decode step's over its working set, a prefill's "
        "last row's over every block) kept by the next prediction whatever their score (counted in top_k_blocks, like "
        "sink_blocks; resident already, so they cost no fetch). A study of issue #34: docs/accuracy.md.",
        "an integer >= 0 (sink_blocks + recent_blocks + attended_blocks < top_k_blocks)",
        lambda v: _int(v) and v >= 0)
    attended_share: float = _opt(
        0.0, "attended_blocks as a share of top_k_blocks (floor(share * top_k_blocks), at least 1), so one setting "
        "scales with the budget (the best measured at 1/8 and 1/4 of the context: 0.25); set one of the two. Off by "
        "default: on SmolLM2 it gains sparse-resident 5-11 points at 1/4 and 1/8 (at 1/4 dense's score) and oasiskv -1 "
        "to +14, costs up to 1.9 at 1/2 and 1.08-1.14x a decode step, and vLLM's sparse-resident has no record for it "
        "(docs/accuracy.md).",
        "a number in [0, 1)", lambda v: _num(v) and 0.0 <= v < 1.0)
    selection_score: str = _opt(
        "quest", "What ranks the candidate blocks: quest (an upper bound of q.k from each block's key min/max), "
        "minmax_mass (an estimate of each block's attention mass from the same min/max, every mode; keeps more mass "
        "offline but scored under quest on NIAH: docs/accuracy.md), attention (the step's true softmax attention "
        "mass on each block, summed over the GQA group: the exact top-K, a study ceiling; sparse-resident only), "
        "gauss (the Gaussian log-mass of each block's key mean and variance, computed from every key at every step: a "
        "study of summaries the engine does not keep; sparse-resident only) or quest_rank (Quest's bound per query "
        "head, a KV head's selection shared among its query heads by each one's ranking instead of the bounds' group "
        "max; every mode, a study setting); quest_half / quest_quarter / max_logit (Quest's bound over 2 / 4 / "
        "block_size runs of each block's keys, the block's best run: the ranking of summaries 2x / 4x as fine with "
        "the same fetch unit, computed from every key at every step; a study setting, sparse-resident only); "
        "max_logit_b1 / _b2 / _b4 (each block's largest logit over its keys coded in 1 / 2 / 4 bits per dimension "
        "within the block's min/max, codes the engine keeps on the device beside the summaries: bits/16 of a bf16 "
        "key cache, taken from the device budget; every mode of the embedded engine, not with summary_parts, "
        "accept_drafts, prefill-decode or prefix-cache hits; on a GPU with a bf16 / fp16 model each coded key is "
        "rounded to that dtype for a tensor-core product; max_logit_b2 ranks like the exact attention mass on "
        "SmolLM2 at 1/8 of 2K-4K, docs/accuracy.md).",
        "quest, minmax_mass, attention, gauss, quest_rank, quest_half, quest_quarter, max_logit, max_logit_b1, "
        "max_logit_b2 or max_logit_b4",
        lambda v: v in SELECTION_SCORES)
    dense_layers: int = _opt(0, "The first N layers attend over the whole context in the sparse modes (Quest keeps "
                             "2; the paper 0).", "an integer >= 0", lambda v: _int(v) and v >= 0)
    early_fetch_ratio: float = _opt(
        0.0, "proxy-prefetch / oasiskv: a request's first early_steps decode steps after its prefill admit up to "
        "ceil(early_fetch_ratio * top_k_blocks) blocks per KV head instead of fetch_ratio's cap, so its working set "
        "can turn over from the fill to what the decode attends (0: off). Off by default: on SmolLM2, with "
        "attended_share and fill_window, 1.0 gains 3.3 / 5.0 points at 1/8 (2K / 4K) but 0.25 loses 2.5 at 1/4 of 2K "
        "(docs/accuracy.md).",
        "a number in [0, 1] (0: off)", lambda v: _num(v) and 0.0 <= v <= 1.0)
    early_steps: int = _opt(16, "How many of a request's first decode steps get early_fetch_ratio's cap.",
                            "a positive integer", lambda v: _int(v) and v > 0)
    link_gbps: float = _opt(
        0.0, "GB/s the prefetch may use: each decode step's cap becomes what that rate moves in one measured step, "
        "never below the fetch_ratio cap (0: the fixed cap; set it below the rate the gather reaches).",
        "a number >= 0 (0: the fixed fetch cap)", lambda v: _num(v) and v >= 0)
    fetch_on_demand_cap: bool = _opt(
        False, "fetch-on-demand: apply the fetch cap too (default: fetch every missing block, as retrieval does).",
        "true or false", lambda v: isinstance(v, bool))
    demand_fetch: bool = _opt(
        False, "proxy-prefetch / oasiskv: before a decode step attends, also rank with the step's own query and fetch "
        "the blocks of that top-K the prefetch missed (every one, on the critical path), so the step attends what "
        "fetch-on-demand would; the prefetch still moves the rest ahead. A study of issue #34's prediction gap: "
        "docs/accuracy.md.", "true or false", lambda v: isinstance(v, bool))
    demand_fetch_cap: int = _opt(
        0, "demand_fetch: at most this many of the step's own top-K misses fetched on demand per request, layer and KV "
        "head, the highest-ranked first (0: every miss); bounds the copy on the step's critical path. Not a default: "
        "2, with selection_score=max_logit_b2, attended_share, fill_window and early_fetch_ratio, reaches the exact "
        "top-K at 1/8 and dense within a point at 1/4 on SmolLM2, but costs 1.35x oasiskv's decode step at 16 "
        "requests (the codes and the demand fetch; H100, Qwen3-8B shapes), 1.74x on vLLM with the whole setting "
        "(docs/accuracy.md, docs/vllm.md).",
        "an integer >= 0 (0: every miss)", lambda v: _int(v) and v >= 0)
    fill_query: str = _opt(
        "draft", "oasiskv: which query predicts the working set filled when a prefill completes: draft (the prefill "
        "step's draft row, a guess of the first decode token's query) or last (the last prompt token's, as the vLLM "
        "plug-in must: vLLM proposes no draft on a prefill step).", "draft or last", lambda v: v in ("draft", "last"))
    fill_window: int = _opt(
        0, "proxy-prefetch / oasiskv: fill the working set a completed prefill leaves with the top-K blocks by the "
        "exact attention mass of the prompt's last N rows (the prefill has every key on the device then; SnapKV's "
        "observation window) instead of fill_query's prediction from one query's summaries (0: that prediction). "
        "Off by default: on SmolLM2 it helps at half the context and, with attended_share, at 1/8, but costs 0.7 / 2.4 "
        "points at 1/4 (2K / 4K) and ~5% of a 32K prefill (docs/accuracy.md).", "an integer >= 0",
        lambda v: _int(v) and v >= 0)
    summary_parts: int = _opt(
        1, "Summary rows per block: each block's keys in this many equal runs with their own min/max, a block scored "
        "by its best run's Quest bound; 2 doubles the summaries' device memory (from 1/16 to 1/8 of the KV at block "
        "size 16), every sparse mode of the embedded engine, selection_score quest (the full-key study scores ignore "
        "it), not with prefix caching or prefill-decode hand-off (yet), not on vLLM. A divisor of block_size. 1 by "
        "default: at 1/8 of 2K / 4K on SmolLM2, 2 and 4 move sparse-resident -3 to +7 and oasiskv 0 to +5 points, far "
        "from closing the gap to the exact top-K, for 2-4x the summaries' memory (docs/accuracy.md).",
        "a positive divisor of block_size", lambda v: _int(v) and v > 0)
    accept_drafts: bool = _opt(
        False, "oasiskv: when the model's token equals the draft, emit the draft row's token too (two tokens a step, "
        "as vLLM's speculative decoding; outputs stay exact). The draft's KV is kept only when accepted. n-gram "
        "drafts; no GPU figures yet.", "true or false", lambda v: isinstance(v, bool))

    def __post_init__(self) -> None:
        _validate(self)
        if self.demand_fetch_cap and not self.demand_fetch:
            raise ValueError(f"demand_fetch_cap={self.demand_fetch_cap} needs demand_fetch=true (it bounds what "
                             "demand_fetch fetches)")
        if self.code_bits and self.accept_drafts:
            raise ValueError(f"selection_score={self.selection_score!r} does not run with accept_drafts yet (the key "
                             "codes are written as a block fills, and an accepted draft can fill one)")
        if self.summary_parts > 1 and self.selection_score in SUMMARY_SCORES and self.selection_score != "quest":
            raise ValueError(f"summary_parts={self.summary_parts} scores blocks by Quest's bound of their best run "
                             f"(selection_score=quest), not {self.selection_score!r}")
        if self.sink_blocks >= self.top_k_blocks:
            raise ValueError(f"sink_blocks must be in [0, top_k_blocks), got {self.sink_blocks}")
        if self.attended_blocks and self.attended_share:
            raise ValueError(f"set attended_blocks ({self.attended_blocks}) or attended_share ({self.attended_share}), "
                             "not both: the share is the count as a share of top_k_blocks")
        if self.sink_blocks + self.recent_blocks + self.attended >= self.top_k_blocks:
            raise ValueError(f"sink_blocks + recent_blocks + attended_blocks must be < top_k_blocks (a prediction must "
                             f"choose at least one block), got {self.sink_blocks} + {self.recent_blocks} + "
                             f"{self.attended} with top_k_blocks {self.top_k_blocks}"
                             + (f" (attended_share {self.attended_share})" if self.attended_share else ""))

    def check_mode(self, mode: Mode) -> None:
        """The options that apply to some modes only (checked by ``EngineConfig`` once ``draft`` is resolved, and on
        a running engine)."""
        if self.selection_score in FULL_KEY_SCORES and mode is not Mode.SPARSE_RESIDENT:
            raise ValueError(f"selection_score={self.selection_score!r} needs mode sparse-resident (it reads every "
                             f"candidate key at every step, so the full KV must be on the device), not {mode.value}")
        if self.accept_drafts:
            self._check_accept(mode)
        if self.fill_window and not mode.prefetches:
            raise ValueError(f"fill_window needs a prefetching mode (proxy-prefetch or oasiskv: the modes that fill a "
                             f"working set when a prefill completes), not {mode.value}")
        if self.early_fetch_ratio and not mode.prefetches:
            raise ValueError(f"early_fetch_ratio needs a prefetching mode (proxy-prefetch or oasiskv: the modes with a "
                             f"fetch cap), not {mode.value}")
        if self.demand_fetch and not mode.prefetches:
            raise ValueError(f"demand_fetch needs a prefetching mode (proxy-prefetch or oasiskv), not {mode.value}"
                             + (" (it fetches every missing block on demand already)"
                                if mode is Mode.FETCH_ON_DEMAND else ""))

    @property
    def code_bits(self) -> int:
        """Bits per key dimension of the key codes the engine keeps (``CODED_KEY_SCORES``; 0: none)."""
        return CODED_KEY_SCORES.get(self.selection_score, 0)

    def _check_accept(self, mode: Mode) -> None:
        """``accept_drafts`` needs the draft row of oasiskv, every layer sparse (a dense layer does not attend the
        draft row) and a draft that keeps no model state (an n-gram: its next proposal reads only the tokens)."""
        if mode is not Mode.OASISKV:
            raise ValueError(f"accept_drafts needs mode oasiskv (the mode with a draft row), not {mode.value}")
        if self.dense_layers:
            raise ValueError("accept_drafts does not run with dense_layers (a dense layer attends no draft row)")
        if any(part.split(":")[0] != "ngram" for part in self.draft.split("+")):
            raise ValueError(f"accept_drafts runs with n-gram drafts (draft=ngram[:N]), not {self.draft!r}: a head's "
                             "next proposal would need the accepted draft's hidden states")

    @property
    def attended(self) -> int:
        """Blocks each prediction keeps by attention feedback: ``attended_blocks``, or ``attended_share`` of
        ``top_k_blocks`` (0: off)."""
        if self.attended_share:
            return max(1, int(self.attended_share * self.top_k_blocks))
        return self.attended_blocks

    @property
    def fetch_cap(self) -> int:
        from oasiskv_runtime.core.selector import fetch_cap

        return fetch_cap(self.fetch_ratio, self.top_k_blocks)

    @property
    def early_cap(self) -> int:
        """The cap of a request's first ``early_steps`` decode steps (0: ``early_fetch_ratio`` off)."""
        from oasiskv_runtime.core.selector import fetch_cap

        return fetch_cap(self.early_fetch_ratio, self.top_k_blocks) if self.early_fetch_ratio else 0


@dataclass(frozen=True)
class KernelConfig:
    """How the same arithmetic runs: kernel choices and launch settings. None of them changes a result beyond
    rounding; they exist for A/B runs and for references."""

    backend: str = _opt("auto", "Every op, dense included: auto (GPU kernels on CUDA, plain-PyTorch references on "
                        "the CPU) or ref (the references everywhere).", "auto or ref", lambda v: v in ("auto", "ref"))
    cuda_graphs: str = _opt("auto", "Decode-only steps: auto (replayed from CUDA graphs on CUDA), off (eager), static "
                            "(eager on the graphs' input layout; tests it on the CPU).", "auto, off or static",
                            lambda v: v in ("auto", "off", "static"))
    fused_norm_rope: bool = _opt(True, "RMSNorm, and the q/k norm with rotary, as one Triton kernel each on CUDA "
                                 "(off: their PyTorch composition).", "true or false", lambda v: isinstance(v, bool))
    select_kernel: bool = _opt(True, "The prefetch's selection and copy plan as one fused kernel per layer (off: its "
                               "PyTorch reference; same decisions).", "true or false", lambda v: isinstance(v, bool))
    copy_engine_prefill: bool = _opt(
        True, "Host-pool modes on CUDA: prefill chunks' pool reads and writes by cudaMemcpyAsync on side streams "
        "(off: UVA kernels in the step's critical path).", "true or false", lambda v: isinstance(v, bool))
    gather_ctas: int = _opt(GATHER_CTAS, "CTAs of the UVA gather that copies prefetched blocks from host memory (0: "
                            "one per copied block-head).", ">= 0 (0: one CTA per copy)", lambda v: _int(v) and v >= 0)
    gather_copies: int = _opt(GATHER_COPIES, "Copies each of those CTAs has in flight.", "a power of two >= 1", _pow2)
    gather_hint: str = _opt("", "Cache hints of that gather's loads and stores: '' (hardware defaults), cg, cv, "
                            "stream.", f"one of {sorted(GATHER_HINTS)}", lambda v: v in GATHER_HINTS)
    pipeline_priority: int = _opt(0, "CUDA priority of the prefetch pipeline's three streams (lower is higher).",
                                  "a non-positive integer (lower is higher)", lambda v: _int(v) and v <= 0)

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class DebugConfig:
    """Measurement switches: they change what is measured or reported, never what a user would deploy."""

    measure_recall: bool = _opt(False, "Per-layer recall of each predicted top-K against the true next query's "
                                "(host round trips: no CUDA graphs).", "true or false", lambda v: isinstance(v, bool))
    disable_transfers: bool = _opt(
        False, "Benchmarks only: predict and select but skip the copies (an all-resident bound on step time; outputs "
        "are meaningless).", "true or false", lambda v: isinstance(v, bool))

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = _opt(256, "Most requests running at once.", "positive",
                             lambda v: _int(v) and v > 0)
    max_num_batched_tokens: int = _opt(2048, "Token budget of one step; longer prompts are prefilled in chunks.",
                                       "positive", lambda v: _int(v) and v > 0)

    def __post_init__(self) -> None:
        _validate(self)


PD_TRANSFERS = ("rpf", "full")
PD_TRANSPORTS = ("nixl", "tcp")


@dataclass(frozen=True)
class PDConfig:
    """Prefill-decode disaggregation (``oasiskv_runtime.pd``)."""

    transfer: str = _opt("rpf", "What crosses to the decode node at admission: rpf (the first decode step's blocks "
                         "and the key summaries; misses read on demand) or full (the whole prompt KV).",
                         "rpf or full", lambda v: v in PD_TRANSFERS)
    transport: str = _opt("nixl", "How KV moves host to host: nixl (UCX) or tcp.", "nixl or tcp",
                          lambda v: v in PD_TRANSPORTS)
    prefix_cache: bool = _opt(False, "Prefill side: reuse staged prompt blocks across requests that share a prefix.",
                              "true or false", lambda v: isinstance(v, bool))

    def __post_init__(self) -> None:
        _validate(self)


_SECTIONS: dict[str, type] = {"cache": CacheConfig, "sparse": SparseConfig, "kernels": KernelConfig,
                              "debug": DebugConfig, "scheduler": SchedulerConfig, "pd": PDConfig}


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine runs with. Flat option names (``top_k_blocks``, ``backend``...) are unique across the
    sections, so a user and the CLI set them by name (:meth:`from_overrides`)."""

    model: str
    """Packaged name, random-weight preset, Hugging Face directory or .gguf file."""
    device: str = "cpu"
    """cpu or cuda[:N]."""
    dtype: str = "float32"
    """float32, bfloat16 or float16."""
    mode: Mode = Mode.DENSE
    """dense, sparse-resident, fetch-on-demand, proxy-prefetch or oasiskv (settings of one engine)."""
    seed: int = 0
    """Seed of the weights of random presets, of sampling and of workloads."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pd: PDConfig = field(default_factory=PDConfig)

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
        self.sparse.check_mode(self.mode)
        parts = self.sparse.summary_parts
        if self.cache.block_size % parts:
            raise ValueError(f"summary_parts={parts} must divide block_size={self.cache.block_size} (each block's "
                             f"keys in equal runs)")
        if parts > 1 and self.pd.prefix_cache:
            raise ValueError(f"summary_parts={parts} does not run with prefix_cache yet (its entries hold one "
                             f"summary per block)")
        if self.sparse.code_bits and self.pd.prefix_cache:
            raise ValueError(f"selection_score={self.sparse.selection_score!r} does not run with prefix_cache yet (its "
                             f"entries hold no key codes)")

    @staticmethod
    def options() -> dict[str, OptionSpec]:
        """Every engine option by its flat name: section, default, valid values, meaning."""
        out: dict[str, OptionSpec] = {}
        for section, t in _SECTIONS.items():
            for f in dataclasses.fields(t):
                out[f.name] = OptionSpec(f.name, section, f.default, f.metadata["doc"], f.metadata["expect"],
                                         f.metadata["check"])
        return out

    @classmethod
    def from_overrides(cls, model: str, device: str = "cpu", dtype: str = "float32", mode: str | Mode = "dense",
                       seed: int = 0, **overrides: Any) -> EngineConfig:
        """Route flat keyword overrides to the section owning each name; unknown names are errors. ``kv_cache_gb``
        is ``kv_cache_bytes`` in GiB."""
        owner = {name: spec.section for name, spec in cls.options().items()}
        if "kv_cache_gb" in overrides:
            gb = overrides.pop("kv_cache_gb")
            if gb is not None:
                if not _num(gb) or gb <= 0:
                    raise ValueError(f"kv_cache_gb must be a positive number (GiB), got {gb!r}")
                overrides["kv_cache_bytes"] = int(float(gb) * (1 << 30))
        per_section: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
        for key, value in overrides.items():
            if key not in owner:
                valid = ", ".join(sorted(list(owner) + ["kv_cache_gb"]))
                raise TypeError(f"unknown engine option {key!r}; valid options: {valid}")
            per_section[owner[key]][key] = value
        return cls(model=model, device=device, dtype=dtype, mode=Mode.parse(mode), seed=seed,
                   **{s: t(**per_section[s]) for s, t in _SECTIONS.items()})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mode"] = self.mode.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        """The inverse of :meth:`to_dict` (a section may be missing: its defaults)."""
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown engine config keys: {', '.join(sorted(unknown))}")
        sections = {s: t(**d.pop(s, {})) for s, t in _SECTIONS.items()}
        return cls(**d, **sections)
