"""The throughput runner: one engine per point, a fixed random-token workload, vLLM-named metrics.

A point runs on the embedded engine (``engine`` unset, the default) in this process, or on vLLM (``engine: vllm``:
plain vLLM for dense, the OasisKV plug-in for the other modes) in a process of its own
(:mod:`oasisbench.runners.vllm_point`); both serve the same requests (:mod:`oasisbench.runners.workload`).

Each point is ``num_requests`` prompts of ``context_len - output_len`` random token ids (seeded, so every
mode sees the same work), all submitted at t0 with ``max_num_seqs = concurrency`` on the engine: the
shape of ``vllm bench throughput`` / ``--max-concurrency``. Decoding is greedy with ``ignore_eos`` so
every request generates exactly ``output_len`` tokens.

Failure policy: a bad *config* (unknown model, fetch_ratio the engine rejects...) raises ``ValueError``
from :func:`plan_points` before anything runs; a point that fails while *running* (KV budget too small
for one request, out of memory; or a bug in one mode, whose traceback is printed) is recorded with
``failed = num_requests`` and an ``error`` string, and the sweep goes on. ``--resume`` skips recorded
points except failed ones, which are retried.

Example::

    store = RunStore(Path("results"), "throughput")
    with Progress() as progress:
        run_throughput([{"mode": "oasiskv", "context_len": 1024, "concurrency": 4}], store, progress)
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from oasisbench.results.schema import (CONFIG_FILE, DEFAULT_ENGINE, Record, normalize_value, order_modes, point_id,
                                       series_label)
from oasisbench.results.store import RunStore, to_jsonable
from oasisbench.runners.workload import (WARMUP_OUTPUT_LEN, RequestRow, make_prompts, point_metrics,
                                         warm_up_prompt_len)
from oasisbench.suites import ENGINE_KEYS as SUITE_ENGINE_KEYS
from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.drafts import resolve_draft

#: Values a point gets for keys it does not set: the engine's defaults for the options every point id names (SPEC
#: item 7's K, fetch ratio and block size...), None for the rest (the engine's default, left out of the id).
#: ``num_requests`` None means "= concurrency" (one full batch).
_NAMED = ("top_k_blocks", "fetch_ratio", "draft", "block_size", "sink_blocks", "dense_layers", "measure_recall",
          "max_num_batched_tokens")
POINT_DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "output_len": 32,
    "num_requests": None,
    "kv_cache_gb": None,
    "host_kv_gb": None,
    "device_tier_gb": None,
    "device": "",
    "dtype": "",
    "seed": 0,
    "engine": None,
    "speculate": None,
    **{k: None for k in SUITE_ENGINE_KEYS},
    **{k: EngineConfig.options()[k].default for k in _NAMED},
}
#: Point keys that go to the engine as overrides (plus ``max_num_seqs = concurrency``).
ENGINE_KEYS = ("kv_cache_gb",) + SUITE_ENGINE_KEYS
#: Expected ways for one point to fail (budget too small for one request, out of memory incl.
#: torch.cuda.OutOfMemoryError, the engine's "KV budget exhausted" deadlock): recorded quietly. Any other
#: exception is a bug, but it still fails only its point (hours of sweep are not thrown away for one mode's
#: crash); its traceback is printed so it is not mistaken for a capacity limit.
EXPECTED_POINT_ERRORS = (ValueError, MemoryError, RuntimeError)


@dataclass(frozen=True)
class PlannedPoint:
    """A fully resolved point and the engine config it runs on."""

    point: dict[str, Any]
    engine: Any
    """The :class:`~oasiskv_runtime.config.EngineConfig` built from the point, or for a vLLM point its
    :class:`~oasisbench.runners.vllm_point.VllmPlan`."""

    @property
    def on_vllm(self) -> bool:
        return self.point.get("engine") == "vllm"

    @property
    def pid(self) -> str:
        return point_id(self.point)


def resolve_point(point: dict[str, Any]) -> dict[str, Any]:
    """``point`` with every key of :data:`POINT_DEFAULTS` filled in and device/dtype made concrete."""
    from oasisbench.cli.options import default_device, default_dtype

    out = {**POINT_DEFAULTS, **point}
    if out["engine"] == DEFAULT_ENGINE:  # the default stays out of the id, as every other default
        out["engine"] = None
    out["device"] = default_device(out["device"])
    out["dtype"] = default_dtype(out["dtype"], out["device"])
    if out["num_requests"] is None:
        out["num_requests"] = out["concurrency"]
    return out


def engine_overrides(point: dict[str, Any]) -> dict[str, Any]:
    """Engine keyword overrides of a resolved point."""
    ov = {k: point[k] for k in ENGINE_KEYS if point.get(k) is not None}
    if point.get("host_kv_gb") is not None:  # the engine takes bytes; GiB reads better in a suite
        ov["host_kv_bytes"] = int(float(point["host_kv_gb"]) * (1 << 30))
    ov["max_num_seqs"] = int(point["concurrency"])
    return ov


def plan_points(points: list[dict[str, Any]], check_device: bool = True) -> list[PlannedPoint]:
    """Resolve every point and build its engine config (a vLLM point: its :class:`VllmPlan`), so config errors stop
    the sweep before it starts. ``check_device``: refuse CUDA points on a machine without CUDA (a dry run plans a
    GPU suite anywhere).

    Raises:
        ValueError: a point is invalid (the message names it), two points are one, or a model cannot be found.
    """
    from oasiskv_runtime.models.loader import resolve
    from oasisbench.runners.vllm_point import plan_vllm_point

    planned: list[PlannedPoint] = []
    seen: set[str] = set()
    for raw in points:
        p = resolve_point(raw)
        pid = point_id(p)
        if pid in seen:
            raise ValueError(f"point {pid} is listed twice")
        seen.add(pid)
        if p["output_len"] >= p["context_len"]:
            raise ValueError(f"point {pid}: output_len ({p['output_len']}) must be below context_len "
                             f"({p['context_len']}): the prompt is context_len - output_len tokens")
        if p["device_tier_gb"] is not None and p["engine"] != "vllm":
            raise ValueError(f"point {pid}: device_tier_gb is a vLLM point's key (the plug-in's device tier, in GiB); "
                             f"the embedded engine's is device_tier: true (the device KV budget its working sets "
                             f"leave free)")
        if p["speculate"] and p["engine"] != "vllm":
            raise ValueError(f"point {pid}: speculate is a vLLM point's key (plain vLLM with speculative decoding); "
                             "the embedded engine drafts in mode oasiskv")
        try:
            cfg = plan_vllm_point(p) if p["engine"] == "vllm" else EngineConfig.from_overrides(
                p["model"], device=p["device"], dtype=p["dtype"], mode=p["mode"], seed=p["seed"],
                **engine_overrides(p))
        except (ValueError, TypeError) as e:
            raise ValueError(f"point {pid}: {e}") from None
        planned.append(PlannedPoint(p, cfg))
    cuda = [pp.pid for pp in planned if pp.point["device"].startswith("cuda")]
    if cuda and check_device:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"point {cuda[0]} needs CUDA, and this machine has no CUDA device "
                             "(GPU suites run on the GPU machine; use --device cpu here)")
    from oasiskv_runtime.vllm.models import VLLM_ONLY_PRESETS

    for model in sorted({pp.point["model"] for pp in planned}):
        engines = {pp.point["engine"] for pp in planned if pp.point["model"] == model}
        if model in VLLM_ONLY_PRESETS:  # shapes vLLM runs (MoE) and the embedded engine does not
            if engines != {"vllm"}:
                raise ValueError(f"model {model!r} runs on vLLM only (engine: vllm); the embedded engine has no "
                                 "MoE layers")
            continue
        try:
            resolve(model)  # name -> file, no weights loaded: a typo fails now, not an hour in
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    return planned


def embedded_rows(outputs: list[Any]) -> list[RequestRow]:
    """The finished requests of the embedded engine's ``generate``, as :class:`RequestRow`."""
    return [RequestRow(len(o.prompt_token_ids), len(o.token_ids), o.metrics.get("ttft_ms"), o.metrics.get("tpot_ms"),
                       tuple(o.metrics.get("itl_ms") or ())) for o in outputs if o.finish_reason is not None]


class _EngineCache:
    """Holds at most one LLM: two engines each sizing their KV to free GPU memory would not fit.

    A cached engine is reused only when it can zero its run counters (``LLMEngine.reset_stats()``);
    otherwise one point's counters would leak into the next, so every point gets a fresh engine.
    """

    def __init__(self) -> None:
        self.key: str | None = None
        self.llm: Any = None
        self.num_builds = 0

    def get(self, planned: PlannedPoint) -> Any:
        from oasiskv_runtime import LLM

        key = repr(planned.engine.to_dict())
        if key == self.key and callable(getattr(self.llm.engine, "reset_stats", None)):
            self.llm.engine.reset_stats()
            return self.llm
        self.drop()  # hold no reference to the old engine here (not even a bound method): its memory must go first
        p = planned.point
        self.llm = LLM(p["model"], device=p["device"], dtype=p["dtype"], mode=p["mode"], seed=p["seed"],
                       **engine_overrides(p))
        self.key = key
        self.num_builds += 1
        warm_up(self.llm, p)
        return self.llm

    def drop(self) -> None:
        """Release the engine before the next build (which sizes its KV to the memory left; after an OOM too).
        Dropping the last reference frees it; the collection also frees anything of it left in a reference cycle
        rather than waiting for the automatic one."""
        import gc

        self.llm, self.key = None, None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def warm_up(llm: Any, point: dict[str, Any]) -> None:
    """One request on a fresh engine before anything is timed, then zeroed counters: kernel compilation (Triton
    JIT on a fresh machine), cuBLAS setup and the first CUDA-graph captures would otherwise land in the first
    measured point of each engine. Its prompt is as long as the point's (Triton kernels are compiled per shape
    class: prefill chunks, the context bucket of the prediction kernels); a short one left those compilations in
    the timed run (on the H200 a process's first oasiskv point ran 24% slower than the next one, whose gather
    setting alone was worth ~5%: docs/benchmarks.md, "End-to-end capacity"). The counted metrics (tokens, bytes,
    batches) are unchanged."""
    from oasiskv_runtime import SamplingParams

    eng = llm.engine
    prompt = make_prompts(1, warm_up_prompt_len(int(point["context_len"]), eng.max_model_len),
                          eng.model_config.vocab_size, int(point["seed"]) + 1)
    try:
        llm.generate(prompt, SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, temperature=0.0, ignore_eos=True))
    except ValueError:
        return  # not even this fits: the point's own requests will report the budget error
    eng.reset_stats()


@contextmanager
def _token_progress(engine: Any, progress: Progress, task: Any) -> Iterator[None]:
    """Within this context, advance ``task`` by the tokens the engine's requests generated after every step (and
    show how much of their prompts has been prefilled), so a point's bar moves from its first tokens on and rich's
    ETA has a rate to work from. Counting walks the point's requests once per step: nothing next to a step."""
    seqs: list[Any] = []
    add_request, step = engine.__dict__.get("add_request"), engine.__dict__.get("step")
    real_add, real_step = engine.add_request, engine.step
    num_prompt = [0]

    def add(*args: Any, **kwargs: Any) -> Any:
        seq = real_add(*args, **kwargs)
        seqs.append(seq)
        num_prompt[0] += len(seq.prompt_token_ids)
        return seq

    def counted_step() -> Any:
        out = real_step()
        generated = sum(len(s.output_token_ids) for s in seqs)
        prefilled = sum(min(s.num_computed_tokens, len(s.prompt_token_ids)) if not s.output_token_ids
                        else len(s.prompt_token_ids) for s in seqs)
        share = f"prefill {100 * prefilled // max(1, num_prompt[0])}%" if prefilled < num_prompt[0] else ""
        progress.update(task, completed=generated, prefill=share)
        return out

    engine.add_request, engine.step = add, counted_step
    try:
        yield
    finally:  # put back exactly what was there (another wrapper, e.g. traced_steps', or the class method)
        for name, prev in (("add_request", add_request), ("step", step)):
            if prev is None:
                delattr(engine, name)
            else:
                setattr(engine, name, prev)


def point_label(point: dict[str, Any]) -> str:
    return f"{series_label(point)} ctx={point['context_len']} c={point['concurrency']}"


def run_point(planned: PlannedPoint, cache: _EngineCache, progress: Progress | None = None,
              trace: tuple[tuple[tuple[int, int], ...], Path] | None = None, where: str = "") -> dict[str, Any]:
    """Run one point; returns its metrics (with ``error`` set when it failed). ``trace``: (windows, file): profile
    those windows of the point's engine steps into the file (:mod:`oasisbench.runners.step_trace`). ``progress``
    gets one task for the point, counting generated tokens (field ``prefill``: the share of prompt tokens done,
    blank once all are); ``where`` (e.g. ``"point 2/4"``) heads its description."""
    from oasiskv_runtime import SamplingParams
    from oasisbench.runners.step_trace import traced_steps

    p = planned.point
    n = int(p["num_requests"])
    head = f"{where} " if where else ""
    task = progress.add_task(f"{head}{point_label(p)}", total=n * int(p["output_len"]), prefill="loading model") \
        if progress is not None else None
    try:
        llm = cache.get(planned)
        prompts = make_prompts(n, p["context_len"] - p["output_len"], llm.engine.model_config.vocab_size, p["seed"])
        params = SamplingParams(max_tokens=p["output_len"], temperature=0.0, ignore_eos=True, seed=p["seed"])
        windows, trace_path = trace if trace is not None else (None, None)
        with traced_steps(llm.engine, windows, f"{point_label(p)} ({planned.pid})", trace_path), \
                (_token_progress(llm.engine, progress, task) if progress is not None else nullcontext()):
            if progress is not None:
                progress.update(task, prefill="prefill 0%")
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params)
            duration = time.perf_counter() - t0
        return point_metrics(embedded_rows(outputs), n, duration, llm.engine.run_stats())
    except Exception as e:  # noqa: BLE001  (see EXPECTED_POINT_ERRORS)
        cache.drop()  # an engine that failed mid-run may hold half-allocated requests
        if not isinstance(e, EXPECTED_POINT_ERRORS):
            Console(stderr=True).print_exception(max_frames=8)
        if progress is not None and task is not None:
            progress.update(task, description=f"[red]FAILED[/] {head}{point_label(p)}", prefill="")
        return {"completed": 0, "failed": n, "error": f"{type(e).__name__}: {e}"}


def environment(planned: list[PlannedPoint], random_weights: bool | None) -> dict[str, Any]:
    """``env.json``: where this ran, so two runs can be told apart (and random weights are never hidden)."""
    import torch
    import transformers

    devices = sorted({pp.point["device"] for pp in planned})
    names = []
    for d in devices:
        if d.startswith("cuda") and torch.cuda.is_available():
            names.append(torch.cuda.get_device_name(torch.device(d)))
        else:
            names.append(f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    return {
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": ", ".join(names),
        "model": ", ".join(sorted({pp.point["model"] for pp in planned})),
        "random_weights": random_weights,
        # what each draft spec of the run means here (``auto`` depends on the model and the heads shipped)
        "drafts": {f"{pp.point['draft']} @ {pp.point['model']}": resolve_draft(pp.point["draft"], pp.point["model"])
                   for pp in planned if pp.point["mode"] == "oasiskv" and not pp.on_vllm},
        **_vllm_environment(planned),
        "hostname": socket.gethostname(),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _vllm_environment(planned: list[PlannedPoint]) -> dict[str, Any]:
    """The vLLM of the run's vLLM points (its version, and what their drafts are in vLLM's terms); nothing without
    vLLM points."""
    from oasiskv_runtime.vllm import speculative_config
    from oasiskv_runtime.vllm.version import installed_vllm_version

    on_vllm = [pp for pp in planned if pp.on_vllm]
    if not on_vllm:
        return {}
    drafts = {f"{pp.point['draft']} @ vllm": speculative_config(pp.engine.plugin["draft"])
              for pp in on_vllm if pp.engine.plugin is not None and pp.engine.plugin["draft"] != "none"}
    return {"vllm": installed_vllm_version(), "vllm_drafts": drafts}


def _git_commit() -> str | None:
    """HEAD of the checkout this code runs from, or None outside a git checkout (e.g. a wheel install)."""
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                           text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def config_differences(old: dict[str, Any], planned: list[PlannedPoint]) -> list[str]:
    """What differs between a run's ``config.json`` and ``planned``: one ``key (was ...; now ...)`` per point key
    whose set of values differs. Empty when they match, or when the old config lists no points (a run killed
    before writing it)."""
    if not isinstance(old.get("points"), list):
        return []
    new_points = [to_jsonable(pp.point) for pp in planned]

    def values(points: list[dict[str, Any]], key: str) -> list[str]:
        vals = {json.dumps(normalize_value(pt.get(key)), sort_keys=True) for pt in points}
        return sorted(vals, key=lambda v: (len(v), v))

    keys = sorted({k for pt in old["points"] + new_points for k in pt})
    return [f"{k} (was {', '.join(values(old['points'], k))}; now {', '.join(values(new_points, k))})"
            for k in keys if values(old["points"], k) != values(new_points, k)]


def refuse_other_config(store: RunStore, planned: list[PlannedPoint]) -> None:
    """Raise ``ValueError`` naming what differs when ``store`` (a resumed run) was recorded with other points."""
    config_path = store.path / CONFIG_FILE
    if config_path.is_file():
        diff = config_differences(json.loads(config_path.read_text(encoding="utf-8")), planned)
        if diff:
            raise ValueError(f"{store.path} was recorded with another configuration; --resume continues a run with "
                             f"the flags it was started with. Differs: {'; '.join(diff)}")


def refuse_trace_on_vllm(planned: list[PlannedPoint], trace_window: tuple[tuple[int, int], ...] | None) -> None:
    """Raise ``ValueError`` when steps are to be traced in a run with vLLM points (traces profile our engine's steps
    in this process; a vLLM point runs in another)."""
    if trace_window is not None and any(pp.on_vllm for pp in planned):
        raise ValueError("--trace-steps profiles the embedded engine's steps; this run has vLLM points "
                         "(use vLLM's own profiler there)")


def run_throughput(points: list[dict[str, Any]], store: RunStore, progress: Progress | None = None,
                   trace_window: tuple[tuple[int, int], ...] | None = None,
                   vllm_timeout_s: float | None = None) -> None:
    """Plan ``points`` (:func:`plan_points`) and run them (:func:`run_planned`).

    Raises ``ValueError`` (before running anything) for invalid points; see the module docstring.
    """
    run_planned(plan_points(points), store, progress, trace_window, vllm_timeout_s)


def run_planned(planned: list[PlannedPoint], store: RunStore, progress: Progress | None = None,
                trace_window: tuple[tuple[int, int], ...] | None = None,
                vllm_timeout_s: float | None = None) -> None:
    """Run every planned point not already recorded in ``store``; write config.json, env.json and metrics.json.
    ``trace_window`` ((start, count), ...): profile those engine steps of each point run into ``traces.txt`` in the
    run directory (the profiled steps are slower: their point's timings are marked ``traced_steps``). vLLM points
    run in a process each (killed after ``vllm_timeout_s``, default
    :data:`~oasisbench.runners.vllm_point.DEFAULT_TIMEOUT_S`), their logs kept as ``vllm-point-<i>.log``.

    Raises ``ValueError`` before running anything when ``store`` is a resumed run recorded with other points (its
    config.json differs: resuming would mix two sweeps in one run), or when steps are to be traced in a run with
    vLLM points. ``progress`` gets one task per point (:func:`run_point`); :func:`summary_table` renders the result.
    """
    from oasiskv_runtime.models.presets import preset_names
    from oasisbench.runners.step_trace import window_label
    from oasisbench.runners.vllm_point import DEFAULT_TIMEOUT_S, run_vllm_point

    refuse_trace_on_vllm(planned, trace_window)
    refuse_other_config(store, planned)
    store.write_config({
        "suite": store.suite,
        "points": [pp.point for pp in planned],
        "engines": {pp.pid: pp.engine.to_dict() for pp in planned},
    })
    from oasiskv_runtime.vllm.models import VLLM_ONLY_PRESETS

    random_weights = any(pp.point["model"] in (*preset_names(), *VLLM_ONLY_PRESETS) for pp in planned)
    store.write_env(environment(planned, random_weights))
    done = {point_id(r["point"]) for r in store.records if not r["metrics"].get("error")}
    cache = _EngineCache()
    for i, pp in enumerate(planned):
        if pp.pid in done:
            continue
        where = f"point {i + 1}/{len(planned)}"
        if pp.on_vllm:
            cache.drop()  # the vLLM process sizes its KV to the device memory this one leaves
            metrics = run_vllm_point(pp.point, progress, f"{where} {point_label(pp.point)}",
                                     store.path / f"vllm-point-{i + 1}.log", vllm_timeout_s or DEFAULT_TIMEOUT_S)
            store.add_record(pp.point, metrics)
            continue
        trace = (trace_window, store.path / "traces.txt") if trace_window is not None else None
        metrics = run_point(pp, cache, progress, trace, where=where)
        if trace_window is not None:
            metrics["traced_steps"] = window_label(trace_window)
        store.add_record(pp.point, metrics)
    cache.drop()


def summary_table(records: list[Record]) -> Table:
    """Rich table, one row per point (modes in canonical order, then concurrency); errors are listed by
    the caller, the table only says FAILED, so it stays narrow enough for an 80-column terminal."""
    table = Table(title="throughput")
    # num_requests defaults to the concurrency: a column repeating it would only take width.
    hidden = {"mode", "engine", "concurrency"} | ({"num_requests"} if all(
        r["point"].get("num_requests") == r["point"]["concurrency"] for r in records) else set())
    extra = sorted(k for k in {k for r in records for k in r["point"]} - hidden
                   if len({repr(r["point"].get(k)) for r in records}) > 1)
    for col in ("mode", "conc", *extra, "tok/s", "req/s", "TPOT ms", "batch", "MiB/step", "recall", "status"):
        table.add_column(col, justify="left" if col in ("mode", "status") else "right")
    modes = order_modes({series_label(r["point"]) for r in records})

    def cell(value: Any, fmt: str) -> str:
        return "–" if value is None else format(value, fmt)

    for r in sorted(records, key=lambda r: (modes.index(series_label(r["point"])), r["point"]["concurrency"],
                                            *(repr(r["point"].get(k)) for k in extra))):
        m = r["metrics"]
        fetched = m.get("fetched_bytes_per_step")
        table.add_row(series_label(r["point"]), str(r["point"]["concurrency"]), *(str(r["point"].get(k)) for k in extra),
                      cell(m.get("output_throughput"), ".1f"), cell(m.get("request_throughput"), ".3f"),
                      cell(m.get("median_tpot_ms"), ".1f"), cell(m.get("max_running_batch"), "d"),
                      cell(None if fetched is None else fetched / 2**20, ".3f"),
                      cell(m.get("prediction_recall"), ".3f"), "[red]FAILED[/]" if m.get("error") else "ok")
    return table
