"""Throughput points on vLLM (``engine: vllm``): plain vLLM for ``dense``, vLLM with the OasisKV plug-in
(``oasiskv_runtime.vllm.engine_args``) for ``sparse-resident``, ``proxy-prefetch`` and ``oasiskv``.

The workload is the embedded runner's (:mod:`oasisbench.runners.workload`): the same seeded random prompt ids,
greedy, ``ignore_eos``, every request submitted at t0, ``max_num_seqs = concurrency``, the device KV budget as
vLLM's ``kv_cache_memory_bytes``, a warm-up request as long as the context before the timed run.

Each point runs in a process of its own (``python -m oasisbench.runners.vllm_point POINT DIR``, through
:mod:`oasisbench.runners.vllm_child`): vLLM does not
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

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import Progress

from oasisbench.results.store import to_jsonable
from oasisbench.runners import vllm_child
from oasisbench.runners.vllm_child import ChildStatus, EngineCounters, start_vllm
from oasisbench.runners.workload import WARMUP_OUTPUT_LEN, RequestRow, make_prompts, point_metrics, warm_up_prompt_len
from oasisbench.suites import ENGINE_KEYS
from oasiskv_runtime.config import EngineConfig, Mode

#: Plug-in options (``engine_args``' arguments) taken from the point; plain vLLM (dense) takes none of them.
PLUGIN_KEYS = ("top_k_blocks", "fetch_ratio", "block_size", "sink_blocks", "recent_blocks", "attended_blocks",
               "attended_share", "fill_window", "early_fetch_ratio", "early_steps", "selection_score", "backend",
               "measure_recall", "demand_fetch", "demand_fetch_cap")
#: Engine options a vLLM point passes on: the plug-in's and vLLM's own; any other engine option must keep the
#: embedded engine's default. ``cuda_graphs``: ``off`` runs vLLM eagerly (``enforce_eager``: no torch.compile, no
#: CUDA graphs), ``auto`` is vLLM's default on CUDA and eager on the CPU (no graphs there; vLLM's compile would
#: add ~35 s to each CPU engine start, whose figures are correctness, not speed); ``full`` is ``auto`` with the
#: plug-in's ``cuda_graphs='full'`` (the host-pool modes' decode steps from full graphs).
VLLM_POINT_KEYS = PLUGIN_KEYS + ("draft", "max_num_batched_tokens", "cuda_graphs")
#: Seconds a vLLM point may take, engine start and shutdown included, before its process is killed.
DEFAULT_TIMEOUT_S = 3600.0


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
    host_gb, tier_gb = point.get("host_kv_gb"), point.get("device_tier_gb")
    if not Mode.parse(point["mode"]).uses_host_pool:
        refused += [f"{k} in mode {point['mode']} (only the host-pool modes keep a host pool)"
                    for k in ("host_kv_gb", "device_tier_gb") if point.get(k) is not None]
    if tier_gb is not None and host_gb is None and not refused:
        raise ValueError("device_tier_gb adds rows past the host pool's: set host_kv_gb too (without it the host pool "
                         "is 80% of the host's free memory, which varies from machine to machine)")
    if refused:
        raise ValueError(f"engine vllm does not take {', '.join(refused)}: embedded-engine options")
    # A key the point leaves None has the embedded engine's default, which VllmOptions shares.
    options = {k: point[k] if point.get(k) is not None else specs[k].default for k in PLUGIN_KEYS}
    opts = VllmOptions(mode=point["mode"], **options)  # refuses fetch-on-demand too
    mode = opts.parsed_mode
    graphs = point.get("cuda_graphs") or "auto"
    if graphs not in ("auto", "off", "full"):
        raise ValueError(f"engine vllm takes cuda_graphs auto, full or off (vLLM captures its own graphs), got "
                         f"{graphs!r}")
    speculate = bool(point.get("speculate"))
    if speculate and mode is not Mode.DENSE:
        raise ValueError(f"speculate is for plain vLLM (mode dense); mode {mode.value} drafts as the plug-in does")
    # As on the embedded engine, only oasiskv drafts; vLLM's `auto` draft is its n-gram prompt lookup. Plain vLLM
    # drafts only when the point asks to speculate (the baseline with oasiskv's speculation and none of the plug-in).
    uses_draft = mode.uses_draft or speculate
    draft = (point["draft"] if point["draft"] != "auto" else "ngram") if uses_draft else "none"
    if speculate and draft == "none":
        raise ValueError("speculate needs a draft (ngram, vllm-ngram or eagle3:<dir>), got draft none")
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
    if mode is Mode.DENSE:  # plain vLLM; speculating: engine_args(mode='dense', draft=...) adds only vLLM's own
        plugin = {"mode": mode.value, "draft": draft} if speculate else None
    else:
        plugin = {"mode": mode.value, **options, "draft": draft}
    if host_gb is not None:  # the plug-in's pinned pool (engine_args' host_pool_gb; without it: 80% of free RAM)
        plugin["host_pool_gb"] = float(host_gb)
    if tier_gb is not None:
        plugin["device_tier_gb"] = float(tier_gb)
    if plugin is not None and graphs == "full":  # the host-pool modes' decode steps from full graphs too
        plugin["cuda_graphs"] = "full"
    return VllmPlan(llm, plugin)


# ---- the parent: one process per point (oasisbench.runners.vllm_child) ----------------------------------------


def child_command(point: dict[str, Any], out_dir: str) -> list[str]:
    """The command running ``point`` in a child process that writes its result under ``out_dir`` (:func:`main`)."""
    return vllm_child.child_command(__name__, point, out_dir)


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
    def show(state: dict[str, Any]) -> None:
        if progress is not None and task is not None:
            progress.update(task, completed=state.get("generated", 0), prefill=state.get("phase", ""))

    return vllm_child.run_child(lambda out_dir: child_command(point, out_dir), str(point["device"]), log_path,
                                timeout_s, show)


# ---- the child: one vLLM engine --------------------------------------------------------------------------------


class _StepTap:
    """Within this context, read each engine step's ``EngineCoreOutputs`` as the engine-core client hands it to the
    frontend: the scheduler's running requests (``scheduler_stats.num_running_reqs``, sent with ``log_stats``) and
    when each request's tokens arrived (the step's engine-core timestamp). Nothing is added to the step."""

    def __init__(self, client: Any, status: ChildStatus) -> None:
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


def _request_row(out: Any, tap: _StepTap) -> RequestRow:
    st = out.metrics  # vLLM's RequestStateStats (log_stats on)
    n = len(out.outputs[0].token_ids)
    ttft = st.first_token_latency * 1e3 if st is not None and st.first_token_ts else None
    tpot = ((st.last_token_ts - st.first_token_ts) * 1e3 / (st.num_generation_tokens - 1)
            if st is not None and st.num_generation_tokens > 1 else None)
    return RequestRow(len(out.prompt_token_ids), n, ttft, tpot, tap.itl_ms(out.request_id))


def measure_point(point: dict[str, Any], status: ChildStatus) -> dict[str, Any]:
    """Start vLLM for ``point`` in this process, warm it up, run the point; its metrics."""
    from oasiskv_runtime.vllm.version import check_vllm_version

    plan = plan_vllm_point(point)
    with start_vllm(str(point["model"]), str(point["device"]), plan.llm_kwargs, plan.plugin, status) as (llm, vllm,
                                                                                                          model):
        metrics = _timed_run(llm, vllm, point, plan, model.config.vocab_size, status)
    metrics["vllm_version"] = check_vllm_version()
    return metrics


def _timed_run(llm: Any, vllm: Any, point: dict[str, Any], plan: VllmPlan, vocab_size: int,
               status: ChildStatus) -> dict[str, Any]:
    ctx, out_len, n, seed = (int(point[k]) for k in ("context_len", "output_len", "num_requests", "seed"))
    status.update(phase="warm-up", force=True)
    warm = make_prompts(1, warm_up_prompt_len(ctx, ctx), vocab_size, seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in warm],
                 vllm.SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, temperature=0.0, ignore_eos=True), use_tqdm=False)
    counters = EngineCounters(llm, plan.plugin)

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
        "mean_running_batch": sum(running) / len(running) if running else 0.0, **counters.since()}
    rows = [_request_row(o, tap) for o in outputs if o.finished]
    return to_jsonable(point_metrics(rows, n, duration, stats))


def main(argv: list[str]) -> None:
    """The child: ``POINT_JSON DIR``; writes ``DIR/result.json`` (metrics, or ``error``) and ``DIR/progress.json``."""
    vllm_child.child_main(argv, measure_point)


if __name__ == "__main__":
    main(sys.argv[1:])
