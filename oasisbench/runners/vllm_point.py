"""Throughput points on vLLM (``engine: vllm``): plain vLLM for ``dense``, vLLM with the OasisKV plug-in
(``oasiskv_runtime.vllm.engine_args``) for ``sparse-resident``, ``proxy-prefetch`` and ``oasiskv``.

The workload is the embedded runner's (:mod:`oasisbench.runners.workload`): the same seeded random prompt ids,
greedy, ``ignore_eos``, every request submitted at t0, ``max_num_seqs = concurrency``, the device KV budget as
vLLM's ``kv_cache_memory_bytes``, a warm-up request as long as the context before the timed run.

Each point runs in a process of its own (``python -m oasisbench.runners.vllm_point POINT DIR``): vLLM does not
release an engine cleanly inside a process, and a crashed or hung engine must not take the sweep with it. The
parent polls the child's progress file, kills it (its whole process group: vLLM's engine-core and worker
processes) past the timeout, and records its ``result.json``, or an error naming the cause and the tail of its log.

Where the metrics come from: TTFT and TPOT from vLLM's per-request stats (``RequestOutput.metrics``: first-token
latency, first and last token timestamps); the running batch (requests vLLM's scheduler holds, as the embedded
engine's ``max_running_batch``) and the inter-token gaps from each step's ``EngineCoreOutputs`` (its
``scheduler_stats`` and timestamp), read where the engine-core client hands them to the frontend; preemptions
and the acceptance of drafts from vLLM's Prometheus counters (differences over the timed run); the plug-in's
traffic from its workers (``collect_stats``, counters zeroed after the warm-up). Not measured on vLLM:
``resident_gpu_bytes_per_request``, ``peak_device_memory_bytes``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import Progress

from oasisbench.results.store import atomic_write_json, to_jsonable
from oasisbench.runners.workload import WARMUP_OUTPUT_LEN, RequestRow, make_prompts, point_metrics, warm_up_prompt_len
from oasisbench.suites import ENGINE_KEYS
from oasiskv_runtime.config import EngineConfig, Mode

#: Engine options a vLLM point passes on (to vLLM or to the plug-in); any other engine option must keep the
#: embedded engine's default. ``cuda_graphs``: ``off`` runs vLLM eagerly (``enforce_eager``: no torch.compile, no
#: CUDA graphs), ``auto`` is vLLM's default on CUDA and eager on the CPU (no graphs there; vLLM's compile would
#: add ~35 s to each CPU engine start, whose figures are correctness, not speed).
VLLM_POINT_KEYS = ("top_k_blocks", "fetch_ratio", "draft", "block_size", "sink_blocks", "backend", "measure_recall",
                   "max_num_batched_tokens", "cuda_graphs")
#: Plug-in options (``engine_args``' arguments) taken from the point; plain vLLM (dense) takes none of them.
PLUGIN_KEYS = ("top_k_blocks", "fetch_ratio", "block_size", "sink_blocks", "backend", "measure_recall")
#: Seconds a vLLM point may take, engine start and shutdown included, before its process is killed.
DEFAULT_TIMEOUT_S = 3600.0
#: Figures of the plug-in's host-pool runtime copied into a record (``backend.collect_stats()["oasiskv"]``).
HOST_POOL_STATS = ("fetched_blocks_per_step", "fetched_bytes_per_step", "max_fetched_bytes_per_step",
                   "deferred_blocks_per_step", "initial_fill_bytes", "prediction_recall", "fetch_cap",
                   "max_step_cap_bytes", "max_step_bytes_over_cap", "fills", "gap_rows", "fallback_steps")
#: Per-layer counters of the plug-in's attention (``collect_stats``), as differences over the timed run.
LAYER_STATS = ("decode_rows", "draft_rows", "sparse_rows")
_RESULT, _PROGRESS = "result.json", "progress.json"


@dataclass(frozen=True)
class VllmPlan:
    """What a vLLM point runs: vLLM's engine arguments of ours and the plug-in's (None: plain vLLM)."""

    llm_kwargs: dict[str, Any]
    """``vllm.LLM`` keyword arguments besides the model and the plug-in's."""
    plugin: dict[str, Any] | None
    """``oasiskv_runtime.vllm.engine_args`` arguments (mode, options, draft); None for dense (plain vLLM)."""

    def to_dict(self) -> dict[str, Any]:
        return {"engine": "vllm", "llm": dict(self.llm_kwargs), "engine_args": self.plugin}


def plan_vllm_point(point: dict[str, Any]) -> VllmPlan:
    """The vLLM run of a resolved point, checked without vLLM: a mode vLLM does not run, an option it cannot take
    or a draft it has no counterpart of raises ``ValueError`` before any point runs."""
    from oasiskv_runtime.vllm import speculative_config
    from oasiskv_runtime.vllm.options import VllmOptions

    specs = EngineConfig.options()
    refused = [k for k in ENGINE_KEYS if k not in VLLM_POINT_KEYS and point.get(k) is not None
               and point[k] != specs[k].default]
    if point.get("host_kv_gb") is not None:
        refused.append("host_kv_gb (the plug-in's host pool is as large as vLLM's KV cache, kv_cache_gb)")
    if refused:
        raise ValueError(f"engine vllm does not take {', '.join(refused)}: embedded-engine options")
    # A key the point leaves None has the embedded engine's default, which VllmOptions shares.
    options = {k: point[k] if point.get(k) is not None else specs[k].default for k in PLUGIN_KEYS}
    opts = VllmOptions(mode=point["mode"], **options)  # refuses fetch-on-demand too
    mode = opts.parsed_mode
    graphs = point.get("cuda_graphs") or "auto"
    if graphs not in ("auto", "off"):
        raise ValueError(f"engine vllm takes cuda_graphs auto or off (vLLM captures its own graphs), got {graphs!r}")
    # As on the embedded engine, only oasiskv drafts; vLLM's `auto` draft is its n-gram prompt lookup.
    draft = (point["draft"] if point["draft"] != "auto" else "ngram") if mode.uses_draft else "none"
    speculative_config(draft)
    llm: dict[str, Any] = {
        "dtype": point["dtype"], "seed": int(point["seed"]), "max_model_len": int(point["context_len"]),
        "max_num_seqs": int(point["concurrency"]), "max_num_batched_tokens": int(point["max_num_batched_tokens"]),
        "disable_log_stats": False,  # per-request and scheduler stats, the spec-decode counters
    }
    if point.get("kv_cache_gb") is not None:
        llm["kv_cache_memory_bytes"] = int(float(point["kv_cache_gb"]) * (1 << 30))
    if graphs == "off" or not str(point["device"]).startswith("cuda"):
        llm["enforce_eager"] = True
    plugin = None if mode is Mode.DENSE else {"mode": mode.value, **options, "draft": draft}
    return VllmPlan(llm, plugin)


# ---- the parent: one process per point -------------------------------------------------------------------------


def _child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    # The child runs this checkout's code, whatever an installed copy of the package says.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function (collect_stats) to the workers
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2]
    return env


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


def _root_cause(path: Path) -> str | None:
    """The first exception line in a vLLM log: a failure in vLLM's engine-core process reaches the frontend as
    "Engine core initialization failed. See root cause above", the cause only in the log."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if " WARNING " in line or " INFO " in line:  # e.g. vLLM's warning of no tokenizer (we pass ids)
                    continue
                found = _ERROR_LINE.search(line.rstrip())
                if found:
                    return f"{found.group(1)}: {found.group(2)}"
    except OSError:
        pass
    return None


def child_command(point: dict[str, Any], out_dir: str) -> list[str]:
    """The command running ``point`` in a child process that writes its result under ``out_dir`` (:func:`main`)."""
    return [sys.executable, "-m", __name__, json.dumps(to_jsonable(point)), out_dir]


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).strip()
    except OSError:
        return ""


def run_vllm_point(point: dict[str, Any], progress: Progress | None = None, label: str = "",
                   log_path: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Run one resolved vLLM point in a child process; its metrics, or ``error`` (and ``failed = num_requests``).
    ``progress`` gets one task counting generated tokens; ``log_path`` keeps the child's output (vLLM's log)."""
    from oasiskv_runtime.vllm.version import UnsupportedVllmVersion, check_vllm_version

    n = int(point["num_requests"])
    task = progress.add_task(label, total=n * int(point["output_len"]), prefill="starting vLLM") \
        if progress is not None else None
    try:
        check_vllm_version()
        metrics = _run_child(point, progress, task, log_path, timeout_s)
    except UnsupportedVllmVersion as e:
        metrics = {"error": f"{type(e).__name__}: {e}"}
    if metrics.get("error"):
        metrics.update(completed=0, failed=n)
        if progress is not None and task is not None:
            progress.update(task, description=f"[red]FAILED[/] {label}", prefill="")
    return metrics


def _run_child(point: dict[str, Any], progress: Progress | None, task: Any, log_path: Path | None,
               timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="oasisbench-vllm-") as tmp:
        log = log_path if log_path is not None else Path(tmp) / "vllm.log"
        cmd = child_command(point, tmp)
        with log.open("w", encoding="utf-8") as out:
            # A session of its own: a timeout kills the child's process group, vLLM's engine processes included.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env(str(point["device"])),
                                    start_new_session=True)
            timed_out = False
            try:
                deadline = time.monotonic() + timeout_s
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        timed_out = True
                        _kill(proc)
                        break
                    _show_progress(Path(tmp) / _PROGRESS, progress, task)
                    time.sleep(0.5)
            except BaseException:  # Ctrl-C: leave no vLLM engine behind
                _kill(proc)
                raise
        _show_progress(Path(tmp) / _PROGRESS, progress, task)
        result = Path(tmp) / _RESULT
        if result.is_file():
            metrics = json.loads(result.read_text(encoding="utf-8"))
            cause = _root_cause(log) if metrics.get("error") else None
            if cause is not None and cause != metrics["error"]:
                metrics["error"] += f" (first error in vLLM's log {log_path or ''}: {cause})"
            return metrics
        why = (f"timed out after {timeout_s:g} s" if timed_out
               else f"the vLLM process exited with code {proc.returncode} without a result")
        return {"error": f"{why} (log: {log_path or 'not kept'}); last lines:\n{_log_tail(log)}"}


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _show_progress(path: Path, progress: Progress | None, task: Any) -> None:
    if progress is None or task is None:
        return
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not written yet, or caught mid-write: the next poll reads it
        return
    progress.update(task, completed=state.get("generated", 0), prefill=state.get("phase", ""))


# ---- the child: one vLLM engine --------------------------------------------------------------------------------


class _Status:
    """The child's progress file: phase and generated tokens, rewritten at most twice a second."""

    def __init__(self, path: Path) -> None:
        self.path, self.phase, self.generated, self._last = path, "", 0, 0.0

    def update(self, phase: str | None = None, generated: int | None = None, force: bool = False) -> None:
        self.phase = self.phase if phase is None else phase
        self.generated = self.generated if generated is None else generated
        now = time.monotonic()
        if force or now - self._last >= 0.5:
            self._last = now
            atomic_write_json(self.path, {"phase": self.phase, "generated": self.generated})


class _StepTap:
    """Within this context, read each engine step's ``EngineCoreOutputs`` as the engine-core client hands it to the
    frontend: the scheduler's running requests (``scheduler_stats.num_running_reqs``, sent with ``log_stats``) and
    when each request's tokens arrived (the step's engine-core timestamp). Nothing is added to the step."""

    def __init__(self, client: Any, status: _Status) -> None:
        self.client, self.status = client, status
        self.running: list[int] = []
        self.arrivals: dict[str, list[float]] = {}
        self.generated = 0

    def __enter__(self) -> _StepTap:
        self._own = self.client.__dict__.get("get_output")
        real = self.client.get_output

        def get_output(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            if out.scheduler_stats is not None:
                self.running.append(int(out.scheduler_stats.num_running_reqs))
            for o in out.outputs:
                if o.new_token_ids:
                    self.arrivals.setdefault(o.request_id, []).append(float(out.timestamp))
                    self.generated += len(o.new_token_ids)
            self.status.update(generated=self.generated)
            return out

        self.client.get_output = get_output
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._own is None:
            del self.client.get_output
        else:
            self.client.get_output = self._own

    def itl_ms(self, request_id: str) -> tuple[float, ...]:
        """Gaps between the steps that gave ``request_id`` tokens (the engine core suffixes the frontend's ids)."""
        times = next((t for cid, t in self.arrivals.items()
                      if cid == request_id or cid.rpartition("-")[0] == request_id), [])
        return tuple((b - a) * 1e3 for a, b in zip(times, times[1:]))


def _counter(llm: Any, name: str) -> int:
    """A Prometheus counter of vLLM's, summed over engines (it lives as long as the process: take differences)."""
    return sum(int(m.value) for m in llm.get_metrics() if m.name == name)


def _request_row(out: Any, tap: _StepTap) -> RequestRow:
    st = out.metrics  # vLLM's RequestStateStats (log_stats on)
    n = len(out.outputs[0].token_ids)
    ttft = st.first_token_latency * 1e3 if st is not None and st.first_token_ts else None
    tpot = ((st.last_token_ts - st.first_token_ts) * 1e3 / (st.num_generation_tokens - 1)
            if st is not None and st.num_generation_tokens > 1 else None)
    return RequestRow(len(out.prompt_token_ids), n, ttft, tpot, tap.itl_ms(out.request_id))


def measure_point(point: dict[str, Any], status: _Status) -> dict[str, Any]:
    """Start vLLM for ``point`` in this process, warm it up, run the point; its metrics."""
    from oasiskv_runtime.vllm.models import vllm_model
    from oasiskv_runtime.vllm.version import check_vllm_version

    version = check_vllm_version()
    plan = plan_vllm_point(point)
    import vllm
    from vllm.platforms import current_platform

    on_cuda = str(point["device"]).startswith("cuda")
    if on_cuda != bool(current_platform.is_cuda()):
        raise ValueError(f"the point runs on {point['device']}, and this vLLM build runs on "
                         f"{'CUDA' if current_platform.is_cuda() else 'the CPU'}")
    with tempfile.TemporaryDirectory(prefix="oasisbench-model-") as root:
        model = vllm_model(str(point["model"]), Path(root))
        kwargs = {**plan.llm_kwargs, **model.llm_kwargs}
        if plan.plugin is not None:
            from oasiskv_runtime.vllm import engine_args

            kwargs.update(engine_args(**plan.plugin, platform="cuda" if on_cuda else "cpu"))
        status.update(phase="starting vLLM", force=True)
        llm = vllm.LLM(model=str(model.path), skip_tokenizer_init=True, **kwargs)
        try:
            metrics = _timed_run(llm, vllm, point, plan, model.config.vocab_size, status)
        finally:
            llm.llm_engine.engine_core.shutdown()
    metrics["vllm_version"] = version
    return metrics


def _timed_run(llm: Any, vllm: Any, point: dict[str, Any], plan: VllmPlan, vocab_size: int,
               status: _Status) -> dict[str, Any]:
    from oasiskv_runtime.vllm import acceptance, spec_decode_counts
    from oasiskv_runtime.vllm.backend import collect_stats, configure

    ctx, out_len, n, seed = (int(point[k]) for k in ("context_len", "output_len", "num_requests", "seed"))
    status.update(phase="warm-up", force=True)
    warm = make_prompts(1, warm_up_prompt_len(ctx, ctx), vocab_size, seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in warm],
                 vllm.SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, temperature=0.0, ignore_eos=True), use_tqdm=False)
    host_pool = plan.plugin is not None and Mode(plan.plugin["mode"]).uses_host_pool
    if host_pool:
        llm.apply_model(functools.partial(configure, reset=True))
    layers_before = llm.apply_model(collect_stats)[0] if plan.plugin is not None else None
    spec_before, preempted_before = spec_decode_counts(llm), _counter(llm, "vllm:num_preemptions")

    prompts = [{"prompt_token_ids": p} for p in make_prompts(n, ctx - out_len, vocab_size, seed)]
    params = vllm.SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, seed=seed)
    status.update(phase="", force=True)
    with _StepTap(llm.llm_engine.engine_core, status) as tap:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - t0
    status.update(force=True)

    running = tap.running
    stats: dict[str, Any] = {
        "num_steps": len(running), "max_running_batch": max(running, default=0),
        "mean_running_batch": sum(running) / len(running) if running else 0.0,
        "num_preemptions": _counter(llm, "vllm:num_preemptions") - preempted_before,
        "fetched_blocks_per_step": 0.0, "fetched_bytes_per_step": 0.0, "deferred_blocks_per_step": 0.0,
    }
    if plan.plugin is not None and plan.plugin["draft"] != "none":
        acc = acceptance(spec_before, spec_decode_counts(llm))
        stats.update(draft_accuracy=acc["acceptance_rate"], spec_decode_acceptance_rate=acc["acceptance_rate"],
                     tokens_per_step=acc["tokens_per_step"], num_drafts=acc["drafts"])
    if layers_before is not None:
        layers = llm.apply_model(collect_stats)[0]
        stats.update({k: layers[k] - layers_before[k] for k in LAYER_STATS})
        if host_pool:
            stats.update({k: layers["oasiskv"].get(k) for k in HOST_POOL_STATS})
    rows = [_request_row(o, tap) for o in outputs if o.finished]
    return to_jsonable(point_metrics(rows, n, duration, stats))


def main(argv: list[str]) -> None:
    """The child: ``POINT_JSON DIR``; writes ``DIR/result.json`` (metrics, or ``error``) and ``DIR/progress.json``."""
    point, out_dir = json.loads(argv[0]), Path(argv[1])
    try:
        metrics = measure_point(point, _Status(out_dir / _PROGRESS))
    except Exception as e:  # noqa: BLE001 - the record carries it; the traceback goes to the point's log
        traceback.print_exc()
        metrics = {"error": f"{type(e).__name__}: {e}"}
    atomic_write_json(out_dir / _RESULT, metrics)


if __name__ == "__main__":
    main(sys.argv[1:])
