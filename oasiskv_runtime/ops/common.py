"""Helpers every op module shares: launch-size rounding and the lazy Triton check."""

from __future__ import annotations

from typing import Callable


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (Triton block sizes must be powers of two)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def loads(loader: Callable[[], object]) -> bool:
    """True when ``loader`` (an op module's lazy kernel builder) succeeds: Triton is importable and the
    kernels compile-declare. Ops fall back to their plain-PyTorch reference otherwise."""
    try:
        loader()
        return True
    except Exception:  # noqa: BLE001 - any failure means "use the reference"
        return False
