"""The per-step fetch cap from the link's byte budget (``SparseConfig.link_gbps``): the arithmetic on a fake clock,
and the engine using it."""

from __future__ import annotations

import pytest

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.core.link_cap import LinkCap, pow2_floor
from tests.tiny_models import write_tiny


class Clock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


UNIT = 1_000_000  # bytes one unit of cap moves per request and step


def test_pow2_floor():
    assert [pow2_floor(n) for n in (1, 2, 3, 7, 8, 9, 129)] == [1, 2, 2, 4, 8, 8, 128]


def test_no_link_keeps_the_fixed_cap_and_reads_no_clock():
    lc = LinkCap(ceiling=128, bytes_per_request_unit=UNIT, clock=Clock([]))
    assert [lc.new_step(8, True, 7, 0.0) for _ in range(3)] == [7, 7, 7]
    assert lc.step_seconds == {} and lc.mean_cap() == 7


def test_cap_is_the_links_bytes_in_one_step_shared_by_the_requests():
    # decode-only steps 20 ms apart at 10 GB/s: 200 MB per step; 4 requests x 1 MB per unit -> 50 -> 32.
    lc = LinkCap(ceiling=128, bytes_per_request_unit=UNIT, clock=Clock([0.0, 0.02, 0.04, 0.06, 0.08, 0.1]))
    assert lc.new_step(4, True, 7, 10.0) == 7        # nothing measured yet: the fixed cap
    assert lc.step_seconds == {}
    # 32 is the target; a cap at most doubles per step (rounded down to a power of two): 7 -> 8 -> 16 -> 32
    assert [lc.new_step(4, True, 7, 10.0) for _ in range(4)] == [8, 16, 32, 32]
    assert lc.step_seconds == {True: pytest.approx(0.02)}
    assert lc.cap_for(1, 7, 10.0) == 128             # 200 units, past the working set: its size
    assert lc.cap_for(40, 7, 10.0) == 7              # 5 units: the fixed cap is the floor
    assert lc.cap_for(30, 2, 10.0) == 4              # 6.7 units -> 4
    assert lc.cap_for(300, 2, 10.0) == 2             # under one unit: the floor
    assert lc.cap_for(4, 2, 10.0, decode_only=False) == 2  # no step that carries a prefill timed yet
    assert lc.new_step(0, True, 7, 10.0) == 7        # a step with no decode request is not counted
    assert lc.mean_cap() == pytest.approx((7 + 8 + 16 + 32 + 32) / 5)


def test_each_step_kind_has_its_own_time():
    # decode@0, prefill-carrying@0.01 (the decode step took 10 ms), prefill-carrying@0.41 (400 ms),
    # decode@0.81 (400 ms), decode@0.84 (30 ms)
    lc = LinkCap(ceiling=128, bytes_per_request_unit=UNIT, clock=Clock([0.0, 0.01, 0.41, 0.81, 0.84]))
    caps = [lc.new_step(2, kind, 1, 1.0) for kind in (True, False, False, True, True)]
    assert lc.step_seconds == {False: pytest.approx(0.4), True: pytest.approx(0.01)}
    # 1 GB/s: a 10 ms decode step moves 10 MB = 5 units per request -> 4; a 400 ms step 200 -> 128; each kind's
    # cap grows from its own last one (1 -> 2 -> 4).
    assert caps == [1, 1, 2, 2, 4]
    assert lc.cap_for(2, 1, 1.0, decode_only=False) == 128


def test_a_slow_step_does_not_raise_the_cap():
    """A step that captured a CUDA graph or waited on the host is many times longer than the others: the cap
    follows the shortest recent step, so such a step cannot start the cycle of a larger cap, a new graph key and
    another slow capture step (what a moving average did on the H200)."""
    times = [0.0, 0.01, 0.02, 0.03, 1.03, 1.04, 1.05]   # 10 ms steps, one of 1 s
    lc = LinkCap(ceiling=128, bytes_per_request_unit=UNIT, clock=Clock(times))
    caps = [lc.new_step(2, True, 1, 1.0) for _ in times]
    assert caps == [1, 2, 4, 4, 4, 4, 4]              # 1 GB/s x 10 ms / (2 x 1 MB) = 5 -> 4, the 1 s step ignored
    assert lc.step_seconds == {True: pytest.approx(0.01)}
    lc2 = LinkCap(ceiling=128, bytes_per_request_unit=UNIT, window=2, clock=Clock(times))
    assert [lc2.new_step(2, True, 1, 1.0) for _ in times][-1] == 4  # 10 ms is still within the last two


def test_a_cap_falls_back_at_once_when_steps_get_shorter():
    times = [0.0, 0.2, 0.4, 0.6, 0.8, 0.81, 0.82]     # 200 ms steps, then 10 ms ones
    lc = LinkCap(ceiling=128, bytes_per_request_unit=UNIT, window=3, clock=Clock(times))
    caps = [lc.new_step(2, True, 1, 1.0) for _ in times]
    assert caps == [1, 2, 4, 8, 16, 4, 4]             # 100 units -> grows by doubling; 5 units -> 4 at once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("linkcap"), "qwen3", max_position_embeddings=4096))


PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 9, [300, 12] * 20, list(range(40, 40 + 77))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _run(tiny, link_gbps):
    llm = LLM(tiny, mode="proxy-prefetch", top_k_blocks=4, block_size=4, fetch_ratio=0.25, link_gbps=link_gbps)
    caps = []
    be = llm.engine.backend
    new_step = be.new_step

    def spy(sched):
        new_step(sched)
        caps.append(be.step_cap)
    be.new_step = spy
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs], llm.engine.run_stats(), caps


@pytest.mark.slow
def test_engine_cap_follows_the_link(tiny):
    """With the fixed cap (1 copy per head and step at top_k_blocks 4) blocks are deferred; with a link budget
    far above what this tiny model moves, the cap is the whole working set once a decode step was timed, and
    no block of those steps is deferred."""
    _, fixed, fixed_caps = _run(tiny, 0.0)
    assert set(fixed_caps) == {1} and fixed["mean_fetch_cap"] == 1.0
    assert fixed["deferred_blocks_per_step"] > 0
    _, linked, caps = _run(tiny, 1e6)
    assert caps[0] == 1 and max(caps) == 4 and set(caps) <= {1, 2, 4}
    assert caps[-10:] == [4] * 10                      # decode-only to the end
    assert 1.0 < linked["mean_fetch_cap"] <= 4.0
    assert linked["deferred_blocks_per_step"] < fixed["deferred_blocks_per_step"]
    assert linked["fetched_blocks_per_step"] > fixed["fetched_blocks_per_step"]


def test_link_gbps_must_not_be_negative():
    from oasiskv_runtime.config import SparseConfig

    with pytest.raises(ValueError, match="link_gbps must be a number >= 0"):
        SparseConfig(link_gbps=-1.0)


def test_reset_counts_keeps_the_step_time_and_skips_the_pause():
    lc = LinkCap(ceiling=128, bytes_per_request_unit=UNIT, clock=Clock([0.0, 0.02, 100.0, 100.03]))
    assert [lc.new_step(4, True, 7, 10.0) for _ in range(2)] == [7, 8]
    lc.reset_counts()
    assert lc.mean_cap() is None and lc.step_seconds == {True: pytest.approx(0.02)}
    assert lc.new_step(4, True, 7, 10.0) == 16       # the 100 s pause is not a step; the cap keeps growing
    assert lc.step_seconds == {True: pytest.approx(0.02)}
    lc.new_step(4, True, 7, 10.0)
    assert lc.step_seconds == {True: pytest.approx(0.02)}  # the shortest of 20 and 30 ms
    assert lc.mean_cap() == pytest.approx((16 + 32) / 2)
