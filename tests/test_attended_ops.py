"""The attention feedback's two one-launch ops (``ops/attended.py``): each reference against a plain loop of its
definition, each Triton kernel against its reference on fresh random inputs with odd sizes (CUDA and Triton's
interpreter: ``tests/kernel_devices.py``)."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime.ops.attended import attended_topk, attended_topk_ref, keep_blocks_, keep_blocks_ref_
from tests.kernel_devices import KERNEL_DEVICES

NEG = float("-inf")


def _slot_inputs(seed: int, B=5, hkv=3, g=5, N=37, device="cpu"):
    """Random per-slot log-sum-exps ``[B, Hkv, g, N]`` with empty slots (``-inf`` for the whole group, their block
    ``-1``), one (request, head) with nothing present, and the logical blocks behind the slots."""
    gen = torch.Generator().manual_seed(seed)
    lse = torch.randn(B, hkv, g, N, generator=gen) * 3
    logical = torch.randperm(4 * N, generator=gen)[:N].repeat(B, hkv, 1).contiguous()
    empty = torch.rand(B, hkv, N, generator=gen) < 0.2
    empty[1, 2] = True
    lse.masked_fill_(empty[:, :, None], NEG)
    logical.masked_fill_(empty, -1)
    return lse.to(device), logical.to(device)


def _attended_loop(lse: torch.Tensor, logical: torch.Tensor, m: int, n: int) -> list:
    """Per request and KV head: each query head's softmax over the first n slots' log-sum-exps, summed over the
    group; the m present blocks with the most of it, most first, then -1."""
    out = []
    for b in range(lse.shape[0]):
        row = []
        for h in range(lse.shape[1]):
            x = lse[b, h, :, :n].double()
            present = [j for j in range(n) if x[0, j] > NEG]
            mass = {j: sum(float(torch.exp(x[i, j] - torch.logsumexp(x[i], 0))) for i in range(x.shape[0]))
                    for j in present}
            best = sorted(present, key=lambda j: -mass[j])[:m]
            row.append([int(logical[b, h, j]) for j in best] + [-1] * (m - len(best)))
        out.append(row)
    return out


@pytest.mark.parametrize("m,n", [(3, 37), (7, 36), (40, 37)])  # n < N: a trailing gap column left out
def test_attended_topk_ref_is_the_loop(m, n):
    lse, logical = _slot_inputs(0)
    got = attended_topk_ref(lse, logical, m, n)
    assert got.dtype == torch.int64 and got.shape == (5, 3, m)
    assert got.tolist() == _attended_loop(lse, logical, m, n)
    assert (got[1, 2] == -1).all()                          # nothing present there


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("seed,m,n,g", [(1, 7, 37, 5), (2, 40, 36, 3), (3, 1, 37, 1), (4, 16, 37, 4)])
def test_attended_topk_kernel_matches_ref(device, seed, m, n, g):
    lse, logical = _slot_inputs(seed, g=g, device=device)
    got = attended_topk(lse, logical, m, n, backend="triton")
    assert torch.equal(got, attended_topk_ref(lse, logical, m, n))
    with pytest.raises(ValueError, match="n <= N"):
        attended_topk(lse, logical, m, lse.shape[-1] + 1, backend="triton")


def _keep_inputs(seed: int, B=4, hkv=3, J=53, M=9, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, hkv, J, generator=gen)
    nc = torch.randint(1, J + 1, (B,), generator=gen)
    scores.masked_fill_(torch.arange(J).view(1, 1, J) >= nc.view(B, 1, 1), NEG)       # past the candidates
    keep = torch.randint(-1, J + 5, (B, hkv, M), generator=gen)                        # -1, past J, duplicates
    keep[0, 0, :2] = 3
    return scores.to(device), keep.to(device)


def test_keep_blocks_ref_raises_exactly_the_named_candidates():
    scores, keep = _keep_inputs(0)
    got = keep_blocks_ref_(scores.clone(), keep)
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            named = {int(x) for x in keep[b, h] if 0 <= x < scores.shape[-1] and scores[b, h, int(x)] > NEG}
            for j in range(scores.shape[-1]):
                assert float(got[b, h, j]) == (float("inf") if j in named else float(scores[b, h, j]))
    s2 = scores.clone()
    assert keep_blocks_ref_(s2, keep) is s2                 # in place


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("seed,J,M", [(1, 53, 9), (2, 7, 16), (3, 300, 1)])
def test_keep_blocks_kernel_matches_ref(device, seed, J, M):
    scores, keep = _keep_inputs(seed, J=J, M=M, device=device)
    want = keep_blocks_ref_(scores.clone(), keep)
    s = scores.clone()
    assert keep_blocks_(s, keep, backend="triton") is s
    assert torch.equal(s, want)
    # int32 names (the fused selection path's ids) give the same
    assert torch.equal(keep_blocks_(scores.clone(), keep.int(), backend="triton"), want)
