"""The device tier of the full-KV pool (``CacheConfig.device_tier``): once the host pool is full, host-pool
modes keep further full-KV blocks in the device KV budget, listed as ``tier_first + device id``.

Ops: every pool read and write with a tier equals the same op on one pool that is the host part and the tier
side by side. Bookkeeping: spill order, freeing, admission. Engine: with a small sparse budget the tier changes
nothing but where blocks live (same tokens, same traffic as with a host pool large enough), and it admits more
requests than the host pool alone."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import Mode
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager
from oasiskv_runtime.engine.sequence import Sequence
from oasiskv_runtime.ops import uva_gather as ug
from tests.tiny_models import write_tiny

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pools(gen, n_host, n_tier, bs, h, d, dtype=torch.float32):
    """(host k, host v, tier k, tier v, the two side by side as one pool k, v)."""
    mk = lambda n: torch.randn(n, bs, h, d, generator=gen).to(dtype)  # noqa: E731
    hk, hv, tk, tv = mk(n_host), mk(n_host), mk(n_tier), mk(n_tier)
    return hk, hv, tk, tv, torch.cat([hk, tk]), torch.cat([hv, tv])


@pytest.mark.parametrize("n_host,n_tier,bs,h,d", [(13, 7, 4, 3, 5), (1, 29, 16, 2, 64), (31, 1, 8, 5, 48)])
def test_tiered_gather_equals_one_pool(n_host, n_tier, bs, h, d):
    gen = torch.Generator().manual_seed(n_host * 100 + n_tier)
    hk, hv, tk, tv, ck, cv = _pools(gen, n_host, n_tier, bs, h, d)
    n, n_dev = 41, 23
    src = torch.randint(0, n_host + n_tier, (n,), generator=gen)
    src[torch.rand(n, generator=gen) < 0.2] = -1          # unused entries of a fixed-size plan
    dst = torch.randperm(n_dev * h, generator=gen)[:n]
    dst, heads = dst // h, dst % h                            # distinct (block, head) targets
    want_k, want_v = torch.zeros(n_dev, bs, h, d), torch.zeros(n_dev, bs, h, d)
    ug.uva_gather_ref(ck, cv, want_k, want_v, src, dst, heads)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    tier = ug.PoolTier(tk, tv, n_host)
    assert ug.uva_gather(hk, hv, got_k, got_v, src, dst, heads, tier=tier) == "ref"
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    table = torch.randint(0, n_host + n_tier, (9,), generator=gen)
    num_tokens = 9 * bs - bs // 2
    wk, wv = ug.uva_gather_blocks_ref(ck, cv, table, num_tokens, num_tokens + 3)
    gk, gv = ug.uva_gather_blocks(hk, hv, table, num_tokens, num_tokens + 3, tier=tier)
    assert torch.equal(gk[:num_tokens], wk[:num_tokens]) and torch.equal(gv[:num_tokens], wv[:num_tokens])


def test_tiered_scatter_equals_one_pool():
    gen = torch.Generator().manual_seed(7)
    n_host, n_tier, bs, h, d = 11, 6, 4, 3, 7
    hk, hv, tk, tv, ck, cv = _pools(gen, n_host, n_tier, bs, h, d)
    n = 37
    rows = torch.randperm((n_host + n_tier) * bs, generator=gen)[:n]
    k, v = torch.randn(n, h, d, generator=gen), torch.randn(n, h, d, generator=gen)
    ug.uva_scatter_rows_ref(k, v, ck, cv, rows)
    ug.uva_scatter_rows(k, v, hk, hv, rows, tier=ug.PoolTier(tk, tv, n_host))
    assert torch.equal(torch.cat([hk, tk]), ck) and torch.equal(torch.cat([hv, tv]), cv)
    # a row of -1 writes nothing
    before = hk.clone()
    ug.uva_scatter_rows_ref(k[:2], v[:2], hk, hv, torch.tensor([-1, -1]))
    assert torch.equal(hk, before)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,bs,h,d,programs", [(torch.bfloat16, 16, 8, 128, 32), (torch.float32, 8, 3, 48, 0)])
def test_tiered_kernels_match_reference_on_cuda(dtype, bs, h, d, programs):
    """Pinned host part, CUDA tier: the kernels (one masked launch per part) against the reference, for the
    decode gather, the prefill block read and the token-row write."""
    gen = torch.Generator().manual_seed(3)
    n_host, n_tier, n = 37, 19, 211
    hk, hv, tk, tv, _, _ = _pools(gen, n_host, n_tier, bs, h, d, dtype)
    hk, hv, tk, tv = hk.pin_memory(), hv.pin_memory(), tk.cuda(), tv.cuda()
    tier = ug.PoolTier(tk, tv, n_host)
    src = torch.randint(0, n_host + n_tier, (n,), generator=gen)
    src[torch.rand(n, generator=gen) < 0.2] = -1
    n_dev = 2 * n                                             # room for n distinct (block, head) targets
    flat = torch.randperm(n_dev * h, generator=gen)[:n]
    dst, heads = flat // h, flat % h
    a = torch.zeros(n_dev, bs, h, d, dtype=dtype, device="cuda")
    b = torch.zeros_like(a)
    ra, rb = a.clone(), b.clone()
    ug.uva_gather_ref(hk, hv, ra, rb, src, dst, heads, tier=ug.PoolTier(tk, tv, n_host))
    ug.uva_gather(hk, hv, a, b, src.cuda(), dst.cuda(), heads.cuda(), programs=programs, tier=tier)
    torch.cuda.synchronize()
    assert torch.equal(a, ra) and torch.equal(b, rb)

    table = torch.randint(0, n_host + n_tier, (13,), generator=gen)
    wk, wv = ug.uva_gather_blocks_ref(hk, hv, table.cuda(), 13 * bs - 5, tier=tier)
    gk, gv = ug.uva_gather_blocks(hk, hv, table.cuda(), 13 * bs - 5, tier=tier)
    torch.cuda.synchronize()
    assert torch.equal(gk, wk) and torch.equal(gv, wv)

    rows = torch.randperm((n_host + n_tier) * bs, generator=gen)[:n]
    k = torch.randn(n, h, d, generator=gen).to(dtype)
    v = torch.randn(n, h, d, generator=gen).to(dtype)
    want = [hk.clone(), hv.clone(), tk.clone(), tv.clone()]
    ug.uva_scatter_rows_ref(k, v, want[0], want[1], rows, tier=ug.PoolTier(want[2], want[3], n_host))
    ug.uva_scatter_rows(k.cuda(), v.cuda(), hk, hv, rows.cuda(), programs=programs, tier=tier)
    torch.cuda.synchronize()
    for got, w in zip((hk, hv, tk, tv), want):
        assert torch.equal(got, w)


# ---- bookkeeping ----------------------------------------------------------------------------------------
def _seq(n_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(list(range(n_prompt)), SamplingParams(max_tokens=max_tokens))


def test_manager_spills_past_the_host_pool_into_the_device_pool():
    kv = KVCacheManager(Mode.OASISKV, 4, num_device_blocks=60, num_host_blocks=10, top_k_blocks=3,
                        max_model_len=1000, device_tier=True)
    a, b = _seq(32), _seq(40)
    assert kv.allocate(a, 32)                                  # 8 host blocks; device: 4 ws + 2 summary
    assert kv.blocks(a).host_blocks == list(range(8)) and kv.blocks(a).num_tier == 0
    assert kv.allocate(b, 40)                    # 10 blocks: 2 on the host, 8 in the tier; + 4 ws + 3 summary
    ids = kv.blocks(b).host_blocks
    assert ids[:2] == [8, 9] and all(i >= kv.tier_first == 10 for i in ids[2:])
    assert kv.blocks(b).num_tier == 8 == kv.tier_blocks_used
    assert kv.device_pool.num_used == 6 + 7 + 8
    assert kv.device_blocks_held(b) == 7 + 8 and kv.device_blocks_held(a) == 6
    kv.free(b)
    assert kv.tier_blocks_used == 0 and kv.host_pool.num_free == 2 and kv.device_pool.num_used == 6
    kv.free(a)
    assert kv.host_pool.num_free == 10 and kv.device_pool.num_free == 60


def test_manager_admission_counts_the_spill_against_the_device_budget():
    def manager(tier):
        return KVCacheManager(Mode.OASISKV, 4, num_device_blocks=30, num_host_blocks=10, top_k_blocks=3,
                              max_model_len=1000, device_tier=tier)

    no_tier, tier = manager(False), manager(True)
    big = _seq(60)                                             # 15 full-KV blocks + 4 ws + 4 summary
    assert not no_tier.can_admit(big) and not no_tier.allocate(big, 60)
    assert tier.can_admit(big) and tier.allocate(big, 60)      # 10 host; 5 tier + 8 = 13 device blocks
    assert tier.device_pool.num_free == 17
    fits, too_big = _seq(40), _seq(44)     # all in the tier: 10 + 4 ws + 3 summary = 17; 11 + 4 + 3 = 18
    assert tier.can_admit(fits) and not tier.can_admit(too_big) and not tier.allocate(too_big, 44)
    with pytest.raises(ValueError, match="host KV pool too small"):
        no_tier.check_fits_alone(_seq(60))
    tier.check_fits_alone(_seq(60))
    with pytest.raises(ValueError, match="device tier"):
        manager(True).check_fits_alone(_seq(200))


# ---- the engine ---------------------------------------------------------------------------------------------
PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 9, [300, 12] * 20, list(range(40, 40 + 77)), [3, 4, 5, 6] * 5]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tier"), "qwen3", max_position_embeddings=4096))


def _block_bytes(tiny):
    return LLM(tiny, mode="oasiskv", block_size=4, top_k_blocks=4).engine.block_bytes


@pytest.mark.parametrize("mode", ["fetch-on-demand", "oasiskv"])
@pytest.mark.slow
def test_engine_tier_changes_where_blocks_live_not_what_it_computes(tiny, mode):
    """A host pool of 12 blocks (the four requests need ~90): with the tier the rest goes to the device budget,
    and tokens and fetch counts equal a run whose host pool holds everything, with a budget of 4 blocks per
    head and a cap of 1 copy (blocks are evicted and re-fetched from both parts)."""
    bb = _block_bytes(tiny)
    kw = dict(mode=mode, block_size=4, top_k_blocks=4, fetch_ratio=0.25, max_num_batched_tokens=16,
              kv_cache_bytes=400 * bb)
    big = LLM(tiny, host_kv_bytes=400 * bb, **kw)
    tiered = LLM(tiny, host_kv_bytes=12 * bb, device_tier=True, **kw)
    runs = []
    for llm in (big, tiered):
        outs = llm.generate(PROMPTS, GREEDY)
        st = llm.engine.run_stats()
        runs.append(([o.token_ids for o in outs], st["fetched_blocks_per_step"], st["max_running_batch"]))
    assert runs[0] == runs[1]
    st = tiered.engine.run_stats()
    assert st["peak_device_tier_bytes"] > 40 * bb and big.engine.run_stats()["peak_device_tier_bytes"] == 0
    assert tiered.engine.kv.tier_blocks_used == 0 and tiered.engine.kv.device_pool.num_used == \
        tiered.engine.kv.scratch_blocks[0]


@pytest.mark.slow
def test_engine_tier_admits_more_requests_than_the_host_pool_alone(tiny):
    bb = _block_bytes(tiny)
    prompts = [list(range(10 + i, 70 + i)) for i in range(6)]  # 60 + 8 tokens: 17 blocks each
    kw = dict(mode="oasiskv", block_size=4, top_k_blocks=4, kv_cache_bytes=80 * bb, host_kv_bytes=40 * bb)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batches = []
    for tier in (False, True):
        llm = LLM(tiny, device_tier=tier, **kw)
        outs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == 8 for o in outs)
        batches.append(llm.engine.run_stats()["max_running_batch"])
    assert batches[0] == 2 and batches[1] > batches[0]


def test_engine_tier_refuses_prefill_decode_staging(tiny):
    llm = LLM(tiny, mode="oasiskv", block_size=4, top_k_blocks=4, device_tier=True)
    with pytest.raises(ValueError, match="device tier"):
        llm.engine.add_request([1, 2, 3, 4, 5], GREEDY, stage_kv=True)


@pytest.mark.gpu
@needs_cuda
def test_engine_tier_on_cuda_equals_a_large_host_pool(tmp_path):
    """The asynchronous pipeline, the kernels and CUDA graphs read and write both parts; the same tokens and
    traffic as a host pool that holds everything."""
    path = str(write_tiny(tmp_path, "qwen3", head_dim=64, max_position_embeddings=4096))
    probe = LLM(path, device="cuda", dtype="float32", mode="oasiskv", block_size=16, top_k_blocks=4,
                host_kv_bytes=1 << 24)
    bb = probe.engine.block_bytes
    del probe
    kw = dict(device="cuda", dtype="float32", mode="oasiskv", block_size=16, top_k_blocks=2, fetch_ratio=0.5,
              kv_cache_bytes=200 * bb)
    runs = []
    for host, tier in ((200 * bb, False), (4 * bb, True)):
        llm = LLM(path, host_kv_bytes=host, device_tier=tier, **kw)
        outs = llm.generate(PROMPTS * 2, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        st = llm.engine.run_stats()
        runs.append(([o.token_ids for o in outs], st["fetched_blocks_per_step"], st["peak_device_tier_bytes"] > 0))
    assert runs[0][:2] == runs[1][:2]
    assert runs[1][2] and not runs[0][2]


def test_suite_and_cli_reach_the_engine_config(tmp_path):
    from typer.testing import CliRunner

    from oasisbench.cli.main import app
    from oasisbench.runners.throughput import plan_points
    from oasisbench.suites import SuiteError, load_suite

    path = tmp_path / "s.yaml"
    path.write_text("name: t\nkind: throughput\ndefaults: {model: smollm2-135m, device: cpu}\n"
                    "points:\n  - {mode: oasiskv, context_len: 256, concurrency: 2, device_tier: true}\n"
                    "  - {mode: oasiskv, context_len: 256, concurrency: 2}\n")
    planned = plan_points(load_suite(path).expand())
    assert [pp.engine.cache.device_tier for pp in planned] == [True, False]
    assert "device_tier" not in planned[1].pid  # old run directories resume: the default adds nothing to ids
    path.write_text("name: t\nkind: throughput\npoints:\n  - {mode: oasiskv, device_tier: 1}\n")
    with pytest.raises(SuiteError, match="device_tier"):
        load_suite(path)
    res = CliRunner().invoke(app, ["throughput", "--help"])
    assert "--device-tier" in res.output
