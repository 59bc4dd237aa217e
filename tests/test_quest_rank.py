"""``selection_score="quest_rank"``: a KV head's selection shared among its query heads by each head's own Quest
ranking (its best block before any head's second), not by the bounds' group max."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.ops.score_topk import quest_rank_scores, quest_scores_ref, rank_topk
from tests.test_minmax_mass import paged_summaries
from tests.tiny_models import write_tiny


def _brute_rank_select(q, mins, maxs, nc, hkv, k):
    """Per request and KV head: each query head's candidates by its own Quest bound (stable: the lower block first on
    a tie); the selection takes round by round each head's r-th block (heads in order, by group-max bound within a
    round), skipping blocks already taken, until K."""
    B, hq, d = q.shape
    g = hq // hkv
    out = []
    for b in range(B):
        row = []
        for h in range(hkv):
            n = int(nc[b])
            bounds = [[sum(max(float(q[b, i, dd]) * float(mins[b, j, h, dd]), float(q[b, i, dd]) * float(maxs[b, j, h, dd]))
                           for dd in range(d)) for j in range(n)] for i in range(h * g, (h + 1) * g)]
            orders = [sorted(range(n), key=lambda j, bi=bi: (-bi[j], j)) for bi in bounds]
            best = [max(bi[j] for bi in bounds) for j in range(n)]
            chosen: list[int] = []
            for r in range(n):
                for j in sorted({o[r] for o in orders} - set(chosen), key=lambda j: -best[j]):
                    if len(chosen) < k:
                        chosen.append(j)
            row.append(set(chosen))
        out.append(row)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quest_rank_selects_each_heads_best_blocks_round_by_round(seed):
    gen = torch.Generator().manual_seed(seed)
    B, hkv, g, d, J, k = 3, 2, 3, 16, 19, 5
    a, b = torch.randn(B, J, hkv, d, generator=gen), torch.randn(B, J, hkv, d, generator=gen)
    mins, maxs = torch.minimum(a, b), torch.maximum(a, b)
    smin, smax, table = paged_summaries(mins, maxs, 4, gen)
    q = torch.randn(B, hkv * g, d, generator=gen) * torch.tensor([4.0, 1.0, 0.25] * hkv).view(1, -1, 1)  # scales
    nc = torch.tensor([19, 11, 7])
    scores = quest_rank_scores(q, smin, smax, table, nc, hkv, max_candidates=J)
    assert scores.shape == (B, hkv, J) and torch.isinf(scores[1, :, 11:]).all() and (scores[1, :, 11:] < 0).all()
    ids, _ = rank_topk(scores, nc, k, backend="ref", with_valid=False)
    want = _brute_rank_select(q, mins, maxs, nc, hkv, k)
    for bi in range(B):
        for h in range(hkv):
            got = {int(x) for x in ids[bi, h] if x >= 0}
            assert got == want[bi][h], (bi, h, got, want[bi][h])


def test_quest_rank_keeps_a_small_scale_heads_best_block_where_the_group_max_drops_it():
    """Head 0 of the group has a large query, head 1 a small one whose best block is block 3; with K = 2 the group max
    keeps head 0's two best blocks, quest_rank head 0's best and head 1's best."""
    d = 4
    mins = torch.zeros(1, 4, 1, d)
    maxs = torch.zeros(1, 4, 1, d)
    maxs[0, 0, 0, 0], maxs[0, 1, 0, 0], maxs[0, 2, 0, 0] = 3.0, 2.0, 1.0   # head 0 looks along dim 0
    maxs[0, 3, 0, 1] = 1.0                                               # head 1 along dim 1
    smin, smax, table = paged_summaries(mins, maxs, 4, torch.Generator().manual_seed(0))
    q = torch.tensor([[[10.0, 0.0, 0.0, 0.0], [0.0, 0.1, 0.0, 0.0]]])
    nc = torch.tensor([4])
    quest = rank_topk(quest_scores_ref(q, smin, smax, table, nc, 1, 4), nc, 2, backend="ref", with_valid=False)[0]
    ranked = rank_topk(quest_rank_scores(q, smin, smax, table, nc, 1, 4), nc, 2, backend="ref", with_valid=False)[0]
    assert set(quest[0, 0].tolist()) == {0, 1} and set(ranked[0, 0].tolist()) == {0, 3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3", max_position_embeddings=4096))


@pytest.mark.slow
def test_quest_rank_in_the_engine(tiny):
    """Every mode runs it; with a budget covering the context the tokens are dense's; at a small budget it selects
    other blocks than quest (other tokens here)."""
    prompts = [[5, 17, 33, 9, 101, 250, 7] * 9, list(range(40, 40 + 77))]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    dense = [o.token_ids for o in LLM(tiny).generate(prompts, greedy)]
    for mode in ("sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"):
        llm = LLM(tiny, mode=mode, top_k_blocks=64, block_size=4, draft="ngram", selection_score="quest_rank")
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == dense, mode
    small = dict(mode="sparse-resident", top_k_blocks=2, block_size=4)
    quest = [o.token_ids for o in LLM(tiny, **small).generate(prompts, greedy)]
    ranked = [o.token_ids for o in LLM(tiny, selection_score="quest_rank", **small).generate(prompts, greedy)]
    assert ranked != quest


def test_quest_rank_is_refused_on_vllm_by_name():
    from oasiskv_runtime.vllm.options import VllmOptions

    with pytest.raises(ValueError, match="selection_score 'quest_rank' does not run on vLLM.*quest_rank was measured"):
        VllmOptions(mode="sparse-resident", selection_score="quest_rank")
