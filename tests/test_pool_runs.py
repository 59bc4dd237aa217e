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
