"""The per-step fetch cap from the link's byte budget (``SparseConfig.link_gbps``).

The paper sizes its per-step admission budget by the link: ``C_token = B_link * T_decode`` (SPEC: ~118 tokens
per request per step for Qwen3-8B on an H100 at batch ~64). ``fetch_ratio`` fixes that budget in blocks per
KV head (``ceil(fetch_ratio * top_k_blocks)``), whatever the batch and the step time are. With
``link_gbps`` set, each decode step's cap is instead what the link can move during one decode step at that
rate, shared by the step's requests, and never below the fixed cap:

    cap = clamp(pow2_floor(link_bytes_per_s * T_step / (batch * hkv * layers * bytes_per_head_block)),
                fetch_cap, k_slots)

``T_step`` is a moving average of measured step times (from one step's start to the next's), kept apart for
decode-only steps and for steps that carry a prefill chunk, and the step's own kind is used: the blocks a step
prefetches for the next are copied while the rest of the step runs, and a step that carries a prefill chunk
takes many times longer. The cap is rounded down to a power of two so that a CUDA graph, which bakes the cap in,
is captured for a handful of values rather than one per step. Small batches and small models get caps up to
the whole working set (fewer deferred blocks, the selection the prediction asked for); at large batches the
fixed cap stays the floor.

Set ``link_gbps`` below the rate the prefetch gather reaches (an H200: ~43 GB/s at 64-128 requests): if the
transfers set the step's time, a larger cap lengthens the step, and the next cap grows with it.
"""

from __future__ import annotations

import time
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
        smoothing: weight of the newest decode-step time in the moving average.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, ceiling: int, bytes_per_request_unit: int, smoothing: float = 0.25,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ceiling = ceiling
        self.unit = bytes_per_request_unit
        self.smoothing = smoothing
        self.clock = clock
        self.step_seconds: dict[bool, float] = {}
        """Moving average of measured step times by kind: decode-only (True) or carrying a prefill (False)."""
        self._last: tuple[float, bool] | None = None
        self.cap_sum = 0
        self.cap_steps = 0

    def new_step(self, num_decode: int, decode_only: bool, floor: int, link_gbps: float) -> int:
        """Called as each step starts: times the step before it (as one of its kind) and returns this step's cap
        for ``num_decode`` decoding requests (``floor``: the fixed cap; ``link_gbps`` 0: always ``floor``)."""
        if link_gbps > 0:
            now = self.clock()
            if self._last is not None:
                start, kind = self._last
                dt, prev = now - start, self.step_seconds.get(kind)
                self.step_seconds[kind] = dt if prev is None else self.smoothing * dt + (1 - self.smoothing) * prev
            self._last = (now, decode_only)
        cap = self.cap_for(num_decode, floor, link_gbps, decode_only)
        if num_decode:
            self.cap_sum += cap
            self.cap_steps += 1
        return cap

    def cap_for(self, num_decode: int, floor: int, link_gbps: float, decode_only: bool = True) -> int:
        """The cap for a step of ``num_decode`` requests at the measured time of steps of its kind."""
        seconds = self.step_seconds.get(decode_only)
        if link_gbps <= 0 or seconds is None or num_decode <= 0:
            return floor
        budget = link_gbps * 1e9 * seconds / (num_decode * self.unit)
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
