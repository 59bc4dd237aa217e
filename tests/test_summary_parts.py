"""``summary_parts``: each block's keys in P equal runs with their own min/max summary row, a block scored by its best
run's Quest bound, from the summaries alone (every sparse mode). On a tiny random model: every sub-block row equals
the min/max of its keys after chunked prefills and decode steps (eager and the static layout of CUDA graphs); the
selection is ``selection_score=quest_half``'s (the same bound from the full keys); a covering budget equals dense in
every sparse mode; the static layout agrees with eager steps at a small budget; the allocation of summary blocks;
the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import EngineConfig, Mode
from oasiskv_runtime.core.batch import summary_row
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager, cdiv
from oasiskv_runtime.engine.sequence import Sequence
from tests.test_split_quest import brute_force_split
from tests.selection_checks import check_sink_plus_top_k
from tests.tiny_models import write_tiny

SPARSE = ["sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"]
PROMPTS = [list(range(40, 40 + 77)), [5, 17, 33, 9, 101, 250, 7] * 9]
ODD = [list(range(40, 40 + 77)), [300, 12, 7] * 15]                # 77 and 45 tokens
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KV_GB = 0.05  # zeroing the 2 GiB CPU default would cost a second per engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("parts"), "qwen3"))


@pytest.fixture(scope="module")
def dense_tokens(tiny):
    return [o.token_ids for o in LLM(tiny, kv_cache_gb=KV_GB).generate(PROMPTS, GREEDY)]


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


def _check_summaries_after_each_step(llm) -> list[int]:
    """After every step, for every request it ran: each sub-block row of every layer holds the min / max of that
    sub-block's keys in the engine's full KV (the device cache in sparse-resident, the host pool's copy otherwise).
    Returns the number of rows checked (a list, so the caller sees it grow)."""
    eng = llm.engine
    be, kv, runner = eng.backend, eng.kv, eng.runner
    bs, parts = kv.block_size, kv.summary_parts
    sb = bs // parts
    real, checked = runner.execute, [0]

    def execute(*a, **kw):
        out = real(*a, **kw)
        if be.dev_cache.k[0].is_cuda:
            torch.cuda.synchronize()  # the pool writes of the host-pool modes may run on other streams
        for s in runner.last_meta.seqs:
            rb = kv.requests[s.seq_id]
            n = s.context_len
            table = rb.host_blocks if be.pool is not None else rb.device_blocks
            for layer in range(be.num_layers):
                cache = be.pool.host.k[layer] if be.pool is not None else be.dev_cache.k[layer]
                keys = torch.cat([cache[b] for b in table[:cdiv(n, bs)]])[:n]         # [n, Hkv, D]
                mins, maxs = (t.view(-1, *t.shape[2:]) for t in be.summaries.read(layer))
                for sj in range(cdiv(n, sb)):
                    row = summary_row(rb.summary_blocks, sj, bs)
                    run = keys[sj * sb:(sj + 1) * sb].to(mins.device)
                    assert torch.equal(mins[row], run.amin(0)), (s.seq_id, layer, sj, n)
                    assert torch.equal(maxs[row], run.amax(0)), (s.seq_id, layer, sj, n)
                    checked[0] += 1
        return out

    runner.execute = execute
    return checked


@pytest.mark.parametrize("mode,parts,graphs", [("sparse-resident", 2, "off"), ("sparse-resident", 4, "off"),
                                               ("fetch-on-demand", 4, "off"), ("oasiskv", 2, "static"),
                                               ("proxy-prefetch", 2, "off")])
def test_every_sub_block_row_holds_its_keys_min_and_max(tiny, mode, parts, graphs):
    """Prefills in 13-token chunks (sub-block runs cut mid-way) and decode steps, block size 8, 77- and 45-token
    prompts: every row after every step."""
    llm = LLM(tiny, mode=mode, summary_parts=parts, top_k_blocks=3, block_size=8, max_num_batched_tokens=13,
              kv_cache_gb=KV_GB, draft="ngram", cuda_graphs=graphs)
    checked = _check_summaries_after_each_step(llm)
    _tokens(llm, ODD, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert checked[0] > 1000
    if graphs == "static":
        assert llm.engine.run_stats()["static_eager_steps"] > 0       # decode writes from the static layout too


def test_selection_is_quest_half_from_the_summaries_alone(tiny):
    """At 3 blocks of 4 for a 77-token prompt, with the first block kept (``sink_blocks=1``), every decode step,
    layer and KV head: the engine's choice is the sink plus the top-2 of Quest's bound over 2-key runs on that layer's
    keys (what ``selection_score=quest_half`` ranks by, from every key); the tokens are quest_half's."""
    k = 3
    kw = dict(mode="sparse-resident", top_k_blocks=k, block_size=4, sink_blocks=1, kv_cache_gb=KV_GB)
    llm = LLM(tiny, summary_parts=2, **kw)
    checked = check_sink_plus_top_k(llm, lambda q, keys, batch: brute_force_split(
        q, keys, batch.primary_table, batch.num_candidates, 2), k)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = _tokens(llm, PROMPTS[:1], params)
    assert checked[0] == 5 * 5 * 3  # decode steps (the first token comes from the prefill) x layers x KV heads
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    parts = _tokens(LLM(tiny, summary_parts=2, **kw), PROMPTS, greedy)
    assert parts == _tokens(LLM(tiny, selection_score="quest_half", **kw), PROMPTS, greedy)
    assert parts != _tokens(LLM(tiny, **kw), PROMPTS, greedy)             # one run per block chooses otherwise here
    assert got == [p[:6] for p in parts[:1]]


@pytest.mark.parametrize("mode", SPARSE)
def test_a_covering_budget_equals_dense(tiny, dense_tokens, mode, monkeypatch):
    from oasiskv_runtime.core.predictor import Predictor

    calls, real = [], Predictor._sub_block_quest
    monkeypatch.setattr(Predictor, "_sub_block_quest", lambda self, *a: calls.append(1) or real(self, *a))
    llm = LLM(tiny, mode=mode, summary_parts=2, top_k_blocks=64, block_size=4, max_num_batched_tokens=16,
              draft="ngram", kv_cache_gb=KV_GB)
    assert _tokens(llm) == dense_tokens
    assert calls                                                     # the predictions ranked by sub-blocks


@pytest.fixture(scope="module")
def tiny_short(tmp_path_factory):
    """The same weights at 128 positions: the static layout's tables are as wide as that needs (33 blocks of 4), so
    requests of more than half of it need summary blocks past the width one row per block would give."""
    return str(write_tiny(tmp_path_factory.mktemp("parts_short"), "qwen3", max_position_embeddings=128))


@pytest.mark.parametrize("mode", ["proxy-prefetch", "oasiskv"])
def test_the_static_layout_gives_the_eager_steps_tokens(tiny_short, mode):
    """At a small budget (3 blocks of 4), CUDA graphs' input layout (``cuda_graphs='static'``: no capture, so it
    runs on the CPU) gives the eager engine's tokens with 2 summary rows per block, up to 101 of 128 positions."""
    tiny = tiny_short
    kw = dict(mode=mode, summary_parts=2, top_k_blocks=3, block_size=4, max_num_batched_tokens=32, draft="ngram",
              kv_cache_gb=KV_GB)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    static = LLM(tiny, cuda_graphs="static", **kw)
    got = _tokens(static, PROMPTS, greedy)
    assert got == _tokens(LLM(tiny, cuda_graphs="off", **kw), PROMPTS, greedy)
    assert static.engine.run_stats()["static_eager_steps"] > 10


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SPARSE)
def test_cuda_kernels_and_captured_graphs(tiny_short, mode):
    """On CUDA (the Triton score and summary kernels, decode steps replayed from captured graphs) at a small budget:
    every sub-block row after every step holds its keys' min / max, graphs give eager's tokens, and sparse-resident
    gives quest_half's (the same bound from the full keys)."""
    kw = dict(mode=mode, device="cuda", summary_parts=2, top_k_blocks=3, block_size=4, max_num_batched_tokens=32,
              draft="ngram", kv_cache_gb=KV_GB)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphed = LLM(tiny_short, cuda_graphs="auto", **kw)
    checked = _check_summaries_after_each_step(graphed)
    got = _tokens(graphed, PROMPTS, greedy)
    st = graphed.engine.run_stats()
    assert checked[0] > 1000 and st["graph_replays"] > 0 and st["graphs_disabled"] is None
    assert got == _tokens(LLM(tiny_short, cuda_graphs="off", **kw), PROMPTS, greedy)
    if mode == "sparse-resident":
        half = {**kw, "summary_parts": 1, "selection_score": "quest_half"}
        assert got == _tokens(LLM(tiny_short, cuda_graphs="off", **half), PROMPTS, greedy)


def test_refusals():
    # a divisor of block_size
    assert EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", summary_parts=4, block_size=16)
    with pytest.raises(ValueError, match="summary_parts=3 must divide block_size=16"):
        EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", summary_parts=3)
    with pytest.raises(ValueError, match="summary_parts=32 must divide block_size=16"):
        EngineConfig.from_overrides("qwen3-8b", mode="sparse-resident", summary_parts=32)
    with pytest.raises(ValueError, match="summary_parts must be a positive divisor"):
        EngineConfig.from_overrides("qwen3-8b", mode="sparse-resident", summary_parts=0)
    # Quest's bound only among the summary scores; the full-key study scores ignore the summaries (allowed)
    for name in ("minmax_mass", "quest_rank"):
        with pytest.raises(ValueError, match=f"summary_parts=2 scores blocks by .*not '{name}'"):
            EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", summary_parts=2, selection_score=name)
    assert EngineConfig.from_overrides("qwen3-8b", mode="sparse-resident", summary_parts=2,
                                       selection_score="quest_half")
    # prefix cache; the hand-off is refused by the engine (test below)
    with pytest.raises(ValueError, match="summary_parts=2 does not run with prefix_cache"):
        EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", summary_parts=2, prefix_cache=True)
    # vLLM
    from oasiskv_runtime.vllm.options import VllmOptions

    assert VllmOptions(mode="oasiskv", summary_parts=1).summary_parts == 1
    with pytest.raises(ValueError, match="summary_parts runs on the embedded engine only for now"):
        VllmOptions(mode="sparse-resident", summary_parts=2)
    with pytest.raises(ValueError, match="summary_parts runs on the embedded engine only for now"):
        VllmOptions.from_dict({"mode": "oasiskv", "summary_parts": 4})


def test_a_running_engine_keeps_its_layout_and_refuses_hand_offs(tiny):
    llm = LLM(tiny, mode="oasiskv", summary_parts=2, top_k_blocks=3, block_size=4, kv_cache_gb=KV_GB, draft="ngram")
    with pytest.raises(ValueError, match="summary_parts is fixed when the engine starts"):
        llm.engine.backend.configure(summary_parts=1)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="does not run with prefill-decode hand-off or prefix-cache hits"):
        llm.engine.add_request(PROMPTS[0], params, stage_kv=True)
    blocks = [0]
    with pytest.raises(ValueError, match="does not run with prefill-decode hand-off or prefix-cache hits"):
        llm.engine.add_request(PROMPTS[0], params, prefix=(blocks, torch.zeros(0), torch.zeros(0)))
    with pytest.raises(ValueError, match="summary_parts=2 does not run with prefill-decode hand-off"):
        llm.engine.backend.export_request(0, None, 10, 0)
    from oasiskv_runtime.pd.workers import check_pd_config

    with pytest.raises(ValueError, match="summary_parts=2 is not supported with prefill-decode"):
        check_pd_config(llm.config)


def test_the_vllm_bench_plan_refuses_it_and_the_accuracy_runner_passes_it_on(tiny, tmp_path):
    """oasisbench: a vLLM point refuses it; ``accuracy --set summary_parts=2`` / ``--sweep summary_parts=1,2`` reach
    the engine's options as integers (dense without them), and a value the block size refuses fails before any
    engine loads."""
    from oasisbench.runners.accuracy import AccuracyConfig, _engine_opts
    from oasisbench.runners.vllm_point import plan_vllm_point

    from tests.test_vllm_bench import POINT

    with pytest.raises(ValueError, match="engine vllm does not take summary_parts"):
        plan_vllm_point({**POINT, "engine": "vllm", "mode": "oasiskv", "summary_parts": 2})
    common = dict(tasks=("niah_passkey",), model=tiny, modes=("oasiskv",), top_k_blocks=8, draft="ngram",
                  output_dir=tmp_path)
    cfg = AccuracyConfig(options=(("summary_parts", "2"),), **common)
    assert cfg.settings() == [("dense", {}), ("oasiskv", {"summary_parts": 2})]
    opts = _engine_opts(cfg, cfg.settings()[1][1], "oasiskv")
    assert opts["summary_parts"] == 2 and type(opts["summary_parts"]) is int
    assert EngineConfig.from_overrides(tiny, mode="oasiskv", **opts).sparse.summary_parts == 2
    cfg = AccuracyConfig(sweep=("summary_parts", ("1", "2")), **common)
    assert [st for _, st in cfg.settings()] == [{}, {"summary_parts": 1}, {"summary_parts": 2}]
    with pytest.raises(ValueError, match="summary_parts=3 must divide block_size=16"):
        AccuracyConfig(sweep=("summary_parts", ("1", "3")), **common)


def _seq(n_prompt: int, max_tokens: int) -> Sequence:
    return Sequence(list(range(n_prompt)), SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("mode", [Mode.SPARSE_RESIDENT, Mode.OASISKV])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_summary_blocks_per_request(mode, parts):
    """cdiv(cdiv(tokens, bs) * parts, bs) summary blocks at every length, grown a token at a time past summary-block
    boundaries (block size 4: a summary block holds the rows of 4 / parts blocks, 16 / parts tokens); the new block
    comes at the step whose token starts the first block it summarizes."""
    bs = 4
    kv = KVCacheManager(mode, bs, num_device_blocks=400, num_host_blocks=400, top_k_blocks=3, max_model_len=1000,
                        summary_parts=parts)
    s = _seq(13, 60)
    assert kv.allocate(s, 13)
    s.num_computed_tokens = 13
    want = lambda n: cdiv(cdiv(n, bs) * parts, bs)  # noqa: E731
    assert len(kv.blocks(s).summary_blocks) == want(13)
    grew = []
    for n in range(14, 73):
        before = len(kv.blocks(s).summary_blocks)
        assert kv.allocate(s, 1)
        s.num_computed_tokens = n
        got = len(kv.blocks(s).summary_blocks)
        assert got == want(n), (n, got)
        if got > before:
            grew.append(n)
        rb = kv.blocks(s)   # the summary blocks' own bound (the other blocks' made unbounded): bs / parts a row
        roomy = dataclasses.replace(rb, device_blocks=list(range(999)), host_blocks=list(range(999)))
        assert kv._capacity(roomy) == len(rb.summary_blocks) * bs * (bs // parts)
    per = bs * bs // parts                                            # tokens a summary block covers
    assert grew == [n for n in range(14, 73) if n % per == 1]
    kv.free(s)
    assert kv.device_pool.num_free == 400
