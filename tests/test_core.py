"""The OasisKV core driven without any engine: a hand-made DecodeBatch, key summaries, a host pool and a device
working set, as a front end other than the embedded engine (vLLM's) drives it. One prefetch must select exactly
what the Algorithm-2 oracle selects from the prediction, copy exactly those (block, head) slices, and count them."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime.config import DebugConfig, KernelConfig
from oasiskv_runtime.core.batch import DecodeBatch
from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.core.pipeline import LookaheadPipeline
from oasiskv_runtime.core.predictor import Predictor, keep_always
from oasiskv_runtime.core.selector import select_head
from oasiskv_runtime.core.stats import SparseStats
from oasiskv_runtime.core.summaries import KeySummaries
from oasiskv_runtime.ops.score_topk import quest_scores_ref, select_topk
from oasiskv_runtime.transfer.engine import TransferEngine
from oasiskv_runtime.transfer.host_pool import HostKVPool
from oasiskv_runtime.transfer.paged_kv import PagedKVCache

L, HKV, G, D, BS, K = 2, 3, 2, 8, 4, 5
NUM_LOGICAL = 13  # full blocks before the active one: more than K, so selection matters


def _setup(cap: int):
    g = torch.Generator().manual_seed(3)
    host = PagedKVCache(L, 40, BS, HKV, D, torch.float32, "cpu")
    for t in host.k + host.v:
        t.copy_(torch.randn(t.shape, generator=g))
    dev = PagedKVCache(L, 16, BS, HKV, D, torch.float32, "cpu")   # working set + summary blocks
    pool_table = torch.randperm(40, generator=g)[:NUM_LOGICAL + 1]  # logical block -> host block
    slots = torch.tensor([3, 5, 7, 9, 11])                          # working-set slots (device blocks)
    summary_blocks = [12, 13, 14, 15]                               # BS summary rows each: 16 logical blocks
    for layer in range(L):  # true min / max of each logical block's keys, at rows 12 * BS + j
        keys = host.k[layer][pool_table[:NUM_LOGICAL]]              # [n, BS, Hkv, D]
        dev.k[layer].view(-1, HKV, D)[12 * BS:12 * BS + NUM_LOGICAL] = keys.amin(1)
        dev.v[layer].view(-1, HKV, D)[12 * BS:12 * BS + NUM_LOGICAL] = keys.amax(1)
    batch = DecodeBatch(
        seq_ids=[42], state_rows=torch.tensor([0]), q_rows=torch.tensor([0]), draft_rows=torch.tensor([1]),
        has_draft=torch.tensor([True]), local_block=torch.tensor([1]), local_len=torch.tensor([2]),
        num_candidates=torch.tensor([NUM_LOGICAL], dtype=torch.int32),
        next_candidates=torch.tensor([NUM_LOGICAL], dtype=torch.int32),
        summary_table=torch.tensor([summary_blocks], dtype=torch.int32), primary_table=pool_table[None].long(),
        slot_blocks=slots[None], max_candidates=NUM_LOGICAL, max_next_candidates=NUM_LOGICAL, step=7)
    head_map = HeadMap(2, L, HKV, K, torch.device("cpu"))
    predictor = Predictor(KeySummaries(dev.k, dev.v, "ref"), HKV, K, backend="ref")
    transfer = TransferEngine(HostKVPool(host), dev, L, 2, torch.device("cpu"), backend="ref")
    pipeline = LookaheadPipeline(head_map, predictor, transfer, SparseStats(L, 1), KernelConfig(backend="ref"),
                                 DebugConfig())
    return host, dev, batch, head_map, pipeline, pool_table, slots


def test_prefetch_selects_like_the_oracle_and_copies_exactly_that():
    cap = 2
    host, dev, batch, head_map, pipeline, pool_table, slots = _setup(cap)
    row = head_map.row(42)
    batch.state_rows = torch.tensor([row])
    old = [[1, 4, -1, 0, -1], [2, -1, 6, -1, -1], [-1, -1, -1, -1, -1]]  # some residents, per head
    q = torch.randn(2, HKV * G, D, generator=torch.Generator().manual_seed(5))  # rows: token, draft
    for layer in range(L):
        head_map.slot_map[row, layer] = torch.tensor(old)
        head_map.last_sel[row, layer] = torch.tensor([[3, 1, -1, 2, -1], [4, -1, 1, -1, -1], [-1] * K])
    before = [t.clone() for t in dev.k + dev.v]
    pipeline.prefetch(0, batch, q[batch.pred_rows()], cap)           # the draft row's query predicts
    # the same prediction by the references, then the oracle per head
    smin, smax = dev.k[0], dev.v[0]
    scores = quest_scores_ref(q[1:2], smin, smax, batch.summary_table, batch.next_candidates, HKV, NUM_LOGICAL)
    pred, _ = select_topk(scores, batch.next_candidates, K)
    admitted = 0
    for h in range(HKV):
        slots_h, last_h = list(old[h]), [[3, 1, -1, 2, -1], [4, -1, 1, -1, -1], [-1] * K][h]
        sel = select_head(slots_h, list(last_h), [int(b) for b in pred[0, h] if b >= 0], cap, 7)
        assert head_map.slot_map[row, 0, h].tolist() == slots_h, h
        for slot, logical in sel.admitted:  # the device slot holds the host block's rows of this head
            want = host.k[0][pool_table[logical], :, h]
            assert torch.equal(dev.k[0][slots[slot], :, h], want)
            assert torch.equal(dev.v[0][slots[slot], :, h], host.v[0][pool_table[logical], :, h])
        admitted += sel.num_admitted
        assert sel.num_admitted <= cap
    assert admitted > 0
    c = pipeline.transfer.counters.totals()
    assert c["fetched_by_layer"] == [admitted, 0] and int(pipeline.transfer.counters.req_fetched[row]) == admitted
    # layer 1 and every block no slot received are untouched
    assert torch.equal(dev.k[1], before[1]) and torch.equal(dev.v[1], before[L + 1])


def test_fill_admits_the_whole_prediction_and_counts_it_apart():
    host, dev, batch, head_map, pipeline, pool_table, slots = _setup(cap=1)
    q = torch.randn(2, HKV * G, D, generator=torch.Generator().manual_seed(9))
    row = head_map.row(42)
    batch.state_rows = torch.tensor([row])
    pipeline.fill(1, batch, q[batch.q_rows])
    assert (head_map.slot_map[row, 1] >= 0).sum(-1).tolist() == [K] * HKV  # every slot filled, no cap
    c = pipeline.transfer.counters.totals()
    assert c["initial_fill_blocks"] == K * HKV and c["fetched_by_layer"] == [0, 0]
    exported = head_map.export(42, step=8)
    assert exported["slot_map"].shape == (L, HKV, K) and exported["top_k_blocks"] == K



def test_a_handed_off_map_carries_the_attended_record():
    """Prefill-decode: the attended record a prefill seeded (``attended_blocks``: logical blocks, the same on both
    sides) travels with the map and lands in the peer's row; a peer keeping another number of them, or none, is
    refused by name (the decode would silently differ from one engine's)."""
    cpu = torch.device("cpu")
    prefill, decode = (HeadMap(3, L, HKV, K, cpu, attended_blocks=2) for _ in range(2))
    row = prefill.row(7)
    record = torch.randint(0, 50, (L, HKV, 2))
    prefill.attended[row] = record
    state = prefill.export(7, step=5)
    decode.row(1)  # another request first: the handed-off one gets another row
    got = decode.import_(9, state, step=20)
    assert got != row and torch.equal(decode.attended[got], record)
    assert torch.equal(decode.attended_ids(1, torch.tensor([got]))[0], record[1])
    with pytest.raises(ValueError, match=rf"keeps \({L}, {HKV}, 2\) attended blocks, this engine \({L}, {HKV}, 3\)"):
        HeadMap(3, L, HKV, K, cpu, attended_blocks=3).import_(9, state, step=20)
    with pytest.raises(ValueError, match="attended_blocks differs between the peers"):
        HeadMap(3, L, HKV, K, cpu).import_(9, state, step=20)

def test_sinks_and_recent_blocks_are_always_in_the_top_k():
    """The first ``sink_blocks`` and the last ``recent_blocks`` candidates of each request are in every head's top-K
    even where Quest ranks them last; the rest of K is the best of the others. A request with fewer candidates than
    the kept blocks keeps what it has, and a column beyond the candidates is never chosen."""
    g = torch.Generator().manual_seed(11)
    num_candidates = torch.tensor([13, 9, 2], dtype=torch.int32)
    j = torch.arange(13)
    scores = torch.randn(3, HKV, 13, generator=g).masked_fill((j >= num_candidates[:, None].long())[:, None],
                                                              float("-inf"))
    sinks, recent = 1, 2
    for b, nc in enumerate(num_candidates.tolist()):
        scores[b, :, [0, nc - 2, nc - 1]] = -50.0  # the worst finite scores
    ids, _ = select_topk(keep_always(scores.clone(), num_candidates, sinks, recent), num_candidates, K)
    for b, nc in enumerate(num_candidates.tolist()):
        kept = {x for x in (0, nc - 2, nc - 1) if 0 <= x < nc}
        for h in range(HKV):
            others = sorted(set(range(nc)) - kept, key=lambda x: -float(scores[b, h, x]))
            want = kept | set(others[:K - len(kept)])
            assert {int(x) for x in ids[b, h] if x >= 0} == want, (b, h)
    assert keep_always(scores, num_candidates, 0, 0) is scores  # nothing kept: the scores untouched
