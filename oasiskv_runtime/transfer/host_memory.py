"""The host KV pool's memory: one exact-size page-locked allocation, carved into per-layer tensors.

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every request
up to a power of two: a per-layer pool tensor of 1.4 GiB pins 2 GiB. On a 128 GiB host that capped the pool at
72 GiB (72 tensors of exactly 1 GiB), the next size up does not fit. Here the pool is one pageable allocation
of exactly the bytes asked for, its pages touched by a multi-threaded fill, then page-locked and mapped with
``cudaHostRegister`` (so the GPU reads it zero-copy, like ``cudaHostAlloc`` memory). The registration is undone
when the region is collected; the tensors carved from it keep the memory itself alive.

``huge_pages`` marks the region ``MADV_HUGEPAGE`` before the fill (with transparent huge pages in ``madvise``
mode, the default on our hosts, the pool is otherwise 4 KiB pages). Off by default: on the H200 host the GPU's
UVA reads ran at the same 42-50 GB/s from a 64 GiB pool of either page size and from a 2 GiB one
(``bench/pool_bandwidth.py``; docs/benchmarks.md, "The host pool's read bandwidth"), so page translation is not what limits the pool's reads.
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref

import torch

__all__ = ["PinnedRegion", "available_host_bytes", "advise_huge_pages", "huge_page_bytes"]

_ALIGN = 4096
_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field in bytes (None where there is no such file or field)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (None where there is no such file)."""
    return _meminfo_bytes("MemAvailable")


def advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` over the 2 MiB-aligned part of ``[ptr, ptr + nbytes)``, before its pages are
    touched; False where the call is unavailable or refused (the region then keeps 4 KiB pages)."""
    start = ptr + (-ptr % _HUGE)
    length = (ptr + nbytes - start) // _HUGE * _HUGE
    if length <= 0:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, length, _MADV_HUGEPAGE) == 0


def huge_page_bytes() -> int | None:
    """``AnonHugePages`` from /proc/meminfo (None where there is no such file)."""
    return _meminfo_bytes("AnonHugePages")


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the process is going away anyway
        pass


class PinnedRegion:
    """``nbytes`` of page-locked, GPU-mapped host memory; :meth:`take` carves tensors out of it in order."""

    #: Host memory left to the process and the OS beyond the pool: a pool that leaves less is refused.
    reserve_bytes = 4 << 30

    def __init__(self, nbytes: int, huge_pages: bool = False) -> None:
        nbytes = int(nbytes)
        avail = available_host_bytes()
        if avail is not None and nbytes + self.reserve_bytes > avail:
            raise MemoryError(
                f"host KV pool of {nbytes / 2**30:.1f} GiB does not fit: {avail / 2**30:.1f} GiB of host memory is "
                f"available and {self.reserve_bytes / 2**30:.0f} GiB is kept for the process; lower host_kv_bytes "
                f"(a suite's host_kv_gb)")
        self.nbytes = nbytes
        # The CPU allocator aligns to 64 bytes: one page more, and the region starts at the first page boundary.
        # The whole allocation is registered: torch's is_pinned() looks up the storage's start, not the view's.
        self._raw = torch.empty(max(nbytes, 1) + _ALIGN, dtype=torch.uint8)
        start = -self._raw.data_ptr() % _ALIGN
        self.base = self._raw[start:start + max(nbytes, 1)]
        self.huge_pages = huge_pages and advise_huge_pages(self._raw.data_ptr(), self._raw.numel())
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, min(16, os.cpu_count() or 1)))
        try:
            self._raw.zero_()  # fault the pages in on every core: cudaHostRegister then only locks them
        finally:
            torch.set_num_threads(threads)
        self._offset = 0
        ptr = self._raw.data_ptr()
        rc = torch.cuda.cudart().cudaHostRegister(ptr, self._raw.numel(), _REGISTER_PORTABLE_MAPPED)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of a {nbytes / 2**30:.1f} GiB host KV pool failed (cudaError "
                               f"{int(rc)}): the host cannot lock that much memory (ulimit -l, RAM); lower "
                               f"host_kv_bytes (a suite's host_kv_gb)")
        weakref.finalize(self, _unregister, ptr)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next ``shape`` x ``dtype`` tensor of the region (aligned to 4 KiB)."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = _aligned(self._offset)
        if start + nbytes > self.nbytes:
            raise ValueError(f"pinned region of {self.nbytes} bytes has no room for {nbytes} more at {start}")
        self._offset = start + nbytes
        return self.base[start:start + nbytes].view(dtype).view(shape)

    @staticmethod
    def bytes_for(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes a region needs for ``count`` tensors of ``shape`` x ``dtype`` carved by :meth:`take`."""
        return count * _aligned(math.prod(shape) * dtype.itemsize)
