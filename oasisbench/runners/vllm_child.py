"""One vLLM engine in a process of its own, for any runner (throughput points, accuracy settings).

vLLM does not release an engine cleanly inside a process, and a crashed or hung engine must not take a sweep with it.
The parent starts ``python -m <module> PAYLOAD_JSON DIR`` in a session of its own, polls the child's progress file,
kills the child's whole process group (vLLM's engine-core and worker processes) past the timeout, and returns the
child's ``DIR/result.json``, or an error naming the cause and the tail of the child's log. The child side:
:func:`child_main` (the result file, errors included), :class:`ChildStatus` (the progress file), :func:`start_vllm`
(one engine, plain vLLM or with the plug-in, shut down on leaving).
"""

from __future__ import annotations

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from oasisbench.results.store import atomic_write_json, to_jsonable

RESULT, PROGRESS = "result.json", "progress.json"
#: Figures of the plug-in's host-pool runtime copied into a record (``backend.collect_stats()["oasiskv"]``).
HOST_POOL_STATS = ("fetched_blocks_per_step", "fetched_bytes_per_step", "max_fetched_bytes_per_step",
                   "deferred_blocks_per_step", "initial_fill_bytes", "prediction_recall", "fetch_cap",
                   "max_step_cap_bytes", "max_step_bytes_over_cap", "fills", "gap_rows", "fallback_steps",
                   "host_pool_rows", "device_tier_rows", "demand_fetched_blocks_per_step", "device_bytes")
#: Per-layer counters of the plug-in's attention (``collect_stats``), as differences over the timed run.
LAYER_STATS = ("decode_rows", "draft_rows", "sparse_rows")


PAYLOAD = "payload.json"


def child_command(module: str, payload: dict[str, Any], out_dir: str) -> list[str]:
    """The command running ``module``'s ``main`` on ``payload`` in a child that writes its result under ``out_dir``.
    The payload goes in a file there, not on the command line: an accuracy run's prompts (7 NIAH families x 10
    samples x 2K tokens) are more than the kernel takes as arguments."""
    path = Path(out_dir) / PAYLOAD
    atomic_write_json(path, to_jsonable(payload))
    return [sys.executable, "-m", module, str(path), out_dir]


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    # The child runs this checkout's code, whatever an installed copy of the package says.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function (collect_stats) to the workers
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2]
    return env


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


def root_cause(path: Path) -> str | None:
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


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).strip()
    except OSError:
        return ""


def run_child(command: Callable[[str], list[str]], device: str, log_path: Path | None, timeout_s: float,
              on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``command(out_dir)`` as a child; its ``result.json``, or ``{"error": ...}`` (timeout, crash, no result).
    ``on_progress`` gets the child's progress state whenever it is read; ``log_path`` keeps the child's output."""
    with tempfile.TemporaryDirectory(prefix="oasisbench-vllm-") as tmp:
        log = log_path if log_path is not None else Path(tmp) / "vllm.log"
        progress = Path(tmp) / PROGRESS
        with log.open("w", encoding="utf-8") as out:
            # A session of its own: a timeout kills the child's process group, vLLM's engine processes included.
            proc = subprocess.Popen(command(tmp), stdout=out, stderr=subprocess.STDOUT, env=child_env(device),
                                    start_new_session=True)
            timed_out = False
            try:
                deadline = time.monotonic() + timeout_s
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        timed_out = True
                        _kill(proc)
                        break
                    _read_progress(progress, on_progress)
                    time.sleep(0.5)
            except BaseException:  # Ctrl-C: leave no vLLM engine behind
                _kill(proc)
                raise
        _read_progress(progress, on_progress)
        result = Path(tmp) / RESULT
        if result.is_file():
            metrics = json.loads(result.read_text(encoding="utf-8"))
            cause = root_cause(log) if metrics.get("error") else None
            if cause is not None and cause != metrics["error"]:
                metrics["error"] += f" (first error in vLLM's log {log_path or ''}: {cause})"
            return metrics
        why = (f"timed out after {timeout_s:g} s" if timed_out
               else f"the vLLM process exited with code {proc.returncode} without a result")
        return {"error": f"{why} (log: {log_path or 'not kept'}); last lines:\n{log_tail(log)}"}


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_progress(path: Path, on_progress: Callable[[dict[str, Any]], None] | None) -> None:
    if on_progress is None:
        return
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not written yet, or caught mid-write: the next poll reads it
        return
    on_progress(state)


# ---- the child ---------------------------------------------------------------------------------------------------


class ChildStatus:
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


def child_main(argv: list[str], work: Callable[[dict[str, Any], ChildStatus], dict[str, Any]]) -> None:
    """The child: ``PAYLOAD_FILE DIR`` (:func:`child_command`); writes ``DIR/result.json`` (``work``'s result, or
    ``error``)."""
    payload, out_dir = json.loads(Path(argv[0]).read_text(encoding="utf-8")), Path(argv[1])
    try:
        result = work(payload, ChildStatus(out_dir / PROGRESS))
    except Exception as e:  # noqa: BLE001 - the record carries it; the traceback goes to the child's log
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    atomic_write_json(out_dir / RESULT, result)


@contextmanager
def start_vllm(model_name: str, device: str, llm_kwargs: dict[str, Any], plugin: dict[str, Any] | None,
               status: ChildStatus) -> Iterator[tuple[Any, Any, Any]]:
    """``(llm, the vllm module, VllmModel)``: one vLLM engine in this process for ``model_name`` on ``device``,
    plain vLLM (``plugin`` None) or with ``engine_args(**plugin)``; shut down on leaving. Prompts go in as token
    ids (no tokenizer in vLLM: the caller's tokenizer is the only one)."""
    from oasiskv_runtime.vllm.models import vllm_model
    from oasiskv_runtime.vllm.version import check_vllm_version

    check_vllm_version()
    import vllm
    from vllm.platforms import current_platform

    on_cuda = device.startswith("cuda")
    if on_cuda != bool(current_platform.is_cuda()):
        raise ValueError(f"the run is on {device}, and this vLLM build runs on "
                         f"{'CUDA' if current_platform.is_cuda() else 'the CPU'}")
    with tempfile.TemporaryDirectory(prefix="oasisbench-model-") as root:
        model = vllm_model(model_name, Path(root))
        kwargs = {**llm_kwargs, **model.llm_kwargs}
        if plugin is not None:
            from oasiskv_runtime.vllm import engine_args

            kwargs.update(engine_args(**plugin, platform="cuda" if on_cuda else "cpu"))
        status.update(phase="starting vLLM", force=True)
        llm = vllm.LLM(model=str(model.path), skip_tokenizer_init=True, **kwargs)
        try:
            yield llm, vllm, model
        finally:
            llm.llm_engine.engine_core.shutdown()


def counter(llm: Any, name: str) -> int:
    """A Prometheus counter of vLLM's, summed over engines (it lives as long as the process: take differences)."""
    return sum(int(m.value) for m in llm.get_metrics() if m.name == name)


class EngineCounters:
    """vLLM's and the plug-in's counters from now on: construct it before a timed run (it zeroes the host pool's
    counters), call :meth:`since` after. ``plugin``: the run's ``engine_args`` arguments (None: plain vLLM)."""

    def __init__(self, llm: Any, plugin: dict[str, Any] | None, fresh: bool = False) -> None:
        """``fresh``: no step has run yet (every counter is still zero, and the host pool's runtime does not exist
        before the first step: nothing to read or zero)."""
        import functools

        from oasiskv_runtime.config import Mode
        from oasiskv_runtime.vllm import spec_decode_counts
        from oasiskv_runtime.vllm.backend import collect_stats, configure

        self.llm, self.plugin = llm, plugin
        self.host_pool = plugin is not None and Mode(plugin["mode"]).uses_host_pool
        if self.host_pool and not fresh:
            llm.apply_model(functools.partial(configure, reset=True))
        self.ours = plugin is not None and plugin["mode"] != Mode.DENSE.value  # dense + draft: vLLM's own only
        self.layers = llm.apply_model(collect_stats)[0] if self.ours and not fresh else {}
        self.spec, self.preempted = spec_decode_counts(llm), counter(llm, "vllm:num_preemptions")

    def since(self) -> dict[str, Any]:
        """Preemptions; with a draft its acceptance; with the plug-in its layer counters and host-pool figures."""
        from oasiskv_runtime.vllm import acceptance, spec_decode_counts
        from oasiskv_runtime.vllm.backend import collect_stats

        stats: dict[str, Any] = {"num_preemptions": counter(self.llm, "vllm:num_preemptions") - self.preempted,
                                 "fetched_blocks_per_step": 0.0, "fetched_bytes_per_step": 0.0,
                                 "deferred_blocks_per_step": 0.0}
        if self.plugin is not None and self.plugin["draft"] != "none":
            acc = acceptance(self.spec, spec_decode_counts(self.llm))
            stats.update(draft_accuracy=acc["acceptance_rate"], spec_decode_acceptance_rate=acc["acceptance_rate"],
                         tokens_per_step=acc["tokens_per_step"], num_drafts=acc["drafts"])
        if self.ours:
            layers = self.llm.apply_model(collect_stats)[0]
            stats.update({k: layers[k] - self.layers.get(k, 0) for k in LAYER_STATS})
            if self.host_pool:
                stats.update({k: layers["oasiskv"].get(k) for k in HOST_POOL_STATS})
        return stats
