"""The host KV pool's exact-size pinned region: sizes, carving, the clear error for a pool that cannot fit."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime.transfer.paged_kv import PagedKVCache
from oasiskv_runtime.transfer.host_memory import PinnedRegion, available_host_bytes


def test_a_pool_larger_than_host_memory_is_refused_by_name():
    avail = available_host_bytes()
    if avail is None:
        pytest.skip("no /proc/meminfo")
    with pytest.raises(MemoryError, match="host_kv_gb"):
        PinnedRegion(avail + (1 << 30))


def test_bytes_for_rounds_each_tensor_to_4k():
    assert PinnedRegion.bytes_for(3, (5, 16, 3, 7), torch.bfloat16) == 3 * 4096      # 3,360 bytes each
    assert PinnedRegion.bytes_for(2, (2, 1024), torch.float32) == 2 * 8192           # exact multiples stay


@pytest.mark.gpu
def test_pinned_pool_is_one_exact_region_of_disjoint_pinned_layers():
    shape = (37, 16, 3, 64)
    c = PagedKVCache(4, 37, 16, 3, 64, torch.bfloat16, "cpu", pin_memory=True, zero=False)
    assert c.region.nbytes == PinnedRegion.bytes_for(8, shape, torch.bfloat16)
    tensors = c.k + c.v
    assert all(t.shape == shape and t.is_pinned() and t.data_ptr() % 4096 == 0 for t in tensors)
    starts = sorted(t.data_ptr() for t in tensors)
    nbytes = tensors[0].numel() * 2
    assert all(b - a >= nbytes for a, b in zip(starts, starts[1:]))              # no two layers overlap
    for i, t in enumerate(tensors):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(tensors))
    # The GPU reads it zero-copy: a non_blocking upload sees the written values.
    assert torch.equal(c.k[2].to("cuda", non_blocking=True).cpu(), c.k[2])


def test_huge_page_advice_covers_the_aligned_part_only():
    from oasiskv_runtime.transfer.host_memory import advise_huge_pages, huge_page_bytes

    small = torch.empty(1 << 20, dtype=torch.uint8)
    assert not advise_huge_pages(small.data_ptr(), small.numel())  # no whole 2 MiB page inside
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off here")
    buf = torch.empty((64 << 20) + 4096, dtype=torch.uint8)
    ptr, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    start = ptr + (-ptr % (2 << 20))
    assert advise_huge_pages(ptr, buf.numel())
    # The kernel records the advice on the mapping (VmFlags "hg"), split at the aligned bounds: deterministic, where
    # whether faulting the pages in gets 2 MiB pages depends on the host's free memory at that moment (it did not,
    # once, on a loaded CI machine)
    assert "hg" in _vm_flags(start) and "hg" in _vm_flags(start + ((end - start) // (2 << 20) - 1) * (2 << 20))
    if start > ptr:
        assert "hg" not in _vm_flags(ptr)
    if (end - start) % (2 << 20):
        assert "hg" not in _vm_flags(end - 1)
    buf.fill_(1)
    assert huge_page_bytes() is not None


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of this process's mapping holding ``addr`` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")
