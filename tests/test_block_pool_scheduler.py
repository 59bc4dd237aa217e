"""Block pool, KV cache manager and scheduler: plain Python, no tensors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oasiskv_runtime.config import Mode, SchedulerConfig
from oasiskv_runtime.engine.block_pool import BlockPool, OutOfBlocks
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager
from oasiskv_runtime.engine.scheduler import Scheduler
from oasiskv_runtime.engine.sequence import Sequence
from oasiskv_runtime.sampling_params import SamplingParams


def test_block_pool_allocate_free_accounting():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 2 and pool.num_used == 3
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    assert pool.num_free == 2  # a failed allocation takes nothing
    pool.free(a[:2])
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free([a[0]])  # double free
    b = pool.allocate(4)
    assert set(b).isdisjoint({a[2]})
    pool.free(b + [a[2]])
    assert pool.num_free == 5 and pool.num_used == 0


def seq(n_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(list(range(n_prompt)), SamplingParams(max_tokens=max_tokens))


def test_manager_dense_blocks_grow_with_context():
    kv = KVCacheManager(Mode.DENSE, 4, num_device_blocks=10, num_host_blocks=0, top_k_blocks=8, max_model_len=100)
    s = seq(9)
    assert kv.allocate(s, 9)
    assert len(kv.blocks(s).device_blocks) == 3
    s.num_computed_tokens = 9
    assert kv.allocate(s, 3)  # 12 tokens: still 3 blocks
    assert len(kv.blocks(s).device_blocks) == 3
    s.num_computed_tokens = 12
    assert kv.allocate(s, 1)
    assert len(kv.blocks(s).device_blocks) == 4
    kv.free(s)
    assert kv.device_pool.num_free == 10


def test_manager_host_mode_working_set_is_bounded():
    """A host-pool request holds top_k+1 working-set blocks however long it gets; the host holds the rest."""
    kv = KVCacheManager(Mode.OASISKV, 4, num_device_blocks=200, num_host_blocks=1000, top_k_blocks=3,
                        max_model_len=10_000)
    short, long = seq(20, 1000), seq(2000, 1000)
    assert kv.allocate(short, 20) and kv.allocate(long, 2000)
    rs, rl = kv.blocks(short), kv.blocks(long)
    assert len(rs.ws_blocks) == len(rl.ws_blocks) == 4
    assert len(rl.host_blocks) == 500
    assert len(rl.summary_blocks) == 125  # one row per logical block, 4 rows per summary block
    assert not rl.device_blocks
    kv.free(short)
    kv.free(long)
    assert kv.device_pool.num_free == 200 and kv.host_pool.num_free == 1000


@pytest.mark.parametrize("mode,tier", [(Mode.DENSE, False), (Mode.SPARSE_RESIDENT, False), (Mode.OASISKV, False),
                                       (Mode.OASISKV, True)])
def test_manager_allocation_shortcut_changes_nothing(mode, tier):
    """The decode shortcut (a request whose blocks already cover the tokens gets nothing) holds exactly when the
    full count would take nothing: a request grown a token or a chunk at a time, in 4-token blocks (summary rows
    of 4 blocks), holds the same blocks as the count says, at every length, past a full host pool into the
    tier."""
    kv = KVCacheManager(mode, 4, num_device_blocks=400, num_host_blocks=20 if tier else 40, top_k_blocks=3,
                        max_model_len=10_000, device_tier=tier)
    s = seq(5, 2000)
    grown = 0
    for step in [5, 1, 1, 3, 8, 1, 1, 1, 16, 1, 2, 1, 50, 1, 1, 1, 1, 17, 1, 1]:
        rb = kv.requests.get(s.seq_id)
        shortcut = rb is not None and s.num_computed_tokens + step <= rb.capacity
        before = None if rb is None else (list(rb.host_blocks), list(rb.device_blocks), list(rb.summary_blocks))
        assert kv.allocate(s, step)
        rb = kv.requests[s.seq_id]
        s.num_computed_tokens += step
        if shortcut:  # nothing was taken, and the full count agrees nothing was needed
            assert (rb.host_blocks, rb.device_blocks, rb.summary_blocks) == before
        assert kv.pending_needs(s) == (0, 0)  # what the request holds covers every token so far
        assert rb.capacity >= s.num_computed_tokens
        grown += shortcut
    assert grown >= 8  # the shortcut did serve most single-token steps
    if mode is Mode.OASISKV:
        assert (kv.requests[s.seq_id].num_tier > 0) == tier  # 114 tokens: 29 blocks, past 20 host blocks


def test_manager_all_or_nothing_and_fits_alone():
    kv = KVCacheManager(Mode.DENSE, 4, num_device_blocks=3, num_host_blocks=0, top_k_blocks=8, max_model_len=100)
    a, b = seq(8), seq(8)
    assert kv.allocate(a, 8)
    assert not kv.allocate(b, 8)  # needs 2, 1 free
    assert kv.device_pool.num_free == 1
    with pytest.raises(ValueError, match="too small for one request"):
        kv.check_fits_alone(seq(20))


def dense_scheduler(num_blocks: int, **config) -> tuple[KVCacheManager, Scheduler]:
    """A dense KV manager of ``num_blocks`` 4-token blocks and a scheduler over it."""
    kv = KVCacheManager(Mode.DENSE, 4, num_device_blocks=num_blocks, num_host_blocks=0, top_k_blocks=8,
                        max_model_len=500)
    return kv, Scheduler(SchedulerConfig(**config), kv)


def test_scheduler_continuous_batching_and_chunked_prefill():
    kv, sched = dense_scheduler(64, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(25), seq(3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 10)]  # budget-limited chunk
    a.num_computed_tokens += 10
    out = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 10)]
    a.num_computed_tokens += 10
    out = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 5), (b, 3)]
    assert all(s.completes for s in out.scheduled)


def test_scheduler_preempts_newest_and_frees_its_blocks():
    kv, sched = dense_scheduler(4, max_num_batched_tokens=64)
    a, b = seq(8, 8), seq(8, 8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and kv.device_pool.num_free == 0
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        s.seq.output_token_ids.append(1)
    out = sched.schedule()  # both need a third block: b (newest) is preempted so a can grow
    assert out.preempted_ids == [b.seq_id]
    assert [s.seq for s in out.scheduled] == [a]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and sched.waiting[0] is b
    assert kv.device_blocks_held(b) == 0


def test_scheduler_modules_do_not_import_torch():
    code = ("import sys; import oasiskv_runtime.engine.scheduler, oasiskv_runtime.engine.block_pool, "
            "oasiskv_runtime.engine.kv_cache_manager; sys.exit('torch' in sys.modules)")
    # Import the modules directly from their files' package path without the package __init__ (which
    # exposes the torch-based LLM): stub the parent package.
    stub = ("import sys, types, pathlib; p = types.ModuleType('oasiskv_runtime'); "
            "p.__path__ = [str(pathlib.Path('oasiskv_runtime').resolve())]; sys.modules['oasiskv_runtime'] = p; ")
    r = subprocess.run([sys.executable, "-c", stub + code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr or "torch was imported by scheduler/block bookkeeping"


def test_scheduler_admits_only_when_the_whole_prompt_fits():
    # 10 blocks of 4 tokens. a (8-token prompt) runs; b's 36-token prompt needs 9 blocks, more than the 8 left
    # next to a. Admitting b on its first 8-token chunk (the old rule) would have preempted it a few steps later.
    kv, sched = dense_scheduler(10, max_num_batched_tokens=16)
    a, b = seq(8, 4), seq(36, 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a] and list(sched.waiting) == [b]
    a.num_computed_tokens += 8
    a.output_token_ids.append(1)
    assert [s.seq for s in sched.schedule().scheduled] == [a]  # still waiting: no first-chunk admission
    sched.finish(a, "length")
    out = sched.schedule()  # alone, b starts (in chunks) and never needs a preemption
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(b, 16)] and sched.num_preemptions == 0


def test_scheduler_admission_reserves_running_prompts():
    # Two waiting 20-token prompts (5 blocks each) next to a running one that still has 16 tokens to prefill:
    # only what fits beside all three whole prompts is admitted in the same step.
    kv, sched = dense_scheduler(12, max_num_batched_tokens=8)
    a = seq(24, 4)
    sched.add(a)
    sched.schedule()                      # a: first 8 tokens (2 blocks); 16 more tokens = 4 blocks pending
    a.num_computed_tokens += 8
    b, c = seq(20, 4), seq(20, 4)
    sched.add(b)
    sched.add(c)
    sched.config = SchedulerConfig(max_num_batched_tokens=40)
    out = sched.schedule()                # a takes its 4 blocks; 6 free: b (5) fits, c would not
    assert [s.seq for s in out.scheduled] == [a, b] and list(sched.waiting) == [c]


@pytest.mark.parametrize("mode", [Mode.DENSE, Mode.OASISKV])
def test_scratch_request_blocks_are_its_own_and_not_usable_by_requests(mode):
    """The padding rows of CUDA-graph batches write into a scratch request's blocks: they must be distinct from
    every real request's, and a request that would need them must be refused up front, not admitted alone and
    then stuck short of blocks."""
    kv = KVCacheManager(mode, 4, num_device_blocks=14, num_host_blocks=12, top_k_blocks=3, max_model_len=100)
    scratch = seq(1, 1)
    assert kv.add_scratch_request(scratch)
    rb = kv.requests[scratch.seq_id]
    held_device = set(rb.device_blocks + rb.ws_blocks + rb.summary_blocks)
    assert len(held_device) == kv.scratch_blocks[0] == (2 if mode.is_sparse else 1)
    assert len(rb.host_blocks) == kv.scratch_blocks[1] == (1 if mode.uses_host_pool else 0)
    if mode.uses_host_pool:  # every working-set slot aliases the local block: nothing is ever fetched into them
        assert len(rb.ws_blocks) == 3 + 1 and set(rb.ws_blocks) == {rb.ws_blocks[0]}
    # The largest request the remaining blocks hold is accepted; one block more is refused by check_fits_alone.
    usable = 14 - kv.scratch_blocks[0]
    if mode.is_sparse:  # oasiskv: the context on the host (11 of 12 blocks usable); 7 device blocks either way
        fits, too_big = seq(40, 4), seq(41, 4)  # 44 tokens = 11 host blocks vs 45 = 12
        assert usable >= 7
    else:
        fits, too_big = seq(4 * usable - 4, 4), seq(4 * usable - 3, 4)
    kv.check_fits_alone(fits)
    with pytest.raises(ValueError, match="too small for one request"):
        kv.check_fits_alone(too_big)
    a = seq(8, 4)
    assert kv.allocate(a, 8)
    ra = kv.requests[a.seq_id]
    assert held_device.isdisjoint(ra.device_blocks + ra.ws_blocks + ra.summary_blocks)
    assert set(rb.host_blocks).isdisjoint(ra.host_blocks)


def test_scratch_request_refused_when_the_pools_are_short():
    kv = KVCacheManager(Mode.OASISKV, 4, num_device_blocks=1, num_host_blocks=4, top_k_blocks=3, max_model_len=100)
    s = seq(1, 1)
    assert not kv.add_scratch_request(s)
    assert s.seq_id not in kv.requests and kv.scratch_blocks == (0, 0) and kv.device_pool.num_free == 1
