"""``accept_drafts``: oasiskv emits the draft row's token when the model's own token equals the draft (two tokens a
step, as vLLM's speculative decoding). Outputs stay exact, the accepted draft's KV is kept everywhere a computed
token's is (pool, local block, key summary), and a rejected draft's is kept nowhere."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.core.batch import summary_row
from tests.test_sparse_modes import GREEDY, PROMPTS
from tests.tiny_models import write_tiny


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp(request.param), request.param, max_position_embeddings=16384))


@pytest.mark.slow
def test_accepted_drafts_with_a_covering_budget_equal_dense_in_fewer_steps(tiny):
    dense = [o.token_ids for o in LLM(tiny).generate(PROMPTS, GREEDY)]
    runs = {}
    for accept in (False, True):
        llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, max_num_batched_tokens=16, draft="ngram",
                  accept_drafts=accept)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == dense
        runs[accept] = llm.engine.run_stats()
    on, off = runs[True], runs[False]
    assert off["tokens_per_step"] is None and off["spec_decode_acceptance_rate"] is None
    assert 0 < on["spec_decode_acceptance_rate"] <= on["draft_accuracy"]
    assert on["tokens_per_step"] == pytest.approx(1 + on["spec_decode_acceptance_rate"])
    assert on["num_steps"] < off["num_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_demand_fetch_with_accepted_drafts_attends_a_completed_block_once(tiny, device):
    """demand_fetch ranks the step's own candidates: not the block an accepted draft completed, which the step attends
    in its local slot (the gap column); admitted as well it was attended twice, and a covering budget gave other
    tokens than dense. On CUDA through the side streams and the fetch kernels (float32: the same tokens as dense)."""
    on = dict(device=device, dtype="float32", **({"host_kv_bytes": 1 << 28} if device == "cuda" else {}))  # pin less
    dense = [o.token_ids for o in LLM(tiny, **on).generate(PROMPTS, GREEDY)]
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, max_num_batched_tokens=16, draft="ngram",
              accept_drafts=True, demand_fetch=True, **on)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == dense
    assert llm.engine.runner.sparse_inputs.gap_rows > 0  # some steps attended a gap block


def _check_kept_kv(engine) -> int:
    """For every request past its first decode step: each block's key summary equals the min / max of the keys in its pool rows, and
    the local block holds the pool's keys of the active block. Returns how many requests were checked."""
    be, kv, bs = engine.backend, engine.kv, engine.kv.block_size
    checked = 0
    for seq in engine.scheduler.running:
        n = seq.num_computed_tokens
        rb = kv.requests.get(seq.seq_id)
        if rb is None or seq.seq_id not in be.head_map.ready or n <= len(seq.prompt_token_ids):
            continue
        for layer in range(be.num_layers):
            k, _ = be.pool.read_host(layer, rb.host_blocks, n)
            mins, maxs = (t.flatten(0, 1) for t in be.summaries.read(layer))
            for j in range(-(-n // bs)):
                row = summary_row(rb.summary_blocks, j, bs)
                keys = k[j * bs:min(n, (j + 1) * bs)]
                torch.testing.assert_close(mins[row], keys.amin(0), rtol=0, atol=0)
                torch.testing.assert_close(maxs[row], keys.amax(0), rtol=0, atol=0)
            active = (n - 1) // bs
            local = be.dev_cache.k[layer][rb.local_block(n - 1, bs)][: n - active * bs]
            torch.testing.assert_close(local, k[active * bs:n], rtol=0, atol=0)
        checked += 1
    return checked


@pytest.mark.slow
def test_an_accepted_draft_keeps_its_kv_and_a_rejected_one_leaves_none(tiny):
    """A small budget (2 blocks of 4 per KV head), greedy and seeded sampled requests: after every step each
    decoding request's summaries, pool and local block agree, and drafts were both accepted and rejected."""
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=2, block_size=4, max_num_batched_tokens=32, draft="ngram",
              accept_drafts=True)
    engine = llm.engine
    params = [GREEDY, SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)] * 2
    for prompt, p in zip(PROMPTS, params):
        engine.add_request(list(prompt), p)
    checked, done = 0, []
    while engine.has_unfinished():
        done += engine.step()
        checked += _check_kept_kv(engine)
    assert checked > 20 and len(done) == len(PROMPTS)
    assert engine.runner.sparse_inputs.gap_rows > 0  # drafts completing a block were accepted
    assert all(len(s.output_token_ids) == 40 for s in done)
    st = engine.run_stats()
    assert 0 < st["spec_decode_acceptance_rate"] < st["draft_accuracy"] + 1e-9 and st["draft_accuracy"] < 1.0


@pytest.mark.parametrize("overrides, message", [
    ({"mode": "dense"}, "needs mode oasiskv"),
    ({"mode": "proxy-prefetch"}, "needs mode oasiskv"),
    ({"mode": "oasiskv", "draft": "layerskip:2"}, "n-gram drafts"),
    ({"mode": "oasiskv", "draft": "ngram+layerskip:2"}, "n-gram drafts"),
    ({"mode": "oasiskv", "draft": "ngram", "dense_layers": 1}, "dense_layers"),
])
def test_accept_drafts_is_refused_where_it_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_overrides("smollm2-135m-random", accept_drafts=True, **overrides)
    EngineConfig.from_overrides("smollm2-135m-random", mode="oasiskv", draft="ngram:2", accept_drafts=True)


def test_reports_name_a_point_that_accepts_drafts_apart():
    from oasisbench.results.schema import label_mode, series_label

    assert series_label({"mode": "oasiskv", "accept_drafts": True}) == "oasiskv+accept"
    assert series_label({"mode": "oasiskv", "accept_drafts": False}) == "oasiskv"
    assert label_mode("oasiskv+accept") == "oasiskv"


def test_prefill_decode_refuses_accept_drafts():
    from oasiskv_runtime.pd.workers import check_pd_config

    config = EngineConfig.from_overrides("smollm2-135m-random", mode="oasiskv", draft="ngram", accept_drafts=True)
    with pytest.raises(ValueError, match="accept_drafts is not supported with prefill-decode"):
        check_pd_config(config)


@pytest.mark.slow
def test_the_static_layout_accepts_drafts_as_the_eager_steps_do(tiny):
    """CUDA graphs' input layout (``cuda_graphs='static'``: no capture, so it runs on the CPU) gives the eager
    engine's tokens at a small budget, where gap blocks and accepted block ends occur."""
    kw = dict(mode="oasiskv", top_k_blocks=2, block_size=4, max_num_batched_tokens=32, draft="ngram",
              accept_drafts=True)
    eager = LLM(tiny, cuda_graphs="off", **kw)
    static = LLM(tiny, cuda_graphs="static", **kw)
    assert [o.token_ids for o in static.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    st = static.engine.run_stats()
    assert st["static_eager_steps"] > 10 and st["spec_decode_acceptance_rate"] > 0
    assert static.engine.runner.sparse_inputs.gap_rows > 0
    assert st["spec_decode_acceptance_rate"] == eager.engine.run_stats()["spec_decode_acceptance_rate"]


@pytest.mark.parametrize("fill_query", ["draft", "last"])
def test_fill_query_picks_the_row_that_predicts_the_first_working_set(tiny, fill_query, monkeypatch):
    """The working set filled when a prefill completes is predicted from the prefill step's draft row (``draft``,
    the default) or from the last prompt token's row (``last``: what the vLLM plug-in does, vLLM proposing no draft
    on a prefill step). Greedy tokens at a covering budget are dense's either way."""
    from oasiskv_runtime.core.pipeline import LookaheadPipeline

    seen = []
    fill = LookaheadPipeline.fill

    def spy(self, layer, batch, query, *args, **kw):
        seen.append(batch.q_rows.tolist())
        return fill(self, layer, batch, query, *args, **kw)

    monkeypatch.setattr(LookaheadPipeline, "fill", spy)
    prompt = PROMPTS[0][:30]  # one chunk of 30 rows; the draft row (n-gram: the prompt repeats) comes after them
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, draft="ngram", fill_query=fill_query)
    out = llm.generate([prompt], params)[0].token_ids
    assert seen and all(rows == ([29] if fill_query == "last" else [30]) for rows in seen)
    assert out == LLM(tiny).generate([prompt], params)[0].token_ids
    with pytest.raises(ValueError, match="fill_query"):
        EngineConfig.from_overrides(tiny, mode="oasiskv", fill_query="first")


def test_options_read_at_start_cannot_change_on_a_running_engine(tiny):
    """``configure`` (A/B runs on one engine) refuses accept_drafts (it sizes the working sets' local blocks) and
    fill_query (the step builder reads it at start) rather than half-applying them; their own value is a no-op."""
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=8, block_size=4, draft="ngram")
    be = llm.engine.backend
    for key, value in (("accept_drafts", True), ("fill_query", "last")):
        with pytest.raises(ValueError, match=f"{key} is fixed when the engine starts"):
            be.configure(**{key: value})
    be.configure(accept_drafts=False, fill_query="draft", fetch_ratio=0.5)
    assert be.sparse.fetch_ratio == 0.5
