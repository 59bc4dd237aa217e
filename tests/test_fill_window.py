"""``fill_window``: when a prefill completes, the prefetching modes fill the working set with the top-K blocks by the
exact attention mass of the prompt's last rows (issue #34: the prefill has every key on the device, so the first
decode steps need not start from one query's Quest bounds)."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import EngineConfig, Mode
from oasiskv_runtime.core.pipeline import LookaheadPipeline
from oasiskv_runtime.ops.attention_mass import prompt_block_mass
from tests.tiny_models import STUDY_PROMPTS


def _mass_loop(q, keys, scale, bs):
    """Row by row and query head by query head: the causal softmax over the prompt's keys, each full block's share
    summed over the rows and the KV head's group."""
    W, hq, _ = q.shape
    n, hkv, _ = keys.shape
    g, j = hq // hkv, n // bs
    out = torch.zeros(hkv, j, dtype=torch.float64)
    for r in range(W):
        pos = n - W + r
        for i in range(hq):
            h = i // g
            p = torch.softmax(keys[:pos + 1, h].double() @ q[r, i].double() * scale, dim=0)
            for t in range(min(pos + 1, j * bs)):
                out[h, t // bs] += p[t]
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed,W,n,bs", [(0, 3, 29, 4), (1, 1, 17, 8), (2, 7, 7, 2), (3, 5, 40, 8)])
def test_prompt_block_mass_matches_a_loop_over_rows_and_heads(device, seed, W, n, bs):
    g = torch.Generator().manual_seed(seed)
    hkv, grp, D = 2, 3, 24
    q = torch.randn(W, hkv * grp, D, generator=g)
    keys = torch.randn(n, hkv, D, generator=g)
    want = _mass_loop(q, keys, 0.41, bs)
    got = prompt_block_mass(q.to(device), keys.to(device), 0.41, bs).cpu()
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    if n % bs == 0 and W == 1:  # the last row sees every key, all in full blocks: its group's mass is the group
        torch.testing.assert_close(got.sum(-1), torch.full((hkv,), float(grp)))


def test_prompt_block_mass_refuses_more_rows_than_keys():
    with pytest.raises(ValueError, match="need W <= n"):
        prompt_block_mass(torch.randn(5, 4, 8), torch.randn(4, 2, 8), 1.0, 2)


@pytest.mark.parametrize("mode", ["dense", "sparse-resident", "fetch-on-demand"])
def test_fill_window_needs_a_prefetching_mode(mode):
    EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", fill_window=8, draft="ngram")
    with pytest.raises(ValueError, match="fill_window needs a prefetching mode"):
        EngineConfig.from_overrides("qwen3-8b", mode=mode, fill_window=8)
    with pytest.raises(ValueError, match="fill_window"):
        EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", fill_window=-1, draft="ngram")


def test_fill_window_on_vllm_is_for_the_host_pool_modes(tmp_path):
    """The vLLM front end fills working sets in its host-pool modes (``vllm/host_pool.py``; tested without vLLM in
    test_vllm_plugin.py); sparse-resident fills none and refuses the option by name."""
    from oasisbench.runners.accuracy import AccuracyConfig, _vllm_plan
    from oasiskv_runtime.vllm.options import VllmOptions

    cfg = AccuracyConfig(tasks=("niah_single_needle",), modes=("dense", "oasiskv"), engine="vllm", output_dir=tmp_path,
                         options=(("fill_window", 16),))
    plans = {mode: _vllm_plan(cfg, mode, setting) for mode, setting in cfg.settings()}
    assert plans["oasiskv"].plugin["fill_window"] == 16 and plans["dense"].plugin is None
    with pytest.raises(ValueError, match="fill_window needs a prefetching mode"):
        VllmOptions(mode="sparse-resident", fill_window=16)
    with pytest.raises(ValueError, match="fill_window"):
        AccuracyConfig(tasks=("niah_single_needle",), modes=("dense", "sparse-resident"), engine="vllm",
                       output_dir=tmp_path, options=(("fill_window", 16),))


PROMPTS = STUDY_PROMPTS
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_fill_window_with_a_covering_budget_is_dense(tiny_qwen3):
    dense = [o.token_ids for o in LLM(tiny_qwen3).generate(PROMPTS, GREEDY)]
    for mode in ("proxy-prefetch", "oasiskv"):
        llm = LLM(tiny_qwen3, mode=mode, top_k_blocks=64, block_size=4, draft="ngram", fill_window=8)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == dense, mode


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["proxy-prefetch", "oasiskv"])
@pytest.mark.parametrize("window,sink", [(6, 0), (1, 1)])
def test_the_fill_admits_the_top_k_of_the_prompts_last_rows_mass(tiny_qwen3, monkeypatch, mode, window, sink):
    """Every layer's fill ranks the window's mass (checked against a loop over the prompt's keys), and the working
    set it leaves is that ranking's top-K (with the sink block kept); without the option the fill predicts."""
    from oasiskv_runtime.engine.attention.oasiskv import OasisKVAttention

    real_fill, real_forward = LookaheadPipeline.fill, OasisKVAttention.forward
    filled, inputs = [], {}

    def forward(self, layer, q, k, v):  # the prompt's q/k per layer, for the reference
        step = self.step
        if step.fill is not None:
            inputs[layer] = [(s, q.detach().clone(), k.detach().clone()) for s in step.prefill if s.completes]
        return real_forward(self, layer, q, k, v)

    def fill(self, layer, batch, query, scores=None):
        real_fill(self, layer, batch, query, scores)
        filled.append((layer, batch.seq_ids, scores, self.map.slot_map[batch.state_rows, layer].clone(),
                       batch.next_candidates.clone()))

    monkeypatch.setattr(OasisKVAttention, "forward", forward)
    monkeypatch.setattr(LookaheadPipeline, "fill", fill)
    K, bs = 3, 4
    llm = LLM(tiny_qwen3, mode=mode, top_k_blocks=K, block_size=bs, draft="ngram", fill_window=window, sink_blocks=sink)
    llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    scale = llm.engine.model_config.head_dim ** -0.5
    assert sum(len(f[1]) for f in filled) == len(PROMPTS) * llm.engine.model_config.num_layers
    for layer, seq_ids, scores, slots, nc in filled:
        assert scores is not None
        for b, sid in enumerate(seq_ids):
            (s, q, k), = [x for x in inputs[layer] if x[0].seq_id == sid]
            assert s.num_query == s.context_len  # one chunk: the prompt's keys are this step's rows
            end = s.query_start + s.num_query
            w = min(window, s.num_query)
            want = _mass_loop(q[end - w:end], k[s.query_start:end], scale, bs)
            j = int(nc[b])
            torch.testing.assert_close(scores[b, :, :j], want.float(), rtol=1e-4, atol=1e-5)
            for h in range(want.shape[0]):
                top = want[h].clone()
                top[:sink] = float("inf")
                assert {int(x) for x in slots[b, h] if x >= 0} == set(top.topk(min(K, j)).indices.tolist())
    filled.clear()
    LLM(tiny_qwen3, mode=mode, top_k_blocks=K, block_size=bs, draft="ngram").generate(PROMPTS, GREEDY)
    assert filled and all(f[2] is None for f in filled)


def test_fill_window_is_an_engine_option():
    assert Mode.OASISKV.prefetches and EngineConfig.options()["fill_window"].default == 0


def test_prompt_windows_keep_the_prompts_last_rows_across_chunks():
    """However a prompt is cut into chunks, the rows a completing chunk gets are the prompt's last ``window`` rows;
    a chunk at position 0 starts afresh, and nothing is held once the prompt completes or the request is forgotten."""
    from oasiskv_runtime.core.prefill_feedback import PromptWindows

    torch.manual_seed(0)
    prompt = torch.randn(40, 3, 4)
    for cuts in ([40], [31, 9], [31, 8, 1], [5, 5, 5, 25], [39, 1], [2, 3, 35], [1] * 40):
        win = PromptWindows(8)
        start = 0
        for c in cuts:
            for layer in (0, 1):
                got = win.rows(layer, "r", prompt[start:start + c], start, start + c == 40)
                assert torch.equal(got, prompt[max(0, start + c - 8):start + c]), (cuts, start, layer)
            start += c
        assert win.held == {}, cuts
    win = PromptWindows(8)
    win.rows(0, "r", prompt[:6], 0, False)  # a preempted request prefilled again from position 0
    assert torch.equal(win.rows(0, "r", prompt[:3], 0, True), prompt[:3])
    win.rows(0, "s", prompt[:6], 0, False)
    win.forget("s")
    assert win.held == {}


@pytest.mark.slow
def test_fill_window_after_a_chunked_prefill_whose_last_chunk_is_one_token(tiny_qwen3, monkeypatch):
    """A prompt of 63 tokens in chunks of 31 ends with a 1-token chunk: the fill ranks the mass of the prompt's last
    8 rows (2 chunks' rows), the same scores as the prompt prefilled in one chunk; at a covering budget the tokens
    are dense's."""
    scores_seen = []
    real_fill = LookaheadPipeline.fill

    def fill(self, layer, batch, query, scores=None):
        scores_seen.append(scores)
        real_fill(self, layer, batch, query, scores)

    monkeypatch.setattr(LookaheadPipeline, "fill", fill)
    prompt = [PROMPTS[0]]
    dense = [o.token_ids for o in LLM(tiny_qwen3, max_num_batched_tokens=31).generate(prompt, GREEDY)]
    whole = []
    for k, budget in ((3, 2048), (64, 31), (3, 31)):
        scores_seen.clear()
        llm = LLM(tiny_qwen3, mode="oasiskv", top_k_blocks=k, block_size=4, draft="ngram", fill_window=8,
                  max_num_batched_tokens=budget)
        out = [o.token_ids for o in llm.generate(prompt, GREEDY)]
        assert scores_seen and all(s is not None and s.shape[-1] == 63 // 4 for s in scores_seen)
        if budget == 2048:
            whole = [s.clone() for s in scores_seen]
        elif k == 64:
            assert out == dense
        else:
            assert len(scores_seen) == len(whole)
            for got, want in zip(scores_seen, whole):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
