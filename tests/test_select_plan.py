"""The fused selection + transfer plan of one layer (``oasiskv_runtime/ops/select_plan.py``).

CPU: the reference against Algorithm 2 run row by row (``select_head``) and the plan's meaning (every admitted
slot's copy listed once, nothing else). The Triton kernel against the reference on fresh random inputs with odd
sizes: on CUDA (``-m gpu``) and in Triton's interpreter (``tests/kernel_devices.py``; how it was written without a
GPU at hand).
"""
from __future__ import annotations

import pytest
import torch

from oasiskv_runtime.ops.select_plan import select_plan, select_plan_ref
from oasiskv_runtime.core.selector import select_head
from tests.kernel_devices import KERNEL_DEVICES


def _inputs(gen, R, H, K, P, n, nlog, device="cpu"):
    """A layer's per-head map over ``R`` state rows (distinct residents, holes), recency stamps, and ``n``
    requests' predictions overlapping their residents, padded with -1 at random positions."""
    smap = torch.full((R, H, K), -1, dtype=torch.long)
    for r in range(R):
        for h in range(H):
            res = torch.randperm(nlog, generator=gen)[:K]
            res[torch.rand(K, generator=gen) < 0.3] = -1
            smap[r, h] = res
    ls = torch.randint(-1, 9, (R, H, K), generator=gen)
    ls[smap < 0] = -1
    rows = torch.randperm(R, generator=gen)[:n]
    pred = torch.full((n, H, P), -1, dtype=torch.long)
    for b in range(n):
        for h in range(H):
            res = smap[rows[b], h]
            pool = torch.cat([res[res >= 0], torch.randperm(nlog, generator=gen)]).unique(sorted=False)
            pick = pool[torch.randperm(pool.numel(), generator=gen)][:P]
            pick[torch.rand(pick.numel(), generator=gen) < 0.15] = -1
            pred[b, h, :pick.numel()] = pick
    primary = torch.randperm(10 * nlog, generator=gen)[:nlog].repeat(n, 1) + 1000 * torch.arange(n)[:, None]
    slot_blocks = torch.randint(0, 500, (n, K), generator=gen)
    to = lambda t: t.to(device)  # noqa: E731
    return to(smap), to(ls), to(rows), to(pred), to(primary), to(slot_blocks)


def _run(fn, smap, ls, rows, pred, cap, step, primary, slot_blocks, R, fill):
    smap, ls = smap.clone(), ls.clone()
    dev = smap.device
    fetched = torch.zeros((), dtype=torch.long, device=dev)
    deferred = None if fill else torch.zeros((), dtype=torch.long, device=dev)
    req = None if fill else torch.zeros(R, dtype=torch.long, device=dev)
    src, dst, head = fn(smap, ls, rows, pred, cap, step, primary, slot_blocks, fetched, deferred, req)
    return dict(smap=smap, ls=ls, fetched=fetched, deferred=deferred, req=req, src=src, dst=dst, head=head)


def _copies(out, n, H, c):
    """Per (request, head): the sorted valid (src, dst) pairs, and the unused entries' values."""
    src, dst = out["src"].view(n, H, c).cpu(), out["dst"].view(n, H, c).cpu()
    valid = src >= 0
    pairs = {(b, h): sorted(zip(src[b, h][valid[b, h]].tolist(), dst[b, h][valid[b, h]].tolist()))
             for b in range(n) for h in range(H)}
    return pairs, set(src[~valid].tolist()) | set(dst[~valid].tolist())


CASES = [  # R, H, K, P, n, nlog, cap
    (9, 3, 13, 13, 5, 40, 2),
    (7, 2, 13, 9, 7, 30, 13),
    (5, 1, 7, 7, 3, 11, 0),
    (12, 8, 128, 128, 6, 1024, 7),
    (4, 3, 33, 20, 2, 90, 50),
]


@pytest.mark.parametrize("R,H,K,P,n,nlog,cap", CASES)
@pytest.mark.parametrize("fill", [False, True])
def test_reference_is_algorithm_2_and_lists_every_admitted_copy(R, H, K, P, n, nlog, cap, fill):
    gen = torch.Generator().manual_seed(R * 1000 + K * 10 + cap)
    smap, ls, rows, pred, primary, slot_blocks = _inputs(gen, R, H, K, P, n, nlog)
    step = 11
    out = _run(select_plan_ref, smap, ls, rows, pred, cap, step, primary, slot_blocks, R, fill)
    c = max(1, min(K, cap))
    assert out["src"].shape == (n * H * c,)
    assert out["head"].view(n, H, c).eq(torch.arange(H)[None, :, None]).all()
    pairs, unused = _copies(out, n, H, c)
    assert unused <= {-1}
    total = deferred = 0
    others = torch.ones(R, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out["smap"][others], smap[others]) and torch.equal(out["ls"][others], ls[others])
    for b in range(n):
        r = int(rows[b])
        for h in range(H):
            blocks, stamps = smap[r, h].tolist(), ls[r, h].tolist()
            ref = select_head(blocks, stamps, [x for x in pred[b, h].tolist() if x >= 0], cap, step)
            assert out["smap"][r, h].tolist() == blocks
            assert out["ls"][r, h].tolist() == stamps
            want = sorted((int(primary[b, blk]), int(slot_blocks[b, s])) for s, blk in ref.admitted)
            assert pairs[(b, h)] == want
            total += ref.num_admitted
            deferred += ref.num_deferred
    assert int(out["fetched"]) == total
    if not fill:
        assert int(out["deferred"]) == deferred
        per_req = torch.zeros(R, dtype=torch.long)
        for (b, _), p in pairs.items():
            per_req[rows[b]] += len(p)
        assert torch.equal(out["req"], per_req)


def test_bad_arguments_are_refused():
    gen = torch.Generator().manual_seed(0)
    smap, ls, rows, pred, primary, slot_blocks = _inputs(gen, 4, 2, 5, 5, 2, 20)
    z = torch.zeros((), dtype=torch.long)
    with pytest.raises(ValueError, match="pred must be"):
        select_plan(smap, ls, rows, pred[:, :1], 1, 0, primary, slot_blocks, z)
    with pytest.raises(ValueError, match="go together"):
        select_plan(smap, ls, rows, pred, 1, 0, primary, slot_blocks, z, deferred=z)
    with pytest.raises(ValueError, match="backend"):
        select_plan(smap, ls, rows, pred, 1, 0, primary, slot_blocks, z, backend="cuda")


def _kernel_vs_ref(device, R, H, K, P, n, nlog, cap, fill, strided):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    smap, ls, rows, pred, primary, slot_blocks = _inputs(gen, R, H, K, P, n, nlog, device)
    if strided:  # the engine passes one layer of [R, L, H, K] tables
        L = 3
        big_map = torch.full((R, L, H, K), -7, dtype=torch.long, device=device)
        big_ls = torch.full((R, L, H, K), -7, dtype=torch.long, device=device)
        big_map[:, 1], big_ls[:, 1] = smap, ls
        smap, ls = big_map[:, 1], big_ls[:, 1]
        pred = pred.int()  # the ranking kernel's dtype
    step = torch.tensor(5, device=device)
    ref = _run(select_plan_ref, smap, ls, rows, pred.long(), cap, step, primary, slot_blocks, R, fill)
    ker = _run(lambda *a: select_plan(*a, backend="triton"), smap, ls, rows, pred, cap, step, primary,
               slot_blocks, R, fill)
    for key in ("smap", "ls", "fetched", "deferred", "req", "head"):
        if ref[key] is not None:
            assert torch.equal(ref[key].cpu(), ker[key].cpu()), key
    c = max(1, min(K, cap))
    assert _copies(ref, n, H, c) == _copies(ker, n, H, c)


KERNEL_CASES = CASES + [(70, 8, 128, 128, 64, 1100, 7)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R,H,K,P,n,nlog,cap", KERNEL_CASES)
@pytest.mark.parametrize("fill,strided", [(False, True), (True, False), (False, False)])
def test_kernel_matches_reference(R, H, K, P, n, nlog, cap, fill, strided, device):
    _kernel_vs_ref(device, R, H, K, P, n, nlog, cap, fill, strided)


def _row_caps(gen, n, cap, device="cpu"):
    """Per-request caps in ``[-1, cap + 2]``: out-of-range ones must clip to ``[0, cap]``."""
    return torch.randint(-1, cap + 3, (n,), generator=gen).to(device)


def _compacted(fn, row_cap, *args):
    """``fn`` with per-request caps: its plan, and the copies it lists as a sorted list of (src, dst, head)."""
    count = torch.zeros((), dtype=torch.int32, device=row_cap.device)
    out = _run(lambda *a: fn(*a, row_cap=row_cap, count=count), *args)
    m = int(count)
    src, dst, head = (out[x].cpu() for x in ("src", "dst", "head"))
    assert (src[:m] >= 0).all() and (dst[:m] >= 0).all(), "the first count entries are the copies"
    assert (src[m:] == -1).all() and (dst[m:] == -1).all(), "every later entry is unused"
    assert m == int(out["fetched"])
    return out, sorted(zip(src[:m].tolist(), dst[:m].tolist(), head[:m].tolist()))


@pytest.mark.parametrize("R,H,K,P,n,nlog,cap", [c for c in CASES if c[-1] > 0])
def test_row_caps_are_each_requests_own_cap_in_a_compacted_plan(R, H, K, P, n, nlog, cap):
    """``row_cap`` (early_fetch_ratio's per-request caps): each request's rows are selected as with its own cap
    alone (clipped to ``[0, cap]``), and the plan lists every copy of those selections first, then only -1."""
    gen = torch.Generator().manual_seed(R * 7 + K + cap)
    smap, ls, rows, pred, primary, slot_blocks = _inputs(gen, R, H, K, P, n, nlog)
    row_cap = _row_caps(gen, n, cap)
    out, copies = _compacted(select_plan_ref, row_cap, smap, ls, rows, pred, cap, 11, primary, slot_blocks, R, False)
    assert out["src"].shape == (n * H * max(1, min(K, cap)),)
    want = []
    for b in range(n):
        own = min(max(int(row_cap[b]), 0), cap)
        alone = _run(select_plan_ref, smap, ls, rows[b:b + 1], pred[b:b + 1], own, 11, primary[b:b + 1],
                     slot_blocks[b:b + 1], R, False)
        r = int(rows[b])
        assert torch.equal(out["smap"][r], alone["smap"][r]) and torch.equal(out["ls"][r], alone["ls"][r])
        assert int(out["req"][r]) == int(alone["req"][r])
        valid = alone["src"] >= 0
        want += zip(alone["src"][valid].tolist(), alone["dst"][valid].tolist(), alone["head"][valid].tolist())
    assert copies == sorted(want)


def test_row_caps_of_the_wrong_shape_or_without_a_count_are_refused():
    gen = torch.Generator().manual_seed(1)
    smap, ls, rows, pred, primary, slot_blocks = _inputs(gen, 4, 2, 5, 5, 2, 20)
    z = torch.zeros((), dtype=torch.long)
    count = torch.zeros((), dtype=torch.int32)
    with pytest.raises(ValueError, match="row_cap must be"):
        select_plan(smap, ls, rows, pred, 1, 0, primary, slot_blocks, z, row_cap=torch.ones(3, dtype=torch.long),
                    count=count)
    with pytest.raises(ValueError, match="row_cap and count go together"):
        select_plan(smap, ls, rows, pred, 1, 0, primary, slot_blocks, z, row_cap=torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="row_cap and count go together"):
        select_plan(smap, ls, rows, pred, 1, 0, primary, slot_blocks, z, row_cap=torch.ones(2, dtype=torch.long),
                    count=z)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R,H,K,P,n,nlog,cap", [c for c in KERNEL_CASES if c[-1] > 0])
def test_kernel_matches_reference_with_row_caps(R, H, K, P, n, nlog, cap, device):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    smap, ls, rows, pred, primary, slot_blocks = _inputs(gen, R, H, K, P, n, nlog, device)
    row_cap = _row_caps(gen, n, cap, device)
    step = torch.tensor(5, device=device)
    ref, ref_copies = _compacted(select_plan_ref, row_cap, smap, ls, rows, pred, cap, step, primary, slot_blocks, R,
                                 False)
    ker, ker_copies = _compacted(lambda *a, **kw: select_plan(*a, **kw, backend="triton"), row_cap, smap, ls, rows,
                                 pred.int(), cap, step, primary, slot_blocks, R, False)
    for key in ("smap", "ls", "fetched", "deferred", "req"):
        assert torch.equal(ref[key].cpu(), ker[key].cpu()), key
    assert ref_copies == ker_copies
