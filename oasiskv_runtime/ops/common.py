"""Helpers every op module shares: launch-size rounding, the lazy Triton check, sync-free small uploads, the nvcc
build of a ``csrc/`` kernel."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
"""The CUDA C sources (``csrc/<name>.cu``), beside the package in a source checkout."""


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


def find_nvcc() -> Optional[str]:
    """``nvcc`` from ``CUDA_HOME`` / ``CUDA_PATH`` / ``/usr/local/cuda``, else the ``PATH``; None without one."""
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return str(Path(cand) / "bin" / "nvcc")
    return shutil.which("nvcc")


_BUILT: dict = {}
_BUILD_LOCK = threading.Lock()


def build_csrc(name: str, arch: str = "sm_90", entries: Optional[dict] = None) -> ctypes.CDLL:
    """``csrc/<name>.cu`` compiled by plain nvcc (no torch headers: seconds) into a shared library for ``arch``,
    cached by source hash under ``$OASISKV_BUILD_DIR`` (default ``~/.cache/oasiskv_runtime``), loaded with ctypes
    and its ``entries`` (``{function: argtypes}``, each returning a C int) typed, once a process. Raises
    RuntimeError without nvcc or when it fails, with its message (OSError: a library that does not load)."""
    with _BUILD_LOCK:
        if (name, arch) in _BUILT:
            return _BUILT[name, arch]
        src_path = CSRC / f"{name}.cu"
        if not src_path.exists():
            raise RuntimeError(f"{src_path} not found (the CUDA C kernels ship in a source checkout)")
        tag = hashlib.sha256(src_path.read_bytes()).hexdigest()[:16]
        cache = Path(os.environ.get("OASISKV_BUILD_DIR", Path.home() / ".cache" / "oasiskv_runtime"))
        cache.mkdir(parents=True, exist_ok=True)
        lib = cache / f"lib{name}_{arch}_{tag}.so"
        if not lib.exists():
            nvcc = find_nvcc()
            if nvcc is None:
                raise RuntimeError(f"csrc/{name}.cu: nvcc not found (set CUDA_HOME)")
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            cmd = [nvcc, "-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", str(src_path), "-o", str(tmp)]
            log.info("building csrc/%s.cu for %s with nvcc (once; kept in %s)", name, arch, cache)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{r.stderr}")
            os.replace(tmp, lib)
        dll = ctypes.CDLL(str(lib))
        for fn, argtypes in (entries or {}).items():
            getattr(dll, fn).restype = ctypes.c_int
            getattr(dll, fn).argtypes = argtypes
        _BUILT[name, arch] = dll
        return dll
