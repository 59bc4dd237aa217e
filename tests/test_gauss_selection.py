"""``selection_score="gauss"``: blocks ranked by the Gaussian log-mass of their keys' mean and variance (issue #34, a
study setting that reads every key). The op against a brute-force loop at odd sizes and against the offline study's
``mean_var`` scorer, the mode and vLLM checks, and on a real forward of a tiny random model: a covering budget equals
dense, and at a small budget the engine keeps the top-K of the same score computed independently on its keys."""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.ops.gauss_mass import gauss_mass_scores
from tests.selection_checks import assert_block_scores, brute_force_blocks, check_sink_plus_top_k, scorer_inputs
from tests.tiny_models import write_tiny

PROMPTS = [list(range(40, 40 + 77)), [5, 17, 33, 9, 101, 250, 7] * 9]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KV_GB = 0.05  # zeroing the 2 GiB CPU default would cost a second per engine


def brute_force_gauss(q: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor, num_candidates,
                      scale: float) -> list:
    """Per request and KV head, per candidate block: the max over the group's query heads of
    ``q . mu + scale / 2 * sum_d q_d^2 var_d``, mean and population variance taken token by token in float64.
    Returns ``[B][Hkv]`` lists."""
    bs, D = k_cache.shape[1], q.shape[2]

    def gauss(keys, queries):
        mu = [sum(k[d] for k in keys) / bs for d in range(D)]
        var = [sum((k[d] - mu[d]) ** 2 for k in keys) / bs for d in range(D)]
        return max(sum(qi[d] * mu[d] + scale / 2 * qi[d] ** 2 * var[d] for d in range(D)) for qi in queries)

    return brute_force_blocks(q, k_cache, table, num_candidates, gauss)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bs,bound", [(16, None), (8, 13), (4, None)])
def test_gauss_mass_scores_equal_brute_force(device, bs, bound):
    """2 KV heads x 3 query heads each (g = 3), head dim 20, a random block table, odd counts and a request without
    candidates; ``bound``: a host bound above the real counts (the static layout of CUDA graphs passes its bucket).
    Keys get a per-block offset and spread so means and variances differ between blocks."""
    hkv, d = 2, 20
    q, k_cache, table, num_candidates = scorer_inputs(bs, torch.seed() % (2**31), hkv=hkv, d=d)
    scale = 1.0 / math.sqrt(d)
    got = gauss_mass_scores(q.to(device), k_cache.to(device), table.to(device), num_candidates.to(device), hkv,
                            scale, bound).cpu()
    assert_block_scores(got, brute_force_gauss(q, k_cache, table, num_candidates, scale), num_candidates,
                        bound or 11)


def test_gauss_mass_scores_are_the_offline_studys_mean_var():
    """The engine setting ranks as the scorer the offline study measured (``bench/scorer_study.py``'s ``mean_var``),
    so a NIAH run of it tests that scorer."""
    from bench.scorer_study import block_stats, scorers

    gen = torch.Generator().manual_seed(5)
    hkv, g, d, bs, J = 3, 3, 16, 16, 9
    keys, q, scale = torch.randn(J * bs, hkv, d, generator=gen), torch.randn(hkv * g, d, generator=gen), d ** -0.5
    want = scorers(q, keys, block_stats(keys, bs), hkv, scale)["mean_var"]
    got = gauss_mass_scores(q.unsqueeze(0), keys.view(J, bs, hkv, d), torch.arange(J).view(1, J), torch.tensor([J]),
                            hkv, scale, J)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gauss_mass_with_equal_keys_is_q_dot_k():
    """A block whose keys are all the same has no variance: its score is q . k, and a block of the same mean with a
    spread along the query scores higher (its largest logits carry the softmax)."""
    d = 4
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    same = torch.full((2, d), 0.5)
    spread = torch.tensor([[1.5, 0.5, 0.5, 0.5], [-0.5, 0.5, 0.5, 0.5]])
    k_cache = torch.stack([same, spread]).view(2, 2, 1, d)
    got = gauss_mass_scores(q, k_cache, torch.tensor([[0, 1]]), torch.tensor([2]), 1, 0.5)
    assert got[0, 0, 0].item() == pytest.approx(0.5)
    assert got[0, 0, 1].item() == pytest.approx(0.5 + 0.25 * 1.0)                # var along q: 1, scale / 2 = 0.25


def test_gauss_selection_needs_sparse_resident_and_not_vllm():
    assert EngineConfig.from_overrides("qwen3-8b", mode="sparse-resident", selection_score="gauss")
    for mode in ("dense", "fetch-on-demand", "proxy-prefetch", "oasiskv"):
        with pytest.raises(ValueError, match=f"selection_score='gauss' needs mode sparse-resident.*{mode}"):
            EngineConfig.from_overrides("qwen3-8b", mode=mode, selection_score="gauss")
    from oasiskv_runtime.vllm.options import VllmOptions

    with pytest.raises(ValueError, match="selection_score 'gauss' does not run on vLLM"):
        VllmOptions(mode="sparse-resident", selection_score="gauss")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("gauss"), "qwen3"))


def test_gauss_selection_with_a_covering_budget_equals_dense(tiny, monkeypatch):
    import oasiskv_runtime.core.predictor as predictor

    calls, real = [], predictor.gauss_mass_scores
    monkeypatch.setattr(predictor, "gauss_mass_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens = {}
    for name, kw in (("dense", {}), ("gauss", dict(mode="sparse-resident", selection_score="gauss",
                                                 top_k_blocks=64, block_size=4))):
        llm = LLM(tiny, kv_cache_gb=KV_GB, **kw)
        tokens[name] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert tokens["gauss"] == tokens["dense"]
    assert calls                                                     # the predictions ranked with it


def test_gauss_selection_keeps_the_top_k_of_its_score_on_the_real_keys(tiny):
    """At 3 blocks of 4 for a 77-token prompt, with the first block always kept (``sink_blocks=1``), every decode
    step, layer and KV head: the engine's choice is the sink plus the top-2 of an independent brute-force score on
    the keys of that layer's cache (the wiring: the layer's keys, the request's blocks, attention's scale)."""
    k = 3
    llm = LLM(tiny, mode="sparse-resident", selection_score="gauss", top_k_blocks=k, block_size=4, sink_blocks=1,
              kv_cache_gb=KV_GB)
    scale = llm.engine.backend.scale
    checked = check_sink_plus_top_k(llm, lambda q, keys, batch: brute_force_gauss(
        q, keys, batch.primary_table, batch.num_candidates, scale), k)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert checked[0] == 5 * 5 * 3  # decode steps (the first token comes from the prefill) x layers x KV heads
