"""Plain-PyTorch attention of one sequence: the reference every path shares (so dense and sparse references have
the same numerics), and its torch SDPA counterpart on CUDA. ``backend``: ``"auto"`` (SDPA on CUDA, the reference on
the CPU) or ``"ref"`` (the reference everywhere)."""

from __future__ import annotations

import torch


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of queries over one sequence's keys, with GQA.

    q: [nq, Hq, D]; k, v: [nk, Hkv, D]; allowed: [nq, nk] bool (True = attend) or None (all) -> [nq, Hq, D].
    Computed in float32.
    """
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    nq, d = q.shape[0], q.shape[2]
    qf = q.float().view(nq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * nq, d)  # [Hkv, g*nq, D]
    kf = k.float().permute(1, 2, 0)                                                  # [Hkv, D, nk]
    vf = v.float().permute(1, 0, 2)                                                  # [Hkv, nk, D]
    scores = torch.bmm(qf, kf).mul_(scale).view(hkv, g, nq, -1)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(hkv, g * nq, -1)
    out = torch.bmm(probs, vf).view(hkv, g, nq, d)
    return out.permute(2, 0, 1, 3).reshape(nq, hq, d).to(q.dtype)


def causal_allowed(num_queries: int, context_len: int, device: torch.device) -> torch.Tensor:
    """The last ``num_queries`` tokens of a ``context_len`` sequence attend causally: [nq, nk] bool."""
    q_pos = torch.arange(context_len - num_queries, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]


def attend_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The same contract as :func:`attend_ref` on torch SDPA (used on CUDA, where bit-parity with
    transformers' CPU float32 is not the goal): q [nq, Hq, D], k/v [nk, Hkv, D]."""
    out = sdpa_gqa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, attn_mask=allowed)
    return out.transpose(0, 1)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """torch SDPA with GQA on ``[..., H, n, D]`` tensors (``Hq`` a multiple of ``Hkv``).

    ``enable_gqa`` is only implemented by the flash and math kernels; flash needs half precision and no mask, so a
    float32 or masked call with ``enable_gqa`` runs the math kernel (scores materialised, several passes). On CUDA
    such a call repeats the K/V heads instead, which lets the memory-efficient kernel take it (float32, masks and
    ``is_causal`` supported). Same result either way; half precision without a mask keeps native GQA (flash)."""
    import torch.nn.functional as F

    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv and q.is_cuda and (attn_mask is not None or q.dtype not in (torch.float16, torch.bfloat16)):
        g = hq // hkv
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=hq != hkv)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           allowed: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Reference arithmetic on CPU (exact parity tests) and with ``backend="ref"``, SDPA on CUDA."""
    if q.is_cuda and backend != "ref":
        return attend_fast(q, k, v, scale, allowed)
    return attend_ref(q, k, v, scale, allowed)


_LOWER_RIGHT_FLASH: dict[tuple, bool] = {}


def _flash_lower_right(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float) -> torch.Tensor:
    """Flash attention with ``is_causal=True`` on [1, H, n, D] tensors: for nq < nk FlashAttention-2 aligns
    the causal diagonal to the bottom right (query i sees keys <= nk - nq + i), which is what chunked prefill
    needs; GQA is native (fewer K/V heads). The same call ``torch.nn.attention.bias.causal_lower_right``
    dispatches to."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, True, False, scale=scale)[0]


def _lower_right_flash_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the flash path applies (half precision, head_dim a multiple of 8 up to 256) and, checked once
    per (device, dtype, head_dim, group), computes the bottom-right causal mask: a build whose flash kernel
    aligned the diagonal differently would fall back to the explicit mask instead of giving wrong outputs."""
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256:
        return False
    key = (q.device, q.dtype, d, q.shape[1] // k.shape[1])
    ok = _LOWER_RIGHT_FLASH.get(key)
    if ok is None:
        import torch.nn.functional as F

        g = key[3]
        gen = torch.Generator(device=q.device).manual_seed(0)
        qs = torch.randn(1, 2 * g, 5, d, device=q.device, generator=gen).to(q.dtype)
        ks = torch.randn(1, 2, 37, d, device=q.device, generator=gen).to(q.dtype)
        vs = torch.randn(1, 2, 37, d, device=q.device, generator=gen).to(q.dtype)
        mask = causal_allowed(5, 37, q.device)
        try:
            got = _flash_lower_right(qs, ks, vs, d ** -0.5).float()
            want = F.scaled_dot_product_attention(qs.float(), ks.float().repeat_interleave(g, 1),
                                                  vs.float().repeat_interleave(g, 1), attn_mask=mask,
                                                  scale=d ** -0.5)
            ok = bool(((got - want).norm() / want.norm()) < 2e-2)
        except Exception:  # noqa: BLE001 - no usable flash kernel in this build: the masked path is correct
            ok = False
        _LOWER_RIGHT_FLASH[key] = ok
    return ok


def attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str = "auto"
                   ) -> torch.Tensor:
    """Causal attention of the LAST ``nq`` positions of an ``nk``-token sequence (a prefill chunk over its
    context: query i sees keys ``0 .. nk - nq + i``); q [nq, Hq, D], k/v [nk, Hkv, D] -> [nq, Hq, D].

    CPU, and ``backend="ref"``: :func:`attend_ref` with the explicit ``causal_allowed`` mask (bit-parity with
    transformers). CUDA:
    no ``[nq, nk]`` mask is built when it can be avoided: a chunk that is the whole sequence uses SDPA's
    ``is_causal``; a later chunk uses flash attention's bottom-right causal mode (memory O(nq + nk), never
    ``[Hq, nq, nk]`` scores); float32 (no flash) falls back to SDPA with the boolean mask. At float32 both SDPA calls
    run the memory-efficient kernel (:func:`sdpa_gqa`).
    """
    nq, nk = q.shape[0], k.shape[0]
    if not q.is_cuda or backend == "ref":
        return attend_ref(q, k, v, scale, causal_allowed(nq, nk, q.device) if nq > 1 else None)
    if nq == 1:
        return attend_fast(q, k, v, scale)
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if nq == nk:
        out = sdpa_gqa(q4, k4, v4, scale, is_causal=True)
    elif _lower_right_flash_ok(q, k):
        out = _flash_lower_right(q4, k4, v4, scale)
    else:
        out = sdpa_gqa(q4, k4, v4, scale, attn_mask=causal_allowed(nq, nk, q.device))
    return out[0].transpose(0, 1)
