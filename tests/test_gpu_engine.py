"""The engine on CUDA: every mode runs through the kernels and the asynchronous prefetch pipeline."""

from __future__ import annotations

import pytest

from oasiskv_runtime import LLM, SamplingParams
from tests.tiny_models import write_tiny

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 9, [300, 12] * 20, list(range(40, 40 + 77))]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
HOST = 1 << 28  # host pool: the CUDA default (64 GiB) takes ~40 s to pin per engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 64: the kernels' supported sizes are 64 and 128
    return str(write_tiny(tmp_path_factory.mktemp("gpu"), "qwen3", head_dim=64, max_position_embeddings=4096))


@pytest.mark.parametrize("block_size", [16, 8])  # 8: a block size issue #34's study may sweep
@pytest.mark.parametrize("mode", ["sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"])
def test_full_budget_matches_dense_on_cuda(tiny, mode, block_size):
    dense = LLM(tiny, device="cuda", dtype="float32").generate(PROMPTS, GREEDY)
    llm = LLM(tiny, device="cuda", dtype="float32", mode=mode, top_k_blocks=64, block_size=block_size,
              host_kv_bytes=HOST)
    outs = llm.generate(PROMPTS, GREEDY)
    for o, d in zip(outs, dense):
        agree = sum(a == b for a, b in zip(o.token_ids, d.token_ids))
        assert agree == len(d.token_ids), (mode, o.token_ids, d.token_ids)


@pytest.mark.parametrize("mode", ["proxy-prefetch", "oasiskv"])
def test_async_pipeline_small_budget_bf16(tiny, mode):
    llm = LLM(tiny, device="cuda", dtype="bfloat16", mode=mode, top_k_blocks=2, fetch_ratio=0.5,
              measure_recall=True, host_kv_bytes=HOST)
    assert llm.engine.backend.background
    outs = llm.generate(PROMPTS, GREEDY)
    st = llm.engine.run_stats()
    assert all(len(o.token_ids) == 32 for o in outs)
    assert st["fetched_blocks_per_step"] > 0 and st["prediction_recall"] is not None
    # The per-step maximum is counted on the device too (it read 0 on the async path before).
    assert st["max_fetched_bytes_per_step"] >= st["fetched_bytes_per_step"] > 0
    assert sum(o.metrics["fetched_blocks"] for o in outs) > 0


@pytest.mark.parametrize("mode", ["proxy-prefetch", "oasiskv"])
def test_fused_selection_kernel_equals_its_reference_in_the_engine(tiny, mode):
    """The prefetch pipeline with the fused selection + plan kernel and with its PyTorch composition
    (select_kernel=False): the same tokens and the same traffic counters, with a budget of 4 blocks and a cap
    of 1 copy per head and step, so blocks are admitted and evicted as the context grows."""
    runs = []
    for fused in (True, False):
        llm = LLM(tiny, device="cuda", dtype="float32", mode=mode, top_k_blocks=4, fetch_ratio=0.25,
                  select_kernel=fused, host_kv_bytes=HOST)
        outs = llm.generate(PROMPTS, GREEDY)
        st = llm.engine.run_stats()
        runs.append(([o.token_ids for o in outs], [o.metrics["fetched_blocks"] for o in outs],
                     st["fetched_blocks_per_step"], st["deferred_blocks_per_step"]))
    assert runs[0] == runs[1]
    assert runs[0][2] > 0  # blocks were admitted (this tiny model's selections never defer: measured 0)


@pytest.mark.parametrize("tier", [False, True])
def test_copy_engine_prefill_equals_the_uva_kernels(tiny, tier):
    """Prefill chunks of 29 tokens (block 16: prefixes read back mid-block) with the pool's prefill traffic by the
    copy engines and by the UVA kernels (copy_engine_prefill=False): the same tokens and traffic, with a budget
    of 4 blocks; with ``tier``, a host pool of 3 blocks and the rest of the full KV in the device tier."""
    probe = LLM(tiny, device="cuda", dtype="float32", mode="oasiskv", top_k_blocks=4, host_kv_bytes=HOST)
    bb = probe.engine.block_bytes
    del probe
    pools = dict(host_kv_bytes=3 * bb, device_tier=True, kv_cache_bytes=400 * bb) if tier else \
        dict(host_kv_bytes=HOST)
    runs = []
    for ce in (True, False):
        llm = LLM(tiny, device="cuda", dtype="float32", mode="oasiskv", top_k_blocks=4, fetch_ratio=0.25,
                  max_num_batched_tokens=29, copy_engine_prefill=ce, **pools)
        outs = llm.generate(PROMPTS, GREEDY)
        st = llm.engine.run_stats()
        runs.append(([o.token_ids for o in outs], st["fetched_blocks_per_step"], st["peak_device_tier_bytes"] > 0))
    assert runs[0] == runs[1]
    assert runs[0][2] == tier


def test_pipeline_priority_reaches_the_streams_and_changes_no_token(tiny):
    """The prefetch pipeline's streams at a higher CUDA priority (graphs captured on them keep it): the same
    tokens and traffic as at the default priority, with a budget small enough that blocks are admitted."""
    runs = []
    for prio in (0, -1):
        llm = LLM(tiny, device="cuda", dtype="float32", mode="oasiskv", top_k_blocks=4, fetch_ratio=0.25,
                  pipeline_priority=prio, host_kv_bytes=HOST)
        outs = llm.generate(PROMPTS, GREEDY)
        assert all((s.priority < 0) == (prio < 0) for s in llm.engine.backend.pipeline.streams), prio
        runs.append(([o.token_ids for o in outs], llm.engine.run_stats()["fetched_blocks_per_step"]))
    assert runs[0] == runs[1] and runs[0][1] > 0


@pytest.mark.parametrize("mode", ["proxy-prefetch", "oasiskv"])
def test_demand_fetch_on_cuda_attends_what_fetch_on_demand_attends(tiny, mode):
    """demand_fetch through the CUDA pipeline (side streams, the fetch kernels): the step's own top-K misses come
    over before it attends, so at a small budget its tokens are fetch-on-demand's, and the misses are counted."""
    small = dict(device="cuda", dtype="float32", top_k_blocks=3, block_size=8, fetch_ratio=0.34, draft="ngram",
                 host_kv_bytes=HOST)
    ref = [o.token_ids for o in LLM(tiny, mode="fetch-on-demand", **small).generate(PROMPTS, GREEDY)]
    llm = LLM(tiny, mode=mode, demand_fetch=True, **small)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    stats = llm.engine.run_stats()
    assert stats["demand_fetched_blocks_per_step"] > 0 and stats["fetched_blocks_per_step"] > 0
