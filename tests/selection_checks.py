"""What the full-key selection tests share: random inputs for a block scorer and the check of its output against a
brute-force reference, and a spy on a sparse-resident engine's predictor so every decode step's choice, at every
layer and KV head, is checked against an independent score of that layer's keys."""

from __future__ import annotations

import dataclasses

import torch


def scorer_inputs(bs: int, seed: int, hkv: int = 2, g: int = 3, d: int = 20, counts=(11, 0, 7), spread=True):
    """``(q, k_cache, table, num_candidates)`` for three requests, one per count in ``counts`` (odd, one without
    candidates), over a 40-block cache and a random 14-block table each. ``spread``: keys get a per-block offset and
    spread, so the blocks' statistics (min/max runs, means, variances) differ."""
    gen = torch.Generator().manual_seed(seed)
    nb = 40
    num_candidates = torch.tensor(counts, dtype=torch.int32)
    q = torch.randn(len(counts), hkv * g, d, generator=gen)
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen)
    if spread:
        k_cache = torch.randn(nb, 1, hkv, d, generator=gen) + torch.rand(nb, 1, hkv, d, generator=gen) * 3 * k_cache
    table = torch.stack([torch.randperm(nb, generator=gen)[:14] for _ in counts])
    return q, k_cache, table, num_candidates


def brute_force_blocks(q: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor, num_candidates, score) -> list:
    """A reference block score in float64 Python, per request and KV head, per candidate block: ``score(keys,
    queries)`` with ``keys`` the block's keys of that head and ``queries`` its GQA group's query heads (lists of
    ``D`` floats each). Returns ``[B][Hkv]`` lists."""
    B, Hq, _ = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = Hq // hkv
    return [[[score([[float(x) for x in k_cache[int(table[b, j]), t, h]] for t in range(bs)],
                    [[float(x) for x in q[b, i]] for i in range(h * g, (h + 1) * g)])
              for j in range(int(num_candidates[b]))] for h in range(hkv)] for b in range(B)]


def assert_block_scores(got: torch.Tensor, want, num_candidates: torch.Tensor, width: int, atol: float = 1e-4):
    """``got`` ``[B, Hkv, width]`` fp32 equals the reference's ``want[b][h]`` lists on each request's candidates and
    is ``-inf`` past them."""
    B, hkv = len(num_candidates), len(want[0])
    assert got.shape == (B, hkv, width) and got.dtype == torch.float32
    for b in range(B):
        nc = int(num_candidates[b])
        for h in range(hkv):
            torch.testing.assert_close(got[b, h, :nc], torch.tensor(want[b][h], dtype=torch.float32),
                                       rtol=1e-5, atol=atol)
            assert bool(torch.isneginf(got[b, h, nc:]).all())


def check_sink_plus_top_k(llm, score, k: int) -> list[int]:
    """Spy on ``llm``'s predictor (``sink_blocks=1``, ``top_k_blocks=k``): each prediction must be block 0 plus the
    ``k - 1`` best other candidates of ``score(query, layer_keys, batch)`` (``[B][Hkv]`` lists of per-candidate
    scores, computed by the caller's own reference over ``batch.num_candidates``). ``layer_keys``: the layer's full
    keys, which ``batch.primary_table`` indexes (the device cache in sparse-resident, the host pool in host-pool
    modes); a prediction for the next step (the prefetching modes, the working-set fill) ranks the next step's
    candidates. Returns a one-item list counting the (step, layer, KV head) choices checked, which grows as the
    engine runs."""
    backend, checked = llm.engine.backend, [0]
    predictor = backend.predictor
    real = predictor.predict
    full_keys = backend.pool.k if backend.pool is not None else backend.dev_cache.k

    def spy(layer, query, batch, next_step, int32=False, **kw):
        ids = real(layer, query, batch, next_step, int32, **kw)
        ranked = dataclasses.replace(batch, num_candidates=batch.next_candidates) if next_step else batch
        for b, per_head in enumerate(score(query, full_keys[layer], ranked)):
            for h, s in enumerate(per_head):
                rest = sorted(range(1, len(s)), key=lambda j: -s[j])[:k - 1]
                assert sorted(int(j) for j in ids[b, h] if j >= 0) == sorted([0] + rest)
                checked[0] += 1
        return ids

    predictor.predict = spy
    return checked
