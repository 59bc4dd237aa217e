"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from oasiskv_runtime.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int],
           engine_gen: torch.Generator) -> list[int]:
    """logits [S, V] -> one token per row. A seeded request draws its i-th token from a generator seeded with
    (seed, i), so its output is independent of batching and preemption."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(greedy[i])
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        gen = engine_gen
        if p.seed is not None:
            gen = torch.Generator().manual_seed(p.seed * 1_000_003 + output_lens[i])
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=gen).item()))
    return out
