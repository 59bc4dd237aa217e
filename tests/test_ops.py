"""Tests of the GPU ops and their plain-PyTorch references.

CPU (default run): each ``*_ref`` against an independent naive loop on small odd sizes.
GPU (``-m gpu``, skipped without CUDA): each kernel against its reference on fresh
random CUDA inputs, outputs poisoned first so unwritten elements show up.
"""
from __future__ import annotations

import math

import pytest
import torch

from oasiskv_runtime.ops import score_topk as st
from oasiskv_runtime.ops import sparse_attention as sa
from oasiskv_runtime.ops import summary_update as su
from oasiskv_runtime.ops import uva_gather as ug
from tests.kernel_devices import KERNEL_DEVICES

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _gen(seed=None):
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed() % (2**31))
    return g


# ======================================================================================
# Input makers
# ======================================================================================
def make_attn_inputs(B, Qn, Hkv, g, D, BS, N, NB, extra, dtype=torch.float32, device="cpu",
                     hole_p=0.3, gen=None, empty_head=False):
    gen = gen or _gen()
    Hq = Hkv * g
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q = r(B, Qn, Hq, D)
    kc, vc = r(NB, BS, Hkv, D), r(NB, BS, Hkv, D)
    bids = torch.randint(0, NB, (B, Hkv, N), generator=gen, dtype=torch.int32)
    bids[torch.rand(B, Hkv, N, generator=gen) < hole_p] = -1
    if empty_head:
        bids[0, 0] = -1  # a head with only the local block
    lb = torch.randint(0, NB, (B,), generator=gen, dtype=torch.int32)
    ll = torch.randint(1, BS + 1, (B,), generator=gen, dtype=torch.int32)
    ll[0] = 1
    if B > 1:
        ll[-1] = BS
    ek = r(B, Hkv, D) if extra else None
    ev = r(B, Hkv, D) if extra else None
    dev = lambda t: t.to(device)  # noqa: E731
    return q, kc, vc, dev(bids), dev(lb), dev(ll), ek, ev


def naive_attention(q, kc, vc, bids, lb, ll, scale, ek=None, ev=None):
    """Token-by-token loop in float64: the independent oracle for the reference."""
    B, Qn, Hq, D = q.shape
    BS, Hkv = kc.shape[1], kc.shape[2]
    g = Hq // Hkv
    out = torch.zeros(B, Qn, Hq, D, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // g
            keys, vals = [], []
            for blk in bids[b, h].tolist():
                if blk < 0:
                    continue
                for t in range(BS):
                    keys.append(kc[blk, t, h].double())
                    vals.append(vc[blk, t, h].double())
            for t in range(int(ll[b])):
                keys.append(kc[int(lb[b]), t, h].double())
                vals.append(vc[int(lb[b]), t, h].double())
            for qi in range(Qn):
                ks, vs = list(keys), list(vals)
                if qi == 1 and ek is not None:
                    ks.append(ek[b, h].double())
                    vs.append(ev[b, h].double())
                qv = q[b, qi, hq].double()
                s = torch.stack([qv.dot(k) * scale for k in ks])
                p = torch.softmax(s, 0)
                out[b, qi, hq] = (p[:, None] * torch.stack(vs)).sum(0)
    return out


def make_summary_inputs(B, Hkv, g, D, BS, n_pages, NB, dtype=torch.float32, device="cpu",
                        integer=False, gen=None):
    gen = gen or _gen()
    Hq = Hkv * g
    if integer:  # small integers: every score is exact in fp32 in any summation order
        r = lambda *s: torch.randint(-3, 4, s, generator=gen).to(dtype)  # noqa: E731
    else:
        r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    q = r(B, Hq, D)
    a, c = r(NB, BS, Hkv, D), r(NB, BS, Hkv, D)
    smin, smax = torch.minimum(a, c), torch.maximum(a, c)
    table = torch.stack([torch.randperm(NB, generator=gen)[:n_pages] for _ in range(B)]).int()
    nc = torch.randint(1, n_pages * BS + 1, (B,), generator=gen)
    nc[0] = 3  # fewer candidates than k
    if B > 1:
        nc[1] = n_pages * BS
    # pages past the candidates are unallocated
    for b in range(B):
        used = math.ceil(int(nc[b]) / BS)
        table[b, used:] = -1
    return tuple(t.to(device) for t in (q, smin, smax, table, nc))


def naive_scores(q, smin, smax, table, nc, Hkv):
    B, Hq, D = q.shape
    BS = smin.shape[1]
    g = Hq // Hkv
    res = {}
    for b in range(B):
        for h in range(Hkv):
            sc = []
            for j in range(int(nc[b])):
                page, row = int(table[b, j // BS]), j % BS
                best = -math.inf
                for gi in range(g):
                    qv = q[b, h * g + gi].double()
                    s = torch.maximum(qv * smin[page, row, h].double(),
                                      qv * smax[page, row, h].double()).sum().item()
                    best = max(best, s)
                sc.append(best)
            res[b, h] = sc
    return res


def naive_topk(scores: dict, B, Hkv, k):
    ids = torch.full((B, Hkv, k), -1, dtype=torch.int32)
    for (b, h), sc in scores.items():
        order = sorted(range(len(sc)), key=lambda j: (-sc[j], j))[:k]
        ids[b, h, :len(order)] = torch.tensor(order, dtype=torch.int32)
    return ids


# ======================================================================================
# CPU: reference vs naive loop
# ======================================================================================
@pytest.mark.parametrize("BS,Qn,extra,D", [(16, 2, True, 48), (8, 2, True, 48), (16, 1, False, 48),
                                           (8, 2, False, 64), (16, 2, True, 64)])
def test_attention_ref_matches_naive(BS, Qn, extra, D):
    gen = _gen(1234 + BS + Qn + D)
    B, Hkv, g, N, NB = 3, 3, 3, 5, 23
    q, kc, vc, bids, lb, ll, ek, ev = make_attn_inputs(B, Qn, Hkv, g, D, BS, N, NB, extra,
                                                       gen=gen, empty_head=True)
    scale = D ** -0.5
    ref = sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, scale, ek, ev)
    nv = naive_attention(q, kc, vc, bids, lb, ll, scale, ek, ev)
    assert ref.shape == (B, Qn, Hkv * g, D)
    torch.testing.assert_close(ref.double(), nv, rtol=1e-5, atol=1e-5)


def naive_slot_lse(q, kc, bids, scale, num_full=None):
    """Per (request, KV head, group member, slot): log-sum-exp of the normal row's scaled logits over the slot's
    block, a float64 loop (-inf for an empty slot or one past num_full)."""
    B, _, Hq, D = q.shape
    Hkv, N = bids.shape[1], bids.shape[2]
    g = Hq // Hkv
    out = torch.full((B, Hkv, g, N), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            for j in range(N):
                blk = int(bids[b, h, j])
                if blk < 0 or (num_full is not None and j >= int(num_full[b])):
                    continue
                for i in range(g):
                    logits = kc[blk, :, h].double() @ q[b, 0, h * g + i].double() * scale
                    out[b, h, i, j] = torch.logsumexp(logits, 0)
    return out


@pytest.mark.parametrize("Qn,extra,BS,with_counts", [(2, True, 16, False), (1, False, 8, True), (2, True, 8, True)])
def test_attention_ref_slot_lse_matches_naive(Qn, extra, BS, with_counts):
    """The normal row's per-slot log-sum-exp (attended_blocks' feedback), written beside the output without changing
    it: the local block, the draft's own K/V and padding past num_full are not slots."""
    gen = _gen(41 + Qn + BS)
    B, Hkv, g, D, N, NB = 4, 3, 3, 40, 7, 29
    q, kc, vc, bids, lb, ll, ek, ev = make_attn_inputs(B, Qn, Hkv, g, D, BS, N, NB, extra, gen=gen, empty_head=True)
    nf = None
    if with_counts:
        nf, bids, _ = _padded_tables(gen, B, Hkv, N, NB)
    lse = torch.full((B, Hkv, g, N), float("nan"))
    out = sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, 0.21, ek, ev, num_full=nf, slot_lse=lse)
    want = naive_slot_lse(q, kc, bids, 0.21, nf)
    assert torch.equal(torch.isinf(lse), torch.isinf(want)) and torch.isinf(want).any()
    fin = torch.isfinite(want)
    torch.testing.assert_close(lse[fin].double(), want[fin], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, 0.21, ek, ev,
                                                                   num_full=nf), rtol=0, atol=0)
    with pytest.raises(ValueError, match="slot_lse"):
        sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, 0.21, ek, ev, slot_lse=lse[..., :-1])


def test_attention_normal_row_never_sees_draft_kv():
    gen = _gen(7)
    q, kc, vc, bids, lb, ll, ek, ev = make_attn_inputs(3, 2, 3, 3, 48, 16, 6, 20, True, gen=gen)
    with_x = sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, 0.2, ek, ev)
    without = sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, 0.2)
    torch.testing.assert_close(with_x[:, 0], without[:, 0], rtol=0, atol=0)
    assert (with_x[:, 1] - without[:, 1]).abs().max() > 1e-4


def test_attention_dispatch_cpu_and_validation():
    gen = _gen(3)
    args = make_attn_inputs(2, 2, 3, 3, 48, 8, 4, 11, True, gen=gen)
    q, kc, vc, bids, lb, ll, ek, ev = args
    out = sa.sparse_decode_attention(q, kc, vc, bids, lb, ll, 0.1, ek, ev)
    ref = sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, 0.1, ek, ev)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(ValueError):
        sa.sparse_decode_attention_ref(q[:, :1], kc, vc, bids, lb, ll, 0.1, ek, ev)
    with pytest.raises(ValueError):
        sa.sparse_decode_attention_ref(q[..., :4, :], kc, vc, bids, lb, ll, 0.1)  # Hq % Hkv
    cfg = sa.default_config(64, 8, 128, 16, 128)
    assert cfg["slots"] * 16 >= 16 and cfg["n_splits"] >= 1


@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.parametrize("BS", [16, 8])
def test_score_topk_ref_matches_naive(integer, BS):
    gen = _gen(99 + BS + int(integer))
    B, Hkv, g, D, n_pages, NB, k = 3, 3, 3, 48, 4, 17, 10
    q, smin, smax, table, nc = make_summary_inputs(B, Hkv, g, D, BS, n_pages, NB,
                                                   integer=integer, gen=gen)
    ids, nv = st.score_topk_ref(q, smin, smax, table, nc, k, Hkv)
    scores = naive_scores(q, smin, smax, table, nc, Hkv)
    assert ids.dtype == torch.int32 and ids.shape == (B, Hkv, k)
    assert nv.tolist() == [min(k, int(c)) for c in nc]
    s_ref = st.quest_scores_ref(q, smin, smax, table, nc, Hkv)
    for (b, h), sc in scores.items():
        torch.testing.assert_close(s_ref[b, h, :len(sc)].double(), torch.tensor(sc,
                                   dtype=torch.float64), rtol=1e-5, atol=1e-4)
        assert torch.isinf(s_ref[b, h, len(sc):]).all()
    if integer:  # exact scores: the ranking (ties -> lower index) must match exactly
        assert torch.equal(ids, naive_topk(scores, B, Hkv, k))
    else:
        naive = naive_topk(scores, B, Hkv, k)
        assert torch.equal(ids == -1, naive == -1)


def test_score_topk_ties_go_to_lower_index():
    B, Hkv, g, D, BS, NB, k = 2, 3, 3, 48, 8, 9, 20
    q = torch.ones(B, Hkv * g, D)
    smin = torch.zeros(NB, BS, Hkv, D)
    smax = torch.zeros(NB, BS, Hkv, D)
    smax[:, 5] = 1.0  # every block with j % 8 == 5 scores D, the rest 0 (all ties)
    table = torch.tensor([[4, 2, 7], [1, 0, 3]], dtype=torch.int32)
    nc = torch.tensor([24, 13])
    ids, nv = st.score_topk_ref(q, smin, smax, table, nc, k, Hkv)
    exp0 = [5, 13, 21] + [j for j in range(24) if j % 8 != 5][:17]
    exp1 = [5] + [j for j in range(13) if j != 5] + [-1] * 7
    assert ids[0, 0].tolist() == exp0 and ids[1, 2].tolist() == exp1
    assert nv.tolist() == [20, 13]


def test_select_topk_signed_zero_and_padding():
    s = torch.tensor([[[0.0, -0.0, 1.0, -0.0, float("-inf")]]])
    ids, nv = st.select_topk(s, torch.tensor([4]), 6)
    assert ids[0, 0].tolist() == [2, 0, 1, 3, -1, -1] and nv.tolist() == [4]


def naive_summary_update(k_new, rows, reset, smin, smax):
    """Row by row: base = +-inf if a resetting token hits the row, else the old value."""
    fmin = smin.view(-1, *smin.shape[2:])
    fmax = smax.view(-1, *smax.shape[2:])
    for r in sorted(set(rows.tolist())):
        toks = [t for t in range(len(rows)) if int(rows[t]) == r]
        if any(bool(reset[t]) for t in toks):
            mn = torch.full_like(fmin[r], math.inf)
            mx = torch.full_like(fmax[r], -math.inf)
        else:
            mn, mx = fmin[r].clone(), fmax[r].clone()
        for t in toks:
            mn = torch.minimum(mn, k_new[t].to(mn.dtype))
            mx = torch.maximum(mx, k_new[t].to(mx.dtype))
        fmin[r], fmax[r] = mn, mx


def _prefill_chunk(gen, NB, BS_sum, Hkv, D, kv_block=16, start=21, T=53, dtype=torch.float32):
    """Tokens start..start+T-1 of one request; logical block j = pos // kv_block; its
    summary row = page[j // BS_sum] * BS_sum + j % BS_sum; reset on each block's first token."""
    pos = torch.arange(start, start + T)
    j = pos // kv_block
    pages = torch.randperm(NB, generator=gen)[: int(j.max()) // BS_sum + 1]
    rows = pages[j // BS_sum] * BS_sum + j % BS_sum
    reset = pos % kv_block == 0
    k_new = torch.randn(T, Hkv, D, generator=gen).to(dtype)
    return k_new, rows.long(), reset


@pytest.mark.parametrize("BS_sum", [16, 8])
def test_summary_update_ref_matches_naive(BS_sum):
    gen = _gen(5 + BS_sum)
    NB, Hkv, D = 7, 3, 48
    smin = torch.randn(NB, BS_sum, Hkv, D, generator=gen)
    smax = smin + torch.rand(NB, BS_sum, Hkv, D, generator=gen)
    # prefill chunk (many tokens per row) then decode tokens (distinct rows, random resets)
    k_new, rows, reset = _prefill_chunk(gen, NB, BS_sum, Hkv, D)
    a, b = smin.clone(), smax.clone()
    su.update_summaries_ref(k_new, rows, reset, a, b)
    naive_summary_update(k_new, rows, reset, smin, smax)
    assert torch.equal(a, smin) and torch.equal(b, smax)
    T = 9
    rows = torch.randperm(NB * BS_sum, generator=gen)[:T]
    reset = torch.rand(T, generator=gen) < 0.4
    k_new = torch.randn(T, Hkv, D, generator=gen)
    su.update_summaries(k_new, rows, reset, a, b)  # CPU dispatch -> reference
    naive_summary_update(k_new, rows, reset, smin, smax)
    assert torch.equal(a, smin) and torch.equal(b, smax)


def test_summary_prefill_equals_blockwise_minmax():
    gen = _gen(11)
    NB, BS_sum, Hkv, D = 5, 8, 3, 48
    smin = torch.randn(NB, BS_sum, Hkv, D, generator=gen)
    smax = smin.clone()
    k_new, rows, reset = _prefill_chunk(gen, NB, BS_sum, Hkv, D, start=16, T=40)
    su.update_summaries_ref(k_new, rows, reset, smin, smax)
    fmin, fmax = smin.view(-1, Hkv, D), smax.view(-1, Hkv, D)
    for blk in range(3):  # tokens 16..55: blocks 1, 2 full, block 3 has 8 tokens
        sel = slice(blk * 16, min(blk * 16 + 16, 40))
        r = int(rows[sel][0])
        assert torch.equal(fmin[r], k_new[sel].amin(0)) and torch.equal(fmax[r], k_new[sel].amax(0))


def naive_gather(host_k, host_v, dev_k, dev_v, src, dst, heads):
    for i in range(len(src)):
        s, d, h = int(src[i]), int(dst[i]), int(heads[i])
        for t in range(host_k.shape[1]):
            dev_k[d, t, h] = host_k[s, t, h]
            dev_v[d, t, h] = host_v[s, t, h]


def _gather_inputs(gen, NBh, NBd, BS, Hkv, D, n, dtype=torch.float32):
    hk = torch.randn(NBh, BS, Hkv, D, generator=gen).to(dtype)
    hv = torch.randn(NBh, BS, Hkv, D, generator=gen).to(dtype)
    dk = torch.randn(NBd, BS, Hkv, D, generator=gen).to(dtype)
    dv = torch.randn(NBd, BS, Hkv, D, generator=gen).to(dtype)
    src = torch.randint(0, NBh, (n,), generator=gen)
    pairs = torch.randperm(NBd * Hkv, generator=gen)[:n]  # distinct (dst, head) pairs
    return hk, hv, dk, dv, src, pairs // Hkv, pairs % Hkv


@pytest.mark.parametrize("BS,D", [(16, 48), (8, 64)])
def test_uva_gather_ref_matches_naive(BS, D):
    gen = _gen(17 + BS)
    hk, hv, dk, dv, src, dst, heads = _gather_inputs(gen, 29, 13, BS, 3, D, 11)
    a, b = dk.clone(), dv.clone()
    used = ug.uva_gather(hk, hv, a, b, src.int(), dst.int(), heads.int())  # CPU -> ref
    assert used == "ref"
    naive_gather(hk, hv, dk, dv, src, dst, heads)
    assert torch.equal(a, dk) and torch.equal(b, dv)


def test_ops_import_without_triton_kernels():
    # the modules import everywhere; kernels are only built on first GPU use
    for m in (sa, st, su, ug):
        assert hasattr(m, "_kernels")


# ======================================================================================
# GPU: kernel vs reference
# ======================================================================================
def _rel(out, ref):
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in kernel output (unwritten element?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


ATTN_CASES = [
    # B, Qn, Hkv, g, D, BS, N, NB, extra, dtype, config
    (3, 2, 3, 3, 64, 16, 7, 41, True, torch.bfloat16, None),
    (3, 2, 3, 3, 64, 16, 7, 41, True, torch.bfloat16, {"n_splits": 1}),
    (5, 2, 2, 4, 128, 16, 33, 97, True, torch.bfloat16, {"n_splits": 5, "slots": 2}),
    (4, 1, 3, 2, 128, 16, 19, 50, False, torch.bfloat16, None),
    (3, 2, 3, 3, 64, 8, 13, 37, True, torch.bfloat16, {"n_splits": 3}),
    (2, 2, 1, 5, 64, 16, 9, 20, True, torch.float32, None),
    (2, 2, 3, 3, 48, 16, 6, 20, True, torch.float32, {"n_splits": 2}),
    (5, 1, 3, 3, 64, 16, 11, 70, False, torch.float32, {"dot_prec": "ieee"}),  # plain fp32 FMAs
    (5, 2, 3, 3, 64, 16, 11, 70, True, torch.float32, {"dot_prec": "tf32x3", "n_splits": 3}),
    (7, 2, 8, 4, 128, 16, 129, 1100, True, torch.bfloat16, None),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "B{}Q{}H{}g{}D{}bs{}N{}{}{}".format(
    *c[:7], "x" if c[8] else "", str(c[9]).split(".")[-1]) + ("" if c[10] is None else str(c[10])))
def test_attention_kernel_matches_ref(case):
    B, Qn, Hkv, g, D, BS, N, NB, extra, dtype, cfg = case
    q, kc, vc, bids, lb, ll, ek, ev = make_attn_inputs(B, Qn, Hkv, g, D, BS, N, NB, extra,
                                                       dtype=dtype, device="cuda",
                                                       empty_head=True)
    scale = D ** -0.5
    out = torch.full((B, Qn, Hkv * g, D), float("nan"), dtype=dtype, device="cuda")
    sa.sparse_decode_attention(q, kc, vc, bids, lb, ll, scale, ek, ev, out=out,
                               backend="triton", config=cfg)
    up = lambda t: None if t is None else t.float()  # noqa: E731
    ref = sa.sparse_decode_attention_ref(q.float(), kc.float(), vc.float(), bids, lb, ll, scale,
                                         up(ek), up(ev))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(out, ref) < tol
    if extra:  # the normal row must be bit-identical with and without the draft's own KV
        out2 = sa.sparse_decode_attention(q, kc, vc, bids, lb, ll, scale, backend="triton",
                                          config=cfg)
        assert torch.equal(out[:, 0], out2[:, 0])


def _padded_tables(gen, B, Hkv, N, NB):
    """Dense-style tables: request b's first num_full[b] slots hold blocks (with holes), the rest are padding,
    once as -1 and once as garbage block ids (which num_full must make the kernel ignore)."""
    nf = torch.randint(0, N + 1, (B,), generator=gen, dtype=torch.int32)
    nf[0], nf[-1] = 0, N
    bids = torch.randint(0, NB, (B, Hkv, N), generator=gen, dtype=torch.int32)
    bids[torch.rand(B, Hkv, N, generator=gen) < 0.2] = -1
    past = torch.arange(N).view(1, 1, N) >= nf.view(B, 1, 1)
    return nf, bids.masked_fill(past, -1), bids


def test_attention_ref_num_full_is_padding():
    gen = _gen(23)
    q, kc, vc, _, lb, ll, ek, ev = make_attn_inputs(4, 2, 3, 3, 48, 16, 9, 40, True, gen=gen)
    nf, padded, garbage = _padded_tables(gen, 4, 3, 9, 40)
    want = sa.sparse_decode_attention_ref(q, kc, vc, padded, lb, ll, 0.2, ek, ev)
    got = sa.sparse_decode_attention_ref(q, kc, vc, garbage, lb, ll, 0.2, ek, ev, num_full=nf)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_full"):
        sa.sparse_decode_attention_ref(q, kc, vc, padded, lb, ll, 0.2, ek, ev, num_full=nf[:2])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("Qn,extra,cfg", [(1, False, None), (2, True, None), (2, True, {"n_splits": 4}),
                                          (1, False, {"n_splits": 3, "dot_prec": "ieee"})])
def test_attention_kernel_num_full(Qn, extra, cfg):
    """Counts end each request's loop at its last slot: same result as the padded table without counts, and
    padding slots are never read (garbage ids there change nothing)."""
    gen = _gen(31 + Qn)
    B, Hkv, N, NB = 6, 3, 37, 300
    q, kc, vc, _, lb, ll, ek, ev = make_attn_inputs(B, Qn, Hkv, 3, 64, 16, N, NB, extra, device="cuda", gen=gen)
    nf, padded, garbage = (t.cuda() for t in _padded_tables(gen, B, Hkv, N, NB))
    without = sa.sparse_decode_attention(q, kc, vc, padded, lb, ll, 0.125, ek, ev, backend="triton", config=cfg)
    got = sa.sparse_decode_attention(q, kc, vc, garbage, lb, ll, 0.125, ek, ev, backend="triton", config=cfg,
                                     num_full=nf)
    ref = sa.sparse_decode_attention_ref(q, kc, vc, padded, lb, ll, 0.125, ek, ev)
    assert _rel(got, ref) < 1e-5 and _rel(without, ref) < 1e-5
    torch.testing.assert_close(got, without, rtol=1e-6, atol=1e-6)


SLOT_LSE_CASES = [
    # B, Qn, Hkv, g, D, BS, N, NB, extra, dtype, config, counts
    (3, 2, 3, 3, 64, 16, 7, 41, True, torch.bfloat16, None, False),
    (5, 2, 2, 4, 128, 16, 33, 97, True, torch.bfloat16, {"n_splits": 5, "slots": 2}, True),
    (4, 1, 3, 2, 128, 8, 19, 50, False, torch.bfloat16, {"n_splits": 3}, False),
    (5, 2, 3, 3, 64, 16, 11, 70, True, torch.float32, {"n_splits": 3}, True),
    (7, 2, 8, 4, 128, 16, 129, 1100, True, torch.bfloat16, {"n_splits": 1}, False),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", SLOT_LSE_CASES, ids=lambda c: "B{}Q{}H{}g{}D{}bs{}N{}".format(*c[:7])
                         + str(c[9]).split(".")[-1] + ("" if c[10] is None else str(c[10])) + ("nf" if c[11] else ""))
def test_attention_kernel_slot_lse_matches_ref(case):
    """The kernel's per-slot log-sum-exp against the reference's (poisoned buffer: every slot is written), splits,
    tiles of several slots, counts and the draft row included; the output is bit-identical to a launch without it."""
    B, Qn, Hkv, g, D, BS, N, NB, extra, dtype, cfg, counts = case
    gen = _gen()
    q, kc, vc, bids, lb, ll, ek, ev = make_attn_inputs(B, Qn, Hkv, g, D, BS, N, NB, extra, dtype=dtype,
                                                       device="cuda", gen=gen, empty_head=True)
    nf = None
    if counts:
        nf, _, bids = (t.cuda() for t in _padded_tables(gen, B, Hkv, N, NB))  # garbage past the counts
    scale = D ** -0.5
    lse = torch.full((B, Hkv, g, N), float("nan"), device="cuda")
    out = sa.sparse_decode_attention(q, kc, vc, bids, lb, ll, scale, ek, ev, backend="triton", config=cfg,
                                     num_full=nf, slot_lse=lse)
    plain = sa.sparse_decode_attention(q, kc, vc, bids, lb, ll, scale, ek, ev, backend="triton", config=cfg,
                                       num_full=nf)
    assert torch.equal(out, plain)
    want = torch.empty_like(lse)
    up = lambda t: None if t is None else t.float()  # noqa: E731
    sa.sparse_decode_attention_ref(q.float(), kc.float(), vc.float(), bids, lb, ll, scale, up(ek), up(ev),
                                   num_full=nf, slot_lse=want)
    assert not torch.isnan(lse).any() and torch.equal(torch.isinf(lse), torch.isinf(want))
    fin = torch.isfinite(want)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(lse[fin], want[fin], rtol=0, atol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dot_prec", [None, "ieee", "tf32x3"])
def test_attention_kernel_float32_precisions(dot_prec, device="cuda"):
    """Float32 inputs at SmolLM2's shape (3 KV heads, g=3, D=64) under each dot precision: ~fp32 accuracy,
    which plain TF32 (~1e-3) would miss. (The kernel's loop bounds are run-time values, which Triton's
    interpreter does not run: the attention kernel is tested on the GPU only.)"""
    q, kc, vc, bids, lb, ll, ek, ev = make_attn_inputs(4, 2, 3, 3, 64, 16, 9, 45, True, device=device,
                                                       gen=_gen(17), empty_head=True)
    out = sa.sparse_decode_attention(q, kc, vc, bids, lb, ll, 0.125, ek, ev, backend="triton",
                                     config={"dot_prec": dot_prec})
    ref = sa.sparse_decode_attention_ref(q, kc, vc, bids, lb, ll, 0.125, ek, ev)
    assert _rel(out, ref) < 1e-5
    with pytest.raises(ValueError, match="dot_prec"):
        sa.sparse_decode_attention(q, kc, vc, bids, lb, ll, 0.125, ek, ev, backend="triton",
                                   config={"dot_prec": "fp8"})


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype,integer,BS,D", [(torch.float32, True, 16, 128),
                                                (torch.bfloat16, True, 8, 64),
                                                (torch.bfloat16, False, 16, 128),
                                                (torch.float32, False, 16, 48)])
def test_score_topk_kernel_matches_ref(dtype, integer, BS, D, device):
    B, Hkv, g, n_pages, NB, k = 5, 3, 3, 11, 67, 37
    q, smin, smax, table, nc = make_summary_inputs(B, Hkv, g, D, BS, n_pages, NB, dtype=dtype,
                                                   integer=integer, device=device)
    s_ker = st.quest_scores(q, smin, smax, table, nc, Hkv, backend="triton")
    s_ref = st.quest_scores_ref(q, smin, smax, table, nc, Hkv)
    assert torch.equal(torch.isinf(s_ker), torch.isinf(s_ref))
    fin = ~torch.isinf(s_ref)
    torch.testing.assert_close(s_ker[fin], s_ref[fin], rtol=1e-5, atol=1e-4)
    ids, nv = st.score_topk(q, smin, smax, table, nc, k, Hkv, backend="triton")
    rids, rnv = st.score_topk_ref(q, smin, smax, table, nc, k, Hkv)
    assert torch.equal(nv, rnv) and torch.equal(ids == -1, rids == -1)
    if integer:
        assert torch.equal(ids, rids)
    else:  # near-ties may swap under a different summation order: compare score sets
        got = torch.gather(s_ref, 2, ids.clamp_min(0).long())
        want = torch.gather(s_ref, 2, rids.clamp_min(0).long())
        valid = rids >= 0
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("B,H,J,k", [(3, 3, 37, 10), (2, 2, 100, 128), (3, 2, 300, 37),
                                     (5, 8, 2048, 128), (2, 3, 5000, 100), (1, 1, 5, 3)])
def test_select_topk_triton_matches_torch(B, H, J, k, device):
    if device == "cpu" and J > 1000:
        pytest.skip("Triton's interpreter takes minutes on rows this long (the GPU run covers them)")
    gen = _gen()
    s = torch.randint(-4, 5, (B, H, J), generator=gen).float()  # many exact ties
    z = s == 0
    s[z] = torch.where(torch.rand(int(z.sum()), generator=gen) < 0.5, 0.0, -0.0)
    nc = torch.randint(1, J + 1, (B,), generator=gen)
    nc[0] = min(J, 4)
    s.masked_fill_(torch.arange(J).view(1, 1, J) >= nc.view(B, 1, 1), float("-inf"))
    s, nc = s.to(device), nc.to(device)
    ids, nv = st.select_topk(s, nc, k)
    ids_t, nv_t = st.select_topk_triton(s, nc, k)
    assert torch.equal(ids, ids_t) and torch.equal(nv, nv_t)
    ids_o, nv_o = st.select_topk_triton(s, nc.int(), k, with_valid=False)  # the engine's call: int32 counts
    assert torch.equal(ids, ids_o) and (nv_o is None or torch.equal(nv, nv_o))  # None unless it fell back
    r = torch.randn(B, H, J, generator=gen).to(device)  # distinct scores
    assert torch.equal(st.select_topk(r, nc, k)[0], st.select_topk_triton(r, nc, k)[0])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype,Hkv,D", [(torch.bfloat16, 3, 64), (torch.float32, 8, 128),
                                         (torch.bfloat16, 2, 48)])
def test_summary_update_kernel_matches_ref(dtype, Hkv, D, device):
    gen = _gen()
    NB, BS = 13, 16
    smin = torch.randn(NB, BS, Hkv, D, generator=gen).to(dtype).to(device)
    smax = (smin.float() + torch.rand(NB, BS, Hkv, D, generator=gen).to(device)).to(dtype)
    T = 37
    rows = torch.randperm(NB * BS, generator=gen)[:T].to(device)
    reset = (torch.rand(T, generator=gen) < 0.3).to(device)
    k_new = torch.randn(T, Hkv, D, generator=gen).to(dtype).to(device)
    a, b = smin.clone(), smax.clone()
    su.update_summaries_ref(k_new, rows, reset, a, b)
    su.update_summaries(k_new, rows, reset, smin, smax, assume_distinct=True, backend="triton")
    assert torch.equal(a, smin) and torch.equal(b, smax)
    # repeated rows (prefill): the wrapper must fall back to the scatter_reduce reference
    k_new, rows, reset = _prefill_chunk(gen, NB, BS, Hkv, D, dtype=dtype)
    k_new, rows, reset = k_new.to(device), rows.to(device), reset.to(device)
    su.update_summaries_ref(k_new, rows, reset, a, b)
    su.update_summaries(k_new, rows, reset, smin, smax)
    assert torch.equal(a, smin) and torch.equal(b, smax)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("src_dev,dtype,BS,Hkv,D", [("pinned", torch.bfloat16, 16, 3, 128),
                                                    ("pinned", torch.float32, 8, 3, 48),
                                                    ("cuda", torch.bfloat16, 16, 2, 64),
                                                    ("registered", torch.bfloat16, 16, 5, 64)])
@pytest.mark.parametrize("programs", [0, 7, 32])
def test_uva_gather_kernel_matches_ref(backend, src_dev, dtype, BS, Hkv, D, programs):
    """Also: entries with src = -1 (unused slots of a fixed-size plan) copy nothing; a grid of fewer CTAs
    than copies (each looping over its share) copies the same."""
    if backend == "cuda" and programs:
        pytest.skip("the CUDA C kernel has one CTA per copy")
    gen = _gen()
    hk, hv, dk, dv, src, dst, heads = _gather_inputs(gen, 301, 57, BS, Hkv, D, 113, dtype=dtype)
    src = torch.where(torch.rand(src.shape, generator=gen) < 0.2, torch.full_like(src, -1), src)
    if src_dev == "pinned":
        hk, hv = hk.pin_memory(), hv.pin_memory()
    elif src_dev == "registered":  # the engine's host pool: one exact-size cudaHostRegister'd region
        from oasiskv_runtime.transfer.host_memory import PinnedRegion

        region = PinnedRegion(PinnedRegion.bytes_for(2, tuple(hk.shape), dtype))
        hk, hv = region.take(tuple(hk.shape), dtype).copy_(hk), region.take(tuple(hv.shape), dtype).copy_(hv)
        assert hk.is_pinned() and hv.is_pinned()
    else:
        hk, hv = hk.cuda(), hv.cuda()
    dk, dv = dk.cuda(), dv.cuda()
    a, b = dk.clone(), dv.clone()
    ug.uva_gather_ref(hk, hv, a, b, src, dst, heads)
    used = ug.uva_gather(hk, hv, dk, dv, src.cuda(), dst.int(), heads.cuda(), backend=backend,
                         programs=programs)
    torch.cuda.synchronize()
    assert used == backend
    assert torch.equal(a, dk) and torch.equal(b, dv)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("programs,copies", [(0, 4), (7, 1), (7, 2), (3, 4), (32, 8)])
@pytest.mark.parametrize("tiered", [False, True])
def test_uva_gather_triton_kernel_copies_and_tier(device, programs, copies, tiered):
    """The Triton gather with several copies in flight per CTA (group sizes that do not divide the copy count)
    and a tiered pool read in the same launch (each copy from its own part) equals the reference, which takes the
    parts one at a time; 20% unused entries (src = -1) copy nothing. Interpreted, everything is on the CPU."""
    n_host = 23
    src = _check_triton_gather(_gen(programs * 10 + copies + tiered), device, n_host, 17, 101, programs, copies,
                               tiered)
    if tiered:  # the test reads both parts
        assert bool(((src >= 0) & (src < n_host)).any()) and bool((src >= n_host).any())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("programs,copies,count", [(7, 2, 0), (3, 4, 37), (32, 8, 101), (0, 4, 50)])
def test_uva_gather_triton_stops_at_the_plans_count(device, programs, copies, count):
    """A compacted plan's ``count`` (a device scalar): the Triton gather copies its first ``count`` entries and none
    after, even where later entries look like copies (a compacted plan leaves them -1 for the other backends)."""
    gen = _gen(programs + copies + count)
    BS, Hkv, D, n = 8, 3, 48, 101
    hk, hv, dk, dv, src, dst, heads = _gather_inputs(gen, 40, 57, BS, Hkv, D, n)
    if device == "cuda":
        hk, hv = hk.pin_memory(), hv.pin_memory()
    dk, dv = dk.to(device), dv.to(device)
    want_k, want_v = dk.cpu().clone(), dv.cpu().clone()
    ug.uva_gather_ref(hk.cpu(), hv.cpu(), want_k, want_v, src[:count], dst[:count], heads[:count])
    ug._gather_triton(hk, hv, dk, dv, src.to(device), dst.to(device), heads.to(device), n, programs, copies,
                      count=torch.tensor(count, dtype=torch.int32, device=device))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dk.cpu(), want_k) and torch.equal(dv.cpu(), want_v)


def _check_triton_gather(gen, device, n_host, n_tier, n, programs, copies, tiered, hint=""):
    """The Triton gather of ``n`` random copies (20% unused) from a pool of ``n_host`` blocks (plus a tier of
    ``n_tier`` read in the same launch when ``tiered``) equals the reference, and an unknown hint is refused;
    returns the source ids."""
    BS, Hkv, D = 8, 3, 48
    hk, hv, dk, dv, src, dst, heads = _gather_inputs(gen, n_host + n_tier, 57, BS, Hkv, D, n)
    src = torch.where(torch.rand(n, generator=gen) < 0.2, torch.full_like(src, -1), src)
    tier = None
    if tiered:
        tier = ug.PoolTier(hk[n_host:].clone().to(device), hv[n_host:].clone().to(device), n_host)
        hk, hv = hk[:n_host].contiguous(), hv[:n_host].contiguous()
    if device == "cuda":
        hk, hv = hk.pin_memory(), hv.pin_memory()
    dk, dv = dk.to(device), dv.to(device)
    want_k, want_v = dk.cpu().clone(), dv.cpu().clone()
    ug.uva_gather_ref(hk.cpu(), hv.cpu(), want_k, want_v, src, dst, heads,
                      tier=None if tier is None else ug.PoolTier(tier.k.cpu(), tier.v.cpu(), n_host))
    ug._gather_triton(hk, hv, dk, dv, src.to(device), dst.to(device), heads.to(device), n, programs, copies, tier,
                      hint)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dk.cpu(), want_k) and torch.equal(dv.cpu(), want_v)
    with pytest.raises(ValueError, match="unknown gather hint 'bogus'"):
        ug.uva_gather(hk, hv, dk, dv, src, dst, heads, hint="bogus")
    return src


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("hint", sorted(ug.GATHER_HINTS))
def test_uva_gather_cache_hints_copy_the_same(device, hint):
    """Every cache hint of the Triton gather (a measurement knob: bench_kernels.py --only interference) copies
    what the reference copies, tiered pool and unused entries included; an unknown hint is refused by name."""
    _check_triton_gather(_gen(len(hint) + 5), device, 19, 11, 67, 5, 2, True, hint)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("programs", [0, 5])
@pytest.mark.parametrize("tiered", [False, True])
def test_uva_scatter_triton_kernel_tier(device, programs, tiered):
    """The Triton token-row scatter, a tiered pool written in the same launch (rows past the host part go to
    the tier), rows of -1 skipped, against the reference (which takes the parts one at a time)."""
    gen = _gen(31 + programs + tiered)
    nb_host, nb_tier, bs, Hkv, D, n = 13, 6, 4, 3, 48, 29
    mk = lambda nb: torch.randn(nb, bs, Hkv, D, generator=gen)  # noqa: E731
    hk, hv, tk, tv = mk(nb_host), mk(nb_host), mk(nb_tier), mk(nb_tier)
    total = (nb_host + (nb_tier if tiered else 0)) * bs
    rows = torch.randperm(total, generator=gen)[:n]
    rows[torch.rand(n, generator=gen) < 0.2] = -1
    k, v = torch.randn(n, Hkv, D, generator=gen), torch.randn(n, Hkv, D, generator=gen)
    want = [t.clone() for t in (hk, hv, tk, tv)]
    ug.uva_scatter_rows_ref(k, v, want[0], want[1], rows,
                            tier=ug.PoolTier(want[2], want[3], nb_host) if tiered else None)
    if device == "cuda":
        hk, hv = hk.pin_memory(), hv.pin_memory()
    tk, tv = tk.to(device), tv.to(device)
    ug._scatter_triton(k.to(device), v.to(device), hk, hv, rows.to(device), programs,
                       ug.PoolTier(tk, tv, nb_host) if tiered else None)
    if device == "cuda":
        torch.cuda.synchronize()
    for got, w in zip((hk, hv, tk, tv), want):
        assert torch.equal(got.cpu(), w)
    if tiered:  # both parts were written
        assert bool(((rows >= 0) & (rows < nb_host * bs)).any()) and bool((rows >= nb_host * bs).any())


@pytest.mark.parametrize("copies", [0, 3, 6])
def test_gather_copies_must_be_a_power_of_two(copies):
    from oasiskv_runtime.config import KernelConfig

    with pytest.raises(ValueError, match="gather_copies"):
        KernelConfig(gather_copies=copies)


def test_pipeline_priority_must_not_be_positive():
    from oasiskv_runtime.config import KernelConfig

    with pytest.raises(ValueError, match="pipeline_priority must be a non-positive integer"):
        KernelConfig(pipeline_priority=1)
    assert KernelConfig(pipeline_priority=-3).pipeline_priority == -3


def test_gather_hint_is_one_the_kernel_knows():
    from oasiskv_runtime.config import KernelConfig

    with pytest.raises(ValueError, match="gather_hint must be"):
        KernelConfig(gather_hint="evict_first")
    for hint in ug.GATHER_HINTS:  # the config and the kernel agree on the names
        assert KernelConfig(gather_hint=hint).gather_hint == hint


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,Hkv,D", [(torch.bfloat16, 8, 128), (torch.float32, 3, 48)])
@pytest.mark.parametrize("programs", [0, 7, 64])
def test_uva_scatter_rows_kernel_matches_ref(dtype, Hkv, D, programs):
    """Token rows into the pinned pool (the engine's exact-size registered region) at random distinct rows,
    one CTA per row or a bounded grid looping over them."""
    from oasiskv_runtime.transfer.host_memory import PinnedRegion

    gen = _gen()
    nb, bs, n = 41, 16, 517
    shape = (nb, bs, Hkv, D)
    region = PinnedRegion(PinnedRegion.bytes_for(2, shape, dtype))
    hk, hv = region.take(shape, dtype), region.take(shape, dtype)
    hk.copy_(torch.randn(shape, generator=gen).to(dtype))
    hv.copy_(torch.randn(shape, generator=gen).to(dtype))
    rk, rv = hk.clone(), hv.clone()
    k = torch.randn(n, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(n, Hkv, D, generator=gen).to(dtype)
    rows = torch.randperm(nb * bs, generator=gen)[:n]
    ug.uva_scatter_rows_ref(k, v, rk, rv, rows)
    ug.uva_scatter_rows(k.cuda(), v.cuda(), hk, hv, rows.cuda(), programs=programs)
    torch.cuda.synchronize()
    assert torch.equal(hk, rk) and torch.equal(hv, rv)


@pytest.mark.gpu
@needs_cuda
def test_uva_gather_rejects_pageable_host_memory():
    hk = torch.randn(4, 16, 2, 64)
    dk = torch.empty(4, 16, 2, 64, device="cuda")
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="pinned"):
        ug.uva_gather(hk, hk, dk, dk.clone(), idx, idx, idx, backend="triton")


def test_summary_update_ref_distinct_rows_fast_path():
    """Decode appends one token per row (the fast path): same result as folding keys one at a time."""
    from oasiskv_runtime.ops.summary_update import update_summaries_ref

    g = torch.Generator().manual_seed(3)
    sum_min = torch.randn(4, 8, 3, 48, generator=g)
    sum_max = sum_min + torch.rand(4, 8, 3, 48, generator=g)
    rows = torch.tensor([17, 3, 30, 8, 12])
    reset = torch.tensor([False, True, False, False, True])
    k = torch.randn(5, 3, 48, generator=g)
    exp_min, exp_max = sum_min.view(-1, 3, 48).clone(), sum_max.view(-1, 3, 48).clone()
    for i, r in enumerate(rows.tolist()):
        if reset[i]:
            exp_min[r], exp_max[r] = k[i], k[i]
        else:
            exp_min[r] = torch.minimum(exp_min[r], k[i])
            exp_max[r] = torch.maximum(exp_max[r], k[i])
    update_summaries_ref(k, rows, reset, sum_min, sum_max)
    assert torch.equal(sum_min.view(-1, 3, 48), exp_min) and torch.equal(sum_max.view(-1, 3, 48), exp_max)
