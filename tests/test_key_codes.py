"""Keys coded in a few bits (``ops/key_codes.py``, ``selection_score = "max_logit_b2"``): packing, and a score that
reads only the codes and the min/max summaries equals the study setting the NIAH runs measured
(``coded_max_logit_scores``, which codes the full keys); then the engine that keeps them: code blocks in the device
budget, rows that alias no other block (a covering budget equals dense in every sparse mode), the refusals, and on
CUDA captured graphs. That its predictions are the top-K of the codes of the full keys is in test_split_quest.py."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.config import EngineConfig, Mode
from oasiskv_runtime.core.summaries import KeyCodes
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager, cdiv
from oasiskv_runtime.engine.sequence import Sequence
from oasiskv_runtime.ops.key_codes import (coded_scores, coded_scores_ref, cuda_misfit, head_major, pack_codes,
                                           pack_codes_into, unpack_codes)
from oasiskv_runtime.ops.split_quest import coded_max_logit_scores
from tests.kernel_devices import KERNEL_DEVICES
from tests.selection_checks import scorer_inputs
from tests.tiny_models import write_tiny


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_keeps_the_nearest_level_in_bits_per_dimension(bits):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    n, bs, hkv, d = 5, 7, 3, 16
    keys = torch.randn(n, bs, hkv, d, generator=gen) * torch.rand(n, 1, hkv, d, generator=gen) * 4
    keys[0, :, 0, 0] = 1.5                                    # a dimension with no spread: every code is level 0
    lo, hi = keys.amin(1), keys.amax(1)
    packed = pack_codes(keys, lo, hi, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (n, bs, hkv, d * bits // 8)
    assert packed.numel() * 8 == keys.numel() * bits           # bits / 16 of a bf16 key cache
    codes = unpack_codes(packed, bits).long()
    levels = 2 ** bits - 1
    assert codes.shape == keys.shape and int(codes.max()) <= levels and not bool(codes[0, :, 0, 0].any())
    step = ((hi - lo) / levels).unsqueeze(1)
    grid = lo.unsqueeze(1).unsqueeze(-1) + torch.arange(levels + 1) * step.unsqueeze(-1)      # [n, 1, hkv, d, L]
    dist = (keys.unsqueeze(-1) - grid).abs()
    chosen = dist.gather(-1, codes.unsqueeze(-1)).squeeze(-1)
    assert bool((chosen <= dist.amin(-1) + 1e-5).all())      # no level is nearer than the one kept
    assert torch.equal(unpack_codes(pack_codes(keys, lo, hi, bits), bits), unpack_codes(packed, bits))


@pytest.mark.parametrize("device", [pytest.param(p.values[0], id=p.id or p.values[0], marks=p.marks)
                                    for p in KERNEL_DEVICES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_code_write_kernel_writes_pack_codes_bytes_into_the_rows(device, dtype, bits):
    """``pack_codes_into`` (what ``KeyCodes.write`` runs every decode step and layer): the Triton kernel writes the
    bytes of ``pack_codes`` within each block's own min/max into the given rows of head-major code storage, and
    leaves every other row alone. Fresh random inputs, odd sizes (block size 5 / 12 / 16, head dims 24-64, 1-3 KV
    heads), a dimension with no spread and keys on exact midpoints between levels (ties go to even, as
    ``torch.round``)."""
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    for bs, hkv, d in [(16, 3, 24), (12, 2, 40), (5, 1, 64)]:
        if d * bits % 8:
            continue
        keys = torch.randn(5, bs, hkv, d, generator=gen) * torch.rand(5, 1, hkv, d, generator=gen) * 3
        keys[0, :, 0, :3] = 0.75
        keys[1, :, 0, 0] = torch.tensor([0.0, 1.0] + [0.5, 0.25, 0.75] * bs)[:bs]   # midpoints at 1 and 2 bits
        keys = keys.to(dtype)
        rows = torch.randperm(11, generator=gen)[:5]
        store = torch.randint(0, 256, (11, hkv, bs, d * bits // 8), generator=gen, dtype=torch.uint8)
        want = store.clone().permute(0, 2, 1, 3)
        want[rows] = pack_codes(keys, keys.amin(1), keys.amax(1), bits)
        got = store.to(device).permute(0, 2, 1, 3)
        pack_codes_into(got, rows.to(device), keys.to(device), bits, backend="triton")
        assert torch.equal(got.cpu(), want)


def test_unpack_inverts_pack_on_every_level():
    for bits in (1, 2, 4, 8):
        levels = torch.arange(2 ** bits, dtype=torch.float32).repeat(32)[:32]
        keys = levels.view(1, 1, 1, 32)                     # lo 0, hi 2**bits - 1: each key sits on its level
        packed = pack_codes(keys, torch.zeros(1, 1, 32), torch.full((1, 1, 32), 2.0 ** bits - 1), bits)
        assert torch.equal(unpack_codes(packed, bits).float(), keys)


def _engine_summaries(k_cache: torch.Tensor, table: torch.Tensor, bs: int):
    """``(mins, maxs, summary_table)`` of ``scorer_inputs``' three requests in the engine's layout: logical block ``j``'s
    min/max (from its keys, in their dtype) at row ``j % bs`` of summary block ``j // bs``, two summary blocks a
    request."""
    _, _, hkv, d = k_cache.shape
    mins = torch.zeros(3 * 2, bs, hkv, d, dtype=k_cache.dtype)
    maxs = torch.zeros_like(mins)
    summary_table = torch.arange(3 * 2).view(3, 2)
    for b in range(3):
        for j in range(14):
            blk = k_cache[int(table[b, j])]
            mins[int(summary_table[b, j // bs]), j % bs] = blk.amin(0)
            maxs[int(summary_table[b, j // bs]), j % bs] = blk.amax(0)
    return mins, maxs, summary_table


@pytest.mark.parametrize("device,backend", [pytest.param("cpu", "ref", id="ref")] + [
    pytest.param(p.values[0], "triton", id=p.id or p.values[0], marks=p.marks) for p in KERNEL_DEVICES])
@pytest.mark.parametrize("variant", ["dot", "tile", "key"])
@pytest.mark.parametrize("bs,bits,bound", [(16, 2, None), (16, 1, 13), (8, 4, None), (12, 2, 17), (8, 8, None)])
def test_scores_from_codes_and_summaries_equal_the_measured_study_setting(device, backend, bs, bits, bound, variant):
    """Summaries in the engine's layout (summary block ``j // bs``, row ``j % bs`` of each request's summary table)
    and codes in the KV cache's, both built from the same keys: the score equals ``coded_max_logit_scores`` on the
    keys themselves, the ranking the NIAH study measured; the plain-PyTorch reference and the Triton kernel (on CUDA,
    and on the CPU in Triton's interpreter) alike, fresh random inputs and odd sizes (head dim 24, 3 query heads a
    KV head, a request without candidates, a bound under and over the candidates); every kernel (fp32 queries: the
    tensor-core kernel's products in full fp32), the codes in the cache's layout and stored head-major as
    ``KeyCodes`` stores them."""
    hkv, d = 2, 24
    q, k_cache, table, num_candidates = scorer_inputs(bs, torch.seed() % (2**31), hkv=hkv, d=d)
    nb = k_cache.shape[0]
    mins, maxs, summary_table = _engine_summaries(k_cache, table, bs)
    codes = pack_codes(k_cache, k_cache.amin(1), k_cache.amax(1), bits)
    assert codes.shape[0] == nb
    to = lambda t: t.to(device)  # noqa: E731
    want = coded_max_logit_scores(q, k_cache, table, num_candidates, hkv, bits, bound or 11)
    for stored in (codes, head_major(codes)):
        got = coded_scores(to(q), to(stored), to(mins), to(maxs), to(table), to(summary_table), to(num_candidates),
                           hkv, bits, bound, backend=backend, variant=variant).cpu()
        assert got.shape == want.shape == (3, hkv, bound or 11)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", [pytest.param(p.values[0], id=p.id or p.values[0], marks=p.marks)
                                    for p in KERNEL_DEVICES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,bits,d", [(16, 2, 24), (12, 2, 40), (8, 4, 24), (16, 1, 64), (8, 8, 24), (16, 2, 128)])
def test_the_tensor_core_kernel_rounds_each_coded_key_to_the_query_dtype(device, dtype, bs, bits, d):
    """16-bit queries and summaries (a model's own): the ``dot`` kernel (what ``auto`` picks for them) decodes each
    key in fp32 and rounds it to the query's dtype before its tensor-core product, and equals the reference that does
    the same (``key_dtype``) to fp32 rounding; the fp32 keys' scores differ from it by no more than that rounding can
    make (half a unit in the last place of each key, bf16's 2^-9 of it, times ``|q|``). Fresh random inputs, odd
    sizes, both code layouts, a bound over the candidates."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bf16 tiles as their raw bits")
    hkv, g = 2, 3
    q, k_cache, table, num_candidates = scorer_inputs(bs, torch.seed() % (2**31), hkv=hkv, g=g, d=d)
    q, k_cache = q.to(dtype), k_cache.to(dtype)
    mins, maxs, summary_table = _engine_summaries(k_cache, table, bs)
    codes = pack_codes(k_cache, k_cache.amin(1), k_cache.amax(1), bits)
    args = (q, codes, mins, maxs, table, summary_table, num_candidates, hkv, bits, 15)
    rounded = coded_scores_ref(*args, key_dtype=dtype)
    exact = coded_scores_ref(*args)
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    for stored in (codes, head_major(codes)):
        dev_args = [to(a) for a in args]
        dev_args[1] = to(stored)
        got = coded_scores(*dev_args, variant="dot", backend="triton").cpu()
        torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-4)
    ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    fin = torch.isfinite(exact)
    assert torch.equal(fin, torch.isfinite(rounded))
    # |key - round(key)| <= |key| * ulp / 2 for every key: the scores move by at most sum_d |q_d| |k_d| ulp / 2
    bound = q.float().abs().sum(-1).amax() * k_cache.float().abs().amax() * ulp / 2
    assert float((rounded[fin] - exact[fin]).abs().max()) <= float(bound)
    if bits > 1:  # (with one bit a coded key is its block's min or max, already in the dtype)
        assert not torch.equal(rounded[fin], exact[fin])  # the rounding is there


@pytest.mark.parametrize("device,backend", [pytest.param("cpu", "ref", id="ref")] + [
    pytest.param(p.values[0], "triton", id=p.id or p.values[0], marks=p.marks) for p in KERNEL_DEVICES])
@pytest.mark.parametrize("variant", ["dot", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,bits,d,g", [(16, 2, 24, 3), (12, 2, 40, 5), (8, 4, 24, 8)])
def test_query_sets_score_as_their_own_calls(device, backend, variant, dtype, bs, bits, d, g):
    """A step's queries and its draft's over the same blocks, each with its own candidate count (the draft's one
    more, or fewer): ``[S, B, Hkv, J]`` equal to one call a set, bit for bit (the tensor-core kernel reads the codes
    once and gives each set its own product columns: 3, 5 and 8 query heads a KV head, 2 sets in 16 columns or 32),
    ``-inf`` past each set's own count. Fresh random inputs, odd sizes, head-major codes."""
    if device == "cpu" and backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bf16 tiles as their raw bits")
    hkv = 2
    q, k_cache, table, num_candidates = scorer_inputs(bs, torch.seed() % (2**31), hkv=hkv, g=g, d=d)
    q, k_cache = torch.stack([q, torch.randn_like(q) * 2], dim=1).to(dtype), k_cache.to(dtype)     # [B, 2, Hq, D]
    mins, maxs, summary_table = _engine_summaries(k_cache, table, bs)
    codes = head_major(pack_codes(k_cache, k_cache.amin(1), k_cache.amax(1), bits))
    counts = torch.stack([num_candidates, num_candidates + torch.tensor([1, 0, -2], dtype=torch.int32)])
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    args = [to(a) for a in (codes, mins, maxs, table, summary_table)]
    got = coded_scores(to(q), *args, to(counts), hkv, bits, 13, backend=backend, variant=variant).cpu()
    assert got.shape == (2, 3, hkv, 13)
    for s in range(2):
        one = coded_scores(to(q[:, s]), *args, to(counts[s]), hkv, bits, 13, backend=backend, variant=variant).cpu()
        assert torch.equal(got[s], one)
        for b in range(3):
            assert bool(torch.isfinite(got[s, b, :, :int(counts[s, b])]).all())
            assert bool((got[s, b, :, int(counts[s, b]):] == float("-inf")).all())
    with pytest.raises(ValueError, match=r"2 query sets of 3 requests need num_candidates \[S, B\], got \(3,\)"):
        coded_scores(q, codes, mins, maxs, table, summary_table, num_candidates, hkv, bits, 13, backend=backend)


def test_formats_that_are_not_whole_bytes_are_refused():
    keys = torch.randn(2, 4, 1, 20)
    with pytest.raises(ValueError, match="bits=3 must be one of 1, 2, 4, 8"):
        pack_codes(keys, keys.amin(1), keys.amax(1), 3)
    with pytest.raises(ValueError, match="head_dim=20 x bits=1 is not a whole number of bytes"):
        pack_codes(keys, keys.amin(1), keys.amax(1), 1)


def test_an_unknown_kernel_variant_is_refused_on_every_backend():
    q, k_cache, table, num_candidates = scorer_inputs(16, 0, hkv=2, d=24)
    codes = pack_codes(k_cache, k_cache.amin(1), k_cache.amax(1), 2)
    for backend in ("ref", "auto"):
        with pytest.raises(ValueError, match="variant='words': auto, cuda, dot, tile, key"):
            coded_scores(q, codes, k_cache, k_cache, table, table, num_candidates, 2, 2, 11, backend=backend,
                         variant="words")


def _product_inputs(gen, dtype, d, g, sets, hkv=2, counts=(197, 0, 64, 1, 130), nb=300, width=210,
                    table_dtype=torch.int64):
    """The product's shape at a realistic size: 2-bit codes of blocks of 16 keys (head-major, as ``KeyCodes`` keeps
    them), ``sets`` query sets ``[B, S, Hq, D]`` and their counts ``[S, B]`` (the second set one block more, or
    fewer), each request's own random table of ``width`` blocks over an ``nb``-block cache, its min/max summaries
    in the engine's layout (logical block ``j`` at row ``j % 16`` of summary page ``j // 16``, pages shuffled)."""
    bs, B = 16, len(counts)
    k_cache = (torch.randn(nb, 1, hkv, d, generator=gen)
               + torch.rand(nb, 1, hkv, d, generator=gen) * 3 * torch.randn(nb, bs, hkv, d, generator=gen)).to(dtype)
    table = torch.stack([torch.randperm(nb, generator=gen)[:width] for _ in counts]).to(table_dtype)
    pages = -(-width // bs)
    summary_table = torch.randperm(B * pages, generator=gen).view(B, pages).to(table_dtype)
    mins = torch.zeros(B * pages, bs, hkv, d, dtype=dtype)
    maxs = torch.zeros_like(mins)
    for b in range(B):
        blocks = k_cache[table[b].long()]                                                    # [width, bs, hkv, d]
        for j in range(width):
            mins[int(summary_table[b, j // bs]), j % bs] = blocks[j].amin(0)
            maxs[int(summary_table[b, j // bs]), j % bs] = blocks[j].amax(0)
    codes = head_major(pack_codes(k_cache, k_cache.amin(1), k_cache.amax(1), 2))
    q = (torch.randn(B, sets, hkv * g, d, generator=gen) * 2).to(dtype)
    first = torch.tensor(counts, dtype=torch.int32)
    nc = torch.stack([first, (first + torch.tensor([1, 0, -3, 1, 0][:B], dtype=torch.int32)).clamp(0, width)])
    return q, codes, mins, maxs, table, summary_table, nc[:sets]


@pytest.mark.gpu
def test_the_cuda_kernel_scores_as_the_rounded_reference():
    """``csrc/coded_scores.cu`` (variant ``cuda``, what ``auto`` picks for the product's shape) equals the reference
    that rounds each coded key to the query's dtype (``key_dtype``) to fp32 rounding, and the Triton ``dot`` kernel
    likewise, ``-inf`` exactly where they are: bf16 and fp16, head dims 64 and 128, 1-8 query heads a KV head in one
    set or two (a step's and its draft's), int32 and int64 tables, a bound under and over the candidates, 5 requests
    (one without candidates) of up to 197 candidates over a 300-block cache, fresh random inputs each run."""
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    cases = [(dt, d, g, sets, tdt, bound)
             for dt in (torch.bfloat16, torch.float16) for d in (64, 128)
             for g, sets in ((4, 2), (3, 2), (1, 1), (8, 1), (5, 1), (2, 2))
             for tdt, bound in ((torch.int64, None), (torch.int32, 150))]
    assert len(cases) == 48
    for dt, d, g, sets, tdt, bound in cases:
        q, codes, mins, maxs, table, stab, nc = _product_inputs(gen, dt, d, g, sets, table_dtype=tdt)
        hkv = 2
        dev = [t.cuda() for t in (q, codes, mins, maxs, table, stab, nc)]
        assert cuda_misfit(dev[0], dev[1], dev[2], dev[3], hkv, 2) is None
        got = coded_scores(*dev[:6], dev[6], hkv, 2, bound, variant="cuda").cpu()
        auto = coded_scores(*dev[:6], dev[6], hkv, 2, bound).cpu()
        dot = coded_scores(*dev[:6], dev[6], hkv, 2, bound, variant="dot").cpu()
        J = bound or int(nc.max())
        assert got.shape == (sets, 5, hkv, J)
        assert torch.equal(auto, got)
        for s in range(sets):
            want = coded_scores_ref(q[:, s], codes, mins, maxs, table, stab, nc[s], hkv, 2, J, key_dtype=dt)
            fin = torch.isfinite(want)
            assert torch.equal(fin, torch.isfinite(got[s])), (dt, d, g, sets)
            torch.testing.assert_close(got[s], want, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(got[s], dot[s], rtol=1e-5, atol=1e-4)
            for b in range(5):
                assert int(fin[b, 0].sum()) == min(int(nc[s, b]), J)


@pytest.mark.gpu
def test_the_cuda_kernel_replays_in_a_captured_graph_and_refuses_what_does_not_fit():
    """The engine captures the score in a CUDA graph: a replay over new queries, codes and counts (copied into the
    captured tensors) gives the uncaptured call's scores. ``variant="cuda"`` asked for a shape it does not take is an
    error that names the reason; ``auto`` runs Triton's ``dot`` there."""
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    hkv = 2
    first = [t.cuda() for t in _product_inputs(gen, torch.bfloat16, 128, 4, 2)]
    second = [t.cuda() for t in _product_inputs(gen, torch.bfloat16, 128, 4, 2)]
    bufs = [t.clone() for t in first]
    coded_scores(*bufs[:6], bufs[6], hkv, 2, 200, variant="cuda")  # built and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = coded_scores(*bufs[:6], bufs[6], hkv, 2, 200, variant="cuda")
    for inputs in (second, first):
        for buf, t in zip(bufs, inputs):
            buf.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, coded_scores(*inputs[:6], inputs[6], hkv, 2, 200, variant="cuda"))
    q, codes, mins, maxs, table, stab, nc = _product_inputs(gen, torch.bfloat16, 96, 4, 1)
    dev = [t.cuda() for t in (q, codes, mins, maxs, table, stab, nc)]
    with pytest.raises(ValueError, match="variant='cuda' needs head dim 64 or 128 \\(got 96\\)"):
        coded_scores(*dev[:6], dev[6], hkv, 2, None, variant="cuda")
    torch.testing.assert_close(coded_scores(*dev[:6], dev[6], hkv, 2, None),
                               coded_scores(*dev[:6], dev[6], hkv, 2, None, variant="dot"), rtol=0, atol=0)


def test_the_cuda_kernel_names_the_shapes_it_does_not_take():
    """``cuda_misfit`` says why ``csrc/coded_scores.cu`` cannot score an input (``auto`` then runs a Triton kernel):
    each condition of the product's shape alone, in the order checked; a fitting shape on the CPU needs CUDA. Off
    CUDA ``variant="cuda"`` runs the reference, as every variant does."""
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    q, codes, mins, maxs, table, stab, nc = _product_inputs(gen, torch.bfloat16, 64, 4, 2, counts=(30, 5), nb=40,
                                                            width=33)
    hkv = 2
    assert cuda_misfit(q, codes, mins, maxs, hkv, 2) == "needs CUDA tensors"
    assert cuda_misfit(q[:, 0], codes, mins, maxs, hkv, 2) == "needs CUDA tensors"
    assert "bf16 / fp16 queries and summaries of the same dtype" in cuda_misfit(q.float(), codes, mins, maxs, hkv, 2)
    assert "of the same dtype" in cuda_misfit(q, codes, mins.half(), maxs, hkv, 2)
    assert cuda_misfit(q, codes, mins, maxs, hkv, 4) == "needs 2-bit codes (bits=4)"
    assert cuda_misfit(q, codes[:, :8], mins, maxs, hkv, 2) == "needs blocks of 16 keys (block size 8)"
    assert cuda_misfit(q[..., :32], codes, mins, maxs, hkv, 2) == "needs head dim 64 or 128 (got 32)"
    assert "up to 8 query columns a KV head (2 sets of 8" in cuda_misfit(q.repeat(1, 1, 2, 1), codes, mins, maxs,
                                                                        hkv, 2)
    assert "(3 sets of 4" in cuda_misfit(torch.cat([q, q[:, :1]], 1), codes, mins, maxs, hkv, 2)
    assert cuda_misfit(q, codes[..., 2:14], mins, maxs, hkv, 2) == "needs code rows aligned to 4 bytes"
    odd = torch.zeros(mins.numel() + 1, dtype=mins.dtype)[1:].view(mins.shape)  # a row start off 4 bytes
    assert cuda_misfit(q, codes, odd, maxs, hkv, 2) == "needs summary and query rows aligned to 2 elements"
    args = (codes, mins, maxs, table, stab, nc, hkv, 2, 33)
    want = torch.stack([coded_scores_ref(q[:, s], *args[:5], nc[s], hkv, 2, 33) for s in range(2)])
    assert torch.equal(coded_scores(q, *args, variant="cuda"), want)


def test_the_nvcc_build_names_what_is_missing(tmp_path, monkeypatch):
    """``build_csrc`` (the CUDA C kernels' build; ``auto`` falls back to Triton on its errors): a source that is not
    there, no nvcc, and nvcc's own error are RuntimeErrors that say which; nothing half-built is left for a later
    load."""
    from oasiskv_runtime.ops import common

    monkeypatch.setenv("OASISKV_BUILD_DIR", str(tmp_path / "build"))
    with pytest.raises(RuntimeError, match="no_such_kernel.cu not found"):
        common.build_csrc("no_such_kernel")
    (tmp_path / "bad.cu").write_text("this is not C++\n")
    monkeypatch.setattr(common, "CSRC", tmp_path)
    monkeypatch.setattr(common, "find_nvcc", lambda: None)
    with pytest.raises(RuntimeError, match="csrc/bad.cu: nvcc not found"):
        common.build_csrc("bad")
    monkeypatch.undo()
    monkeypatch.setenv("OASISKV_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setattr(common, "CSRC", tmp_path)
    if common.find_nvcc() is None:
        pytest.skip("no nvcc on this machine for the compile-error case")
    with pytest.raises(RuntimeError, match="nvcc failed"):
        common.build_csrc("bad")
    assert not list((tmp_path / "build").glob("*.so"))


# ---- the engine that keeps them ------------------------------------------------------------------------------------
SPARSE = ["sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"]
PROMPTS = [list(range(40, 40 + 77)), [5, 17, 33, 9, 101, 250, 7] * 9]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KV_GB = 0.05


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("codes"), "qwen3", max_position_embeddings=128))


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("element_size,bits,rows", [(2, 2, 16), (2, 4, 8), (2, 1, 32), (4, 2, 32)])
def test_code_blocks_per_request_and_their_rows(element_size, bits, rows):
    """A device block holds ``16 * element_size / bits`` code rows (its K bytes then its V bytes); a request holds
    cdiv(blocks, rows) code blocks, grown a token at a time, counted among its device blocks and freed with it; every
    row is its own and lies in its block's K or V bytes of the K/V pair viewed as rows; the scratch request (CUDA
    graphs' padding rows) holds one."""
    assert KeyCodes.rows_per_block(element_size, bits) == rows
    # what a memory check counts before the codes exist is what they take: 2 layers, 3 rows, block 4, 2 heads, D 16
    kv_bytes = 2 * 3 * 2 * 4 * 2 * 16 * element_size
    assert KeyCodes.allocate(2, 3, 4, 2, 16, bits, torch.device("cpu")).nbytes() == KeyCodes.bytes_for(
        kv_bytes, element_size, bits)
    bs, n_dev = 4, 300
    kv = KVCacheManager(Mode.OASISKV, bs, num_device_blocks=n_dev, num_host_blocks=400, top_k_blocks=3,
                        max_model_len=2000, code_rows_per_block=rows)
    seqs = [Sequence(list(range(n)), SamplingParams(max_tokens=300)) for n in (13, 70)]
    for s in seqs:
        assert kv.allocate(s, len(s.prompt_token_ids))
        s.num_computed_tokens = len(s.prompt_token_ids)
    s = seqs[0]
    for n in range(14, 14 + 2 * rows * bs):
        assert kv.allocate(s, 1)
        s.num_computed_tokens = n
        rb = kv.blocks(s)
        assert len(rb.code_blocks) == cdiv(cdiv(n, bs), rows) and len(rb.code_rows) == rows * len(rb.code_blocks)
        assert rb.num_device_blocks == 3 + 1 + len(rb.summary_blocks) + len(rb.code_blocks)
    half = rows // 2
    for rb in (kv.blocks(x) for x in seqs):
        for i, p in enumerate(rb.code_blocks):
            mine = rb.code_rows[i * rows:(i + 1) * rows]
            assert mine == [p * half + r for r in range(half)] + [(n_dev + p) * half + r for r in range(half)]
    every = kv.blocks(seqs[0]).code_rows + kv.blocks(seqs[1]).code_rows
    assert len(set(every)) == len(every)
    first = kv.blocks(seqs[0])
    assert not set(first.code_blocks) & set(first.summary_blocks + first.ws_blocks)
    for x in seqs:
        kv.free(x)
    assert kv.device_pool.num_free == n_dev
    assert kv.add_scratch_request(Sequence([1], SamplingParams(max_tokens=1)))
    assert kv.device_pool.num_free == n_dev - 3 and len(next(iter(kv.requests.values())).code_rows) == rows


def test_key_codes_count_against_the_device_budget(tiny):
    """The same request needs its code blocks on top of the working set and summaries: at a budget that holds it
    without codes but not with them, the engine refuses it with the count."""
    kw = dict(mode="oasiskv", top_k_blocks=3, block_size=4, draft="ngram")
    base = LLM(tiny, kv_cache_gb=KV_GB, **kw).engine.kv
    coded = LLM(tiny, kv_cache_gb=KV_GB, selection_score="max_logit_b2", **kw).engine.kv
    seq = Sequence(list(range(100)), SamplingParams(max_tokens=20))
    need = lambda kv: kv._needs(seq, 120)[0]  # noqa: E731
    assert need(coded) == need(base) + cdiv(30, coded.code_rows_per_block) and coded.code_rows_per_block == 32
    budget = need(base) * LLM(tiny, kv_cache_gb=KV_GB, **kw).engine.block_bytes
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert len(_tokens(LLM(tiny, kv_cache_bytes=budget, **kw), [seq.prompt_token_ids], params)[0]) == 20
    with pytest.raises(ValueError, match=f"need {need(coded)} device blocks in mode oasiskv, the budget holds "
                                         f"{need(base)}"):
        LLM(tiny, kv_cache_bytes=budget, selection_score="max_logit_b2", **kw).generate([seq.prompt_token_ids], params)


@pytest.mark.parametrize("mode", SPARSE)
def test_a_covering_budget_with_key_codes_equals_dense(tiny, mode, monkeypatch):
    """Every block selected: dense's tokens in every sparse mode, so the code rows written at every step overwrite no
    KV, summary or working-set byte; and every prediction read the stored codes."""
    from oasiskv_runtime.core.predictor import Predictor

    calls, real = [], Predictor._coded
    monkeypatch.setattr(Predictor, "_coded", lambda self, *a: calls.append(1) or real(self, *a))
    dense = _tokens(LLM(tiny, kv_cache_gb=KV_GB))
    llm = LLM(tiny, mode=mode, selection_score="max_logit_b2", top_k_blocks=40, block_size=4,
              max_num_batched_tokens=16, draft="ngram", kv_cache_gb=KV_GB)
    assert _tokens(llm) == dense and calls


TIGHT = dict(selection_score="max_logit_b2", attended_share=0.25, fill_window=8, early_fetch_ratio=1.0,
             demand_fetch=True)
"""The setting that meets issue #34's bars on SmolLM2 at 1/8 and 1/4 (docs/accuracy.md) with demand_fetch_cap=2."""


def test_the_tight_budget_setting_composes(tiny):
    """Codes, attention feedback, the fill, the early cap and a bounded demand fetch together: a covering budget gives
    dense's tokens; at a tight one the demand fetch copies, at most its cap per request, layer and KV head a decode
    step (on average over the run), and a cap of 1 copies less than a cap of 2."""
    dense = _tokens(LLM(tiny, kv_cache_gb=KV_GB))
    kw = dict(mode="oasiskv", block_size=4, max_num_batched_tokens=16, draft="ngram", kv_cache_gb=KV_GB, **TIGHT)
    assert _tokens(LLM(tiny, top_k_blocks=40, demand_fetch_cap=2, **kw)) == dense
    per_step = {}
    for cap in (1, 2):
        llm = LLM(tiny, top_k_blocks=3, demand_fetch_cap=cap, **kw)
        assert len(_tokens(llm)[0]) == GREEDY.max_tokens
        m = llm.engine.model_config
        per_step[cap] = llm.engine.run_stats()["demand_fetched_blocks_per_step"]
        assert 0 < per_step[cap] <= cap * len(PROMPTS) * m.num_layers * m.num_kv_heads
    assert per_step[1] < per_step[2]


def test_a_demand_fetch_scores_the_step_and_the_prefetch_from_one_read_of_the_codes(tiny, monkeypatch):
    """With ``demand_fetch`` a prefetching mode ranks the step's own query and predicts the next step in the same
    layer: both are scored from one read of the codes (``Predictor.coded_pair``, one ``_coded`` call a layer
    instead of two) and give the tokens and copies of scoring them apart, at a tight budget where the rankings
    decide what is fetched."""
    from oasiskv_runtime.core.predictor import Predictor

    kw = dict(block_size=4, max_num_batched_tokens=16, draft="ngram", kv_cache_gb=KV_GB, top_k_blocks=3,
              demand_fetch_cap=2, **TIGHT)
    calls, real, pair = [], Predictor._coded, Predictor.coded_pair
    monkeypatch.setattr(Predictor, "_coded", lambda self, *a: calls.append(a[1].dim()) or real(self, *a))
    for mode in ("oasiskv", "proxy-prefetch"):
        runs = {}
        for paired in (True, False):
            monkeypatch.setattr(Predictor, "coded_pair", pair if paired else lambda *a: None)
            calls.clear()
            llm = LLM(tiny, mode=mode, **kw)
            tokens, st = _tokens(llm), llm.engine.run_stats()
            runs[paired] = tokens, st["demand_fetched_blocks_per_step"], st["fetched_blocks_per_step"]
            assert set(calls) == {4 if paired else 3}  # [B, 2, Hq, D]: the pair; [B, Hq, D]: a query a call
            runs["calls", paired] = len(calls)
        assert runs[True] == runs[False] and runs[True][1] > 0
        assert runs["calls", True] * 2 == runs["calls", False]


def test_refusals_and_a_running_engine_keeps_its_codes(tiny):
    with pytest.raises(ValueError, match="selection_score='max_logit_b2' does not run with prefix_cache"):
        EngineConfig.from_overrides("qwen3-8b", mode="oasiskv", selection_score="max_logit_b2", prefix_cache=True)
    llm = LLM(tiny, mode="oasiskv", selection_score="max_logit_b2", top_k_blocks=3, block_size=4, kv_cache_gb=KV_GB,
              draft="ngram")
    be = llm.engine.backend
    be.configure(selection_score="quest")                          # codes are still written, quest ranks
    be.configure(selection_score="max_logit_b2")
    with pytest.raises(ValueError, match="max_logit_b4.*reads key codes of 4 bits, which are kept from the start"):
        be.configure(selection_score="max_logit_b4")
    plain = LLM(tiny, mode="oasiskv", top_k_blocks=3, block_size=4, kv_cache_gb=KV_GB, draft="ngram")
    with pytest.raises(ValueError, match="reads key codes of 2 bits, which are kept from the start"):
        plain.engine.backend.configure(selection_score="max_logit_b2")
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"does not run with prefix-cache hits yet \(they carry no key codes\)"):
        llm.engine.add_request(PROMPTS[0], params, prefix=([0], torch.zeros(0), torch.zeros(0)))
    from oasiskv_runtime.pd.workers import check_pd_config

    check_pd_config(llm.config)  # prefill-decode hands the codes over (tests/test_pd.py)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sparse-resident", "oasiskv"])
def test_key_codes_on_cuda_with_captured_graphs(tiny, mode):
    """On CUDA (Triton summaries and ranking, decode steps replayed from captured graphs) at a small budget: graphs
    give the eager steps' tokens, and eager steps rank as the codes of the full keys do (test_split_quest's check)."""
    from tests.selection_checks import check_sink_plus_top_k
    from tests.test_split_quest import brute_force_coded

    kw = dict(mode=mode, device="cuda", selection_score="max_logit_b2", top_k_blocks=3, block_size=4, sink_blocks=1,
              max_num_batched_tokens=32, draft="ngram", kv_cache_gb=KV_GB)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphed = LLM(tiny, cuda_graphs="auto", **kw)
    got = _tokens(graphed, PROMPTS, greedy)
    st = graphed.engine.run_stats()
    assert st["graph_replays"] > 0 and st["graphs_disabled"] is None
    eager = LLM(tiny, cuda_graphs="off", **kw)
    checked = check_sink_plus_top_k(
        eager, lambda q, keys, b: brute_force_coded(q, keys.cpu(), b.primary_table.cpu(), b.num_candidates.cpu(), 2), 3)
    assert got == _tokens(eager, PROMPTS, greedy) and checked[0] > 100


@pytest.mark.gpu
def test_the_tight_budget_setting_on_cuda_in_bf16_with_captured_graphs(tiny, monkeypatch):
    """issue #34's setting on CUDA in bf16 (the tensor-core kernel scoring the step's and the draft's queries in one
    launch, the prefetch on its background streams): graphs replay the eager steps' tokens, and scoring the two
    queries apart gives the same tokens and copies."""
    from oasiskv_runtime.core.predictor import Predictor

    kw = dict(mode="oasiskv", device="cuda", dtype="bfloat16", top_k_blocks=3, block_size=4,
              max_num_batched_tokens=32, draft="ngram", kv_cache_gb=KV_GB, demand_fetch_cap=2, **TIGHT)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(**extra):
        llm = LLM(tiny, **kw, **extra)
        tokens, st = _tokens(llm, PROMPTS, greedy), llm.engine.run_stats()
        return tokens, st["demand_fetched_blocks_per_step"], st.get("graph_replays", 0)

    graphed = run(cuda_graphs="auto")
    eager = run(cuda_graphs="off")
    monkeypatch.setattr(Predictor, "coded_pair", lambda *a: None)
    apart = run(cuda_graphs="off")
    assert graphed[2] > 0 and graphed[:2] == eager[:2] == apart[:2] and eager[1] > 0
