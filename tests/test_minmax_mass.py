"""``selection_score="minmax_mass"``: the block score that estimates attention mass from the key min/max summaries,
the summaries it reads under every writer of the engine, and the offline study's mass-capture measure."""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.ops.score_topk import minmax_mass_scores, quest_scores_ref
from tests.tiny_models import write_tiny


def paged_summaries(mins: torch.Tensor, maxs: torch.Tensor, rows_per_page: int, gen: torch.Generator):
    """Per-request summaries ``[B, J, Hkv, D]`` laid out in shuffled pages ``[pages, rows_per_page, Hkv, D]`` and
    the summary table ``[B, pages per request]`` that finds them (the engine's layout)."""
    B, J, hkv, d = mins.shape
    per = -(-J // rows_per_page)
    order = torch.randperm(B * per + 2, generator=gen)[:B * per].view(B, per)   # two pages nobody owns
    smin = torch.randn(B * per + 2, rows_per_page, hkv, d, generator=gen)
    smax = smin + 1.0
    for b in range(B):
        for j in range(J):
            smin[order[b, j // rows_per_page], j % rows_per_page] = mins[b, j]
            smax[order[b, j // rows_per_page], j % rows_per_page] = maxs[b, j]
    return smin, smax, order


def test_minmax_mass_scores_equal_a_brute_force_loop():
    gen = torch.Generator().manual_seed(3)
    B, hkv, g, d, J, rows = 2, 3, 2, 24, 13, 5
    a, b = torch.randn(B, J, hkv, d, generator=gen), torch.randn(B, J, hkv, d, generator=gen)
    mins, maxs = torch.minimum(a, b), torch.maximum(a, b)
    smin, smax, table = paged_summaries(mins, maxs, rows, gen)
    q = torch.randn(B, hkv * g, d, generator=gen)
    num_candidates, scale = torch.tensor([13, 7]), 0.37
    got = minmax_mass_scores(q, smin, smax, table, num_candidates, hkv, scale, max_candidates=J)
    assert got.shape == (B, hkv, J)
    for bi in range(B):
        for h in range(hkv):
            for j in range(J):
                if j >= num_candidates[bi]:
                    assert got[bi, h, j] == float("-inf")
                    continue
                best = -math.inf
                for i in range(h * g, (h + 1) * g):
                    est = 0.0
                    for dd in range(d):
                        lo, hi, qd = float(mins[bi, j, h, dd]), float(maxs[bi, j, h, dd]), float(q[bi, i, dd])
                        est += qd * (lo + hi) / 2 + scale / 2 * qd * qd * (hi - lo) ** 2 / 12
                    best = max(best, est)
                assert got[bi, h, j].item() == pytest.approx(best, rel=1e-5, abs=1e-5)


def test_minmax_mass_prefers_aligned_keys_where_quest_prefers_a_wide_spread():
    """Block 0's keys all point along the query (q . k = 2 for each); block 1's average zero with a wide spread in
    every dimension. Quest's bound ranks block 1 first (|q| times the spread); the softmax weight is block 0's."""
    d = 8
    q = torch.full((1, 1, d), 0.5)
    mins = torch.stack([torch.full((d,), 0.5), torch.full((d,), -1.5)]).view(1, 2, 1, d)
    maxs = torch.stack([torch.full((d,), 0.5), torch.full((d,), 1.5)]).view(1, 2, 1, d)
    smin, smax, table = paged_summaries(mins, maxs, 4, torch.Generator().manual_seed(0))
    nc = torch.tensor([2])
    quest = quest_scores_ref(q, smin, smax, table, nc, 1, 2)
    est = minmax_mass_scores(q, smin, smax, table, nc, 1, 1 / math.sqrt(d), 2)
    assert quest[0, 0, 1] > quest[0, 0, 0] and est[0, 0, 0] > est[0, 0, 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("llama"), "llama"))


def full_keys(eng, seq, layer: int, num_tokens: int) -> torch.Tensor:
    """A request's first ``num_tokens`` keys ``[n, Hkv, D]`` from where its full KV lives in this mode."""
    blocks = eng.kv.requests[seq.seq_id]
    if eng.backend.pool is None:
        return eng.backend.dev_cache.gather(layer, blocks.device_blocks, num_tokens)[0]
    return eng.backend.pool.read_host(layer, blocks.host_blocks, num_tokens)[0]


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) for m in
                                  ("sparse-resident", "fetch-on-demand", "proxy-prefetch")] + ["oasiskv"])
def test_summaries_match_the_keys_after_prefill_decode_and_block_reuse(tiny, mode):
    """After every step, each logical block's summary row holds the min / max of the keys written to it so far
    (prefill chunks of 16 tokens at block size 4, then one decode token per step); the last wave reuses the
    earlier waves' freed device blocks (summaries or KV before), so a stale row would show unless the writes reset
    it."""
    bs, waves = 4, [[list(range(40, 77)), [300, 12] * 11], [[5, 17, 33, 9, 101] * 7 + [2]], [[7, 8, 9] * 13]]
    llm = LLM(tiny, mode=mode, top_k_blocks=3, block_size=bs, max_num_batched_tokens=16, draft="ngram",
              selection_score="minmax_mass", kv_cache_gb=0.0005)                # ~23 device blocks: reused
    eng, checked, used = llm.engine, 0, []
    summaries = eng.backend.summaries
    for prompts in waves:
        seqs = [eng.add_request(p, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)) for p in prompts]
        used.append(set())
        while eng.has_unfinished():
            eng.step()
            for s in seqs:
                if s.seq_id in eng.kv.requests:
                    rb = eng.kv.requests[s.seq_id]
                    used[-1].update((b, "summary") for b in rb.summary_blocks)
                    used[-1].update((b, "kv") for b in rb.device_blocks + rb.ws_blocks)
            for seq in seqs:
                n = seq.num_computed_tokens
                if seq.seq_id not in eng.kv.requests or n == 0:
                    continue
                table = eng.kv.requests[seq.seq_id].summary_blocks
                for layer in range(summaries.num_layers):
                    keys, (smin, smax) = full_keys(eng, seq, layer, n), summaries.read(layer)
                    for j in range(-(-n // bs)):
                        blk = keys[j * bs:(j + 1) * bs]
                        page, row = table[j // bs], j % bs
                        assert torch.equal(smin[page, row], blk.amin(0)), (mode, layer, j, n)
                        assert torch.equal(smax[page, row], blk.amax(0)), (mode, layer, j, n)
                checked += 1
    earlier = {b for wave in used[:-1] for b, _ in wave}
    assert checked >= 20 and {b for b, kind in used[-1] if kind == "summary"} & earlier   # rows written before


def test_captured_mass_on_a_known_case():
    from bench.scorer_study import captured_mass

    mass = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.05, 0.05, 0.2, 0.7]])
    scores = torch.tensor([[4.0, 3.0, 1.0, 2.0], [1.0, 1.0, 0.0, 9.0]])       # row 1: a tie -> the lower block
    assert torch.allclose(captured_mass(mass, scores, 2), torch.tensor([0.6, 0.75]))
    assert torch.allclose(captured_mass(mass, mass, 2), torch.tensor([0.8, 0.9]))
    assert torch.allclose(captured_mass(mass, scores, 9), mass.sum(1))                  # K over the candidates
