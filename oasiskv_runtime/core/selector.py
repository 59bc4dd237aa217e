"""Incremental block selection with bounded eviction (SPEC item 4, the paper's Algorithm 2).

This is the plain-Python *reference* for one (request, layer, KV head) at one decode step. It is the
oracle the batched tensor version (:mod:`oasiskv_runtime.ops.select_rows`) is tested against, so
it favours obviously-correct code over speed. It must not import torch: it is also used by host-side
simulators and tests that run without an accelerator stack.

Working-set model for one head: ``K`` GPU slots, each holding one logical (CPU) block or ``-1``.
Per step the predictor hands us the top-K logical blocks ``P`` in rank order (best first):

* ``P ∩ R`` (already resident) stays put: zero traffic, its recency is refreshed.
* ``Missing = P \\ R`` in prediction-rank order.
* Eviction order: empty slots first (lowest slot index first), then residents not in ``P`` ordered
  least-recently-selected first (smallest ``last_selected``; ties broken by lower slot index).
* Admit ``n = min(|Missing|, C)`` missing blocks, in rank order, into the first ``n`` slots of the
  eviction order: one host->GPU copy each. The rest are deferred (they retry next step while the
  remaining residents serve).

Since ``|P| <= K``, the eviction pool (``K - |P ∩ R|`` slots) is always at least ``|Missing|``, so a
slot is always available for every admitted block and residents in ``P`` are never evicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["EMPTY", "HeadSelection", "eviction_order", "fetch_cap", "select_head"]

#: Marker for an empty slot in ``slot_blocks`` / "never selected" in ``last_selected``.
EMPTY: int = -1


@dataclass
class HeadSelection:
    """Result of :func:`select_head` for one (request, layer, KV head) at one step.

    Attributes:
        admitted: ``(slot, logical_block)`` copies to perform, in prediction-rank order.
        evicted: logical blocks that left the working set, aligned with ``admitted``
            (``evicted[i]`` was in ``admitted[i][0]`` before the copy); ``-1`` where the slot was empty.
        num_deferred: missing predicted blocks not admitted because of the cap.
        num_hits: ``|P ∩ R|``, predicted blocks that were already resident.
    """

    admitted: list[tuple[int, int]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    num_deferred: int = 0
    num_hits: int = 0

    @property
    def num_admitted(self) -> int:
        """Number of host->GPU block copies this step (``n`` in Algorithm 2)."""
        return len(self.admitted)


def fetch_cap(fetch_ratio: float, top_k_blocks: int) -> int:
    """Per-head, per-step admission cap ``C`` from the fetch ratio (SPEC items 4 and 7).

    ``C = ceil(ratio * K)``, but at least 1 whenever ``ratio > 0`` so a tiny ratio still makes progress.
    The ``- 1e-9`` guards float error: ``0.3 * 10 == 3.0000000000000004`` must give 3, not 4.

    Args:
        fetch_ratio: fraction of the top-K that may be fetched per step (``>= 0``; paper default 0.05).
        top_k_blocks: ``K``, predicted blocks per KV head (``>= 0``; paper default 128).

    Returns:
        The cap ``C >= 0`` (``fetch_cap(0.05, 128) == 7``).
    """
    if not math.isfinite(fetch_ratio) or fetch_ratio < 0:
        raise ValueError(f"fetch_ratio must be a finite number >= 0, got {fetch_ratio!r}")
    if top_k_blocks < 0:
        raise ValueError(f"top_k_blocks must be >= 0, got {top_k_blocks!r}")
    if fetch_ratio == 0:
        return 0
    return max(1, math.ceil(fetch_ratio * top_k_blocks - 1e-9))


def eviction_order(slot_blocks: list[int], last_selected: list[int], predicted_set: set[int]) -> list[int]:
    """Slots in the order they are given up: empty slots (ascending index), then residents not in
    ``predicted_set`` by ``(last_selected, slot)`` ascending. Slots holding predicted blocks are excluded.
    """
    empties = [s for s, b in enumerate(slot_blocks) if b == EMPTY]
    evictable = [s for s, b in enumerate(slot_blocks) if b != EMPTY and b not in predicted_set]
    evictable.sort(key=lambda s: (last_selected[s], s))
    return empties + evictable


def select_head(
    slot_blocks: list[int],
    last_selected: list[int],
    predicted: list[int],
    cap: int,
    step: int,
) -> HeadSelection:
    """Algorithm 2 for one KV head. Mutates ``slot_blocks`` / ``last_selected`` in place.

    Args:
        slot_blocks: length ``K``; ``slot_blocks[s]`` is the logical block resident in working-set slot
            ``s``, or ``-1`` (empty). Residents are assumed distinct.
        last_selected: length ``K``; the last step at which slot ``s``'s block was in the predicted set
            (or was admitted); ``-1`` if never.
        predicted: the predicted top-K logical blocks (each ``>= 0``) in rank order (best first),
            no duplicates, ``len(predicted) <= K``.
        cap: ``C``, the maximum number of blocks admitted this step (``>= 0``).
        step: the current decode step, stamped into ``last_selected`` for hits and admissions.

    Returns:
        A :class:`HeadSelection` with the copies to perform (already applied to ``slot_blocks``).
    """
    k = len(slot_blocks)
    if len(last_selected) != k:
        raise ValueError(f"last_selected has length {len(last_selected)}, slot_blocks has {k}")
    if len(predicted) > k:
        raise ValueError(f"{len(predicted)} predicted blocks do not fit in {k} slots")
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    predicted_set = set(predicted)
    if len(predicted_set) != len(predicted):
        raise ValueError("predicted contains duplicate blocks")
    if any(b < 0 for b in predicted):
        raise ValueError("predicted blocks must be >= 0 (-1 means empty)")

    # Hits: refresh recency so a block the predictor keeps choosing is the last to be evicted.
    resident = {b: s for s, b in enumerate(slot_blocks) if b != EMPTY}
    num_hits = 0
    for b in predicted:
        s = resident.get(b)
        if s is not None:
            last_selected[s] = step
            num_hits += 1

    missing = [b for b in predicted if b not in resident]  # keeps prediction-rank order
    n = min(len(missing), cap)
    # The order must be computed before any admission rewrites slots; residents in P are excluded, so
    # admissions can never displace a hit.
    order = eviction_order(slot_blocks, last_selected, predicted_set)

    result = HeadSelection(num_deferred=len(missing) - n, num_hits=num_hits)
    for block, slot in zip(missing[:n], order):
        result.admitted.append((slot, block))
        result.evicted.append(slot_blocks[slot])
        slot_blocks[slot] = block
        last_selected[slot] = step
    return result
