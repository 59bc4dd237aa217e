"""``oasisbench throughput / run / report / compare / gate / make-baseline`` end to end on a tiny model.

Failure contract under test: bad input (unknown mode, malformed suite, missing run dir) exits 2 before
anything runs; a point that fails while running (KV budget too small for one request) is recorded in
metrics.json with ``failed`` and ``error``, the sweep goes on, and the command exits 1.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from oasisbench.cli.main import app
from oasisbench.results.gate import gate, load_baseline
from oasisbench.results.schema import Record, Run, point_id
from oasisbench.results.store import load_run
from oasisbench.runners import throughput as tp
from tests.tiny_models import write_tiny

runner = CliRunner()
CI_BASELINE = Path(__file__).resolve().parent.parent / "suites" / "throughput" / "ci-smoke.baseline.yaml"
# 40-token context = 2.5 blocks: tiny, but long enough for oasiskv to select (top-k 1 of 2 full blocks).
SMALL = ["--context-len", "40", "--output-len", "3", "--kv-cache-gb", "0.01", "--top-k-blocks", "1",
         "--device", "cpu", "--suite-name", "tp"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("tp") / "tiny", "llama", max_position_embeddings=128))


def run_dir_of(output: str) -> Path:
    return Path(output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sweep(tiny, tmp_path_factory) -> Path:
    """One real sweep shared by the read-only tests: dense and oasiskv at concurrency 1 and 2."""
    out = tmp_path_factory.mktemp("sweep")
    r = runner.invoke(app, ["throughput", "--model", tiny, "--modes", "dense,oasiskv", "--concurrency", "1,2",
                            "--measure-recall", "--output-dir", str(out), *SMALL])
    assert r.exit_code == 0, r.output
    return run_dir_of(r.output)


def test_throughput_writes_one_record_per_point(sweep):
    assert sweep.parent.parent.is_dir() and sweep.parent.name == "tp"  # <output-dir>/<suite>/<run-id>
    doc = json.loads((sweep / "metrics.json").read_text())
    assert doc["schema_version"] == 1
    records = doc["records"]
    assert sorted((r["point"]["mode"], r["point"]["concurrency"]) for r in records) == [
        ("dense", 1), ("dense", 2), ("oasiskv", 1), ("oasiskv", 2)]
    assert len({point_id(r["point"]) for r in records}) == 4
    for r in records:
        m, c = r["metrics"], r["point"]["concurrency"]
        assert m["completed"] == c and m["failed"] == 0 and "error" not in m  # num_requests = concurrency
        assert m["total_output_tokens"] == 3 * c and m["total_input_tokens"] == 37 * c
        assert m["max_admitted_batch"] == m["max_running_batch"] == c
        for name in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                     "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "fetched_blocks_per_step"):
            assert isinstance(m[name], float), name
    oasis = [r for r in records if r["point"]["mode"] == "oasiskv"]
    assert all(r["metrics"]["prediction_recall"] is not None for r in oasis)
    env = json.loads((sweep / "env.json").read_text())
    assert {"git_commit", "python", "torch", "transformers", "device", "model"} <= set(env)
    assert env["random_weights"] is False
    config = json.loads((sweep / "config.json").read_text())
    assert len(config["points"]) == 4 and len(config["engines"]) == 4
    assert (sweep / "report.md").is_file()


@pytest.mark.parametrize("args,message", [
    (["--modes", "dense,turbo"], "unknown mode"),
    (["--concurrency", "1,x"], "comma-separated list of integers"),
    (["--output-len", "40"], "must be below context_len"),
    (["--model", "/no/such/model"], "not found"),
    (["--kv-cache-gb", "-1"], "--kv-cache-gb must be a positive number of GiB, got -1"),
    pytest.param(["--device", "cuda"], "needs CUDA", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="checks the CPU-only message")),
])
def test_bad_input_exits_2_before_running(tiny, tmp_path, args, message):
    r = runner.invoke(app, ["throughput", "--model", tiny, "--output-dir", str(tmp_path), *SMALL, *args])
    assert r.exit_code == 2, r.output
    assert message in r.output.replace("\n", " ")
    assert "Traceback" not in r.output
    assert not any(tmp_path.iterdir())  # no empty run directory left behind


def test_budget_too_small_is_a_recorded_failed_point(tiny, tmp_path):
    args = ["throughput", "--model", tiny, "--modes", "dense", "--concurrency", "2", "--output-dir", str(tmp_path),
            *SMALL, "--kv-cache-gb", "0.00001"]
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    assert "too small for one request" in r.output.replace("\n", " ")
    (record,) = load_run(run_dir_of(r.output)).records
    assert record["metrics"]["failed"] == 2 and record["metrics"]["completed"] == 0
    assert "too small for one request" in record["metrics"]["error"]


def test_host_pool_is_oasiskvs_capacity_wall(tiny, tmp_path):
    """--host-kv-gb sizes the offloading modes' host pool: 4 blocks (92,160 bytes each in this model) hold one
    40-token request (3 blocks) but not two, so oasiskv runs them one at a time; 1 block holds none."""
    block = 16 * 5 * 3 * 48 * 2 * 4
    args = ["throughput", "--model", tiny, "--modes", "oasiskv", "--concurrency", "2", *SMALL]
    r = runner.invoke(app, [*args, "--output-dir", str(tmp_path / "a"), "--host-kv-gb", str(4.5 * block / 2**30)])
    assert r.exit_code == 0, r.output
    (record,) = load_run(run_dir_of(r.output)).records
    assert record["point"]["host_kv_gb"] == pytest.approx(4.5 * block / 2**30)
    assert record["metrics"]["completed"] == 2 and record["metrics"]["max_admitted_batch"] == 1
    r = runner.invoke(app, [*args, "--output-dir", str(tmp_path / "b"), "--host-kv-gb", str(1.5 * block / 2**30)])
    assert r.exit_code == 1, r.output
    assert "--host-kv-gb" in load_run(run_dir_of(r.output)).records[0]["metrics"]["error"]


def test_a_crashing_point_does_not_stop_the_sweep(tiny, tmp_path, monkeypatch):
    real = tp._EngineCache.get

    def get(self, planned):
        if planned.point["concurrency"] == 1:
            raise AttributeError("a bug in one mode")
        return real(self, planned)

    monkeypatch.setattr(tp._EngineCache, "get", get)
    args = ["throughput", "--model", tiny, "--modes", "dense", "--concurrency", "1,2", "--output-dir", str(tmp_path)]
    r = runner.invoke(app, [*args, *SMALL])
    assert r.exit_code == 1 and "a bug in one mode" in r.output
    records = load_run(run_dir_of(r.output)).records
    errors = {rec["point"]["concurrency"]: rec["metrics"].get("error") for rec in records}
    assert errors == {1: "AttributeError: a bug in one mode", 2: None}


def test_resume_skips_finished_points_and_refuses_other_flags(tiny, sweep, tmp_path, monkeypatch):
    run_dir = tmp_path / "tp" / sweep.name
    shutil.copytree(sweep, run_dir)
    ran: list[str] = []
    real = tp.run_point
    monkeypatch.setattr(tp, "run_point", lambda pp, cache, progress=None, trace=None, where="":
                        ran.append(pp.pid) or real(pp, cache, progress, trace, where))
    base = ["throughput", "--model", tiny, "--measure-recall", *SMALL, "--resume", str(run_dir)]
    r = runner.invoke(app, [*base, "--modes", "dense,oasiskv", "--concurrency", "1,2"])
    assert r.exit_code == 0, r.output
    assert ran == []
    # other flags would mix a second sweep into this run: refused before anything runs, naming what differs
    r = runner.invoke(app, [*base, "--modes", "dense", "--concurrency", "1,2,3"])
    assert r.exit_code == 2, r.output
    text = r.output.replace("\n", " ")
    assert "another configuration" in text and "concurrency (was 1, 2; now 1, 2, 3)" in text
    assert 'mode (was "dense", "oasiskv"; now "dense")' in text and "output_len" not in text
    assert ran == [] and len(load_run(run_dir).records) == 4
    assert "run directory:" not in r.output  # refused before the run is announced


def test_progress_counts_tokens_per_point_and_names_the_run_first(tiny, tmp_path):
    r = runner.invoke(app, ["throughput", "--model", tiny, "--modes", "dense,oasiskv", "--concurrency", "2",
                            "--output-dir", str(tmp_path), *SMALL])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == f"run directory: {run_dir_of(r.output)}"
    bars = [line for line in lines if line.startswith("point ")]
    assert len(bars) == 2 and bars[0].startswith("point 1/2 dense ctx=40 c=2")
    assert bars[1].startswith("point 2/2 oasiskv ctx=40 c=2")
    assert all("6/6 tok" in bar and "took " in bar for bar in bars)  # 2 requests x 3 tokens, finished


def test_ctrl_c_prints_the_run_and_the_resume_command(tiny, tmp_path, monkeypatch):
    real = tp.run_point

    def interrupted(pp, cache, progress=None, trace=None, where=""):
        if pp.point["concurrency"] == 2:
            raise KeyboardInterrupt
        return real(pp, cache, progress, trace, where)

    monkeypatch.setattr(tp, "run_point", interrupted)
    args = ["throughput", "--model", tiny, "--modes", "dense", "--concurrency", "1,2", "--no-measure-recall",
            "--output-dir", str(tmp_path), *SMALL]
    r = runner.invoke(app, args)
    assert r.exit_code == 130, r.output
    run_dir = next((tmp_path / "tp").iterdir())
    assert f"interrupted: 1 of 2 point(s) recorded in {run_dir}" in r.output
    (command,) = [line.removeprefix("resume with: ") for line in r.output.splitlines() if "resume with:" in line]
    words = shlex.split(command)
    assert words[:2] == ["oasisbench", "throughput"] and words[-2:] == ["--resume", str(run_dir)]
    assert "--output-dir" not in words and "--no-measure-recall" in words and words[words.index("--modes") + 1] == "dense"
    monkeypatch.setattr(tp, "run_point", real)
    r = runner.invoke(app, words[1:])  # the printed command finishes the run
    assert r.exit_code == 0, r.output
    assert sorted(rec["point"]["concurrency"] for rec in load_run(run_dir).records) == [1, 2]


def test_cpu_default_budget_shows_the_capacity_wall(tiny, tmp_path):
    """Without --kv-cache-gb on the CPU the budget holds the dense KV of half the top concurrency's requests: at
    concurrency 4, dense runs 2 at a time and oasiskv, whose default K (a quarter of the context's 7 blocks) keeps
    3 device blocks per request against dense's 7, all 4; the run ends saying so."""
    r = runner.invoke(app, ["throughput", "--model", tiny, "--context-len", "100", "--output-len", "3",
                            "--concurrency", "4", "--device", "cpu", "--output-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "the dense KV of 2 request(s) of 100 tokens" in r.output
    records = {rec["point"]["mode"]: rec for rec in load_run(run_dir_of(r.output)).records}
    assert records["oasiskv"]["point"]["top_k_blocks"] == 1
    assert records["dense"]["metrics"]["max_running_batch"] == 2
    assert records["oasiskv"]["metrics"]["max_running_batch"] == 4
    text = r.output.replace("\n", " ")
    assert "fit 2 dense requests at once and 4 oasiskv (2.00x)" in text and "CPU timings are noisy" in text


def test_resume_missing_run_dir(tiny, tmp_path):
    r = runner.invoke(app, ["throughput", "--model", tiny, *SMALL, "--resume", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "nothing to resume" in r.output


class _FakeEngine:
    model_config = None

    def __init__(self, resettable: bool) -> None:
        if resettable:
            self.reset_stats = lambda: None


def test_engine_reused_only_when_counters_can_be_reset(tiny, monkeypatch):
    import oasiskv_runtime

    points = [{"model": tiny, "mode": "dense", "context_len": ctx, "concurrency": 1, "device": "cpu"}
              for ctx in (40, 48)]
    planned = tp.plan_points(points)
    warmed = []
    monkeypatch.setattr(tp, "warm_up", lambda llm, p: warmed.append(llm))
    for resettable, builds in ((True, 1), (False, 2)):
        monkeypatch.setattr(oasiskv_runtime, "LLM", lambda *a, **k: type("L", (), {"engine": _FakeEngine(resettable)}))
        cache = tp._EngineCache()
        warmed.clear()
        for pp in planned:
            cache.get(pp)
        assert cache.num_builds == builds
        assert len(warmed) == builds  # every fresh engine is warmed up once, a reused one not again


@pytest.mark.parametrize("mode", ["dense", "oasiskv"])
def test_engine_cache_frees_the_old_engine_before_building_the_next(tiny, monkeypatch, mode):
    """The next point's engine sizes its KV to the memory left, so the engine it replaces must be gone when the
    build starts, without waiting for a garbage collection. (On the H200 a dense-then-oasiskv suite ran the
    oasiskv engine out of memory: a bound ``reset_stats`` of the dense engine was still held during the build.)"""
    import gc
    import weakref

    import oasiskv_runtime

    points = [{"model": tiny, "mode": mode, "context_len": 40, "concurrency": 1, "device": "cpu", "output_len": 4,
               "top_k_blocks": 3, "block_size": 8, "cuda_graphs": "static", "kv_cache_gb": gb} for gb in (0.01, 0.02)]
    first, second = tp.plan_points(points)
    cache = tp._EngineCache()
    tp.run_point(first, cache)
    ref = weakref.ref(cache.llm.engine)
    alive_at_build = []
    real_llm = oasiskv_runtime.LLM

    def build(*a, **k):
        alive_at_build.append(ref() is not None)
        return real_llm(*a, **k)

    monkeypatch.setattr(oasiskv_runtime, "LLM", build)
    gc.disable()  # only the cache's own doing may free it
    try:
        cache.get(second)
    finally:
        gc.enable()
    assert cache.num_builds == 2 and alive_at_build == [False]


@pytest.mark.parametrize("mode", ["dense", "oasiskv"])
def test_warm_up_leaves_counted_metrics_unchanged(tiny, monkeypatch, mode):
    # The warm-up request runs on the point's engine before timing; its counters are zeroed, and it must not
    # shift what the gate checks (tokens, bytes, batches, recall).
    point = {"model": tiny, "mode": mode, "context_len": 120, "output_len": 12, "concurrency": 2,
             "num_requests": 3, "device": "cpu", "top_k_blocks": 3, "block_size": 8, "measure_recall": True}
    (pp,) = tp.plan_points([point])
    warm = tp.run_point(pp, tp._EngineCache())
    monkeypatch.setattr(tp, "warm_up", lambda llm, p: None)
    cold = tp.run_point(pp, tp._EngineCache())
    keys = ("completed", "total_output_tokens", "max_running_batch", "num_preemptions", "fetched_bytes_per_step",
            "deferred_blocks_per_step", "prediction_recall", "draft_accuracy", "num_steps")
    assert "error" not in warm
    assert {k: warm.get(k) for k in keys} == {k: cold.get(k) for k in keys}


SUITE = """\
name: tiny-suite
kind: throughput
defaults: {{model: "{model}", mode: dense, context_len: 40, output_len: 2, kv_cache_gb: 0.01, device: cpu}}
grid:
  concurrency: [2]
gate: tiny.baseline.yaml
"""


def test_run_suite_layout_matches_ci(tiny, tmp_path):
    suite = tmp_path / "tiny.yaml"
    suite.write_text(SUITE.format(model=tiny))
    out = tmp_path / "out"
    r = runner.invoke(app, ["run", str(suite), "--output-dir", str(out)])
    assert r.exit_code == 0, r.output
    (run_dir,) = out.glob("*/*")  # what .ci/run's `ls -d "$out"/*/* | head -1` picks
    assert run_dir == run_dir_of(r.output) and run_dir.parent.name == "tiny-suite"
    assert "oasisbench gate --baseline" in r.output
    assert load_run(run_dir).records[0]["metrics"]["completed"] == 2


def test_run_malformed_suite_names_the_line(tmp_path):
    suite = tmp_path / "bad.yaml"
    suite.write_text("name: bad\nkind: throughput\ndefaults:\n  mode: dense\n  contex_len: 40\n")
    r = runner.invoke(app, ["run", str(suite)])
    assert r.exit_code == 2
    assert "bad.yaml:5:" in r.output and "context_len" in r.output
    r = runner.invoke(app, ["run", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "not found" in r.output


def test_report_compare(sweep, tmp_path):
    r = runner.invoke(app, ["report", str(sweep), "--output", str(tmp_path / "r.md")])
    assert r.exit_code == 0, r.output
    assert "oasiskv / dense" in (tmp_path / "r.md").read_text()
    r = runner.invoke(app, ["compare", str(sweep), str(sweep)])
    assert r.exit_code == 0 and "matched points: 4" in r.output


def test_make_baseline_then_gate(sweep, tmp_path):
    baseline = tmp_path / "b.yaml"
    r = runner.invoke(app, ["make-baseline", str(sweep), "--output", str(baseline)])
    assert r.exit_code == 0, r.output
    assert runner.invoke(app, ["gate", str(sweep), "--baseline", str(baseline)]).exit_code == 0
    doc = yaml.safe_load(baseline.read_text())
    check = next(c for c in doc["checks"] if c["metric"] == "total_output_tokens")
    check["expected"] += 1
    baseline.write_text(yaml.safe_dump(doc))
    r = runner.invoke(app, ["gate", str(sweep), "--baseline", str(baseline)])
    assert r.exit_code == 1 and "FAIL" in r.output
    # Regenerating keeps the hand-written parts: the leading comments and the ratio checks.
    doc["ratio_checks"] = [{"metric": "total_output_tokens", "numerator": {"mode": "oasiskv"},
                            "denominator": {"mode": "dense"}, "match_on": ["concurrency"], "min": 1, "max": 1}]
    baseline.write_text("# why\n" + yaml.safe_dump(doc))
    assert runner.invoke(app, ["make-baseline", str(sweep), "--output", str(baseline)]).exit_code == 0
    assert baseline.read_text().startswith("# why\n")
    assert runner.invoke(app, ["gate", str(sweep), "--baseline", str(baseline)]).exit_code == 0
    assert len(load_baseline(baseline)["ratio_checks"]) == 1
    r = runner.invoke(app, ["make-baseline", str(sweep), "--metrics", "median_tpot_ms"])
    assert r.exit_code == 2 and "wall-clock" in r.output
    assert runner.invoke(app, ["make-baseline", str(tmp_path / "nope")]).exit_code == 2


def _run_satisfying(baseline: dict) -> Run:
    """A run whose every record holds exactly what the baseline expects (ratios at their bounds)."""
    by_id: dict[str, Record] = {}
    for c in baseline["checks"]:
        rec = by_id.setdefault(point_id(c["point"]), Record(point=dict(c["point"]), metrics={}))
        rec["metrics"][c["metric"]] = c["expected"]
    records = list(by_id.values())
    for rc in baseline.get("ratio_checks") or []:
        ratio = rc.get("min", rc.get("max"))
        for r in records:
            if all(r["point"].get(k) == v for k, v in rc["denominator"].items()):
                r["metrics"].setdefault(rc["metric"], 1.0)
        for r in records:
            if all(r["point"].get(k) == v for k, v in rc["numerator"].items()):
                r["metrics"].setdefault(rc["metric"], ratio * 1.0)
    return Run(suite=baseline["suite"], run_id="synthetic", records=records)


def test_committed_ci_baseline_gates(tmp_path):
    doc = load_baseline(CI_BASELINE)
    assert doc["suite"] == "ci-smoke" and doc["checks"]
    run = _run_satisfying(doc)
    assert gate(run, doc).passed
    doctored = json.loads(json.dumps(doc))
    check = next(c for c in doctored["checks"] if c["metric"] == "total_output_tokens")
    check["expected"] += 1
    result = gate(run, doctored)
    assert not result.passed and any(o.metric == "total_output_tokens" for o in result.failures)


@pytest.mark.slow
def test_trace_steps_writes_a_per_kind_summary(tiny, tmp_path):
    """--trace-steps profiles a window of each point's engine steps and reports them per step kind (on the CPU:
    host wall time and the step split; kernels need CUDA); the records say their timings were traced. A bad
    window exits 2 before any run directory is made."""
    r = runner.invoke(app, ["throughput", "--model", tiny, "--modes", "dense,oasiskv", "--concurrency", "2",
                            "--trace-steps", "0:5", "--output-dir", str(tmp_path), *SMALL])
    assert r.exit_code == 0, r.output
    run = run_dir_of(r.output)
    text = (run / "traces.txt").read_text()
    # Per point: 40-token prompts in 2,048-token steps, so step 0 prefills both requests (and samples their first
    # tokens), steps 1-2 decode the other 2 outputs; the run ends before the window's 5 steps.
    assert text.count("==== ") == 2 and text.count("3 profiled steps") == 2
    assert text.count("-- prefill-carrying: 1 steps, host wall") == 2 and text.count("-- decode-only: 2 steps") == 2
    # ... and where the host's Python time went, per kind: the engine's step is among the functions it names
    assert text.count("-- decode-only: Python own time") == 2 and "calls/step" in text
    assert "engine.py" in text
    records = json.loads((run / "metrics.json").read_text())["records"]
    assert len(records) == 2 and all(rec["metrics"]["traced_steps"] == "0:5" for rec in records)
    # two windows: one trace each (step 0; steps 2-3, of which only step 2 runs)
    r = runner.invoke(app, ["throughput", "--model", tiny, "--modes", "oasiskv", "--concurrency", "2",
                            "--trace-steps", "2:2,0:1", "--output-dir", str(tmp_path / "two"), *SMALL])
    assert r.exit_code == 0, r.output
    run = run_dir_of(r.output)
    text = (run / "traces.txt").read_text()
    assert "steps 0-0: 1 profiled steps" in text and "steps 2-3: 1 profiled steps" in text
    assert "-- prefill-carrying: 1 steps" in text and "-- decode-only: 1 steps" in text
    assert json.loads((run / "metrics.json").read_text())["records"][0]["metrics"]["traced_steps"] == "0:1,2:2"
    bad = runner.invoke(app, ["throughput", "--model", tiny, "--trace-steps", "4", "--output-dir",
                              str(tmp_path / "bad"), *SMALL])
    assert bad.exit_code == 2 and "START:COUNT" in bad.output and not (tmp_path / "bad").exists()


def test_link_gbps_and_pipeline_priority_reach_the_engine_config(tiny):
    point = {"model": tiny, "mode": "oasiskv", "context_len": 40, "concurrency": 1, "device": "cpu",
             "link_gbps": 20, "pipeline_priority": -1}
    (pp,) = tp.plan_points([point])
    assert pp.engine.sparse.link_gbps == 20 and pp.engine.kernels.pipeline_priority == -1
    (pp,) = tp.plan_points([{k: v for k, v in point.items() if k not in ("link_gbps", "pipeline_priority")}])
    assert pp.engine.sparse.link_gbps == 0 and pp.engine.kernels.pipeline_priority == 0


def test_default_top_k_stays_below_the_context():
    from oasisbench.cli.defaults import default_top_k_blocks, top_k_note

    assert [default_top_k_blocks([c]) for c in (40, 1024, 2048, 2100, 4096)] == [1, 16, 32, 128, 128]
    assert default_top_k_blocks([]) == 128 and default_top_k_blocks([4096, 1024]) == 16
    assert top_k_note(128, [4096]) is None and "below 63" in top_k_note(128, [1024, 4096])
