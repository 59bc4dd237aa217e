"""Suite files: expansion rules and file:line errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oasisbench.results.schema import MODES, point_id
from oasisbench.suites import Suite, SuiteError, load_suite

SMOKE = """\
name: throughput-smoke
description: dense vs oasiskv
kind: throughput
defaults:
  model: smollm2-135m
  modes: [dense, oasiskv]
  output_len: 64
  fetch_ratio: 0.05
grid:
  context_len: [1024, 4096]
  concurrency: [1, 8]
points:
  - {mode: oasiskv, context_len: 4096, concurrency: 32, top_k_blocks: 64}
  - {mode: dense, context_len: 1024, concurrency: 1}   # duplicate of a grid point
gate: baselines/smoke.yaml
"""


def write(tmp_path: Path, text: str, name: str = "suite.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SuiteError) as info:
        load_suite(path)
    return str(info.value)


def test_expand_grid_modes_and_points(tmp_path: Path) -> None:
    suite = load_suite(write(tmp_path, SMOKE))
    assert (suite.name, suite.kind, suite.description) == ("throughput-smoke", "throughput", "dense vs oasiskv")
    assert suite.gate == tmp_path / "baselines" / "smoke.yaml"
    points = suite.expand()
    # 2 contexts x 2 concurrencies x 2 modes, plus one new explicit point (the other is a duplicate).
    assert len(points) == 9
    assert len({point_id(p) for p in points}) == 9
    # Modes vary innermost so compared modes run back to back.
    assert [(p["mode"], p["context_len"], p["concurrency"]) for p in points[:4]] == [
        ("dense", 1024, 1),
        ("oasiskv", 1024, 1),
        ("dense", 1024, 8),
        ("oasiskv", 1024, 8),
    ]
    last = points[-1]
    assert last == {
        "model": "smollm2-135m",
        "mode": "oasiskv",
        "output_len": 64,
        "fetch_ratio": 0.05,
        "context_len": 4096,
        "concurrency": 32,
        "top_k_blocks": 64,
    }
    assert all("modes" not in p for p in points)


def test_points_only_and_mode_overrides_modes(tmp_path: Path) -> None:
    suite = load_suite(
        write(
            tmp_path,
            """\
            name: s
            defaults: {modes: [dense, oasiskv], context_len: 512}
            points:
              - {mode: proxy-prefetch, concurrency: 2}
              - {modes: [dense, fetch-on-demand], concurrency: 4}
            """,
        )
    )
    assert suite.kind == "throughput" and suite.gate is None
    assert [(p["mode"], p["concurrency"]) for p in suite.expand()] == [
        ("proxy-prefetch", 2),
        ("dense", 4),
        ("fetch-on-demand", 4),
    ]


def test_no_grid_no_points_is_one_point_per_mode(tmp_path: Path) -> None:
    path = write(tmp_path, "name: s\ndefaults: {modes: [dense, oasiskv], context_len: 8, concurrency: 1}\n")
    assert [p["mode"] for p in load_suite(path).expand()] == ["dense", "oasiskv"]


def test_accuracy_kind_accepted(tmp_path: Path) -> None:
    suite = load_suite(write(tmp_path, "name: a\nkind: accuracy\ndefaults: {mode: oasiskv}\n"))
    assert suite.kind == "accuracy"  # throughput-only required keys do not apply


def test_malformed_yaml_names_line(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "name: s\ndefaults:\n  model: m\n  concurrency: [1, 2\ngrid: {}\n")
    assert f"{tmp_path / 'suite.yaml'}:5: malformed YAML" in msg
    assert "started on line 4" in msg
    msg = error_of(tmp_path, "name: s\ndefaults:\n  model: m\n   mode: dense\n")
    assert "suite.yaml:4: malformed YAML" in msg


def test_unknown_keys_name_line_and_suggest(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "name: s\ndefaults:\n  model: m\n  contxt_len: 5\n")
    assert "suite.yaml:4: unknown key 'contxt_len' in defaults (did you mean 'context_len'?)" in msg
    msg = error_of(tmp_path, "name: s\ngird:\n  concurrency: [1]\n")
    assert "suite.yaml:2: unknown key 'gird' in suite" in msg
    grid = "name: s\ndefaults: {mode: dense, context_len: 8}\ngrid:\n  concurrency: [1]\n  zzz: [1]\n"
    msg = error_of(tmp_path, grid)
    assert "suite.yaml:5: unknown key 'zzz' in grid" in msg
    msg = error_of(tmp_path, "name: s\npoints:\n  - {mode: dense, context_len: 8, concurrency: 1}\n  - {bogus: 1}\n")
    assert "suite.yaml:4: unknown key 'bogus' in points[1]" in msg


def test_wrong_types_name_line(tmp_path: Path) -> None:
    base = "name: s\ndefaults: {mode: dense, context_len: 8}\ngrid:\n  concurrency:\n    - 1\n    - eight\n"
    msg = error_of(tmp_path, base)
    assert "suite.yaml:6: grid.concurrency must be a positive integer (requests), got 'eight'" in msg
    msg = error_of(tmp_path, "name: s\ndefaults:\n  modes: [dense, turbo]\n")
    assert "suite.yaml:3: defaults.modes must be a non-empty list of modes" in msg
    msg = error_of(tmp_path, "name: s\ndefaults:\n  measure_recall: yes please\n")
    assert "suite.yaml:3: defaults.measure_recall must be true or false" in msg
    msg = error_of(tmp_path, "name: s\ndefaults:\n  link_gbps: fast\n")
    assert "suite.yaml:3: defaults.link_gbps must be a number >= 0" in msg
    msg = error_of(tmp_path, "name: s\ndefaults:\n  pipeline_priority: 2\n")
    assert "suite.yaml:3: defaults.pipeline_priority must be a non-positive integer" in msg
    msg = error_of(tmp_path, "name: s\nkind: latency\n")
    assert "suite.yaml:2: kind must be one of throughput, accuracy" in msg
    msg = error_of(tmp_path, "name: s\ngrid:\n  context_len: 1024\n")
    assert "suite.yaml:3: grid.context_len must be a non-empty list" in msg
    msg = error_of(tmp_path, "name: s\ndefaults: {context_len: 8, concurrency: 1}\ngrid:\n  modes: [dense, oasiskv]\n")
    assert "suite.yaml:4:" in msg and "write 'mode: [...]'" in msg


def test_structural_errors(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "name: s\ndefaults:\n  model: a\n  model: b\n")
    assert "suite.yaml:4: defaults: duplicate key 'model' (first on line 3)" in msg
    msg = error_of(tmp_path, "name: s\ndefaults: {mode: dense, modes: [dense]}\n")
    assert "suite.yaml:2: defaults sets both 'mode' and 'modes'" in msg
    msg = error_of(tmp_path, "description: no name\n")
    assert "suite.yaml:1: suite needs 'name'" in msg
    msg = error_of(tmp_path, "name: s\ndefaults: {mode: dense}\ngrid:\n  context_len: [8]\n")
    assert "suite.yaml:3: throughput points need concurrency" in msg
    msg = error_of(tmp_path, "name: s\ndefaults: {mode: dense}\npoints:\n  - {context_len: 8}\n")
    assert "suite.yaml:4: points[0] needs concurrency" in msg
    assert "empty suite file" in error_of(tmp_path, "")
    with pytest.raises(SuiteError, match="suite file not found"):
        load_suite(tmp_path / "missing.yaml")


@settings(max_examples=30, deadline=None)
@given(
    modes=st.lists(st.sampled_from(MODES), min_size=1, max_size=5, unique=True),
    contexts=st.lists(st.integers(1, 10**6), min_size=1, max_size=4, unique=True),
    concurrencies=st.lists(st.integers(1, 512), min_size=1, max_size=4, unique=True),
)
def test_expand_is_full_cartesian_product(modes: list[str], contexts: list[int], concurrencies: list[int]) -> None:
    suite = Suite(
        name="p",
        kind="throughput",
        defaults={"modes": modes},
        grid={"context_len": contexts, "concurrency": concurrencies},
    )
    points = suite.expand()
    assert len(points) == len(modes) * len(contexts) * len(concurrencies)
    assert {(p["mode"], p["context_len"], p["concurrency"]) for p in points} == {
        (m, c, n) for m in modes for c in contexts for n in concurrencies
    }


SHIPPED = sorted(p for p in (Path(__file__).resolve().parent.parent / "suites" / "throughput").glob("*.yaml")
                 if not p.name.endswith(".baseline.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_suites_load_and_expand(path):
    suite = load_suite(path)
    points = suite.expand()
    assert suite.kind == "throughput" and suite.name == path.stem and points
    assert all(p["mode"] in MODES and p["output_len"] < p["context_len"] for p in points)
