"""``attended_blocks``: the blocks of a KV head's working set that held the most of a decode step's attention are kept
by the next prediction (issue #34's study of attention feedback: what the step read, it knows exactly)."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import SparseConfig
from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.core.predictor import Predictor
from oasiskv_runtime.ops.attended import keep_blocks_
from oasiskv_runtime.ops.attention_mass import slot_mass, working_set_mass
from oasiskv_runtime.ops.sparse_attention import sparse_decode_attention_ref
from oasiskv_runtime.ops.score_topk import rank_topk
from tests.tiny_models import STUDY_PROMPTS


def _mass_loop(q, k_cache, block_ids, scale):
    """Per request and KV head, one query head at a time: the softmax over the keys of the head's non-empty slots,
    each slot's share summed over the group."""
    B, hq, _ = q.shape
    hkv, K = block_ids.shape[1:]
    g, bs = hq // hkv, k_cache.shape[1]
    out = torch.full((B, hkv, K), float("-inf"))
    for b in range(B):
        for h in range(hkv):
            slots = [s for s in range(K) if block_ids[b, h, s] >= 0]
            if not slots:
                continue
            keys = torch.cat([k_cache[int(block_ids[b, h, s]), :, h].double() for s in slots])  # [n * bs, D]
            mass = torch.zeros(len(slots), dtype=torch.float64)
            for i in range(h * g, (h + 1) * g):
                p = torch.softmax(keys @ q[b, i].double() * scale, dim=0)
                mass += p.view(len(slots), bs).sum(1)
            for n, s in enumerate(slots):
                out[b, h, s] = float(mass[n])
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", [0, 1])
def test_working_set_mass_matches_a_loop_over_slots(device, seed):
    g = torch.Generator().manual_seed(seed)
    B, hkv, grp, D, K, bs, NB = 3, 2, 3, 24, 7, 5, 13  # odd sizes
    q = torch.randn(B, hkv * grp, D, generator=g)
    k_cache = torch.randn(NB, bs, hkv, D, generator=g)
    block_ids = torch.randint(0, NB, (B, hkv, K), generator=g)
    block_ids[0, 1, 2] = block_ids[2, 0, 6] = -1          # empty slots
    block_ids[1, 1] = -1                                    # a head with nothing resident
    want = _mass_loop(q, k_cache, block_ids, 0.37)
    got = working_set_mass(q.to(device), k_cache.to(device), block_ids.to(device), 0.37).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin].float(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.masked_fill(~fin, 0).sum(-1)[fin.any(-1)], torch.tensor(float(grp)))


@pytest.mark.parametrize("seed", [0, 1])
def test_slot_mass_from_the_attentions_lse_is_working_set_mass(seed):
    """The decode step's feedback comes from the exp-sums its attention writes (slot_lse): the same mass as the
    loop, with the local block and a trailing column (an accepted draft's gap block) left out of the softmax."""
    g = torch.Generator().manual_seed(seed)
    B, hkv, grp, D, K, bs, NB = 3, 2, 3, 24, 7, 5, 13
    q = torch.randn(B, hkv * grp, D, generator=g)
    k_cache, v_cache = torch.randn(NB, bs, hkv, D, generator=g), torch.randn(NB, bs, hkv, D, generator=g)
    block_ids = torch.randint(0, NB, (B, hkv, K), generator=g)
    block_ids[0, 1, 2] = block_ids[2, 0, 6] = -1
    block_ids[1, 1] = -1
    want = _mass_loop(q, k_cache, block_ids, 0.37)
    local = torch.randint(0, NB, (B,), generator=g)
    gap = torch.randint(0, NB, (B, hkv, 1), generator=g)
    for table, n in ((block_ids, None), (torch.cat([block_ids, gap], dim=2), K)):
        lse = torch.empty(B, hkv, grp, table.shape[2])
        sparse_decode_attention_ref(q[:, None], k_cache, v_cache, table, local, torch.full((B,), 2), 0.37,
                                    slot_lse=lse)
        got = slot_mass(lse, n)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_engine_records_the_mass_its_attention_gave(tiny_qwen3, monkeypatch):
    """Wiring: each decode step's record is working_set_mass of the step's own query over the table it attended."""
    from oasiskv_runtime.engine.attention import oasiskv as mod
    real, checked = mod.sparse_decode_attention, []

    def spy(qs, k_cache, v_cache, block_ids, *args, slot_lse=None, **kw):
        res = real(qs, k_cache, v_cache, block_ids, *args, slot_lse=slot_lse, **kw)
        if slot_lse is not None:
            want = working_set_mass(qs[:, 0], k_cache, block_ids, args[2])  # args: local block, length, scale, ...
            got = slot_mass(slot_lse)
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            torch.testing.assert_close(got[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-4, atol=1e-5)
            checked.append(1)
        return res

    monkeypatch.setattr(mod, "sparse_decode_attention", spy)
    for mode in ("sparse-resident", "oasiskv"):
        LLM(tiny_qwen3, mode=mode, top_k_blocks=3, block_size=4, draft="ngram", attended_blocks=2).generate(
            STUDY_PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0))
    assert len(checked) > 20


def test_keep_blocks_forces_named_candidates_into_the_top_k():
    g = torch.Generator().manual_seed(3)
    B, hkv, J, k = 2, 3, 11, 4
    nc = torch.tensor([11, 6])
    scores = torch.randn(B, hkv, J, generator=g)
    scores[1, :, 6:] = float("-inf")                          # request 1 has 6 candidates
    keep = torch.full((B, hkv, 2), -1, dtype=torch.long)
    low = scores.argsort(-1)                                  # each row's lowest-scored candidates
    keep[0, :, 0] = low[0, :, 0]
    keep[0, 1, 1] = low[0, 1, 1]
    keep[1, 0] = torch.tensor([9, 40])                        # not a candidate / past the columns: ignored
    keep[1, 2, 0] = int(scores[1, 2, :6].argmin())
    ids, _ = rank_topk(keep_blocks_(scores.clone(), keep, backend="ref"), nc, k, backend="ref")
    plain, _ = rank_topk(scores, nc, k, backend="ref")
    for b in range(B):
        for h in range(hkv):
            kept = {int(x) for x in keep[b, h] if 0 <= x < int(nc[b])}
            chosen = {int(x) for x in ids[b, h] if x >= 0}
            assert kept <= chosen and len(chosen) == k
            # the rest of the selection is the plain ranking's best, in its order
            rest = [int(x) for x in plain[b, h] if int(x) not in kept][:k - len(kept)]
            assert chosen == kept | set(rest)
    assert torch.equal(ids[1, 0], plain[1, 0])               # nothing kept there: the plain ranking


def test_head_map_records_the_most_attended_blocks_most_first():
    hm = HeadMap(4, 2, 2, 5, torch.device("cpu"), with_map=False, attended_blocks=2)
    rows = torch.tensor([3, 1])
    logical = torch.tensor([[[7, 2, 9, -1, 4], [1, 0, 5, 6, 3]], [[-1, -1, -1, -1, 8], [2, 3, 4, 5, 6]]])
    mass = torch.tensor([[[0.1, 0.5, 0.3, float("-inf"), 0.05], [0.2, 0.1, 0.3, 0.25, 0.15]],
                         [[float("-inf")] * 4 + [0.9], [0.1, 0.2, 0.3, 0.4, 0.0]]])
    hm.record_attended(1, rows, logical, mass)
    assert hm.attended_ids(1, rows).tolist() == [[[2, 9], [5, 6]], [[8, -1], [5, 4]]]
    assert (hm.attended_ids(0, rows) == -1).all()             # another layer: untouched
    hm.rows[11] = 3
    hm.free(11)
    assert (hm.attended[3] == -1).all() and (hm.attended[1, 1] >= 0).any()
    assert HeadMap(4, 2, 2, 5, torch.device("cpu"), with_map=False).attended_ids(1, rows) is None


def test_attended_blocks_count_in_the_budget():
    SparseConfig(top_k_blocks=8, sink_blocks=1, recent_blocks=2, attended_blocks=4)
    with pytest.raises(ValueError, match="sink_blocks \\+ recent_blocks \\+ attended_blocks must be < top_k_blocks"):
        SparseConfig(top_k_blocks=8, sink_blocks=1, recent_blocks=2, attended_blocks=5)
    with pytest.raises(ValueError, match="attended_blocks"):
        SparseConfig(attended_blocks=-1)


def test_attended_share_is_the_count_as_a_share_of_the_budget(tiny_qwen3):
    """``attended_share`` scales with ``top_k_blocks`` (floor, at least 1), counts in the budget like the count,
    excludes it, and sizes the engine's record; the record cannot change size on a running engine."""
    from oasiskv_runtime.vllm.options import VllmOptions

    assert [SparseConfig(top_k_blocks=k, attended_share=0.25).attended for k in (3, 8, 16, 128)] == [1, 2, 4, 32]
    assert SparseConfig(top_k_blocks=16, attended_blocks=3).attended == 3 and SparseConfig().attended == 0
    with pytest.raises(ValueError, match="not both"):
        SparseConfig(top_k_blocks=16, attended_blocks=2, attended_share=0.25)
    with pytest.raises(ValueError, match="attended_share 0.5"):
        SparseConfig(top_k_blocks=4, sink_blocks=1, recent_blocks=1, attended_share=0.5)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="attended_share"):
            SparseConfig(attended_share=bad)
    assert VllmOptions(mode="oasiskv", top_k_blocks=16, attended_share=0.25).sparse.attended == 4
    with pytest.raises(ValueError, match="attended_share is for the host-pool modes"):
        VllmOptions(mode="sparse-resident", attended_share=0.25)
    llm = LLM(tiny_qwen3, mode="oasiskv", top_k_blocks=8, block_size=4, draft="ngram", attended_share=0.25)
    attn = llm.engine.backend
    assert attn.head_map.attended.shape[-1] == 2
    attn.configure(top_k_blocks=8)  # the same record: allowed
    with pytest.raises(ValueError, match="fixed when the engine starts"):
        attn.configure(top_k_blocks=16)


PROMPTS = STUDY_PROMPTS
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_attended_blocks_in_every_mode(tiny_qwen3):
    """Every mode runs it; with a budget covering the context the tokens are dense's."""
    dense = [o.token_ids for o in LLM(tiny_qwen3).generate(PROMPTS, GREEDY)]
    for mode in ("sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"):
        llm = LLM(tiny_qwen3, mode=mode, top_k_blocks=64, block_size=4, draft="ngram", attended_blocks=8)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == dense, mode


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sparse-resident", "oasiskv"])
def test_each_prediction_keeps_the_blocks_the_last_step_attended_most(tiny_qwen3, monkeypatch, mode):
    """Wired end to end: every prediction made with a record keeps each recorded block that is a candidate, and the
    record holds blocks the step read with the most mass (so a run with it selects other blocks than without)."""
    seen = []
    real = Predictor.predict

    def spy(self, layer, query, batch, next_step, int32=False, keep=None):
        ids = real(self, layer, query, batch, next_step, int32=int32, keep=keep)
        if keep is not None:
            seen.append((keep.clone(), ids.clone(), (batch.next_candidates if next_step else batch.num_candidates)
                         .clone()))
        return ids

    monkeypatch.setattr(Predictor, "predict", spy)
    small = dict(mode=mode, top_k_blocks=3, block_size=4, draft="ngram")
    with_rec = [o.token_ids for o in LLM(tiny_qwen3, attended_blocks=2, **small).generate(PROMPTS, GREEDY)]
    kept = 0
    for keep, ids, nc in seen:
        for b in range(keep.shape[0]):
            for h in range(keep.shape[1]):
                rec = {int(x) for x in keep[b, h] if 0 <= x < int(nc[b])}
                assert rec <= {int(x) for x in ids[b, h]}
                kept += len(rec)
    assert kept > 0
    seen.clear()
    without = [o.token_ids for o in LLM(tiny_qwen3, **small).generate(PROMPTS, GREEDY)]
    assert not seen and without != with_rec


def test_attended_blocks_on_vllm_is_for_the_host_pool_modes(tmp_path):
    """The vLLM front end runs the feedback where it keeps per-request state (proxy-prefetch, oasiskv: the host-pool
    runtime's ``HeadMap``); its sparse-resident keeps none between steps and refuses the option by name."""
    from oasisbench.runners.accuracy import AccuracyConfig, _vllm_plan
    from oasiskv_runtime.vllm.options import VllmOptions

    cfg = AccuracyConfig(tasks=("niah_single_needle",), modes=("dense", "oasiskv"), engine="vllm",
                         output_dir=tmp_path, options=(("attended_blocks", 2),))
    plans = {mode: _vllm_plan(cfg, mode, setting) for mode, setting in cfg.settings()}
    assert plans["oasiskv"].plugin["attended_blocks"] == 2 and plans["dense"].plugin is None
    with pytest.raises(ValueError, match="attended_blocks is for the host-pool modes"):
        VllmOptions(mode="sparse-resident", attended_blocks=2)
    with pytest.raises(ValueError, match="attended_blocks"):
        AccuracyConfig(tasks=("niah_single_needle",), modes=("dense", "sparse-resident"), engine="vllm",
                       output_dir=tmp_path, options=(("attended_blocks", 2),))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sparse-resident", "oasiskv"])
def test_the_end_of_prefill_seeds_the_record_with_the_dense_attentions_heaviest_blocks(tiny_qwen3, monkeypatch, mode):
    """A prefill attends the whole context, so the first sparse step starts from the blocks its last row weighed most
    (its attention over every key of the prompt, summed per full block: the next step's candidates), checked
    against a per-head loop on the same keys."""
    from oasiskv_runtime.engine.attention.oasiskv import OasisKVAttention

    real = OasisKVAttention._end_of_prefill
    checked = []

    def spy(self, layer, s, q, ks, seed, fills):
        out = real(self, layer, s, q, ks, seed, fills)
        bs, hkv, n = self.dev_cache.block_size, ks.shape[1], s.context_len
        j = n // bs
        qrow = q[s.query_start + s.num_query - 1].double()
        g = qrow.shape[0] // hkv
        want = torch.zeros(hkv, j, dtype=torch.float64)
        for h in range(hkv):
            keys = ks[:n, h].double()
            for i in range(h * g, (h + 1) * g):
                want[h] += torch.softmax(keys @ qrow[i] * self.scale, dim=0)[:j * bs].view(j, bs).sum(1)
        got = self.head_map.attended[self.head_map.rows[s.seq_id], layer]
        m = got.shape[-1]
        assert seed and torch.equal(got, want.topk(m, dim=-1).indices), (layer, got, want)
        checked.append(layer)
        return out

    monkeypatch.setattr(OasisKVAttention, "_end_of_prefill", spy)
    llm = LLM(tiny_qwen3, mode=mode, top_k_blocks=4, block_size=4, draft="ngram", attended_blocks=2)
    llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(checked) == len(PROMPTS) * llm.engine.model_config.num_layers
