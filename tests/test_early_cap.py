"""``early_fetch_ratio`` / ``early_steps``: a request's first decode steps after its prefill admit up to a larger cap
per KV head (issue #34: the working set turns over from the fill to what the decode attends), the other requests of
the same step keep the fixed cap."""

from __future__ import annotations

import pytest

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import EngineConfig, SparseConfig
from oasiskv_runtime.core.pipeline import LookaheadPipeline
from tests.test_cuda_graphs import staggered, tiny  # noqa: F401  (the module's tiny model fixture)
from tests.tiny_models import STUDY_PROMPTS


@pytest.mark.parametrize("mode", ["dense", "sparse-resident", "fetch-on-demand"])
def test_early_fetch_ratio_needs_a_prefetching_mode(mode):
    EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", early_fetch_ratio=0.25, draft="ngram")
    with pytest.raises(ValueError, match="early_fetch_ratio needs a prefetching mode"):
        EngineConfig.from_overrides("qwen3-8b", mode=mode, early_fetch_ratio=0.25)
    for bad in ({"early_fetch_ratio": 1.5}, {"early_fetch_ratio": -0.1}, {"early_steps": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", draft="ngram", **bad)


def test_early_cap_is_the_fetch_cap_of_its_ratio():
    assert SparseConfig().early_cap == 0 and EngineConfig.options()["early_fetch_ratio"].default == 0
    assert SparseConfig(top_k_blocks=128, early_fetch_ratio=0.25).early_cap == 32
    assert SparseConfig(top_k_blocks=16, early_fetch_ratio=1.0).early_cap == 16


def test_early_fetch_ratio_on_vllm_is_for_the_host_pool_modes(tmp_path):
    """The vLLM front end takes the option in its host-pool modes (the same core caps: ``HeadMap.prefetch_caps``;
    tested without vLLM in test_vllm_plugin.py), from ``engine_args`` down to the accuracy runner's ``--set`` and
    ``--sweep``; sparse-resident fetches nothing and refuses it by name."""
    from oasisbench.runners.accuracy import AccuracyConfig, _vllm_plan
    from oasisbench.runners.vllm_point import plan_vllm_point
    from oasiskv_runtime.vllm.options import VllmOptions

    for mode in ("proxy-prefetch", "oasiskv"):
        opts = VllmOptions(mode=mode, top_k_blocks=16, early_fetch_ratio=0.5, early_steps=4)
        assert (opts.sparse.early_cap, opts.sparse.early_steps, opts.sparse.fetch_cap) == (8, 4, 1)
        assert VllmOptions.from_dict(opts.to_dict()) == opts  # what additional_config carries to the workers
    assert VllmOptions(mode="oasiskv").sparse.early_cap == 0  # off by default
    with pytest.raises(ValueError, match="early_fetch_ratio needs a prefetching mode"):
        VllmOptions(mode="sparse-resident", early_fetch_ratio=0.5)
    for bad in ({"early_fetch_ratio": 1.5}, {"early_steps": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            VllmOptions(mode="oasiskv", **bad)
    cfg = AccuracyConfig(tasks=("niah_single_needle",), modes=("dense", "proxy-prefetch", "oasiskv"), engine="vllm",
                         output_dir=tmp_path, options=(("early_steps", 8),),
                         sweep=("early_fetch_ratio", ("0.25", "1.0")))
    plans = [(mode, setting, _vllm_plan(cfg, mode, setting)) for mode, setting in cfg.settings()]
    assert plans[0][0] == "dense" and plans[0][2].plugin is None
    assert [(m, p.plugin["early_fetch_ratio"], p.plugin["early_steps"]) for m, _, p in plans[1:]] == [
        ("proxy-prefetch", 0.25, 8), ("proxy-prefetch", 1.0, 8), ("oasiskv", 0.25, 8), ("oasiskv", 1.0, 8)]
    point = {"model": "smollm2-135m-random", "mode": "oasiskv", "device": "cpu", "dtype": "float32", "seed": 0,
             "context_len": 512, "concurrency": 2, "max_num_batched_tokens": 256, "draft": "auto",
             "early_fetch_ratio": 0.5}
    assert plan_vllm_point(point).plugin["early_fetch_ratio"] == 0.5  # a throughput point: no longer refused
    with pytest.raises(ValueError, match="early_fetch_ratio"):
        AccuracyConfig(tasks=("niah_single_needle",), modes=("dense", "sparse-resident"), engine="vllm",
                       output_dir=tmp_path, options=(("early_fetch_ratio", 0.5),))


def _record_caps(monkeypatch):
    """Every prefetch's (seq_ids, cap, row caps) at layer 0."""
    seen = []
    real = LookaheadPipeline.prefetch

    def prefetch(self, layer, batch, pred_q, cap, row_cap=None, **kw):
        if layer == 0:
            seen.append((list(batch.seq_ids), cap, None if row_cap is None else row_cap.tolist()))
        real(self, layer, batch, pred_q, cap, row_cap, **kw)

    monkeypatch.setattr(LookaheadPipeline, "prefetch", prefetch)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["proxy-prefetch", "oasiskv"])
def test_a_requests_first_decode_steps_get_the_early_cap(tiny, monkeypatch, mode):  # noqa: F811
    """Staggered arrivals: at every prefetch, a request in its first ``early_steps`` decode steps has the early cap
    (K * 0.5 = 4 here), the others the fixed cap (1), in a plan as wide as the early cap."""
    seen = _record_caps(monkeypatch)
    n_early = 3
    llm = LLM(tiny, mode=mode, top_k_blocks=8, block_size=4, fetch_ratio=0.05, early_fetch_ratio=0.5,
              early_steps=n_early, draft="ngram", max_num_batched_tokens=16)
    eng, pending = llm.engine, list(zip(STUDY_PROMPTS * 2, [12, 9, 7, 10]))
    while pending or eng.has_unfinished():
        if pending and eng.stats.num_steps % 4 == 0:
            p, n = pending.pop(0)
            eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        eng.step()
    decoded: dict[int, int] = {}
    both = set()
    for seq_ids, cap, caps in seen:
        assert cap == 4 and caps is not None
        for sid, c in zip(seq_ids, caps):
            decoded[sid] = decoded.get(sid, 0) + 1
            assert c == (4 if decoded[sid] <= n_early else 1), (sid, decoded[sid], c)
        both |= set(caps)
    assert both == {1, 4} and len(decoded) == 4


@pytest.mark.slow
def test_without_the_option_the_prefetch_has_one_cap(tiny, monkeypatch):  # noqa: F811
    seen = _record_caps(monkeypatch)
    for extra in ({}, {"early_fetch_ratio": 0.05}):  # an early cap no larger than the fixed one changes nothing
        seen.clear()
        LLM(tiny, mode="oasiskv", top_k_blocks=8, block_size=4, fetch_ratio=0.25, draft="ngram", **extra).generate(
            STUDY_PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert seen and all(cap == 2 and caps is None for _, cap, caps in seen)


@pytest.mark.slow
def test_an_early_cap_over_every_step_is_that_fixed_cap(tiny):  # noqa: F811
    """early_fetch_ratio r for more steps than any request decodes selects exactly what fetch_ratio r does."""
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(mode="oasiskv", top_k_blocks=6, block_size=4, draft="ngram")
    fixed = LLM(tiny, fetch_ratio=0.5, **kw)
    early = LLM(tiny, fetch_ratio=0.05, early_fetch_ratio=0.5, early_steps=100, **kw)
    want = [o.token_ids for o in fixed.generate(STUDY_PROMPTS, p)]
    assert [o.token_ids for o in early.generate(STUDY_PROMPTS, p)] == want
    a, b = fixed.engine.run_stats(), early.engine.run_stats()
    assert a["fetched_blocks_per_step"] == b["fetched_blocks_per_step"] > 0
    assert a["deferred_blocks_per_step"] == b["deferred_blocks_per_step"]


@pytest.mark.slow
def test_early_caps_in_the_static_layout_equal_eager(tiny):  # noqa: F811
    """The per-request caps are made on the device from the step stamp (no host read): a step laid out on the
    static buffers (the CUDA-graph layout, here on the CPU) selects what the eager step does."""
    kw = dict(early_fetch_ratio=0.67, early_steps=4)
    eager, st_e = staggered(tiny, "oasiskv", "off", **kw)
    static, st_s = staggered(tiny, "oasiskv", "static", **kw)
    assert static == eager and st_s["split_steps"] > 5
    assert st_s["fetched_blocks_per_step"] == st_e["fetched_blocks_per_step"]
    assert st_s["deferred_blocks_per_step"] == st_e["deferred_blocks_per_step"]
    plain, st_p = staggered(tiny, "oasiskv", "off")
    assert st_p["fetched_blocks_per_step"] != st_e["fetched_blocks_per_step"]  # the option did something


@pytest.mark.gpu
@pytest.mark.slow
def test_early_caps_under_cuda_graphs_equal_eager_on_cuda(tiny):  # noqa: F811
    kw = dict(early_fetch_ratio=0.67, early_steps=4)
    eager, st_e = staggered(tiny, "oasiskv", "off", device="cuda", **kw)
    graphs, st_g = staggered(tiny, "oasiskv", "auto", device="cuda", **kw)
    assert graphs == eager
    assert st_g["fetched_blocks_per_step"] == st_e["fetched_blocks_per_step"]
