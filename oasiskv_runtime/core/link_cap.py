"""The per-step fetch cap from the link's byte budget (``SparseConfig.link_gbps``).

The paper sizes its per-step admission budget by the link: ``C_token = B_link * T_decode`` (SPEC: ~118 tokens
per request per step for Qwen3-8B on an H100 at batch ~64). ``fetch_ratio`` fixes that budget in blocks per
KV head (``ceil(fetch_ratio * top_k_blocks)``), whatever the batch and the step time are. With
``link_gbps`` set, each decode step's cap is instead what the link can move during one decode step at that
rate, shared by the step's requests, and never below the fixed cap:

    cap = clamp(pow2_floor(link_bytes_per_s * T_step / (batch * hkv * layers * bytes_per_head_block)),
                fetch_cap, k_slots)

``T_step`` is the shortest of the last ``window`` measured step times (from one step's start to the next's),
kept apart for decode-only steps and for steps that carry a prefill chunk, and the step's own kind is used: the
blocks a step prefetches for the next are copied while the rest of the step runs, and a step that carries a
prefill chunk takes many times longer. The shortest, not a mean: a step that captured a CUDA graph (each new cap
value is a new graph key, captured on its second step) or waited on the host takes many times longer than a
replay, and on the H200 a moving average of such steps raised the cap, which made new keys and more captures
(docs/benchmarks.md, "Link-sized fetch cap": caps of 6-100 and steps of 55-685 ms where the fixed cap's took 11-46 ms). A cap also grows by
at most a factor of two per step of its kind, so a long first interval cannot jump it to the working set. The
cap is rounded down to a power of two so that a CUDA graph, which bakes the cap in, is captured for a handful of
values rather than one per step. Small batches and small models get caps up to the whole working set (fewer
deferred blocks, the selection the prediction asked for); at large batches the fixed cap stays the floor.

Set ``link_gbps`` below the rate the prefetch gather reaches (an H200: ~43 GB/s at 64-128 requests): when the
transfers set the step's time, the next cap is that step's bytes scaled by ``link_gbps`` / the rate reached, so
it shrinks back only if that ratio is below one.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


class LinkCap:
    """The admission cap of each decode step; see the module docstring.

    Args:
        ceiling: the most copies per (request, KV head) a step can need (the working set's slots).
        bytes_per_request_unit: bytes one unit of cap lets one request move in a step: a (block, head) copy
            in every KV head of every layer.
        window: how many of the latest step times of each kind the shortest is taken from.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, ceiling: int, bytes_per_request_unit: int, window: int = 16,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ceiling = ceiling
        self.unit = bytes_per_request_unit
        self.clock = clock
        self._times: dict[bool, deque[float]] = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self._caps: dict[bool, int] = {}
        """The last cap given to a step of each kind: the next may be at most twice it."""
        self._last: tuple[float, bool] | None = None
        self.cap_sum = 0
        self.cap_steps = 0

    def new_step(self, num_decode: int, decode_only: bool, floor: int, link_gbps: float) -> int:
        """Called as each step starts: times the step before it (as one of its kind) and returns this step's cap
        for ``num_decode`` decoding requests (``floor``: the fixed cap; ``link_gbps`` 0: always ``floor``)."""
        cap = floor
        if link_gbps > 0:
            now = self.clock()
            if self._last is not None:
                start, kind = self._last
                self._times[kind].append(now - start)
            self._last = (now, decode_only)
            cap = self.cap_for(num_decode, floor, link_gbps, decode_only)
            if num_decode:
                last = self._caps.get(decode_only)
                if last is not None:
                    cap = min(cap, max(floor, pow2_floor(2 * last)))
                self._caps[decode_only] = cap
        if num_decode:
            self.cap_sum += cap
            self.cap_steps += 1
        return cap

    @property
    def step_seconds(self) -> dict[bool, float]:
        """The step time the cap uses, by kind (decode-only: True): the shortest of the latest measured."""
        return {kind: min(times) for kind, times in self._times.items() if times}

    def cap_for(self, num_decode: int, floor: int, link_gbps: float, decode_only: bool = True) -> int:
        """The cap for a step of ``num_decode`` requests at the measured time of steps of its kind (before the
        growth limit of :meth:`new_step`)."""
        times = self._times[decode_only]
        if link_gbps <= 0 or not times or num_decode <= 0:
            return floor
        budget = link_gbps * 1e9 * min(times) / (num_decode * self.unit)
        if budget >= self.ceiling:
            return max(floor, self.ceiling)
        return max(floor, pow2_floor(int(budget))) if budget >= 1 else floor

    def reset_counts(self) -> None:
        """Zero the mean cap's counts and forget the last step's start (the next interval would span the pause
        between two measured windows); the measured step times stay."""
        self.cap_sum = self.cap_steps = 0
        self._last = None

    def mean_cap(self) -> float | None:
        """Mean cap over the decode steps seen; None before any."""
        return self.cap_sum / self.cap_steps if self.cap_steps else None
