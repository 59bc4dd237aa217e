"""A throughput point's workload and what its outputs add up to, shared by every engine that runs points.

The requests are ``num_requests`` prompts of seeded random token ids (the same ids in every mode, engine and
machine), greedy with ``ignore_eos``; each engine reduces its finished requests to :class:`RequestRow` and
:func:`point_metrics` turns them, the wall time and the engine's run counters into one record's metrics
(vLLM bench names).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Lowest prompt token id: keeps clear of BOS/EOS/pad and other special ids at the bottom of vocabularies.
MIN_TOKEN_ID = 10
#: Run counters every record carries (None where an engine does not measure one).
RUN_STAT_KEYS = ("max_running_batch", "mean_running_batch", "num_preemptions", "fetched_blocks_per_step",
                 "fetched_bytes_per_step", "deferred_blocks_per_step", "prediction_recall", "draft_accuracy",
                 "resident_gpu_bytes_per_request", "peak_device_memory_bytes", "peak_device_tier_bytes")


#: The warm-up request each fresh engine serves before its point is timed (:func:`warm_up_prompt_len`).
WARMUP_PROMPT_LEN = 80
WARMUP_OUTPUT_LEN = 4


def warm_up_prompt_len(context_len: int, max_model_len: int) -> int:
    """Prompt length of the warm-up request: as long as the point's context (kernels are compiled per shape class,
    and a short warm-up leaves those compilations in the timed run), at least :data:`WARMUP_PROMPT_LEN`, within the
    engine's ``max_model_len`` with its :data:`WARMUP_OUTPUT_LEN` tokens."""
    return min(max(WARMUP_PROMPT_LEN, context_len - WARMUP_OUTPUT_LEN), max_model_len - WARMUP_OUTPUT_LEN - 1)


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random prompts; the same (seed, shape) gives the same ids in every mode and on every machine."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(MIN_TOKEN_ID, vocab_size, size=(num_requests, prompt_len), dtype=np.int64)
    return ids.tolist()


@dataclass(frozen=True)
class RequestRow:
    """One finished request, as either engine reports it."""

    num_prompt_tokens: int
    num_output_tokens: int
    ttft_ms: float | None
    """From submission to the first generated token."""
    tpot_ms: float | None
    """(last token - first token) / (tokens - 1); None for a single token."""
    itl_ms: tuple[float, ...] = ()
    """Gaps between successive arrivals of the request's tokens."""


def _stats(prefix: str, values: list[float]) -> dict[str, float | None]:
    """vLLM bench's mean/median/std/p99 of one latency, in ms; None without samples."""
    if not values:
        return {f"{s}_{prefix}_ms": None for s in ("mean", "median", "std", "p99")}
    arr = np.asarray(values, dtype=np.float64)
    return {f"mean_{prefix}_ms": float(arr.mean()), f"median_{prefix}_ms": float(np.median(arr)),
            f"std_{prefix}_ms": float(arr.std()), f"p99_{prefix}_ms": float(np.percentile(arr, 99))}


def point_metrics(rows: Iterable[RequestRow], num_requests: int, duration_s: float,
                  run_stats: dict[str, Any]) -> dict[str, Any]:
    """Metrics of one finished point: its finished requests, the wall time of the measured phase, the engine's
    run counters (copied in; :data:`RUN_STAT_KEYS` it lacks become None)."""
    done = list(rows)
    out_tokens = sum(r.num_output_tokens for r in done)
    in_tokens = sum(r.num_prompt_tokens for r in done)
    m: dict[str, Any] = {
        "completed": len(done),
        "failed": num_requests - len(done),
        "duration": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
    }
    m.update(_stats("ttft", [r.ttft_ms for r in done if r.ttft_ms is not None]))
    m.update(_stats("tpot", [r.tpot_ms for r in done if r.tpot_ms is not None]))
    m.update(_stats("itl", [x for r in done for x in r.itl_ms]))
    m.update({k: v for k, v in run_stats.items() if k != "random_weights"})
    for key in RUN_STAT_KEYS:
        m.setdefault(key, None)
    # Every request is submitted at t0, so the largest running batch is what the KV budget admitted.
    m["max_admitted_batch"] = m["max_running_batch"]
    return m
