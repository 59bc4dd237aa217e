"""Results store, plots, reports, compare and gate, on a synthetic run (no runtime, no GPU)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from oasisbench.cli.compare import compare_cmd
from oasisbench.cli.gate import gate_cmd
from oasisbench.cli.report import report_cmd
from oasisbench.results import store as store_mod
from oasisbench.results.gate import BaselineError, dump_baseline, gate, load_baseline, make_baseline
from oasisbench.results.plots import ROOFLINE_PNG, THROUGHPUT_PNG, write_plots
from oasisbench.results.report import compare_runs, reading_lines, render_report
from oasisbench.results.schema import Run, point_id
from oasisbench.results.store import RunStore, atomic_write_json, atomic_write_text, load_run

MODES = ("dense", "oasiskv")
CONTEXTS = (1024, 4096)
CONCURRENCIES = (1, 4, 16)


def synth_metrics(mode: str, ctx: int, conc: int) -> dict[str, Any]:
    """Plausible numbers: dense is capacity-bound at long context, oasiskv keeps a 10x smaller working set."""
    resident = ctx * 144 * 1024 * (1.0 if mode == "dense" else 0.1)
    cap = int(40e9 // (ctx * 144 * 1024)) if mode == "dense" else 10_000
    batch = min(conc, cap)
    return {
        "completed": 2 * conc,
        "failed": 0,
        "output_throughput": 100.0 * batch * (0.9 if mode == "oasiskv" else 1.0),
        "median_tpot_ms": 10.0 + batch * 0.5,
        "median_ttft_ms": 50.0,
        "max_running_batch": batch,
        "mean_running_batch": batch * 0.9,
        "total_output_tokens": 2 * conc * 64,
        "fetched_bytes_per_step": 0.0 if mode == "dense" else 1.5e6 * batch,
        "prediction_recall": None if mode == "dense" else 0.985,
        "resident_gpu_bytes_per_request": resident,
        "max_admitted_batch": cap,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    store = RunStore(tmp_path / "results", "smoke", "20261129-101500-ab12")
    store.write_config({"model": "tiny"})
    store.write_env({"git_commit": "abc1234", "device": "NVIDIA H200", "model": "tiny", "random_weights": True})
    for ctx in CONTEXTS:
        for conc in CONCURRENCIES:
            for mode in MODES:
                point = {"mode": mode, "context_len": ctx, "concurrency": conc}
                store.add_record(point, synth_metrics(mode, ctx, conc))
    return store.path


# ---- store -----------------------------------------------------------------------------------------


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    atomic_write_text(target, "one")
    atomic_write_json(target, {"x": float("nan"), "y": np.float32(1.5), "z": np.arange(3), "p": Path("/q")})
    assert json.loads(target.read_text()) == {"x": None, "y": 1.5, "z": [0, 1, 2], "p": "/q"}
    assert os.listdir(tmp_path) == ["a.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "metrics.json"
    atomic_write_text(target, "old")

    def boom(src: str, dst: str) -> None:
        raise KeyboardInterrupt  # an interrupted sweep, mid-write

    monkeypatch.setattr(store_mod.os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_store_resume_and_replace(tmp_path: Path) -> None:
    store = RunStore(tmp_path, "smoke")
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", store.run_id)
    assert load_run(store.path).records == []  # loadable before the first point
    p1 = {"mode": "dense", "context_len": 1024, "concurrency": 1}
    p2 = {"mode": "oasiskv", "context_len": 1024, "concurrency": 1, "fetch_ratio": 0.05}
    store.add_record(p1, {"completed": 1})
    store.add_record(p2, {"completed": 1})
    # Every point is on disk as soon as it finished.
    assert len(json.loads((store.path / "metrics.json").read_text())["records"]) == 2

    reopened = RunStore(tmp_path, "smoke", store.run_id)
    assert reopened.finished_point_ids() == {point_id(p1), point_id(p2)}
    reopened.add_record(dict(reversed(list(p1.items()))), {"completed": 7})  # same point, other key order
    run = load_run(reopened.path)
    assert len(run.records) == 2
    assert run.by_point_id()[point_id(p1)]["metrics"]["completed"] == 7
    # A run dir copied under another suite's name is refused rather than silently mixed.
    shutil.copytree(store.path, tmp_path / "other" / store.run_id)
    with pytest.raises(ValueError, match="belongs to suite 'smoke'"):
        RunStore(tmp_path, "other", store.run_id)


def test_load_errors_name_the_file(tmp_path: Path, run_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_run(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"metrics\.json"):
        load_run(empty)

    metrics = run_dir / "metrics.json"
    doc = json.loads(metrics.read_text())
    metrics.write_text('{"schema_version": 1, "records": [')
    with pytest.raises(ValueError, match=r"metrics\.json: corrupt JSON at line 1"):
        load_run(run_dir)
    metrics.write_text(json.dumps({**doc, "schema_version": 2}))
    with pytest.raises(ValueError, match="schema_version 2 is not supported"):
        load_run(run_dir)
    bad = {**doc, "records": [{"point": {"context_len": 1, "concurrency": 1}, "metrics": {}}]}
    metrics.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"records\[0\]: point lacks required key\(s\) mode"):
        load_run(run_dir)
    metrics.write_text(json.dumps(doc))
    (run_dir / "env.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"env\.json"):
        load_run(run_dir)


@given(
    st.dictionaries(
        st.sampled_from(["mode", "context_len", "concurrency", "top_k_blocks", "fetch_ratio", "draft"]),
        st.one_of(st.integers(0, 10**6), st.sampled_from(["dense", "oasiskv", "eagle3"]), st.none()),
        min_size=1,
    ),
    st.randoms(),
)
def test_point_id_ignores_key_order(point: dict[str, Any], rnd: Any) -> None:
    items = list(point.items())
    rnd.shuffle(items)
    assert point_id(dict(items)) == point_id(point)
    assert point_id({**point, "extra": None}) == point_id(point)


def test_point_id_treats_integral_floats_as_ints() -> None:
    assert point_id({"kv_cache_gb": 40.0, "mode": "dense"}) == point_id({"mode": "dense", "kv_cache_gb": 40})
    assert point_id({"fetch_ratio": 0.05}) != point_id({"fetch_ratio": 0.1})


# ---- plots and reports ---------------------------------------------------------------------------




def test_plots_skip_missing_metrics(tmp_path: Path) -> None:
    run = Run(suite="s", run_id="r", records=[{"point": {"mode": "dense", "context_len": 8, "concurrency": 1},
                                               "metrics": {"output_throughput": 5.0}}])
    paths = write_plots(run, tmp_path)
    assert [p.name for p in paths] == [THROUGHPUT_PNG]  # no batch, TPOT or resident bytes: skipped
    assert write_plots(Run(suite="s", run_id="r"), tmp_path / "empty") == []


def test_plots_and_report(run_dir: Path) -> None:
    run = load_run(run_dir)
    paths = write_plots(run)
    assert {p.name for p in paths} == {
        THROUGHPUT_PNG,
        "running_batch_vs_concurrency.png",
        "tpot_vs_concurrency.png",
        ROOFLINE_PNG,
    }
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000

    text = render_report(run)
    assert "**RANDOM WEIGHTS**" in text and "abc1234" in text and "NVIDIA H200" in text
    assert "## context_len = 1,024" in text and "## context_len = 4,096" in text
    assert "## oasiskv / dense" in text
    # ctx 4096: dense admits int(40e9 / 4096 / 147456) = 66 requests, so at concurrency 16 both run 16;
    # oasiskv's synthetic throughput is 0.9x dense.
    assert "| 4,096 | 16 | 1,440 | 1,600 | 0.90x | 16 | 16 | 1.00x |" in text
    assert f"![roofline]({ROOFLINE_PNG})" in text


def test_plots_read_at_a_glance(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plot has numbered axes and one legend entry per mode; the concurrency plots draw one line per mode and
    context across concurrency (``num_requests`` following the concurrency, as by default, must not split a line
    into dots), dense on top of oasiskv; every roofline point is labelled with its concurrency."""
    from oasisbench.results import plots

    run = load_run(run_dir)
    for r in run.records:
        r["point"]["num_requests"] = r["point"]["concurrency"]
    figures: dict[str, Any] = {}
    real_save = plots._save

    def save(fig: Any, path: Path) -> Path:
        figures[path.name] = fig
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", save)
    write_plots(run)
    assert set(figures) == {THROUGHPUT_PNG, "running_batch_vs_concurrency.png", "tpot_vs_concurrency.png",
                            ROOFLINE_PNG}
    for name, fig in figures.items():
        for ax in fig.axes:
            for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
                assert len([t for t in labels if t.get_text()]) >= 2, (name, [t.get_text() for t in labels])
            assert ax.get_xlabel(), name
        legend = fig.axes[0].get_legend()
        assert [t.get_text() for t in legend.get_texts()] == list(MODES), name
        if name == ROOFLINE_PNG:
            (ax,) = fig.axes
            assert sorted(t.get_text() for t in ax.texts) == sorted(f"c={c} {ctx // 1024}K" for c in CONCURRENCIES
                                                                    for ctx in CONTEXTS for _ in MODES)
            continue
        assert len(fig.axes) == len(CONTEXTS)  # one panel per context length
        for ax in fig.axes:
            lines = {line.get_label(): line for line in ax.get_lines() if line.get_label() in MODES}
            assert set(lines) == set(MODES)
            assert all(list(line.get_xdata()) == list(CONCURRENCIES) for line in lines.values())
            assert lines["dense"].get_zorder() > lines["oasiskv"].get_zorder()


def test_plots_skipped_without_matplotlib(tmp_path: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert write_plots(load_run(run_dir), tmp_path) == []


def test_report_without_dense_has_no_ratio_table(run_dir: Path) -> None:
    run = load_run(run_dir)
    run.records = [r for r in run.records if r["point"]["mode"] == "oasiskv"]
    run.env = {}
    text = render_report(run)
    assert "oasiskv / dense" not in text and "RANDOM WEIGHTS" not in text and "no env.json" in text


def _pair_run(dense: dict[str, Any], oasis: dict[str, Any], device: str = "cpu (x86_64, 2 threads)") -> Run:
    point = {"context_len": 1024, "concurrency": 4, "output_len": 32, "kv_cache_gb": 0.0903}
    return Run(suite="throughput", run_id="r", env={"device": device}, records=[
        {"point": {**point, "mode": "dense"}, "metrics": dense},
        {"point": {**point, "mode": "oasiskv", "top_k_blocks": 16}, "metrics": oasis}])


def test_report_says_what_was_compared_and_how_to_read_it() -> None:
    run = _pair_run({"output_throughput": 10.0, "max_running_batch": 2},
                    {"output_throughput": 11.0, "max_running_batch": 4})
    compared, capacity, reading = reading_lines(run)
    assert "dense and oasiskv on the same requests (1,024 tokens, 32 generated; concurrency 4)" in compared
    assert "0.0903 GiB" in compared
    assert "fit 2 dense requests at once and 4 oasiskv (2.00x)" in capacity
    assert "1.10x (the bigger batch outweighed" in reading and "CPU timings are noisy" in reading
    text = render_report(run)
    assert capacity in text and "numbers to trust" not in text
    # no wall: said so, with what to change
    run = _pair_run({"output_throughput": 10.0, "max_running_batch": 4},
                    {"output_throughput": 9.0, "max_running_batch": 4}, device="NVIDIA H200")
    _, capacity, reading = reading_lines(run)
    assert "no capacity wall" in capacity and "--kv-cache-gb" in capacity and "CPU" not in reading


def test_report_of_a_failed_run_says_it_failed() -> None:
    run = _pair_run({"completed": 0, "failed": 4, "error": "ValueError: KV cache budget too small for one request"},
                    {"output_throughput": 11.0, "max_running_batch": 4})
    text = render_report(run)
    assert "## Failed points" in text and "dense ctx=1024 c=4: ValueError: KV cache budget too small" in text
    assert "numbers to trust" not in text
    compared, capacity, reading = reading_lines(run)
    assert "no point ran in both modes" in capacity and "1 point(s) failed" in capacity
    assert "fix the failures" in reading


def test_compare_ratios_and_unmatched(run_dir: Path) -> None:
    a = load_run(run_dir)
    b = load_run(run_dir)
    for r in b.records:
        r["metrics"]["output_throughput"] *= 2
    b.records.append({"point": {"mode": "oasiskv", "context_len": 8192, "concurrency": 1}, "metrics": {}})
    a.records = a.records[1:]
    b.env = {**b.env, "device": "NVIDIA H100"}
    text = compare_runs(a, b)
    assert "## output_throughput" in text
    assert "| oasiskv ctx=1024 c=1 | 90.0 | 180.0 | 2.00x |" in text  # mode first: a cut cell still tells rows apart
    assert "## Only in B" in text and "context_len=8192" in text
    assert "different devices" in text
    assert "matched points: 11" in text


# ---- gate ---------------------------------------------------------------------------------------

GATED = ["fetched_bytes_per_step", "total_output_tokens", "max_admitted_batch", "prediction_recall"]
RATIO_CHECK = {
    "metric": "output_throughput",
    "numerator": {"mode": "oasiskv"},
    "denominator": {"mode": "dense"},
    "match_on": ["context_len", "concurrency"],
    "min": 0.5,
}


def test_gate_passes_on_own_baseline(run_dir: Path) -> None:
    run = load_run(run_dir)
    baseline = make_baseline(run, GATED, tolerance_rel=0.02)
    baseline["ratio_checks"] = [RATIO_CHECK]
    result = gate(run, baseline)
    assert result.passed, result.failures
    # 12 records x 4 metrics, minus 6 dense records whose recall is null, plus 6 ratio pairs.
    assert len(result.outcomes) == 12 * 4 - 6 + 6


def test_gate_fails_on_doctored_run(run_dir: Path) -> None:
    run = load_run(run_dir)
    baseline = make_baseline(run, GATED, tolerance_rel=0.02)
    baseline["ratio_checks"] = [{**RATIO_CHECK, "min": 1.0}]  # oasiskv is 0.9x dense at equal batch
    victim = next(r for r in run.records if r["point"]["mode"] == "oasiskv")
    victim["metrics"]["fetched_bytes_per_step"] *= 1.05  # beyond the 2% tolerance, in the bad direction
    run.records = [r for r in run.records if point_id(r["point"]) != point_id(run.records[0]["point"])]
    result = gate(run, baseline)
    assert not result.passed
    reasons = {(o.metric, o.message.split(":")[0]) for o in result.failures}
    assert ("fetched_bytes_per_step", "regressed") in reasons
    assert ("total_output_tokens", "no record matches this point") in reasons
    assert any(o.kind == "ratio" and "out of range" in o.message for o in result.failures)


def test_gate_directions_and_tolerance() -> None:
    rec = {"point": {"mode": "oasiskv", "context_len": 1, "concurrency": 1}, "metrics": {"x": 95.0, "y": None}}
    run = Run(suite="s", run_id="r", records=[rec])

    def outcome(direction: str, tol: dict[str, float], metric: str = "x") -> bool:
        check = {"point": {"mode": "oasiskv"}, "metric": metric, "expected": 100, "tolerance": tol}
        check["direction"] = direction
        return gate(run, {"schema_version": 1, "suite": "s", "checks": [check]}).passed

    assert outcome("higher_is_better", {"rel": 0.05}) and not outcome("higher_is_better", {"rel": 0.04})
    assert outcome("lower_is_better", {})
    assert outcome("equal", {"abs": 5}) and not outcome("equal", {"abs": 4.9})
    assert not outcome("equal", {"abs": 1e9}, metric="y")  # null metric never passes
    assert not gate(run, {"schema_version": 1, "suite": "other", "checks": []}).passed


def test_make_baseline_refuses_wall_clock(run_dir: Path) -> None:
    with pytest.raises(ValueError, match="wall-clock"):
        make_baseline(load_run(run_dir), ["median_tpot_ms"], 0.1)


def test_baseline_file_roundtrip_and_validation(tmp_path: Path, run_dir: Path) -> None:
    run = load_run(run_dir)
    for name in ("b.yaml", "b.json"):
        dump_baseline(make_baseline(run, GATED), tmp_path / name)
        assert gate(run, tmp_path / name).passed
    bad = "schema_version: 1\nchecks:\n  - {point: {}, metric: x, expected: 1, direction: up}\n"
    (tmp_path / "bad.yaml").write_text(bad)
    with pytest.raises(BaselineError, match=r"checks\[0\]: direction"):
        load_baseline(tmp_path / "bad.yaml")


# ---- CLI ----------------------------------------------------------------------------------------


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()
    app.command("report")(report_cmd)
    app.command("compare")(compare_cmd)
    app.command("gate")(gate_cmd)
    return app


def test_cli_report_and_compare(cli: typer.Typer, run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "oasiskv / dense" in (run_dir / "report.md").read_text()
    assert (run_dir / ROOFLINE_PNG).stat().st_size > 0
    out = tmp_path / "elsewhere" / "r.md"
    result = runner.invoke(cli, ["report", str(run_dir), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert f"](../results/smoke/{run_dir.name}/{ROOFLINE_PNG})" in out.read_text()

    result = runner.invoke(cli, ["compare", str(run_dir), str(run_dir), "-o", str(tmp_path / "c.md")])
    assert result.exit_code == 0, result.output
    assert "1.00x" in (tmp_path / "c.md").read_text()


def test_cli_gate_exit_codes(cli: typer.Typer, run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    run = load_run(run_dir)
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    dump_baseline(make_baseline(run, GATED), good)
    doctored = make_baseline(run, GATED)
    doctored["checks"][0]["expected"] = -1  # fetched bytes (lower is better) now exceed the baseline
    dump_baseline(doctored, bad)

    result = runner.invoke(cli, ["gate", str(run_dir), "--baseline", str(good)])
    assert result.exit_code == 0, result.output
    assert "gate passed" in result.output
    result = runner.invoke(cli, ["gate", str(run_dir), "--baseline", str(bad)])
    assert result.exit_code == 1 and "gate FAILED" in result.output
    result = runner.invoke(cli, ["gate", str(tmp_path / "missing-run"), "--baseline", str(good)])
    assert result.exit_code == 2 and "run directory not found" in result.output
    result = runner.invoke(cli, ["gate", str(run_dir), "--baseline", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "baseline file not found" in result.output
