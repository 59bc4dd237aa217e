"""RMSNorm, and Qwen3's per-head q/k norm with rotary embedding, as one kernel each.

In plain PyTorch an RMSNorm is ~7 kernels (cast, square, mean, add, rsqrt, multiply, cast, scale) and rotary ~6
per tensor (negate, concatenate, three multiplies, add). A Qwen3 decoder layer runs four norms and two rotaries:
~40 of the ~75 main-stream kernels a decode step launches per layer, each a few microseconds of work, so a
replayed step spends much of its time between them (docs/benchmarks.md, "CUDA graphs").

Both kernels ask for the reference's roundings (casts after each product). On the H200 the norm gave the
reference's results (a rare last bit where the float32 sum of squares is added in another order); 24-27% of the
rotary results differed by one last bit of the products' magnitude, as if the products were not rounded before
the sum (the compiler's doing, not isolated; ``tests/test_norm_rope.py`` bounds it). The model with the kernels
gives the composition's greedy tokens on CUDA (same test file). The references:

* :func:`rms_norm_ref`: ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype)`` (transformers'
  order: normalise in float32, cast back, then scale).
* :func:`norm_rope_ref`: the optional per-head norm, then ``x * cos + rotate_half(x) * sin`` with each product and
  the sum rounded to the tensor's dtype, as the element-wise PyTorch ops do.

:func:`rms_norm` / :func:`norm_rope` take ``backend`` 'auto' (the kernel on CUDA when Triton loads, else the
reference), 'triton' or 'ref'. ``norm_rope`` reads a strided ``[T, H, D]`` view (the q or k columns of the fused
qkv projection's output) and returns a contiguous tensor.
"""
from __future__ import annotations


import torch

from oasiskv_runtime.ops.common import lazy_kernels, loads, next_pow2, on_device

__all__ = ["rms_norm", "rms_norm_ref", "norm_rope", "norm_rope_ref"]

triton = None
tl = None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (``weight`` [D] or None: no norm), cos / sin [T, D] -> [T, H, D]."""
    if weight is not None:
        x = rms_norm_ref(x, weight, eps)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _rms_norm_kernel(X, W, Y, s_x, N, eps, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        off = tl.arange(0, BLOCK)
        ok = off < N
        h = tl.load(X + r * s_x + off, mask=ok, other=0.0).to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
        y = (h * scale).to(X.dtype.element_ty).to(tl.float32)  # cast back to x's dtype, then scale
        w = tl.load(W + off, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + r * N + off, (w * y).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _norm_rope_kernel(X, W, COS, SIN, Y, s_xt, s_xh, H, eps, HAS_NORM: tl.constexpr, HALF: tl.constexpr,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)      # t * H + h
        t = row // H
        hd = row % H
        off = tl.arange(0, BLOCK)
        ok = off < HALF
        dt = Y.dtype.element_ty
        src = X + t * s_xt + hd * s_xh
        x1 = tl.load(src + off, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + off, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            scale = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
            w1 = tl.load(W + off, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(W + HALF + off, mask=ok, other=0.0).to(tl.float32)
            x1 = (w1 * (x1 * scale).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * scale).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(COS + t * 2 * HALF + off, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t * 2 * HALF + HALF + off, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t * 2 * HALF + off, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t * 2 * HALF + HALF + off, mask=ok, other=0.0).to(tl.float32)
        # Casts as `x * cos + rotated * sin` rounds in PyTorch; on the H200 the results match one rounding instead.
        y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        dst = Y + row * 2 * HALF
        tl.store(dst + off, y1.to(dt), mask=ok)
        tl.store(dst + HALF + off, y2.to(dt), mask=ok)

    from types import SimpleNamespace
    return SimpleNamespace(rms_norm=_rms_norm_kernel, norm_rope=_norm_rope_kernel)


def _use_kernel(backend: str, x: torch.Tensor) -> bool:
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    return backend == "triton" or (backend == "auto" and x.is_cuda and loads(_kernels))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension (any leading shape); see the module docstring."""
    if not _use_kernel(backend, x) or x.numel() == 0:
        return rms_norm_ref(x, weight, eps)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    with on_device(x):
        _kernels().rms_norm[(x2.shape[0],)](x2, weight, y, x2.stride(0), n, eps, BLOCK=next_pow2(n),
                                           num_warps=4 if n <= 1024 else 8)
    return y.view(x.shape)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              backend: str = "auto") -> torch.Tensor:
    """The optional per-head RMSNorm then rotary embedding of ``x`` [T, H, D] (last stride 1; the token and
    head strides may be anything) with ``cos`` / ``sin`` [T, D]; a new contiguous [T, H, D]."""
    if not _use_kernel(backend, x) or x.numel() == 0:
        return norm_rope_ref(x, weight, eps, cos, sin)
    t, h, d = x.shape
    if d % 2 or x.stride(-1) != 1:
        raise ValueError(f"norm_rope: x must be [T, H, D] with an even D and unit last stride, got {tuple(x.shape)}"
                         f" strides {x.stride()}")
    if weight is not None and weight.dtype != x.dtype:
        raise ValueError(f"norm_rope: weight dtype {weight.dtype} differs from x's {x.dtype}")
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    with on_device(x):
        _kernels().norm_rope[(t * h,)](x, weight if weight is not None else x, cos, sin, y, x.stride(0),
                                       x.stride(1), h, eps, HAS_NORM=weight is not None, HALF=d // 2,
                                       BLOCK=next_pow2(d // 2), num_warps=1)
    return y
