"""Plain-PyTorch attention used by every reference path, so dense and sparse references share numerics."""

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
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Reference arithmetic on CPU (exact parity tests), SDPA on CUDA."""
    if q.is_cuda:
        return attend_fast(q, k, v, scale, allowed)
    return attend_ref(q, k, v, scale, allowed)
