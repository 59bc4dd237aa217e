"""Helpers every op module shares: launch-size rounding, the lazy Triton check, sync-free small uploads."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch


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


def use_triton(backend: str, t: torch.Tensor, loader: Callable[[], object]) -> bool:
    """Whether an op runs its Triton kernel (``loader``: the module's lazy kernel builder) on ``t``'s data:
    ``backend="triton"`` always, ``"auto"`` on CUDA tensors when the kernels load, ``"ref"`` never (the
    plain-PyTorch reference); any other name is an error."""
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    return backend == "triton" or (backend == "auto" and t.is_cuda and loads(loader))


def on_device(t: torch.Tensor):
    """The context a kernel launch on ``t``'s data runs in: its CUDA device current (a tensor on cuda:1 needs
    cuda:1's stream); nothing for CPU tensors (Triton's interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def lazy_kernels(module_globals: dict) -> Callable:
    """Decorator for an op module's kernel builder. On the first call: import Triton, bind ``triton`` and ``tl``
    in the module (its ``@triton.jit`` kernels resolve ``tl`` there), run the builder and keep what it returns;
    later calls return that. An import or build error propagates and nothing is kept (see :func:`loads`)."""
    def wrap(build: Callable[[], object]) -> Callable[[], object]:
        built: list = []

        @functools.wraps(build)
        def kernels():
            if not built:
                import triton
                import triton.language as tl

                module_globals["triton"], module_globals["tl"] = triton, tl
                built.append(build())
            return built[0]
        return kernels
    return wrap


def host_list_to(data: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small host list as a tensor on ``device``, without a host sync on CUDA.

    ``torch.tensor(data, device="cuda")`` copies from pageable memory and then waits for the whole stream
    (a blocking copy), so every call in a layer loop stalls the host until the GPU has caught up. Here the
    list goes through pinned memory and a non-blocking copy, ordered on the current stream (the caching
    host allocator keeps the pinned buffer alive until the copy has run)."""
    t = torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
