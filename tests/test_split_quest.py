"""``selection_score`` = ``quest_half`` / ``quest_quarter`` / ``max_logit``: Quest's bound over runs of each block's
keys, the block's best run (issue #34, a study setting that reads every key). The op against a brute-force loop at
odd sizes, its two ends (one run: Quest's score from the engine's own summaries; one key per run: the block's largest
logit), the mode and vLLM checks, and on a real forward of a tiny random model: a covering budget equals dense, and
at a small budget the engine keeps the top-K of the same score computed independently on its keys."""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.ops.score_topk import quest_scores_ref
from oasiskv_runtime.config import CODED_KEY_SCORES as CODED_BITS
from oasiskv_runtime.ops.split_quest import SPLIT_PARTS, coded_max_logit_scores, split_quest_scores
from tests.selection_checks import assert_block_scores, brute_force_blocks, check_sink_plus_top_k, scorer_inputs
from tests.tiny_models import write_tiny

PROMPTS = [list(range(40, 40 + 77)), [5, 17, 33, 9, 101, 250, 7] * 9]
KV_GB = 0.05  # zeroing the 2 GiB CPU default would cost a second per engine


def brute_force_split(q: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor, num_candidates,
                      parts: int) -> list:
    """Per request and KV head, per candidate block: the max over the group's query heads and the block's ``parts``
    runs of ``sum_d max(q_d * min_d, q_d * max_d)``, min / max per dimension over the run's keys, in float64 Python.
    Returns ``[B][Hkv]`` lists."""
    bs, D = k_cache.shape[1], q.shape[2]
    run = bs // (parts or bs)

    def best_run(keys, queries):
        best = -math.inf
        for r0 in range(0, bs, run):
            lo = [min(k[d] for k in keys[r0:r0 + run]) for d in range(D)]
            hi = [max(k[d] for k in keys[r0:r0 + run]) for d in range(D)]
            for qi in queries:
                best = max(best, sum(max(qi[d] * lo[d], qi[d] * hi[d]) for d in range(D)))
        return best

    return brute_force_blocks(q, k_cache, table, num_candidates, best_run)


def brute_force_coded(q: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor, num_candidates,
                      bits: int) -> list:
    """Per request and KV head, per candidate block: the largest ``q_i . k^_t`` over the group's query heads and the
    block's keys, each key dimension coded to the nearest of ``2**bits`` levels from the block's min to its max, in
    float64 Python. Returns ``[B][Hkv]`` lists."""
    D, levels = q.shape[2], 2 ** bits - 1

    def coded_max(keys, queries):
        lo = [min(k[d] for k in keys) for d in range(D)]
        hi = [max(k[d] for k in keys) for d in range(D)]
        step = [(hi[d] - lo[d]) / levels for d in range(D)]
        coded = [[lo[d] + (round((k[d] - lo[d]) / step[d]) * step[d] if step[d] > 0 else 0.0) for d in range(D)]
                 for k in keys]
        return max(sum(qi[d] * k[d] for d in range(D)) for qi in queries for k in coded)

    return brute_force_blocks(q, k_cache, table, num_candidates, coded_max)


def _inputs(bs: int, seed: int):
    """2 KV heads x 3 query heads each (g = 3), head dim 20, a random block table, odd counts and a request without
    candidates, keys with a per-block offset and spread so the runs of one block differ."""
    return (*scorer_inputs(bs, seed), 2)


FULL_KEY_OPS = {"split": (split_quest_scores, brute_force_split), "coded": (coded_max_logit_scores, brute_force_coded)}
"""The op and its float64 reference, each taking the run count (``split``) or the bits (``coded``) last."""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op,bs,arg,bound", [("split", 16, 2, None), ("split", 16, 4, 13), ("split", 8, 0, None),
                                             ("split", 12, 3, 17), ("split", 4, 1, None), ("coded", 16, 1, None),
                                             ("coded", 16, 2, 13), ("coded", 8, 4, None), ("coded", 12, 3, 17)])
def test_full_key_scores_equal_brute_force(device, op, bs, arg, bound):
    """``arg``: runs a block (``split``; 0: one key a run) or bits a key dimension (``coded``); ``bound``: a host
    bound above the real counts (the static layout of CUDA graphs passes its bucket)."""
    score, reference = FULL_KEY_OPS[op]
    q, k_cache, table, num_candidates, hkv = _inputs(bs, torch.seed() % (2**31))
    got = score(q.to(device), k_cache.to(device), table.to(device), num_candidates.to(device), hkv, arg, bound).cpu()
    assert_block_scores(got, reference(q, k_cache, table, num_candidates, arg), num_candidates, bound or 11)


def test_coded_keys_rank_between_the_box_and_the_keys():
    """Two keys a block: every dimension of each is its block's min or max, so one bit codes them exactly and the
    score is the largest logit; many bits approach the largest logit for any block; no bits are refused."""
    q, k_cache, table, num_candidates, hkv = _inputs(2, 5)
    exact = split_quest_scores(q, k_cache, table, num_candidates, hkv, SPLIT_PARTS["max_logit"], 11)
    torch.testing.assert_close(coded_max_logit_scores(q, k_cache, table, num_candidates, hkv, 1, 11), exact)
    q, k_cache, table, num_candidates, hkv = _inputs(16, 6)
    exact = split_quest_scores(q, k_cache, table, num_candidates, hkv, SPLIT_PARTS["max_logit"], 11)
    one_bit = coded_max_logit_scores(q, k_cache, table, num_candidates, hkv, 1, 11)
    assert not torch.allclose(one_bit, exact)  # 16 keys: one bit loses where they sit inside the box
    torch.testing.assert_close(coded_max_logit_scores(q, k_cache, table, num_candidates, hkv, 16, 11), exact,
                               rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="bits=0 must be >= 1"):
        coded_max_logit_scores(q, k_cache, table, num_candidates, hkv, 0, 11)


def test_one_run_is_quest_from_the_engines_summaries():
    """``parts = 1`` ranks as Quest does from the per-block min/max rows the engine keeps (summary block ``j //
    block_size``, row ``j % block_size``), built here from the same keys."""
    bs = 8
    q, k_cache, table, num_candidates, hkv = _inputs(bs, 11)
    nb, _, _, d = k_cache.shape
    mins, maxs = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    summary_table = torch.arange(3 * 2).view(3, 2)                # 2 summary blocks of 8 rows per request
    for b in range(3):
        for j in range(14):
            blk = k_cache[int(table[b, j])]
            mins[int(summary_table[b, j // bs]), j % bs] = blk.amin(0)
            maxs[int(summary_table[b, j // bs]), j % bs] = blk.amax(0)
    want = quest_scores_ref(q, mins, maxs, summary_table, num_candidates, hkv, 11)
    got = split_quest_scores(q, k_cache, table, num_candidates, hkv, 1, 11)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_key_per_run_is_the_blocks_largest_logit():
    """``max_logit`` (one key per run): the bound is exact, each block scores ``max_t max_i q_i . k_t``; a block of
    one large logit among small ones outranks a block whose keys are all moderately aligned."""
    q, k_cache, table, num_candidates, hkv = _inputs(8, 3)
    got = split_quest_scores(q, k_cache, table, num_candidates, hkv, SPLIT_PARTS["max_logit"], 11)
    B, Hq, d = q.shape
    logits = torch.einsum("bhgd,nthd->bhgnt", q.view(B, hkv, Hq // hkv, d), k_cache)     # every key of every block
    want = logits.amax(-1).amax(2).gather(-1, table.long()[:, None, :11].expand(B, hkv, 11))
    ok = torch.arange(11)[None, :] < num_candidates[:, None]
    torch.testing.assert_close(got, want.masked_fill(~ok[:, None], float("-inf")), rtol=1e-5, atol=1e-5)

    qq = torch.tensor([[[1.0, 0.0]]])
    one_spike = torch.tensor([[3.0, 0.0], [0.0, 5.0]])               # logits 3, 0
    aligned = torch.tensor([[2.0, 1.0], [2.0, -1.0]])                # logits 2, 2
    cache = torch.stack([one_spike, aligned]).view(2, 2, 1, 2)
    s = split_quest_scores(qq, cache, torch.tensor([[0, 1]]), torch.tensor([2]), 1, 0)[0, 0]
    assert s.tolist() == [3.0, 2.0]
    whole = split_quest_scores(qq, cache, torch.tensor([[0, 1]]), torch.tensor([2]), 1, 1)[0, 0]
    assert whole.tolist() == [3.0, 2.0] and bool((whole >= s).all())


def test_a_split_that_does_not_divide_the_block_is_refused():
    q, k_cache, table, num_candidates, hkv = _inputs(12, 1)
    with pytest.raises(ValueError, match="parts=5 must divide the block size 12"):
        split_quest_scores(q, k_cache, table, num_candidates, hkv, 5, 11)


@pytest.mark.parametrize("name", sorted(SPLIT_PARTS) + sorted(CODED_BITS))
def test_split_quest_needs_sparse_resident_and_not_vllm(name):
    """The split bounds read every key (sparse-resident only; not on vLLM); the coded keys are kept on the device, so
    they run in every mode of the embedded engine and vLLM's host-pool modes, but not with what would need codes it
    does not write or carry."""
    assert EngineConfig.from_overrides("qwen3-8b", mode="sparse-resident", selection_score=name)
    for mode in ("dense", "fetch-on-demand", "proxy-prefetch", "oasiskv"):
        if name in CODED_BITS:
            assert EngineConfig.from_overrides("qwen3-8b", mode=mode, selection_score=name).sparse.code_bits == \
                CODED_BITS[name]
            continue
        with pytest.raises(ValueError, match=f"selection_score='{name}' needs mode sparse-resident.*{mode}"):
            EngineConfig.from_overrides("qwen3-8b", mode=mode, selection_score=name)
    if name in CODED_BITS:
        with pytest.raises(ValueError, match=f"selection_score='{name}' does not run with accept_drafts"):
            EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", selection_score=name, accept_drafts=True,
                                        draft="ngram")
        with pytest.raises(ValueError, match="summary_parts=2 scores blocks by Quest's bound"):
            EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", selection_score=name, summary_parts=2)
    from oasiskv_runtime.vllm.options import VllmOptions

    if name in CODED_BITS:  # vLLM keeps the codes in its host-pool modes only
        assert VllmOptions(mode="oasiskv", selection_score=name).sparse.code_bits == CODED_BITS[name]
        with pytest.raises(ValueError, match=f"selection_score '{name}' reads key codes, which the vLLM front end "
                                             "keeps in the host-pool modes"):
            VllmOptions(mode="sparse-resident", selection_score=name)
        return
    with pytest.raises(ValueError, match=f"selection_score '{name}' does not run on vLLM"):
        VllmOptions(mode="sparse-resident", selection_score=name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("split"), "qwen3"))


def test_split_quest_with_a_covering_budget_equals_dense(tiny, monkeypatch):
    import oasiskv_runtime.core.predictor as predictor

    calls, real = [], predictor.split_quest_scores
    monkeypatch.setattr(predictor, "split_quest_scores", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for name, kw in (("dense", {}), ("split", dict(mode="sparse-resident", selection_score="quest_half",
                                                 top_k_blocks=64, block_size=4))):
        llm = LLM(tiny, kv_cache_gb=KV_GB, **kw)
        tokens[name] = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    assert tokens["split"] == tokens["dense"]
    assert calls and set(calls) == {2}                               # the predictions ranked with it, 2 runs a block


@pytest.mark.parametrize("name", ["quest_half", "max_logit", "max_logit_b2"])
def test_split_quest_keeps_the_top_k_of_its_score_on_the_real_keys(tiny, name):
    """At 3 blocks of 4 for a 77-token prompt, with the first block always kept (``sink_blocks=1``), every decode
    step, layer and KV head: the engine's choice is the sink plus the top-2 of an independent brute-force score on
    the keys of that layer's cache (the wiring: the layer's keys, the request's blocks, the runs)."""
    k = 3
    llm = LLM(tiny, mode="sparse-resident", selection_score=name, top_k_blocks=k, block_size=4, sink_blocks=1,
              kv_cache_gb=KV_GB)
    def score(q, keys, batch):
        if name in CODED_BITS:
            return brute_force_coded(q, keys, batch.primary_table, batch.num_candidates, CODED_BITS[name])
        return brute_force_split(q, keys, batch.primary_table, batch.num_candidates, SPLIT_PARTS[name])

    checked = check_sink_plus_top_k(llm, score, k)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert checked[0] == 5 * 5 * 3  # decode steps (the first token comes from the prefill) x layers x KV heads


@pytest.mark.parametrize("mode,graphs", [("oasiskv", "off"), ("oasiskv", "static"), ("fetch-on-demand", "static")])
def test_key_codes_kept_on_the_device_rank_like_codes_of_the_full_keys(tiny, mode, graphs):
    """``max_logit_b2`` in the modes whose full KV is in the host pool: the ranking reads only the codes the engine
    wrote into its device blocks (prefill chunks that fill blocks, every decode step's active block) and the min/max
    summaries, yet every prediction (the working-set fill, oasiskv's next-step prefetch from the draft row,
    fetch-on-demand's own step) is the sink plus the top-K of the coded score computed independently from the full
    keys in the host pool. Prefill in chunks of 29 tokens so blocks fill across chunk boundaries; two requests; decode
    steps eager or on the static layout of CUDA graphs (the code table and the active block's row as static inputs)."""
    k = 3
    llm = LLM(tiny, mode=mode, selection_score="max_logit_b2", top_k_blocks=k, block_size=4, sink_blocks=1,
              kv_cache_gb=KV_GB, draft="ngram", max_num_batched_tokens=29, cuda_graphs=graphs)
    checked = check_sink_plus_top_k(
        llm, lambda q, keys, batch: brute_force_coded(q, keys, batch.primary_table, batch.num_candidates, 2), k)
    llm.generate(PROMPTS, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert checked[0] >= 8 * 5 * 3 * 2  # at least one prediction per decode step, layer, KV head and request
