"""Zero-copy (UVA) gather of per-head KV blocks: pinned host pool -> GPU cache, ONE launch.

SPEC mechanism items 3-5 (the KV transfer stage). For each i::

    dev_k[dst_blocks[i], :, heads[i], :] = host_k[src_blocks[i], :, heads[i], :]
    dev_v[dst_blocks[i], :, heads[i], :] = host_v[src_blocks[i], :, heads[i], :]

``host_k/host_v``: ``[num_host_blocks, block_size, Hkv, D]`` pinned CPU tensors (a CUDA
tensor is accepted too, for tests); ``dev_k/dev_v``: ``[num_dev_blocks, block_size, Hkv, D]``
CUDA tensors. The GPU reads the pinned pages straight over PCIe (zero-copy): no staging
copy and never one copy call per block (measured 70x slower, FACTS.md). Duplicate
``(dst_blocks[i], heads[i])`` pairs are undefined (last writer wins, in no fixed order).

Two kernels, one launch each (grid = n copies x {K, V}):

* ``"triton"`` (default): a Triton copy kernel. Triton refuses plain CPU tensors only
  because its launcher asks the driver for the device address of each pointer
  argument (``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``), which fails
  for pageable memory. Pinned (``cudaHostAlloc``, hence mapped under UVA) memory has a
  device address, so we hand the kernel a tiny pointer wrapper (``data_ptr`` + ``dtype``,
  the duck type Triton documents) and the launcher resolves it to the mapped address.
  Pageable host tensors are rejected with a clear error.
* ``"cuda"``: ``csrc/uva_gather.cu``, plain CUDA C compiled with ``nvcc -arch=sm_90``
  (no torch headers, seconds to build) into a shared library loaded with ctypes; it maps
  the host pointers with ``cudaHostGetDevicePointer`` and copies in 16-byte units with
  several loads in flight per thread. Used when Triton is missing or refuses the
  pointer, and kept as a second implementation for the benchmark.

``uva_gather_ref`` is the plain-torch reference: index_select on the host, one bulk
``.to(device)``, ``index_copy_`` into the flat ``[blocks * block_size * Hkv, D]`` view.

``uva_gather_blocks`` (reference ``uva_gather_blocks_ref``) reads a sequence's first tokens from
whole blocks of the pool into a contiguous ``[rows, Hkv, D]`` device tensor with the same kernel:
what prefill attention over a host-pool context reads, without a host sync.

Every function here takes an optional :class:`PoolTier`: a pool whose block ids run past the host part into a
second tensor (the device tier of ``CacheConfig.device_tier``: full-KV blocks kept in the device KV budget once
the host pool is full). Ids ``>= tier.first`` address block ``id - tier.first`` of ``tier.k`` / ``tier.v``. On
CUDA the Triton gather reads both parts in one launch (each copy from its own part); the CUDA C kernel and the
references take one part at a time over ``-1``-masked id lists (no host sync to split them).
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from oasiskv_runtime.config import GATHER_COPIES, GATHER_CTAS, GATHER_HINTS
from oasiskv_runtime.ops.common import build_csrc, lazy_kernels, loads, next_pow2, on_device

__all__ = ["PoolTier", "uva_gather", "uva_gather_ref", "uva_gather_blocks", "uva_gather_blocks_ref",
           "uva_scatter_rows", "uva_scatter_rows_ref", "build_cuda_extension"]

triton = None
tl = None


_next_pow2 = next_pow2


class PoolTier(NamedTuple):
    """The blocks of a pool past its host part: block id ``first + j`` is block ``j`` of ``k`` / ``v``
    (``[num_blocks, block_size, Hkv, D]``, on the device in the engine)."""

    k: torch.Tensor
    v: torch.Tensor
    first: int


def split_ids(ids: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids below first, ids at or past first minus first)``, each ``-1`` where the id belongs to the other part
    (an id of ``-1`` stays ``-1`` in both): two fixed-size lists for one masked launch each."""
    ids = ids.to(torch.int64)
    neg = torch.full_like(ids, -1)
    return torch.where(ids < first, ids, neg), torch.where(ids >= first, ids - first, neg)


def _check(host_k, host_v, dev_k, dev_v, src_blocks, dst_blocks, heads):
    if host_k.shape != host_v.shape or dev_k.shape != dev_v.shape:
        raise ValueError("host_k/host_v and dev_k/dev_v must be equal-shaped")
    if host_k.dim() != 4 or host_k.shape[1:] != dev_k.shape[1:]:
        raise ValueError(f"host blocks {tuple(host_k.shape)} and device blocks "
                         f"{tuple(dev_k.shape)} must share [block_size, Hkv, D]")
    if host_k.dtype != dev_k.dtype or host_v.dtype != dev_v.dtype:
        raise ValueError("host and device caches must share a dtype")
    n = src_blocks.numel()
    if dst_blocks.numel() != n or heads.numel() != n:
        raise ValueError("src_blocks, dst_blocks and heads must have one entry per copy")
    return n


def uva_gather_ref(host_k, host_v, dev_k, dev_v, src_blocks, dst_blocks, heads, tier: PoolTier | None = None) -> None:
    """Reference: gather on the source device, one bulk transfer, index_copy_ on the target (per part of a tiered
    pool)."""
    if tier is not None:
        src_host, src_tier = split_ids(src_blocks, tier.first)
        uva_gather_ref(host_k, host_v, dev_k, dev_v, src_host, dst_blocks, heads)
        uva_gather_ref(tier.k, tier.v, dev_k, dev_v, src_tier, dst_blocks, heads)
        return
    n = _check(host_k, host_v, dev_k, dev_v, src_blocks, dst_blocks, heads)
    keep = src_blocks >= 0  # entries with src = -1 are unused slots of a fixed-size plan
    if not bool(keep.all()):
        src_blocks, dst_blocks, heads = src_blocks[keep], dst_blocks[keep.to(dst_blocks.device)], \
            heads[keep.to(heads.device)]
        n = int(src_blocks.numel())
    if n == 0:
        return
    _, BS, H, D = host_k.shape
    t = torch.arange(BS, dtype=torch.int64)

    def flat_rows(blocks, hd, device):
        blocks = blocks.to(device, torch.int64).view(n, 1)
        hd = hd.to(device, torch.int64).view(n, 1)
        return ((blocks * BS + t.to(device).view(1, BS)) * H + hd).reshape(-1)

    s_idx = flat_rows(src_blocks, heads, host_k.device)
    d_idx = flat_rows(dst_blocks, heads, dev_k.device)
    for h_t, d_t in ((host_k, dev_k), (host_v, dev_v)):
        vals = h_t.reshape(-1, D).index_select(0, s_idx).to(d_t.device)
        d_t.view(-1, D).index_copy_(0, d_idx, vals)


# --------------------------------------------------------------------------------------
# Triton path
# --------------------------------------------------------------------------------------
class _MappedPtr:
    """Pointer argument for Triton: the launcher resolves ``data_ptr()`` of pinned host
    memory to its UVA device address (cuPointerGetAttribute)."""

    __slots__ = ("tensor", "dtype")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _uva_gather_kernel(HK, HV, TK, TV, DK, DV, SRC, DST, HEADS, COUNT, n, groups, programs, first,
                           hs_b, hs_t, hs_h, ds_b, ds_t, ds_h, BS: tl.constexpr,
                           D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr,
                           TIER: tl.constexpr, LCM: tl.constexpr, LEV: tl.constexpr, SCM: tl.constexpr,
                           HAS_COUNT: tl.constexpr):
        # A grid of `programs` CTAs, each looping over groups of C copies: group pid, pid + programs, ... The
        # C copies' K and V tiles are all loaded before any is stored, so a CTA keeps 2 C tiles of reads in
        # flight: a PCIe read stalls its CTA for microseconds, and a CTA with one copy in flight spends most of
        # its time waiting (on the H200 the decode prefetch moved ~25 GB/s that way under the step's kernels).
        # A small grid leaves the other SMs to the foreground kernels. TIER: ids >= first are block id - first
        # of TK / TV (same strides as HK / HV), in the same pass (masked loads of the other part move nothing),
        # so a tiered pool costs one launch, not one per part. LCM / LEV / SCM: the hints of GATHER_HINTS.
        c = tl.arange(0, C)
        r = tl.arange(0, ROWS)
        d = tl.arange(0, D_PAD)
        g = tl.program_id(0)
        if HAS_COUNT:  # a compacted plan: only its first COUNT entries are copies (read on the device)
            n = tl.minimum(tl.load(COUNT).to(tl.int32), n)
            groups = (n + C - 1) // C
        while g < groups:  # groups = cdiv(n, C) (a while loop: Triton's interpreter cannot run a range loop
            i = g * C + c  # over runtime scalars)
            g += programs
            live = i < n
            src = tl.load(SRC + i, mask=live, other=-1).to(tl.int64)
            dst = tl.load(DST + i, mask=live, other=0).to(tl.int64)
            hd = tl.load(HEADS + i, mask=live, other=0).to(tl.int64)
            valid = src >= 0  # fixed-size plans mark unused entries with src = -1 (no host sync to compact)
            if TIER:
                in_tier = src >= first
                src = tl.where(in_tier, src - first, src)
            src = tl.maximum(src, 0)
            dst = tl.maximum(dst, 0)
            s_base = (src * hs_b + hd * hs_h)[:, None, None]
            d_base = (dst * ds_b + hd * ds_h)[:, None, None]
            for r0 in tl.static_range(0, BS, ROWS):
                rr = r0 + r
                m = valid[:, None, None] & (rr < BS)[None, :, None] & (d < D)[None, None, :]
                s_off = s_base + (rr * hs_t)[None, :, None] + d[None, None, :]
                d_off = d_base + (rr * ds_t)[None, :, None] + d[None, None, :]
                if TIER:
                    mt = m & in_tier[:, None, None]
                    mh = m & ~in_tier[:, None, None]
                    xk = tl.where(mt, tl.load(TK + s_off, mask=mt),
                                  tl.load(HK + s_off, mask=mh, cache_modifier=LCM, eviction_policy=LEV))
                    xv = tl.where(mt, tl.load(TV + s_off, mask=mt),
                                  tl.load(HV + s_off, mask=mh, cache_modifier=LCM, eviction_policy=LEV))
                else:
                    xk = tl.load(HK + s_off, mask=m, cache_modifier=LCM, eviction_policy=LEV)
                    xv = tl.load(HV + s_off, mask=m, cache_modifier=LCM, eviction_policy=LEV)
                tl.store(DK + d_off, xk, mask=m, cache_modifier=SCM)
                tl.store(DV + d_off, xv, mask=m, cache_modifier=SCM)

    @triton.jit
    def _uva_scatter_kernel(SRC_K, SRC_V, HK, HV, TK, TV, DST_ROWS, n, programs, first_row, W: tl.constexpr,
                            W_PAD: tl.constexpr, TIER: tl.constexpr):
        # Token rows i = 0 .. n-1 ([Hkv * D] contiguous), device -> pinned host, written over UVA; `programs` CTAs
        # each loop over rows pid, pid + programs, ... (a bounded grid leaves the SMs to kernels running beside
        # it; a while loop, which Triton's interpreter can run). Rows of -1 are skipped. TIER: rows >= first_row
        # are row - first_row of TK / TV, in the same launch.
        c = tl.arange(0, W_PAD)
        m = c < W
        i = tl.program_id(0)
        while i < n:
            d = tl.load(DST_ROWS + i).to(tl.int64)
            mm = m & (d >= 0)
            xk = tl.load(SRC_K + i.to(tl.int64) * W + c, mask=mm)
            xv = tl.load(SRC_V + i.to(tl.int64) * W + c, mask=mm)
            if TIER:
                in_t = d >= first_row
                d = tl.maximum(tl.where(in_t, d - first_row, d), 0)
                tl.store(TK + d * W + c, xk, mask=mm & in_t)
                tl.store(TV + d * W + c, xv, mask=mm & in_t)
                tl.store(HK + d * W + c, xk, mask=mm & ~in_t)
                tl.store(HV + d * W + c, xv, mask=mm & ~in_t)
            else:
                d = tl.maximum(d, 0)
                tl.store(HK + d * W + c, xk, mask=mm)
                tl.store(HV + d * W + c, xv, mask=mm)
            i += programs

    from types import SimpleNamespace
    return SimpleNamespace(gather=_uva_gather_kernel, scatter=_uva_scatter_kernel)


def _triton_available() -> bool:
    return loads(_kernels)


def _index(t: torch.Tensor, device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()


def _host_ptrs(host_k, host_v, device_side):
    """The host pool's tensors as the kernel's pointer arguments; ``device_side``: the kernel's device operand."""
    if host_k.is_cuda or not device_side.is_cuda:  # a CUDA pool, or Triton's interpreter (all on the CPU)
        return host_k, host_v
    if not (host_k.is_pinned() and host_v.is_pinned()):
        raise ValueError("uva_gather: host_k/host_v must be pinned (pin_memory()) for zero-copy")
    return _MappedPtr(host_k), _MappedPtr(host_v)


def _gather_triton(host_k, host_v, dev_k, dev_v, src, dst, heads, n, programs, copies=GATHER_COPIES,
                   tier: PoolTier | None = None, hint: str = "", count: torch.Tensor | None = None):
    K = _kernels()
    _, BS, H, D = host_k.shape
    if host_k.stride() != host_v.stride() or dev_k.stride() != dev_v.stride():
        raise ValueError("K and V tensors must share strides")
    if host_k.stride(-1) != 1 or dev_k.stride(-1) != 1:
        raise ValueError("unit stride on head_dim required")
    if tier is not None and (tier.k.stride() != host_k.stride() or tier.v.stride() != host_k.stride()):
        raise ValueError("a tier read in the same launch must share the host part's strides")
    D_PAD = _next_pow2(D)
    C = 1 if programs <= 0 else _next_pow2(max(1, copies))  # one CTA per copy keeps one copy per CTA
    rows = max(1, min(_next_pow2(BS), 8192 // max(D_PAD * C, 1)))  # <= 8K elements per tile
    groups = -(-n // C)
    grid = groups if programs <= 0 else min(groups, programs)
    lcm, lev, scm = GATHER_HINTS[hint]
    hk, hv = _host_ptrs(host_k, host_v, dev_k)
    tk, tv = (tier.k, tier.v) if tier is not None else (hk, hv)
    with on_device(dev_k):
        K.gather[(grid,)](hk, hv, tk, tv, dev_k, dev_v, src, dst, heads, count if count is not None else src, n, groups,
                          grid, tier.first if tier else 0,
                          host_k.stride(0), host_k.stride(1), host_k.stride(2),
                          dev_k.stride(0), dev_k.stride(1), dev_k.stride(2), BS,
                          D=D, D_PAD=D_PAD, ROWS=rows, C=C, TIER=tier is not None, LCM=lcm, LEV=lev, SCM=scm,
                          HAS_COUNT=count is not None, num_warps=4 if C == 1 else 8)


# --------------------------------------------------------------------------------------
# CUDA C path (nvcc + ctypes)
# --------------------------------------------------------------------------------------
def build_cuda_extension() -> ctypes.CDLL:
    """``csrc/uva_gather.cu`` built and loaded (:func:`~oasiskv_runtime.ops.common.build_csrc`), its entry typed."""
    return build_csrc("uva_gather", entries={"oasis_uva_gather": [ctypes.c_uint64] * 7 + [ctypes.c_int64] * 7
                                             + [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint64]})


def _gather_cuda(host_k, host_v, dev_k, dev_v, src, dst, heads, n):
    dll = build_cuda_extension()
    _, BS, H, D = host_k.shape
    if host_k.stride() != host_v.stride() or dev_k.stride() != dev_v.stride():
        raise ValueError("K and V tensors must share strides")
    if host_k.stride(-1) != 1 or dev_k.stride(-1) != 1:
        raise ValueError("unit stride on head_dim required")
    if not host_k.is_cuda and not (host_k.is_pinned() and host_v.is_pinned()):
        raise ValueError("uva_gather: host_k/host_v must be pinned (pin_memory()) for zero-copy")
    es = host_k.element_size()
    hs = [s * es for s in host_k.stride()[:3]]
    ds = [s * es for s in dev_k.stride()[:3]]
    with torch.cuda.device(dev_k.device):
        stream = torch.cuda.current_stream(dev_k.device).cuda_stream
        rc = dll.oasis_uva_gather(host_k.data_ptr(), host_v.data_ptr(), dev_k.data_ptr(),
                                  dev_v.data_ptr(), src.data_ptr(), dst.data_ptr(),
                                  heads.data_ptr(), n, *hs, *ds, BS, D * es,
                                  1 if host_k.is_cuda else 0, stream)
    if rc != 0:
        raise RuntimeError(f"oasis_uva_gather failed with cudaError {rc}")


_PREFERRED = ("triton", "cuda")


def _gather_parts(host_k, host_v, dev_k, dev_v, src_blocks, dst_blocks, heads, tier: PoolTier, backend: str) -> str:
    """A tiered pool's gather one part at a time, each over a ``-1``-masked id list (no host sync to split)."""
    src_host, src_tier = split_ids(src_blocks, tier.first)
    used = uva_gather(host_k, host_v, dev_k, dev_v, src_host, dst_blocks, heads, backend=backend)
    uva_gather(tier.k, tier.v, dev_k, dev_v, src_tier, dst_blocks, heads, backend=backend)
    return used


def uva_gather(host_k: torch.Tensor, host_v: torch.Tensor, dev_k: torch.Tensor,
               dev_v: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor,
               heads: torch.Tensor, *, backend: str = "auto", programs: int = GATHER_CTAS,
               copies: int = GATHER_COPIES, tier: PoolTier | None = None, hint: str = "",
               count: torch.Tensor | None = None) -> str:
    """Copy the listed (block, head) slices host -> device in one kernel launch (a tiered pool too, with Triton).

    ``backend``: ``"auto"`` (Triton, else the CUDA C kernel; the reference when
    ``dev_k`` is not on CUDA), ``"triton"``, ``"cuda"`` or ``"ref"``. Index tensors may
    live on the host or the device (int32/int64). ``programs``: CTAs in the Triton kernel's grid, each
    looping over its share of the copies (``<= 0``: one CTA per copy, the CUDA C kernel's layout); ``copies``:
    how many copies each of them has in flight at once (a power of two; 1 with one CTA per copy). The CUDA C
    kernel and the reference take a tiered pool one part at a time. ``hint``: a key of
    ``oasiskv_runtime.config.GATHER_HINTS`` (the Triton kernel's cache hints; the other backends ignore it).
    ``count``: a 0-d int tensor on the device, the number of leading entries that are copies (a compacted plan,
    :func:`oasiskv_runtime.ops.select_plan.select_plan` with ``row_cap``): the Triton kernel reads it and walks
    only those; the other backends walk every entry, so the entries past it must be ``src = -1`` too.
    Returns the backend used.
    """
    if hint not in GATHER_HINTS:
        raise ValueError(f"unknown gather hint {hint!r}; one of {sorted(GATHER_HINTS)}")
    if tier is not None:
        _check(tier.k, tier.v, dev_k, dev_v, src_blocks, dst_blocks, heads)
        one_pass = (backend in ("auto", "triton") and dev_k.is_cuda and _triton_available()
                    and tier.k.stride() == host_k.stride() == tier.v.stride())
        if not one_pass:
            return _gather_parts(host_k, host_v, dev_k, dev_v, src_blocks, dst_blocks, heads, tier, backend)
    n = _check(host_k, host_v, dev_k, dev_v, src_blocks, dst_blocks, heads)
    if backend not in ("auto", "triton", "cuda", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    if backend == "ref" or (backend == "auto" and not dev_k.is_cuda):
        uva_gather_ref(host_k, host_v, dev_k, dev_v, src_blocks, dst_blocks, heads)
        return "ref"
    if n == 0:
        return backend
    dev = dev_k.device
    src, dst, hd = _index(src_blocks, dev), _index(dst_blocks, dev), _index(heads, dev)
    order = _PREFERRED if backend == "auto" else (backend,)
    err = None
    for be in order:
        try:
            if be == "triton":
                if backend == "auto" and not _triton_available():
                    continue
                _gather_triton(host_k, host_v, dev_k, dev_v, src, dst, hd, n, programs, copies, tier, hint, count)
            elif tier is not None:
                return _gather_parts(host_k, host_v, dev_k, dev_v, src, dst, hd, tier, "cuda")
            else:
                _gather_cuda(host_k, host_v, dev_k, dev_v, src, dst, hd, n)
            return be
        except ValueError as e:  # a refused pointer: try the next backend
            if "pinned" in str(e) or backend != "auto":
                raise
            err = e
    raise RuntimeError(f"uva_gather: no backend could run ({err})")


def _rows_out(host_k: torch.Tensor, num_tokens: int, out_rows: int | None) -> int:
    rows = num_tokens if out_rows is None else int(out_rows)
    if num_tokens < 0 or rows < num_tokens:
        raise ValueError(f"out_rows ({out_rows}) must be >= num_tokens ({num_tokens}) >= 0")
    return rows


def _select_blocks(pool: torch.Tensor, tier_t: torch.Tensor | None, first: int, ids: torch.Tensor,
                   device: torch.device) -> torch.Tensor:
    """Blocks ``ids`` of a (possibly tiered) pool as ``[n, block_size, Hkv, D]`` on ``device``."""
    if tier_t is None:
        return pool.index_select(0, ids.to(pool.device, torch.int64)).to(device)
    ids = ids.to("cpu", torch.int64)
    out = torch.empty((ids.numel(), *pool.shape[1:]), dtype=pool.dtype, device=device)
    in_tier = ids >= first
    for part, t, idx in ((~in_tier, pool, ids), (in_tier, tier_t, ids - first)):
        pos = part.nonzero().flatten()
        if pos.numel():
            out[pos.to(device)] = t.index_select(0, idx[pos].to(t.device)).to(device)
    return out


def uva_gather_blocks_ref(host_k: torch.Tensor, host_v: torch.Tensor, blocks: torch.Tensor, num_tokens: int,
                          out_rows: int | None = None, tier: PoolTier | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`uva_gather_blocks`: ``index_select`` of whole blocks where the pool (each part of a
    tiered one) lives, one bulk ``.to(blocks.device)``; rows ``>= num_tokens`` of the result are left unset."""
    rows = _rows_out(host_k, num_tokens, out_rows)
    _, BS, H, D = host_k.shape
    nb = -(-num_tokens // BS)
    if nb > blocks.numel():
        raise ValueError(f"{num_tokens} tokens need {nb} blocks, got {blocks.numel()}")
    ids = blocks[:nb]
    out = []
    for h, t in ((host_k, tier and tier.k), (host_v, tier and tier.v)):
        vals = _select_blocks(h, t, tier.first if tier else 0, ids, blocks.device).flatten(0, 1)[:num_tokens]
        if rows > num_tokens:
            buf = torch.empty((rows, H, D), dtype=h.dtype, device=blocks.device)
            buf[:num_tokens] = vals
            vals = buf
        out.append(vals)
    return out[0], out[1]


def uva_gather_blocks(host_k: torch.Tensor, host_v: torch.Tensor, blocks: torch.Tensor, num_tokens: int,
                      out_rows: int | None = None, *, backend: str = "auto", tier: PoolTier | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ``num_tokens`` keys and values, read from whole blocks of a pinned host pool, as
    contiguous ``[out_rows, Hkv, D]`` tensors on ``blocks.device`` (rows ``>= num_tokens`` are left unset, so
    a caller can append rows it already holds without a concatenation).

    ``host_k/host_v``: ``[num_blocks, block_size, Hkv, D]``; ``blocks``: the sequence's block table (at least
    ``ceil(num_tokens / block_size)`` entries; int64/int32, on the target device). On CUDA this is ONE
    :func:`uva_gather` launch (one (block, head) copy per program, read straight from pinned memory over
    PCIe), ordered on the current stream: no host synchronisation and no host-side read of the pool, so GPU
    writes to the pool earlier on the stream (:func:`uva_scatter_rows`) are seen. ``backend``: as
    :func:`uva_gather` (``"auto"`` on a CPU ``blocks`` is the reference).
    """
    rows = _rows_out(host_k, num_tokens, out_rows)
    if backend == "ref" or (backend == "auto" and not blocks.is_cuda):
        return uva_gather_blocks_ref(host_k, host_v, blocks, num_tokens, out_rows, tier)
    _, BS, H, D = host_k.shape
    dev = blocks.device
    nb = -(-num_tokens // BS)
    if nb > blocks.numel():
        raise ValueError(f"{num_tokens} tokens need {nb} blocks, got {blocks.numel()}")
    alloc = max(nb, -(-rows // BS))  # whole blocks are copied: room for the last one's unused rows
    out_k = torch.empty((alloc, BS, H, D), dtype=host_k.dtype, device=dev)
    out_v = torch.empty((alloc, BS, H, D), dtype=host_v.dtype, device=dev)
    if nb:
        src = blocks[:nb].to(torch.int64)[:, None].expand(nb, H).reshape(-1)
        dst = torch.arange(nb, device=dev)[:, None].expand(nb, H).reshape(-1)
        heads = torch.arange(H, device=dev)[None, :].expand(nb, H).reshape(-1)
        uva_gather(host_k, host_v, out_k, out_v, src, dst, heads, backend=backend, tier=tier)
    return out_k.view(-1, H, D)[:rows], out_v.view(-1, H, D)[:rows]


def uva_scatter_rows_ref(k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor,
                         dst_rows: torch.Tensor, tier: PoolTier | None = None) -> None:
    """Reference: ``host.view(-1, Hkv, D)[dst_rows[i]] = k[i]`` for K and V (any devices); rows of ``-1`` are
    skipped, rows past the host part of a tiered pool go to its tier."""
    if tier is not None:
        rows_host, rows_tier = split_ids(dst_rows, tier.first * host_k.shape[1])
        uva_scatter_rows_ref(k, v, host_k, host_v, rows_host)
        uva_scatter_rows_ref(k, v, tier.k, tier.v, rows_tier)
        return
    h, d = host_k.shape[-2], host_k.shape[-1]
    rows = dst_rows.to(host_k.device, torch.int64)
    keep = rows >= 0
    if not bool(keep.all()):
        k, v, rows = k[keep.to(k.device)], v[keep.to(v.device)], rows[keep]
    host_k.view(-1, h, d).index_copy_(0, rows, k.to(host_k.device, host_k.dtype))
    host_v.view(-1, h, d).index_copy_(0, rows, v.to(host_v.device, host_v.dtype))


def _scatter_triton(k, v, host_k, host_v, dst_rows, programs, tier: PoolTier | None) -> None:
    """One launch of the scatter kernel (the caller checked the tensors); ``tier`` in the same pass."""
    n = k.shape[0]
    kk, vv = k.contiguous(), v.contiguous()
    w = kk.shape[1] * kk.shape[2]
    K = _kernels()
    hk, hv = _host_ptrs(host_k, host_v, k)
    tk, tv = (tier.k, tier.v) if tier is not None else (hk, hv)
    with on_device(k):
        grid = min(n, programs) if programs > 0 else n
        K.scatter[(grid,)](kk, vv, hk, hv, tk, tv, _index(dst_rows, k.device), n, grid,
                           tier.first * host_k.shape[1] if tier is not None else 0,
                           W=w, W_PAD=_next_pow2(w), TIER=tier is not None, num_warps=4)


def uva_scatter_rows(k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor,
                     dst_rows: torch.Tensor, programs: int = 0, tier: PoolTier | None = None,
                     backend: str = "auto") -> None:
    """Write token rows ``k, v: [n, Hkv, D]`` (CUDA) into a pinned host pool viewed as ``[rows, Hkv, D]`` with
    one kernel launch (a tiered pool too: rows past the host part go to the tier in the same pass) and no host
    synchronisation (the GPU writes over UVA). ``programs``: CTAs in the grid, each looping over its share of
    the rows (0: one per row). Rows of ``-1`` are skipped. Falls back to the reference for CPU tensors and with
    ``backend="ref"``."""
    if backend not in ("auto", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    n = k.shape[0]
    if n == 0:
        return
    mapped = host_k.is_cuda or host_k.is_pinned()
    if backend == "ref" or not k.is_cuda or not mapped or not _triton_available():
        uva_scatter_rows_ref(k, v, host_k, host_v, dst_rows, tier=tier)
        return
    if tier is not None and not (tier.k.is_contiguous() and tier.v.is_contiguous()):
        rows_host, rows_tier = split_ids(dst_rows, tier.first * host_k.shape[1])
        uva_scatter_rows(k, v, host_k, host_v, rows_host, programs)
        uva_scatter_rows(k, v, tier.k, tier.v, rows_tier, programs)
        return
    _scatter_triton(k, v, host_k, host_v, dst_rows, programs, tier)
