"""Prefill without host round trips (issues #4/#5): the context is read by device ops, the chunk's own rows
are not read back, no [nq, nk] mask on CUDA, summaries updated without a sync.

CPU: each new reference against an independent computation, and the engine's device path (forced on with
``device_prefill``) against its host path, token for token (the arithmetic is the same, so equality is exact).
GPU (``-m gpu``): each op against its reference on odd sizes, no host sync inside them, and chunked prefill on
CUDA in every mode against dense.
"""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.engine.attention.dense import DenseAttention
from oasiskv_runtime.ops.attend import attend_prefill, attend_ref, causal_allowed
from oasiskv_runtime.ops import summary_update as su
from oasiskv_runtime.ops import uva_gather as ug
from oasiskv_runtime.engine.attention.oasiskv import OasisKVAttention
from tests.kernel_devices import KERNEL_DEVICES
from tests.tiny_models import write_tiny

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
MODES = ["dense", "sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"]
PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 9, [300, 12] * 20, list(range(40, 40 + 77)), [3, 4, 5, 6] * 5]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CPU_PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 5, [300, 12] * 11, list(range(40, 40 + 29))]
CPU_GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(gen, nb, bs, h, d, dtype=torch.float32):
    return (torch.randn(nb, bs, h, d, generator=gen).to(dtype), torch.randn(nb, bs, h, d, generator=gen).to(dtype))


def _prefill_rows(gen, T, nrows):
    """A prefill chunk's summary rows: runs of tokens per row (a block), the run's first token resets it, plus
    a few decode-like singletons; shuffled so grouping cannot rely on order."""
    rows, reset = [], []
    r = 0
    while len(rows) < T:
        run = int(torch.randint(1, 9, (1,), generator=gen))
        fresh = bool(torch.rand(1, generator=gen) < 0.6)
        for i in range(min(run, T - len(rows))):
            rows.append(r % nrows)
            reset.append(fresh and i == 0)
        r += 1 + int(torch.randint(0, 3, (1,), generator=gen))
    perm = torch.randperm(T, generator=gen)
    return torch.tensor(rows)[perm], torch.tensor(reset)[perm]


# ---- CPU: references ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens,out_rows", [(37, None), (37, 45), (40, 40), (1, 9), (0, 5)])
def test_gather_blocks_ref_matches_naive(num_tokens, out_rows):
    gen = _gen(num_tokens)
    bs, h, d = 8, 3, 48
    hk, hv = _pool(gen, 23, bs, h, d)
    table = torch.randperm(23, generator=gen)[:6]
    k, v = ug.uva_gather_blocks(hk, hv, table, num_tokens, out_rows)  # CPU -> reference
    assert k.shape == (out_rows or num_tokens, h, d)
    for t in range(num_tokens):
        blk, off = int(table[t // bs]), t % bs
        assert torch.equal(k[t], hk[blk, off]) and torch.equal(v[t], hv[blk, off])
    with pytest.raises(ValueError):
        ug.uva_gather_blocks(hk, hv, table[:2], 3 * bs)       # too few blocks for the tokens
    with pytest.raises(ValueError):
        ug.uva_gather_blocks(hk, hv, table, 10, out_rows=9)   # no room for the tokens


def test_summaries_grouped_equals_ref():
    for seed in range(6):
        gen = _gen(seed)
        nb, bs, h, d = (7, 8, 3, 5) if seed < 4 else (37, 16, 2, 7)   # the last: 1,500 tokens, rows wrap
        T = 61 if seed < 4 else 1500
        dtype = torch.float32 if seed % 2 else torch.bfloat16
        smin = torch.randn(nb, bs, h, d, generator=gen).to(dtype)
        smax = smin + torch.rand(nb, bs, h, d, generator=gen).to(dtype)
        rows, reset = _prefill_rows(gen, T, nb * bs)
        k = torch.randn(T, h, d, generator=gen).to(dtype)
        a, b = smin.clone(), smax.clone()
        su.update_summaries_ref(k, rows, reset, a, b)
        su.update_summaries_grouped(k, rows, reset, smin, smax)
        assert torch.equal(a, smin) and torch.equal(b, smax)


def _chunk_rows(gen, nseq, nrows, bs):
    """Rows / reset flags of a step's written tokens as the engine lays them out: per request a run of
    consecutive positions (any start inside a block), each block a distinct row, decode-like singletons too."""
    rows, reset = [], []
    free = torch.randperm(nrows, generator=gen).tolist()
    for _ in range(nseq):
        start = int(torch.randint(0, 5 * bs, (1,), generator=gen))
        n = int(torch.randint(1, 4 * bs, (1,), generator=gen))
        block_row = {}
        for p in range(start, start + n):
            if p // bs not in block_row:
                block_row[p // bs] = free.pop()
            rows.append(block_row[p // bs])
            reset.append(p % bs == 0)
    return rows, reset


def test_summaries_runs_equal_ref():
    for seed in range(8):
        gen = _gen(seed)
        nb, bs, h, d = (13, 16, 3, 5) if seed % 2 else (29, 8, 2, 48)
        dtype = torch.float32 if seed % 3 else torch.bfloat16
        rows, reset = _chunk_rows(gen, 1 + seed % 4, nb * bs, bs)
        smin = torch.randn(nb, bs, h, d, generator=gen).to(dtype)
        smax = smin + torch.rand(nb, bs, h, d, generator=gen).to(dtype)
        k = torch.randn(len(rows), h, d, generator=gen)          # float32 keys into a bf16 cache: the ref's cast
        a, b = smin.clone(), smax.clone()
        su.update_summaries_ref(k, torch.tensor(rows), torch.tensor(reset), a, b)
        pad, run_rows, run_reset = su.token_runs(rows, reset, bs)
        assert len(pad) == bs * len(run_rows) and len(set(run_rows)) == len(run_rows)
        su.update_summaries_runs(k, torch.tensor(pad), torch.tensor(run_rows), torch.tensor(run_reset), smin, smax)
        assert torch.equal(a, smin) and torch.equal(b, smax)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype,bs,h,d", [(torch.bfloat16, 16, 8, 128), (torch.float16, 8, 3, 48),
                                         (torch.float32, 4, 2, 40)])
def test_summaries_runs_kernel_equals_ref(device, dtype, bs, h, d):
    """The runs kernel against the plain-PyTorch runs update, bit for bit, on random run layouts (several
    sequences, chunks starting mid-block, resets), odd sizes and a strided key view (the layer's k)."""
    for seed in range(4):
        gen = _gen(seed)
        nb = 11 + seed
        rows, reset = _chunk_rows(gen, 1 + seed % 3, nb * bs, bs)
        pad, run_rows, run_reset = su.token_runs(rows, reset, bs)
        smin = torch.randn(nb, bs, h, d, generator=gen).to(dtype)
        smax = smin + torch.rand(nb, bs, h, d, generator=gen).to(dtype)
        # keys in the summaries' dtype (the engine's case): Triton's interpreter rounds bf16 casts differently
        qkv = torch.randn(len(rows), 3 * h, d, generator=gen).to(dtype)
        k = qkv[:, h:2 * h]  # a strided view, as the layer's k is
        a, b = smin.clone(), smax.clone()
        su.update_summaries_runs_ref(k, torch.tensor(pad), torch.tensor(run_rows), torch.tensor(run_reset), a, b)
        dev = torch.device("cuda" if device == "cuda" else "cpu")
        tm, tx = smin.to(dev), smax.to(dev)
        su.update_summaries_runs(k.to(dev), torch.tensor(pad, device=dev), torch.tensor(run_rows, device=dev),
                                 torch.tensor(run_reset, device=dev), tm, tx, backend="triton")
        assert torch.equal(a, tm.cpu()) and torch.equal(b, tx.cpu())


def test_token_runs_rejects_layouts_it_cannot_reduce():
    with pytest.raises(ValueError, match="not adjacent"):
        su.token_runs([3, 4, 3], [False] * 3, 4)
    with pytest.raises(ValueError, match="at most 2"):
        su.token_runs([3, 3, 3], [False] * 3, 2)
    with pytest.raises(ValueError, match="resets after"):
        su.token_runs([3, 3], [False, True], 4)
    assert su.token_runs([5, 5, 2], [True, False, False], 3) == ([0, 1, 0, 2, 2, 2], [5, 2], [True, False])


def test_attend_prefill_cpu_is_the_masked_reference():
    gen = _gen(3)
    q, k, v = torch.randn(7, 6, 16, generator=gen), torch.randn(19, 2, 16, generator=gen), torch.randn(19, 2, 16, generator=gen)
    assert torch.equal(attend_prefill(q, k, v, 0.25), attend_ref(q, k, v, 0.25, causal_allowed(7, 19, "cpu")))
    assert torch.equal(attend_prefill(q[:1], k, v, 0.25), attend_ref(q[:1], k, v, 0.25))


# ---- CPU: the engine's device path equals its host path -------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("prefill"), "qwen3", max_position_embeddings=4096))


def _tokens(tiny, mode, device_prefill, **kw):
    llm = LLM(tiny, mode=mode, block_size=4, max_num_batched_tokens=13, draft="ngram", **kw)
    llm.engine.backend.device_prefill = device_prefill
    return [o.token_ids for o in llm.generate(CPU_PROMPTS, CPU_GREEDY)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_device_prefill_path_equals_host_path_on_cpu(tiny, mode):
    # 13-token chunks with decode tokens sharing the budget: chunk starts fall anywhere in a block, prompts
    # end inside a block (the tail copy), and a 2-block working set makes the initial fill matter.
    kw = {} if mode == "dense" else dict(top_k_blocks=2)
    assert _tokens(tiny, mode, True, **kw) == _tokens(tiny, mode, False, **kw)


@pytest.mark.slow
def test_device_prefill_dense_layers_on_cpu(tiny):
    kw = dict(top_k_blocks=2, dense_layers=2)
    assert _tokens(tiny, "oasiskv", True, **kw) == _tokens(tiny, "oasiskv", False, **kw)


def test_device_prefill_defaults_to_cuda():
    assert OasisKVAttention.device_prefill is None and DenseAttention.device_prefill is None


# ---- GPU ------------------------------------------------------------------------------------------------
def _rel(out, ref):
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,bs,h,d,num_tokens,out_rows", [(torch.bfloat16, 16, 8, 128, 1001, 1077),
                                                              (torch.float32, 8, 3, 48, 37, None),
                                                              (torch.bfloat16, 16, 3, 64, 48, 48),
                                                              (torch.bfloat16, 4, 5, 64, 1, 3)])
def test_gather_blocks_kernel_matches_ref(dtype, bs, h, d, num_tokens, out_rows):
    gen = _gen(num_tokens)
    nb = -(-num_tokens // bs)
    hk, hv = _pool(gen, 3 * nb + 5, bs, h, d, dtype)
    hk, hv = hk.pin_memory(), hv.pin_memory()
    table = torch.randperm(3 * nb + 5, generator=gen)[:nb + 2].cuda()
    rk, rv = ug.uva_gather_blocks_ref(hk, hv, table, num_tokens, out_rows)
    k, v = ug.uva_gather_blocks(hk, hv, table, num_tokens, out_rows)
    assert k.is_cuda and k.shape == rk.shape
    assert torch.equal(k[:num_tokens], rk[:num_tokens]) and torch.equal(v[:num_tokens], rv[:num_tokens])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_summaries_grouped_cuda_equals_ref(dtype):
    gen = _gen(11)
    nb, bs, h, d = 29, 16, 3, 64
    smin = torch.randn(nb, bs, h, d, generator=gen).to(dtype).cuda()
    smax = (smin.float() + torch.rand(nb, bs, h, d, generator=gen).cuda()).to(dtype)
    rows, reset = _prefill_rows(gen, 307, nb * bs)
    k = torch.randn(307, h, d, generator=gen).to(dtype).cuda()
    a, b = smin.clone(), smax.clone()
    su.update_summaries_ref(k, rows.cuda(), reset.cuda(), a, b)
    su.update_summaries(k, rows.cuda(), reset.cuda(), smin, smax, assume_distinct=False)  # -> grouped on CUDA
    assert torch.equal(a, smin) and torch.equal(b, smax)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,nq,nk,hq,hkv,d", [(torch.bfloat16, 37, 101, 12, 3, 64),
                                                  (torch.bfloat16, 64, 64, 8, 2, 128),
                                                  (torch.bfloat16, 1, 33, 4, 4, 128),
                                                  (torch.bfloat16, 300, 2077, 32, 8, 128),
                                                  (torch.float32, 21, 50, 6, 3, 48),
                                                  (torch.float32, 577, 577, 9, 3, 64),
                                                  (torch.float32, 131, 1030, 9, 3, 64)])
def test_attend_prefill_cuda_matches_ref(dtype, nq, nk, hq, hkv, d):
    gen = _gen(nq + nk)
    q = torch.randn(nq, hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(nk, hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(nk, hkv, d, generator=gen).to(dtype).cuda()
    out = attend_prefill(q, k, v, d ** -0.5)
    ref = attend_ref(q.double().cpu(), k.double().cpu(), v.double().cpu(), d ** -0.5,
                     causal_allowed(nq, nk, "cpu") if nq > 1 else None)
    assert out.shape == (nq, hq, d) and out.dtype == dtype
    assert _rel(out.cpu(), ref) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["causal", "mask", "none"])
def test_sdpa_gqa_matches_ref(device, dtype, how):
    """sdpa_gqa: native GQA where flash can take it, K/V heads repeated where it cannot (CUDA float32, masks);
    either way the reference's result, odd sizes, 9 query heads over 3 KV heads."""
    from oasiskv_runtime.ops.attend import sdpa_gqa

    nq, nk, hq, hkv, d = (77, 77, 9, 3, 64) if how == "causal" else (23, 141, 9, 3, 64)
    gen = _gen(nq * 7 + nk)
    q, k, v = (torch.randn(n, h, d, generator=gen) for n, h in ((nq, hq), (nk, hkv), (nk, hkv)))
    mask = causal_allowed(nq, nk, "cpu") if how != "none" else None
    if how == "mask":
        mask = mask & (torch.rand(nq, nk, generator=gen) > 0.3)
        mask[:, 0] = True
    ref = attend_ref(q.double(), k.double(), v.double(), d ** -0.5, mask)
    q4, k4, v4 = (t.to(dtype).to(device).transpose(0, 1)[None] for t in (q, k, v))
    out = sdpa_gqa(q4, k4, v4, d ** -0.5, attn_mask=None if how != "mask" else mask.to(device),
                   is_causal=how == "causal")
    assert out.shape == (1, hq, nq, d) and out.dtype == dtype
    assert _rel(out[0].transpose(0, 1).cpu(), ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@needs_cuda
def test_prefill_ops_do_not_synchronize():
    gen = _gen(5)
    bs, h, d = 16, 8, 128
    hk, hv = _pool(gen, 200, bs, h, d, torch.bfloat16)
    hk, hv = hk.pin_memory(), hv.pin_memory()
    table = torch.randperm(200, generator=gen)[:130].cuda()
    q = torch.randn(257, 32, d, generator=gen).to(torch.bfloat16).cuda()
    smin = torch.randn(40, bs, h, d).to(torch.bfloat16).cuda()
    smax = smin.clone()
    rows, reset = _prefill_rows(gen, 257, 40 * bs)
    rows, reset, kn = rows.cuda(), reset.cuda(), torch.randn(257, h, d).to(torch.bfloat16).cuda()

    qf = q.float()

    def run():
        k, v = ug.uva_gather_blocks(hk, hv, table, 2000, 2077)
        k[2000:] = kn[:77]
        v[2000:] = kn[:77]
        attend_prefill(q[:77], k, v, d ** -0.5)
        attend_prefill(q, q[:, :8], q[:, 8:16], d ** -0.5)
        attend_prefill(qf, qf[:, :8], qf[:, 8:16], d ** -0.5)  # float32: K/V heads repeated (sdpa_gqa)
        attend_prefill(qf[:77], qf[:, :8], qf[:, 8:16], d ** -0.5)
        su.update_summaries(kn, rows, reset, smin, smax, assume_distinct=False)

    run()  # warm-up: kernel compilation, the one-off flash self-check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("gpu-prefill"), "qwen3", head_dim=64, max_position_embeddings=4096))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"])
def test_chunked_prefill_on_cuda_matches_dense(tiny64, mode):
    kw = dict(device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=29, host_kv_bytes=1 << 30)
    dense = LLM(tiny64, **kw).generate(PROMPTS, GREEDY)
    llm = LLM(tiny64, mode=mode, top_k_blocks=64, **kw)
    assert llm.engine.backend._use_device_prefill(torch.empty(1, device="cuda"))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in dense]


@pytest.mark.gpu
@needs_cuda
def test_chunked_prefill_bf16_device_path_close_to_host_path(tiny64):
    """bf16, small budget: the device path (flash, UVA gather) and the host path (masked SDPA, CPU read) give
    the same greedy tokens for most of each output (they are different kernels: not bit-identical)."""
    kw = dict(device="cuda", dtype="bfloat16", mode="oasiskv", top_k_blocks=4, max_num_batched_tokens=29,
              host_kv_bytes=1 << 30)
    outs = {}
    for flag in (True, False):
        llm = LLM(tiny64, **kw)
        llm.engine.backend.device_prefill = flag
        outs[flag] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    first = [o[0] for o in outs[True]]
    assert first == [o[0] for o in outs[False]]


class _NoSyncModel:
    """Wraps the engine's model: while ``armed``, its forward runs under ``set_sync_debug_mode('error')``."""

    def __init__(self, model):
        self.inner, self.armed, self.calls = model, False, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kw):
        if not self.armed:
            return self.inner(*args, **kw)
        self.calls += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self.inner(*args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["proxy-prefetch", "oasiskv"])
def test_prefill_steps_do_not_synchronize_inside_the_layers(tiny64, mode):
    """Steps that only prefill, one of them completing a prompt (the first working-set fill and the prompt
    tail's copy into the local slot run per layer): no host sync from the first layer to the last."""
    llm = LLM(tiny64, mode=mode, device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=29,
              host_kv_bytes=1 << 30)
    eng = llm.engine
    guard = eng.runner.model = _NoSyncModel(eng.runner.model)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for armed in (False, True):  # the first round compiles kernels and runs the one-off checks
        for p in ([7, 8, 9] * 13, [21, 22] * 20):                     # 39 and 40 tokens: 29 + (10 + 19) + ...
            eng.add_request(p, params)
        for _ in range(2):       # step 1: 29 tokens of the first prompt; step 2: it completes, the second starts
            guard.armed = armed
            eng.step()
            guard.armed = False
        while eng.has_unfinished():
            eng.step()
    assert guard.calls == 2


@pytest.mark.gpu
@needs_cuda
def test_dense_mixed_step_setup_does_not_synchronize(tiny64):
    """Dense steps that prefill one request while others decode (eager, not graphed: dense does not split them)
    build their paged decode batch without a host sync (it made four blocking uploads per step)."""
    llm = LLM(tiny64, device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=29)
    eng, backend = llm.engine, llm.engine.runner.backend
    begin, armed, calls = backend.begin_step, [False], []

    def guarded(meta):
        if not armed[0] or not any(s.num_query == 1 for s in meta.seqs) or all(s.num_query == 1 for s in meta.seqs):
            return begin(meta)
        calls.append(1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return begin(meta)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    backend.begin_step = guarded
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for armed[0] in (False, True):
        eng.add_request([7, 8, 9] * 5, params)
        eng.step()                                    # 15 tokens: prefill alone
        eng.add_request([21, 22] * 20, params)        # then 40 tokens in chunks beside the first one's decode
        while eng.has_unfinished():
            eng.step()
    assert calls


def test_summary_runs_by_block_equal_token_runs_of_the_token_layout():
    """The backend lays out a step's summary runs a block at a time; it must equal :func:`token_runs` of the
    per-token rows (the layout it replaced) for mixed steps: chunks starting mid-block, decode rows, odd sizes."""
    from types import SimpleNamespace

    from oasiskv_runtime.config import Mode
    from oasiskv_runtime.core.batch import summary_row
    from oasiskv_runtime.engine.attention.metadata import SeqSlice
    from oasiskv_runtime.engine.attention.sparse_step import SparseStepBuilder

    for seed in range(18):
        gen = _gen(seed)
        bs = (4, 16, 8)[seed % 3]
        parts = (1, 2, 4)[seed // 3 % 3]  # summary_parts: a row per run of bs // parts tokens
        sb = bs // parts
        tables, seqs, row = {}, [], 0
        free = torch.randperm(400, generator=gen).tolist()
        for sid in range(1 + seed % 5):
            ctx = int(torch.randint(1, 12 * bs, (1,), generator=gen))
            nq = 1 if sid % 2 else int(torch.randint(1, ctx + 1, (1,), generator=gen))
            tables[sid] = [free.pop() for _ in range(-(-ctx // sb) // bs + 1)]
            seqs.append(SeqSlice(sid, row, nq, ctx, []))
            row += nq
        kv = SimpleNamespace(block_size=bs, summary_parts=parts, code_rows_per_block=0,
                             requests={i: SimpleNamespace(summary_blocks=t) for i, t in tables.items()})
        builder = SparseStepBuilder(Mode.SPARSE_RESIDENT, kv, None, torch.device("cpu"), device_step=False)
        rows = [summary_row(tables[s.seq_id], p // sb, bs) for s in seqs
                for p in range(s.context_len - s.num_query, s.context_len)]
        reset = [p % sb == 0 for s in seqs for p in range(s.context_len - s.num_query, s.context_len)]
        got = [t.tolist() for t in builder.summary_writes(seqs, runs=True).runs]
        assert tuple(got) == su.token_runs(rows, reset, bs)
