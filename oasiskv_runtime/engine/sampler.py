"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

All rows of a step are sampled at once on the logits' device, with one host copy at the end. A sampled row
draws its token by the Gumbel-max trick, ``argmax(logit / T + Gumbel noise)`` over the top-k / top-p filtered
logits, which is a draw from their softmax. The noise comes from a counter-based hash of (row seed, vocabulary
index), so a seeded request's i-th token depends only on (seed, i) and its logits: not on batching,
preemption, or which device samples it. The first version drew each sampled row with ``torch.multinomial`` on
the host after a device copy of its probabilities: ~0.45 s per decode step at batch 512 with half the rows
sampled, on the H200 (docs/benchmarks.md, "Host-side costs").
"""

from __future__ import annotations

import torch

from oasiskv_runtime.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow: c in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (``lowbias32``, C. Wellons) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] float32 uniforms in (0, 1): row r is a fixed function of ``seeds[r]`` (int64) alone."""
    s = seeds.to(torch.int64)
    row = _mix32((s & _M32) ^ _mix32(((s >> 32) & _M32) ^ 0x9E3779B9))
    col = _mix32(torch.arange(vocab, device=s.device, dtype=torch.int64) + 0x632BE5AB)
    h = _mix32(row[:, None] ^ col[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def filter_logits_ref(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference for one row: logits / T with the tokens outside top-k and top-p set to -inf."""
    row = row.float() / p.temperature
    if p.top_k and 0 < p.top_k < row.numel():
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        probs = torch.softmax(row, dim=-1)
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the most likely token
        drop = torch.ones_like(row, dtype=torch.bool).scatter_(0, idx[keep], False)
        row = row.masked_fill(drop, float("-inf"))
    return row


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`filter_logits_ref` for every row at once (no row may be greedy)."""
    x = logits.float()
    dev, vocab = x.device, x.shape[1]
    x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    ks = [p.top_k if p.top_k and 0 < p.top_k < vocab else vocab for p in params]
    tps = [p.top_p for p in params]
    if min(ks) == vocab and min(tps) >= 1.0:
        return x
    sorted_x, order = x.sort(dim=1, descending=True)
    if min(ks) < vocab:
        kth = sorted_x.gather(1, torch.tensor(ks, device=dev)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if min(tps) < 1.0:
        sorted_p = torch.softmax(sorted_x, dim=1)
        # a row without top-p keeps everything (its cumulative sum may round past 1.0)
        tp = torch.tensor([t if t < 1.0 else float("inf") for t in tps], device=dev)
        keep = sorted_p.cumsum(1) - sorted_p < tp[:, None]
        x = x.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int],
           engine_gen: torch.Generator) -> list[int]:
    """logits [S, V] -> one token per row. A seeded request's i-th token is drawn with the noise of seed
    (seed, i) (see the module docstring); unseeded rows take seeds from ``engine_gen``."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = [params[i] for i in rows]
        step_seeds = torch.randint(0, 1 << 62, (len(rows),), generator=engine_gen).tolist()
        seeds = [(p.seed * 1_000_003 + output_lens[i]) % (1 << 63) if p.seed is not None else s
                 for i, p, s in zip(rows, sub, step_seeds)]
        idx = torch.tensor(rows, device=logits.device)
        x = filter_logits(logits.index_select(0, idx), sub)
        u = hash_uniform(torch.tensor(seeds, dtype=torch.int64, device=logits.device), x.shape[1])
        tokens = tokens.index_copy(0, idx, (x - torch.log(-torch.log(u))).argmax(dim=-1))
    return tokens.tolist()
