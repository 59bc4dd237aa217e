"""Prefill pool traffic by copy engines: a sequence's pool rows as runs of consecutive rows (plain Python), and
the runs applied with ``copy_`` equal the UVA kernels' references, the device tier included. The engine with
``copy_engine_prefill`` on and off (CUDA) is in tests/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime.ops import uva_gather as ug
from oasiskv_runtime.transfer.runs import PoolRun, copy_runs, pool_runs


def test_consecutive_blocks_make_one_run_and_breaks_split_it():
    assert pool_runs([3, 4, 5], 0, 12, 0, 4) == [PoolRun(False, 12, 0, 12)]
    # a break in the ids, a partial first block, rows written from buffer row 7
    assert pool_runs([3, 4, 9, 10], 2, 13, 7, 4) == [PoolRun(False, 14, 7, 6), PoolRun(False, 36, 13, 7)]
    # the tier: ids from 6 on are device blocks 0, 1, ...; a run never crosses the parts
    assert pool_runs([4, 5, 6, 7], 0, 16, 0, 4, tier_first=6) == [PoolRun(False, 16, 0, 8), PoolRun(True, 0, 8, 8)]
    assert pool_runs([2], 1, 0, 0, 4) == []


@pytest.mark.parametrize("seed", range(4))
def test_runs_copied_equal_the_kernel_references(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, h, d, n_host, n_tier = 4, 3, 5, 23, 11
    mk = lambda n: torch.randn(n, bs, h, d, generator=gen)  # noqa: E731
    hk, hv, tk, tv = mk(n_host), mk(n_host), mk(n_tier), mk(n_tier)
    tier = ug.PoolTier(tk, tv, n_host)
    # a block table of mostly consecutive ids in both parts, with breaks
    table = (list(range(5, 9)) + [2, 3] + list(range(n_host + 4, n_host + 9)) + [17, 18, 11])[:14]
    ctx = 14 * bs - int(torch.randint(0, bs, (1,), generator=gen))
    prefix = int(torch.randint(1, ctx, (1,), generator=gen))

    # read: the prefix, as uva_gather_blocks_ref with the tier
    want_k, want_v = ug.uva_gather_blocks_ref(hk, hv, torch.tensor(table), prefix, tier=tier)
    buf = (torch.zeros(ctx, h, d), torch.zeros(ctx, h, d))
    copy_runs(pool_runs(table, 0, prefix, 0, bs, n_host), (hk, hv), (tk, tv), buf, to_pool=False)
    assert torch.equal(buf[0][:prefix], want_k) and torch.equal(buf[1][:prefix], want_v)

    # write: the chunk's rows from the step's rows (starting at row 3), as uva_scatter_rows_ref with the tier
    start, n = 3, ctx - prefix
    k, v = torch.randn(start + n + 2, h, d, generator=gen), torch.randn(start + n + 2, h, d, generator=gen)
    rows = torch.tensor([table[p // bs] * bs + p % bs for p in range(prefix, ctx)])
    ref = [t.clone() for t in (hk, hv, tk, tv)]
    ug.uva_scatter_rows_ref(k[start:start + n], v[start:start + n], ref[0], ref[1], rows,
                            tier=ug.PoolTier(ref[2], ref[3], n_host))
    copy_runs(pool_runs(table, prefix, n, start, bs, n_host), (hk, hv), (tk, tv), (k, v), to_pool=True)
    for got, want in zip((hk, hv, tk, tv), ref):
        assert torch.equal(got, want)


def test_a_tier_run_without_a_tier_is_an_error():
    t = torch.zeros(2, 4, 1, 1)
    with pytest.raises(ValueError, match="tier"):
        copy_runs([PoolRun(True, 0, 0, 1)], (t, t), None, (t.view(-1, 1, 1), t.view(-1, 1, 1)), to_pool=False)


# ---- the engine: the copy-engine path's data flow on the CPU (streams are no-ops there) ----------------------
PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 9, [300, 12] * 20, list(range(40, 40 + 77)), [3, 4, 5, 6] * 5]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("runs"), "qwen3", max_position_embeddings=4096))


@pytest.mark.parametrize("mode,tier", [("proxy-prefetch", False), ("oasiskv", False), ("oasiskv", True)])
@pytest.mark.slow
def test_engine_copy_path_equals_the_kernel_path_on_cpu(tiny, mode, tier, monkeypatch):
    """The device prefill path (13-token chunks, block 4: prefixes end mid-block, prompts end mid-block, decode
    rows share steps with chunks) with the pool's prefill traffic planned as runs and copied, against the same
    path through the UVA kernels' references: same tokens, same traffic; with ``tier``, a host pool of 6 blocks."""
    from oasiskv_runtime import LLM, SamplingParams
    import oasiskv_runtime.transfer.prefill_io as prefill_io

    calls = []
    real = prefill_io.copy_runs
    monkeypatch.setattr(prefill_io, "copy_runs", lambda runs, *a, **k: (calls.append(len(runs)), real(runs, *a, **k)))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bb = LLM(tiny, mode=mode, block_size=4, top_k_blocks=2).engine.block_bytes
    pools = dict(host_kv_bytes=6 * bb, device_tier=True, kv_cache_bytes=400 * bb) if tier else {}
    out = []
    for on in (True, False):
        llm = LLM(tiny, mode=mode, block_size=4, top_k_blocks=2, fetch_ratio=0.5, max_num_batched_tokens=13,
                  copy_engine_prefill=on, **pools)
        llm.engine.backend.device_prefill = True
        n = len(calls)
        outs = llm.generate(PROMPTS, greedy)
        used = len(calls) - n
        st = llm.engine.run_stats()
        out.append(([o.token_ids for o in outs], st["fetched_blocks_per_step"], st["peak_device_tier_bytes"] > 0))
        assert (used > 0) == on
    assert out[0] == out[1] and out[0][2] == tier
