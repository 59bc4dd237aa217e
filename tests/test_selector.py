"""Tests for Algorithm 2 (SPEC item 4): the reference ``select_head`` and the batched ``select_batched``.

Property tests drive the reference through many steps of random predictions over a small logical-block
universe (so hits, misses and evictions all happen) and check the rules from first principles rather
than by re-running the same code. The batched version is then checked row by row against the reference.
"""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv_runtime.core.selector import HeadSelection, fetch_cap, select_head
from oasiskv_runtime.ops.select_rows import SelectionPlan, select_batched

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None)
MAIN_PROPERTY_SETTINGS = settings(max_examples=250, deadline=None)


# ----------------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, list[int], list[int], list[tuple[list[int], int]]]:
    """(K, universe size, initial slot_blocks, initial last_selected, [(predicted, cap)] per step)."""
    k = draw(st.integers(1, 12))
    universe = draw(st.integers(k, k + 8))  # small: predictions overlap the resident set often
    # Initial state: empty, or a random valid working set (distinct blocks, random holes and recency).
    if draw(st.booleans()):
        slots = [-1] * k
        last = [-1] * k
    else:
        slots = [
            b if draw(st.booleans()) else -1
            for b in draw(st.permutations(range(universe)))[:k]
        ]
        last = [draw(st.integers(-1, 3)) if b != -1 else -1 for b in slots]
    n_steps = draw(st.integers(1, 12))
    steps = []
    for _ in range(n_steps):
        size = draw(st.integers(0, k))
        predicted = draw(st.permutations(range(universe)))[:size]
        cap = draw(st.sampled_from([0, 1, 2, 3, k, k + 5]) | st.integers(0, k + 2))
        steps.append((predicted, cap))
    return k, universe, slots, last, steps


# ----------------------------------------------------------------------------------------------------
# Invariant checker (independent of the implementation's internals)
# ----------------------------------------------------------------------------------------------------


def check_step(
    before_slots: list[int],
    before_last: list[int],
    slots: list[int],
    last: list[int],
    predicted: list[int],
    cap: int,
    step: int,
    universe: int,
    res: HeadSelection,
) -> None:
    k = len(before_slots)
    pset = set(predicted)
    resident_before = {b for b in before_slots if b != -1}
    missing = [b for b in predicted if b not in resident_before]
    n = min(len(missing), cap)

    # Counts and the cap.
    assert len(res.admitted) == len(res.evicted) == n <= cap
    assert res.num_hits == len(pset & resident_before)
    assert res.num_deferred == len(missing) - n

    # Admitted = the top-ranked missing blocks, in rank order.
    assert [b for _, b in res.admitted] == missing[:n]

    # Admitted slots are distinct; the evicted block is what the slot held before.
    admitted_slots = [s for s, _ in res.admitted]
    assert len(set(admitted_slots)) == n
    assert res.evicted == [before_slots[s] for s in admitted_slots]

    # P ∩ R is never evicted.
    assert not (set(res.evicted) & pset)
    for s, b in enumerate(before_slots):
        if b in pset:
            assert slots[s] == b and last[s] == step

    # Empty slots are used first, lowest index first; then evicted residents are the least recently
    # selected non-predicted ones, in (last_selected, slot) order.
    empties = [s for s, b in enumerate(before_slots) if b == -1]
    n_empty_used = min(n, len(empties))
    assert admitted_slots[:n_empty_used] == empties[:n_empty_used]
    evicted_slots = admitted_slots[n_empty_used:]
    keys = [(before_last[s], s) for s in evicted_slots]
    assert keys == sorted(keys)
    survivors = [
        s for s, b in enumerate(before_slots) if b != -1 and b not in pset and s not in evicted_slots
    ]
    if evicted_slots:
        assert max(keys) < min(((before_last[s], s) for s in survivors), default=(math.inf, 0))
    # Residents are only evicted once the empty slots are gone.
    if evicted_slots:
        assert n_empty_used == len(empties)

    # Resulting state.
    expected = list(before_slots)
    for s, b in res.admitted:
        expected[s] = b
    assert slots == expected
    occupied = [b for b in slots if b != -1]
    assert len(occupied) == len(set(occupied)), "duplicate residents"
    assert all(0 <= b < universe for b in occupied)
    for s in range(k):
        if s in admitted_slots or before_slots[s] in pset:
            assert last[s] == step
        else:
            assert last[s] == before_last[s]

    # With an unbounded cap the working set covers the prediction after one step.
    if cap >= k:
        assert pset <= set(slots)


# ----------------------------------------------------------------------------------------------------
# Reference: properties
# ----------------------------------------------------------------------------------------------------


@MAIN_PROPERTY_SETTINGS
@given(scenarios())
def test_select_head_properties(scenario) -> None:
    k, universe, slots, last, steps = scenario
    for step, (predicted, cap) in enumerate(steps, start=10):
        before_slots, before_last = list(slots), list(last)
        res = select_head(slots, last, predicted, cap, step)
        check_step(before_slots, before_last, slots, last, predicted, cap, step, universe, res)


@PROPERTY_SETTINGS
@given(
    st.integers(1, 12).flatmap(
        lambda k: st.tuples(
            st.just(k),
            st.lists(st.integers(0, k + 6), min_size=k, max_size=k),  # initial residents (deduped)
            st.permutations(range(k + 7)),
            st.integers(0, k),
            st.integers(1, k),
        )
    )
)
def test_deferred_blocks_arrive_within_ceil_k_over_cap_steps(args) -> None:
    """Liveness: a stable prediction is fully resident after ceil(|P| / C) steps (deferral is bounded)."""
    k, init, perm, size, cap = args
    seen: set[int] = set()
    slots = []
    for b in init:
        slots.append(b if b not in seen else -1)
        seen.add(b)
    last = [0 if b != -1 else -1 for b in slots]
    predicted = perm[:size]
    steps_needed = max(1, math.ceil(size / cap))
    for step in range(1, steps_needed + 1):
        select_head(slots, last, predicted, cap, step)
    assert set(predicted) <= set(slots)
    # And once resident, the same prediction costs no traffic.
    res = select_head(slots, last, predicted, cap, steps_needed + 1)
    assert res.admitted == [] and res.num_hits == size and res.num_deferred == 0


# ----------------------------------------------------------------------------------------------------
# Reference: hand-computed examples
# ----------------------------------------------------------------------------------------------------


def test_example_empty_first_then_lru_and_deferral() -> None:
    slots = [10, 11, -1, 12]
    last = [3, 1, -1, 2]
    res = select_head(slots, last, [11, 20, 21, 22], cap=2, step=5)
    # 11 hits (slot 1). Missing [20, 21, 22]. Order: empty slot 2, then slot 3 (ls 2), slot 0 (ls 3).
    assert res.admitted == [(2, 20), (3, 21)]
    assert res.evicted == [-1, 12]
    assert res.num_hits == 1 and res.num_deferred == 1 and res.num_admitted == 2
    assert slots == [10, 11, 20, 21]
    assert last == [3, 5, 5, 5]

    # Next step: 20 hits; 22 (deferred before) is admitted over slot 0, the least recently selected.
    res = select_head(slots, last, [22, 20], cap=4, step=6)
    assert res.admitted == [(0, 22)]
    assert res.evicted == [10]
    assert res.num_hits == 1 and res.num_deferred == 0
    assert slots == [22, 11, 20, 21]
    assert last == [6, 5, 6, 5]


def test_example_ties_broken_by_lower_slot() -> None:
    slots, last = [5, 6, 7], [2, 2, 2]
    res = select_head(slots, last, [9, 8], cap=1, step=3)
    assert res.admitted == [(0, 9)] and res.evicted == [5] and res.num_deferred == 1
    assert slots == [9, 6, 7] and last == [3, 2, 2]


def test_example_recently_hit_resident_outlives_older_one() -> None:
    slots, last = [1, 2, 3], [-1, -1, -1]
    select_head(slots, last, [1], cap=3, step=0)  # refresh 1
    res = select_head(slots, last, [4, 5], cap=3, step=1)
    # Slots 1 and 2 (never selected, ls -1) go before slot 0 (selected at step 0).
    assert res.admitted == [(1, 4), (2, 5)] and res.evicted == [2, 3]
    assert slots == [1, 4, 5] and last == [0, 1, 1]


def test_example_cap_zero_only_refreshes_hits() -> None:
    slots, last = [4, -1, 6], [0, -1, 0]
    res = select_head(slots, last, [6, 7, 8], cap=0, step=9)
    assert res.admitted == [] and res.evicted == []
    assert res.num_hits == 1 and res.num_deferred == 2
    assert slots == [4, -1, 6] and last == [0, -1, 9]


def test_example_all_hits_and_empty_prediction() -> None:
    slots, last = [3, 1, 2], [0, 0, 0]
    res = select_head(slots, last, [2, 3, 1], cap=1, step=4)
    assert res == HeadSelection(admitted=[], evicted=[], num_deferred=0, num_hits=3)
    assert last == [4, 4, 4]
    res = select_head(slots, last, [], cap=5, step=5)
    assert res == HeadSelection() and slots == [3, 1, 2] and last == [4, 4, 4]


def test_example_cold_start_fills_slots_in_order() -> None:
    slots, last = [-1] * 4, [-1] * 4
    res = select_head(slots, last, [7, 3, 9], cap=10, step=0)
    assert res.admitted == [(0, 7), (1, 3), (2, 9)] and res.evicted == [-1, -1, -1]
    assert slots == [7, 3, 9, -1] and last == [0, 0, 0, -1]


def test_select_head_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        select_head([-1, -1], [-1, -1], [1, 1], 1, 0)  # duplicates
    with pytest.raises(ValueError):
        select_head([-1], [-1], [1, 2], 1, 0)  # more predicted than slots
    with pytest.raises(ValueError):
        select_head([-1], [-1], [1], -1, 0)  # negative cap
    with pytest.raises(ValueError):
        select_head([-1], [-1, -1], [1], 1, 0)  # length mismatch
    with pytest.raises(ValueError):
        select_head([-1], [-1], [-1], 1, 0)  # -1 is not a block


def test_fetch_cap() -> None:
    assert fetch_cap(0.05, 128) == 7  # ceil(6.4)
    assert fetch_cap(0.25, 128) == 32
    assert fetch_cap(0.3, 10) == 3  # 0.3 * 10 == 3.0000000000000004 in floating point
    assert fetch_cap(0.7, 10) == 7  # 0.7 * 10 == 7.000000000000001
    assert fetch_cap(0.001, 128) == 1  # at least one block when the ratio is positive
    assert fetch_cap(0.0, 128) == 0
    assert fetch_cap(1.0, 128) == 128
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            fetch_cap(bad, 128)


def test_reference_does_not_import_torch() -> None:
    # Checked on the source rather than sys.modules: the package's own __init__ may import torch, but
    # the reference module must stay loadable on a host without it.
    import oasiskv_runtime.core.selector as selector_module

    tree = ast.parse(Path(selector_module.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "math", "dataclasses", "typing", "collections"}, imported


# ----------------------------------------------------------------------------------------------------
# Batched version == reference, row by row
# ----------------------------------------------------------------------------------------------------


def _random_batch_inputs(
    rng: random.Random, n: int, k: int, p: int, universe: int
) -> tuple[list[list[int]], list[list[int]]]:
    slots, last = [], []
    for _ in range(n):
        blocks = rng.sample(range(universe), k)
        row = [b if rng.random() < 0.6 else -1 for b in blocks]
        slots.append(row)
        last.append([rng.randint(-1, 2) if b != -1 else -1 for b in row])
    return slots, last


def _run_batched_vs_reference(
    seed: int, n: int, k: int, p: int, universe: int, n_steps: int, dtype: torch.dtype, cap_kind: str
) -> None:
    rng = random.Random(seed)
    ref_slots, ref_last = _random_batch_inputs(rng, n, k, p, universe)
    t_slots = torch.tensor(ref_slots, dtype=dtype)
    t_last = torch.tensor(ref_last, dtype=dtype)
    for step in range(3, 3 + n_steps):
        preds = []
        for _ in range(n):
            size = rng.randint(0, p)
            preds.append(rng.sample(range(universe), size) + [-1] * (p - size))
        caps = [rng.choice([0, 1, 2, 5, k, k + 3]) for _ in range(n)]
        if cap_kind == "int":
            caps = [caps[0]] * n
            cap_arg: int | torch.Tensor = caps[0]
        elif cap_kind == "scalar_tensor":
            caps = [caps[0]] * n
            cap_arg = torch.tensor(caps[0])
        else:
            cap_arg = torch.tensor(caps, dtype=torch.int32)
        step_arg: int | torch.Tensor = step if step % 2 else torch.tensor(step)

        plan = select_batched(t_slots, t_last, torch.tensor(preds, dtype=dtype), cap_arg, step_arg)
        assert isinstance(plan, SelectionPlan)
        assert plan.new_slot_blocks.dtype == dtype and plan.new_last_selected.dtype == dtype

        for i in range(n):
            before = list(ref_slots[i])
            res = select_head(ref_slots[i], ref_last[i], [b for b in preds[i] if b >= 0], caps[i], step)
            assert plan.new_slot_blocks[i].tolist() == ref_slots[i], (step, i)
            assert plan.new_last_selected[i].tolist() == ref_last[i], (step, i)
            admitted_slots = sorted(s for s, _ in res.admitted)
            assert plan.admit_mask[i].nonzero().flatten().tolist() == admitted_slots
            assert int(plan.num_admitted[i]) == res.num_admitted
            assert int(plan.num_deferred[i]) == res.num_deferred
            assert int(plan.num_hits[i]) == res.num_hits
            expected_evicted = [-1] * k
            for s, _ in res.admitted:
                expected_evicted[s] = before[s]
            assert plan.evicted_blocks[i].tolist() == expected_evicted

        # Inputs are not mutated; carry the new state forward.
        assert t_slots.tolist() != [] and t_slots is not plan.new_slot_blocks
        t_slots, t_last = plan.new_slot_blocks, plan.new_last_selected


@pytest.mark.parametrize(
    ("seed", "n", "k", "p", "universe", "dtype", "cap_kind"),
    [
        (0, 7, 13, 13, 20, torch.int64, "per_row"),
        (1, 7, 13, 9, 17, torch.int32, "per_row"),
        (2, 5, 1, 1, 3, torch.int64, "int"),
        (3, 3, 8, 0, 12, torch.int32, "int"),
        (4, 11, 6, 6, 6, torch.int64, "scalar_tensor"),  # universe == K: the working set can fill up
        (5, 9, 16, 12, 40, torch.int32, "int"),
    ],
)
def test_select_batched_matches_reference(seed, n, k, p, universe, dtype, cap_kind) -> None:
    _run_batched_vs_reference(seed, n, k, p, universe, n_steps=8, dtype=dtype, cap_kind=cap_kind)


def test_select_batched_matches_reference_random_sizes() -> None:
    """Many small random shapes (odd sizes, tight and loose universes), all cap flavours."""
    rng = random.Random(1234)
    for seed in range(40):
        k = rng.randint(1, 17)
        _run_batched_vs_reference(
            seed=1000 + seed,
            n=rng.randint(1, 9),
            k=k,
            p=rng.randint(0, k),
            universe=rng.randint(k, 3 * k + 2),
            n_steps=5,
            dtype=rng.choice([torch.int32, torch.int64]),
            cap_kind=rng.choice(["int", "scalar_tensor", "per_row"]),
        )


def test_select_batched_ignores_padding_anywhere_and_does_not_mutate() -> None:
    slots = torch.tensor([[4, -1, 6, 7]])
    last = torch.tensor([[1, -1, 0, 2]])
    slots_copy, last_copy = slots.clone(), last.clone()
    # A -1 in the middle is just ignored: equivalent to predicted [6, 9, 8].
    plan = select_batched(slots, last, torch.tensor([[6, -1, 9, 8]]), cap=1, step=5)
    assert torch.equal(slots, slots_copy) and torch.equal(last, last_copy)
    assert plan.new_slot_blocks.tolist() == [[4, 9, 6, 7]]
    assert plan.new_last_selected.tolist() == [[1, 5, 5, 2]]
    assert plan.admit_mask.tolist() == [[False, True, False, False]]
    assert plan.num_hits.tolist() == [1] and plan.num_deferred.tolist() == [1]
    assert plan.evicted_blocks.tolist() == [[-1, -1, -1, -1]]


def test_select_batched_rejects_bad_shapes() -> None:
    z = torch.full((2, 3), -1)
    with pytest.raises(ValueError):
        select_batched(z, z, torch.full((2, 4), -1), 1, 0)  # P > K
    with pytest.raises(ValueError):
        select_batched(z, z[:1], torch.full((2, 3), -1), 1, 0)
    with pytest.raises(ValueError):
        select_batched(z, z, torch.full((2, 3), -1), -1, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_select_batched_on_cuda_matches_cpu() -> None:
    rng = random.Random(7)
    slots, last = _random_batch_inputs(rng, 64, 128, 128, 400)
    preds = [rng.sample(range(400), 128) for _ in range(64)]
    args = (torch.tensor(slots), torch.tensor(last), torch.tensor(preds))
    cpu = select_batched(*args, cap=7, step=3)
    cuda_args = [a.cuda() for a in args]
    cap_t = torch.tensor(7, device="cuda")
    step_t = torch.tensor(3, device="cuda")
    torch.cuda.synchronize()
    # No host round trips: any synchronizing op inside select_batched raises here.
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = select_batched(*cuda_args, cap=cap_t, step=3)
        gpu_int_cap = select_batched(*cuda_args, cap=7, step=step_t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b, c in zip(cpu, gpu, gpu_int_cap):
        assert torch.equal(a, b.cpu()) and torch.equal(a, c.cpu())


@pytest.mark.parametrize(("n", "k", "p"), [(0, 4, 4), (3, 0, 0), (2, 5, 0)])
def test_select_batched_degenerate_shapes(n: int, k: int, p: int) -> None:
    slots = torch.full((n, k), -1, dtype=torch.int32)
    plan = select_batched(slots, slots.clone(), torch.full((n, p), -1), cap=3, step=1)
    assert plan.new_slot_blocks.shape == (n, k) and plan.admit_mask.shape == (n, k)
    assert plan.num_admitted.shape == plan.num_hits.shape == plan.num_deferred.shape == (n,)
    assert not plan.admit_mask.any() and int(plan.num_admitted.sum()) == 0
