"""Versioned on-disk schema of one benchmark run.

A run directory ``results/<suite>/<run-id>/`` holds:

- ``config.json``: the fully resolved config (any JSON object);
- ``env.json``: where it ran (``git_commit``, ``python``/``torch``/``transformers`` versions, ``device``,
  ``model``, ``random_weights``, ``hostname``, ``created_at``);
- ``metrics.json``: ``{"schema_version": 1, "suite": str, "run_id": str, "records": [Record, ...]}``;
- PNG plots and ``report.md``, regenerated from the above at will.

A :class:`Record` is ``{"point": {...}, "metrics": {...}}``. The point says *what* was measured (mode,
context length, concurrency, sparse settings...), the metrics say what came out, using vLLM bench names
where they exist so numbers can be set beside ``vllm bench serve`` output. Unknown extra keys are kept.

This module is pure data (no file I/O), so the store, plots, reports and gates share one definition.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

SCHEMA_VERSION = 1

METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.json"
ENV_FILE = "env.json"

#: The five engine modes, in the order tables and legends list them (baseline first, ours last).
MODES: tuple[str, ...] = ("dense", "sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv")
#: Engines a throughput point runs on: ours (``embedded``, the default) or vLLM (``dense`` = plain vLLM, the other
#: modes through the OasisKV plug-in). A point's ``engine`` is None for the default, so it stays out of the point id
#: and runs recorded before the key existed keep their ids.
ENGINES: tuple[str, ...] = ("embedded", "vllm")
DEFAULT_ENGINE = ENGINES[0]

#: Point keys every record must carry.
REQUIRED_POINT_KEYS: tuple[str, ...] = ("mode", "context_len", "concurrency")
#: Point keys a record may carry; others are kept but these are the ones we know how to label.
OPTIONAL_POINT_KEYS: tuple[str, ...] = (
    "top_k_blocks",
    "fetch_ratio",
    "draft",
    "kv_cache_gb",
    "output_len",
    "num_requests",
    "engine",
)
#: Point keys that only configure the sparse and host-pool modes: dense has no counterpart for them, so cross-mode
#: matching (oasiskv vs dense at the same context and concurrency) ignores them.
SPARSE_ONLY_POINT_KEYS: tuple[str, ...] = ("top_k_blocks", "fetch_ratio", "draft", "host_kv_gb", "device_tier",
                                          "device_tier_gb", "link_gbps")


class PointMetrics(TypedDict, total=False):
    """What one point of a sweep measured. All keys optional: a mode reports what applies to it."""

    completed: int
    """Requests that finished."""
    failed: int
    """Requests that errored or were aborted."""
    duration: float
    """Wall-clock seconds of the measured phase."""
    output_throughput: float
    """Generated tokens per second over the run (vLLM name)."""
    request_throughput: float
    """Completed requests per second."""
    total_token_throughput: float
    """(Prompt + generated) tokens per second."""
    mean_ttft_ms: float
    """Mean time to first token."""
    median_ttft_ms: float
    """Median time to first token."""
    p99_ttft_ms: float
    """99th percentile time to first token."""
    mean_tpot_ms: float
    """Mean time per output token after the first, per request."""
    median_tpot_ms: float
    """Median time per output token."""
    p99_tpot_ms: float
    """99th percentile time per output token."""
    mean_itl_ms: float
    """Mean inter-token latency."""
    median_itl_ms: float
    """Median inter-token latency."""
    p99_itl_ms: float
    """99th percentile inter-token latency."""
    total_output_tokens: int
    """Generated tokens, all requests."""
    total_input_tokens: int
    """Prompt tokens, all requests."""
    max_running_batch: int
    """Largest number of requests decoding in one step."""
    mean_running_batch: float
    """Mean number of requests decoding per step."""
    num_preemptions: int
    """Requests preempted for lack of KV space."""
    fetched_bytes_per_step: float
    """Host->device KV bytes moved per decode step (all layers, all requests)."""
    fetched_blocks_per_step: float
    """KV blocks moved host->device per decode step."""
    deferred_blocks_per_step: float
    """Predicted blocks whose fetch did not fit the per-step cap and were deferred."""
    prediction_recall: float | None
    """Fraction of the true next-step top-K blocks the predictor found; null where no predictor runs."""
    draft_accuracy: float | None
    """Fraction of draft tokens equal to the token the target model emitted; null without a draft."""
    resident_gpu_bytes_per_request: float
    """KV bytes one request keeps in GPU memory (its resident working set)."""
    peak_device_memory_bytes: int
    """Peak allocated device memory over the run."""
    peak_device_tier_bytes: int
    """Most full-KV bytes held in the device tier at once (host-pool modes with ``device_tier``; else 0)."""
    max_admitted_batch: int
    """Most requests admitted at once given the KV budget (capacity, not measured concurrency)."""
    spec_decode_acceptance_rate: float | None
    """vLLM points with a draft, and the embedded oasiskv with ``accept_drafts``: accepted / proposed draft tokens
    (vLLM's name; on vLLM, with one speculative token, it is ``draft_accuracy``, which the record also carries; the
    embedded engine accepts no draft that completes a block, so there it can be lower)."""
    tokens_per_step: float | None
    """Points that accept drafts (vLLM with a draft, the embedded oasiskv with ``accept_drafts``): tokens per step and
    request (1 + accepted / drafts); None where every step emits one token."""


#: Every metric name the schema documents, in display order.
METRIC_NAMES: tuple[str, ...] = tuple(PointMetrics.__annotations__)


class Record(TypedDict):
    """One measured point: what was run and what came out."""

    point: dict[str, Any]
    metrics: dict[str, Any]


@dataclass
class Run:
    """A loaded run directory. ``path`` is None for runs built in memory (tests, merges)."""

    suite: str
    run_id: str
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    path: Path | None = None

    def modes(self) -> list[str]:
        """Mode labels (:func:`series_label`) present in the run, canonical order first."""
        return order_modes({series_label(r["point"]) for r in self.records})

    def context_lens(self) -> list[int]:
        """Distinct context lengths, ascending."""
        return sorted({int(r["point"]["context_len"]) for r in self.records})

    def by_point_id(self) -> dict[str, Record]:
        """Records keyed by :func:`point_id` (later records win, as in a resumed sweep)."""
        return {point_id(r["point"]): r for r in self.records}


def series_label(point: dict[str, Any]) -> str:
    """What tables, legends and ratios call a point's mode: the mode on the default engine, ``engine:mode`` on
    another (``vllm:dense`` is plain vLLM), so one run's embedded and vLLM points of a mode are two series; plain
    vLLM speculating with a draft is ``vllm:dense+<draft>``, the embedded oasiskv accepting drafts ``oasiskv+accept``,
    the plug-in with a device tier ``vllm:oasiskv+tier``."""
    engine = point.get("engine")
    mode = str(point["mode"])
    if point.get("speculate"):
        mode = f"{mode}+{point.get('draft')}"
    if point.get("accept_drafts"):
        mode = f"{mode}+accept"
    if point.get("device_tier_gb"):
        mode = f"{mode}+tier"
    return mode if engine in (None, DEFAULT_ENGINE) else f"{engine}:{mode}"


def label_mode(label: str) -> str:
    """The mode of a :func:`series_label` (``vllm:dense`` -> ``dense``, ``vllm:dense+ngram`` -> ``dense``)."""
    return label.rpartition(":")[2].partition("+")[0]


def order_modes(modes: set[str] | list[str]) -> list[str]:
    """Mode labels (:func:`series_label`) by mode in :data:`MODES` order, each mode's default engine first, then
    other engines in :data:`ENGINES` order; unknown ones alphabetically after."""
    def rank(label: str) -> tuple[int, int, str]:
        engine = label.rpartition(":")[0] or DEFAULT_ENGINE
        mode = label_mode(label)
        return (MODES.index(mode) if mode in MODES else len(MODES),
                ENGINES.index(engine) if engine in ENGINES else len(ENGINES), label)

    return sorted(set(modes), key=rank)


def normalize_value(value: Any) -> Any:
    """Canonical form for comparing point values: YAML's ``40`` and JSON's ``40.0`` are one point."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, (list, tuple)):
        return [normalize_value(v) for v in value]
    return value


def point_id(point: dict[str, Any]) -> str:
    """Stable id of a point: ``key=value`` pairs sorted by key, joined by ``,``.

    None values are dropped so ``{"draft": None}`` and a point without ``draft`` are the same point;
    integral floats print as ints for the same reason. Values are JSON-encoded (strings unquoted) so ids
    stay readable in reports and resume logs.
    """
    parts = []
    for key in sorted(point):
        value = normalize_value(point[key])
        if value is None:
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
        parts.append(f"{key}={text}")
    return ",".join(parts)


def point_matches(point: dict[str, Any], partial: dict[str, Any]) -> bool:
    """True when every item of ``partial`` equals the point's (after :func:`normalize_value`)."""
    return all(
        key in point and normalize_value(point[key]) == normalize_value(value) for key, value in partial.items()
    )


def validate_record(obj: Any, where: str) -> Record:
    """Check one record's shape; ``where`` (e.g. ``"metrics.json: records[3]"``) prefixes errors."""
    if not isinstance(obj, dict) or not isinstance(obj.get("point"), dict) or not isinstance(obj.get("metrics"), dict):
        raise ValueError(f"{where}: a record must be an object with 'point' and 'metrics' objects")
    point = obj["point"]
    missing = [k for k in REQUIRED_POINT_KEYS if k not in point]
    if missing:
        raise ValueError(f"{where}: point lacks required key(s) {', '.join(missing)}")
    if not isinstance(point["mode"], str):
        raise ValueError(f"{where}: point.mode must be a string, got {point['mode']!r}")
    for key in ("context_len", "concurrency"):
        value = point[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: point.{key} must be an integer, got {value!r}")
    return Record(point=point, metrics=obj["metrics"])


def metric_value(record: Record, metric: str) -> float | None:
    """The metric as a float, or None when absent, null or not a number (bools are not numbers)."""
    value = record["metrics"].get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
