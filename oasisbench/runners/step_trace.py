"""Where the time of end-to-end steps goes: torch.profiler over a window of a throughput point's engine steps,
reported per step kind (prefill-carrying vs decode-only).

``oasisbench run SUITE --trace-steps START:COUNT`` (and ``throughput --trace-steps``) profiles engine steps
START .. START+COUNT-1 of every point it runs and appends a text summary to ``traces.txt`` in the run directory.
Each step runs inside a ``torch.profiler.record_function`` range; a GPU kernel belongs to the step whose host range
holds its launch (the CUDA runtime call with the kernel's correlation id; a graph replay's kernels correlate to
the replay's launch). Per kind the summary gives: steps, host wall time per step, the GPU's busy time (union of
kernel intervals) and summed kernel time per step, kernels per step by stream, the top kernels, and the host's
blocking CUDA calls (synchronisations and synchronous copies) with the time the host spent in them: where a step
waits for the GPU, and the GPU, idle, waits for the host.

:func:`trace_lines` summarises a whole profiled window the same way without the split (the decode and prefill
bench scripts use it). The profiler adds host overhead to the profiled steps: compare kinds and kernels, not the
window's wall time with an unprofiled run.
"""
from __future__ import annotations

import bisect
import contextlib
import cProfile
import gzip
import json
import os
import pstats
import tempfile
from typing import Any, Iterator

#: The record_function name of a profiled step; its kind is kept beside it, in step order.
STEP_RANGE = "oasisbench::step"
#: Packages whose functions :func:`python_lines` also ranks by cumulative time (where a step's host time goes).
OUR_PACKAGES = ("oasiskv_runtime", "oasisbench")
#: How many of the top own-time functions :func:`python_lines` lists with their callers.
CALLER_ROWS = 4
#: How many of our top functions by cumulative time :func:`python_lines` lists with their callees.
CALLEE_ROWS = 8
#: Host CUDA runtime calls that block until the GPU (or a copy) is done.
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                  "cudaMemcpy2D", "cudaMemset", "cudaFree", "cudaFreeHost")
#: Profiler categories of host-side CUDA API calls (runtime and driver).
API_CATS = ("cuda_runtime", "cuda_driver")
#: How many CUDA API calls the per-kind line names.
API_ROWS = 8


#: A ``--trace-steps`` value parsed: (start, count) windows, in step order, not overlapping.
Windows = tuple[tuple[int, int], ...]


def parse_window(spec: str | None) -> Windows | None:
    """``"START:COUNT[,START:COUNT...]"`` -> ((start, count), ...) in step order; None or "" -> None. Raises
    ValueError naming the format, or the windows that overlap."""
    if not spec:
        return None
    out = []
    for part in spec.split(","):
        try:
            start, count = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--trace-steps takes START:COUNT (engine steps, e.g. 40:30; several comma-separated), "
                             f"got {spec!r}") from None
        if start < 0 or count < 1:
            raise ValueError(f"--trace-steps START:COUNT needs START >= 0 and COUNT >= 1, got {spec!r}")
        out.append((start, count))
    out.sort()
    for (a, n), (b, _) in zip(out, out[1:]):
        if a + n > b:
            raise ValueError(f"--trace-steps windows overlap: {a}:{n} and the one starting at {b}")
    return tuple(out)


def window_label(windows: Windows) -> str:
    """The canonical ``START:COUNT,...`` text of parsed windows (what a traced record is marked with)."""
    return ",".join(f"{a}:{n}" for a, n in windows)


def _events(prof, raw_copy: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
        if raw_copy is not None and not os.path.exists(raw_copy):
            with open(raw, "rb") as f, gzip.open(raw_copy, "wb") as g:
                g.write(f.read())
    return [e for e in trace.get("traceEvents", []) if "dur" in e and "ts" in e]


def _stream(e: dict) -> Any:
    return e.get("args", {}).get("stream", "?")


def _tally(events: list[dict], key) -> list[tuple[Any, int, float]]:
    """(key, count, summed duration in us) per value of ``key``, longest first."""
    out: dict = {}
    for e in events:
        c = out.setdefault(key(e), [0, 0.0])
        c[0] += 1
        c[1] += e["dur"]
    return sorted(((k, n, d) for k, (n, d) in out.items()), key=lambda x: -x[2])


def _busy(kernels: list[dict]) -> float:
    """Union of the kernels' intervals, us."""
    busy, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        a, b = max(e["ts"], end), e["ts"] + e["dur"]
        if b > a:
            busy += b - a
        end = max(end, b)
    return busy


def _kernel_lines(kernels: list[dict], steps: int, rows: int) -> list[str]:
    lines = [f"  stream {sid}: {n / steps:.0f} kernels/step, {d / 1e3 / steps:.2f} ms/step"
             for sid, n, d in _tally(kernels, _stream)]
    for (name, sid), n, d in _tally(kernels, lambda e: (e["name"][:70], _stream(e)))[:rows]:
        lines.append(f"  {d / 1e3 / steps:7.2f} ms/step {n / steps:6.0f}/step  stream {sid}  {name}")
    return lines


def trace_lines(prof, title: str, steps: int, rows: int = 12, raw_copy: str | None = None) -> list[str]:
    """What the GPU did under ``prof`` (a finished torch.profiler run over ``steps`` steps, graph replays
    included): kernels per stream, the union of their busy time against the wall window (the rest: the GPU waits
    on launches, events or the host), and the top kernels by total time, each with its stream. ``raw_copy``: a
    .json.gz path the raw trace is written to (once: an existing file is kept)."""
    kernels = [e for e in _events(prof, raw_copy) if e.get("cat") == "kernel"]
    lines = [f"==== {title}: {steps} steps as they run, {len(kernels)} kernels"]
    if not kernels:
        return lines
    t0 = min(e["ts"] for e in kernels)
    t1 = max(e["ts"] + e["dur"] for e in kernels)
    busy, summed = _busy(kernels), sum(e["dur"] for e in kernels)
    lines.append(f"window {(t1 - t0) / 1e3 / steps:.2f} ms/step, some kernel running {busy / 1e3 / steps:.2f} "
                 f"ms/step ({100 * busy / (t1 - t0):.0f}%), kernel time summed {summed / 1e3 / steps:.2f} ms/step")
    return lines + _kernel_lines(kernels, steps, rows)


def _op_label(e: dict) -> str:
    """An operator and the shapes of its tensor inputs (``record_shapes``), e.g. ``aten::copy_ [8192,8,128] [...]``."""
    dims = " ".join(str(d).replace(" ", "") for d in e.get("args", {}).get("Input Dims", []) if d)
    return f"{e['name']} {dims}"[:110].rstrip()


def step_kind_lines(events: list[dict], kinds: list[str], title: str, rows: int = 10) -> list[str]:
    """The per-kind summary (module docstring) of profiler ``events`` whose ``STEP_RANGE`` ranges are the steps
    of ``kinds`` (one kind per step, in order)."""
    # the host ranges only: on CUDA each range also appears on the GPU timeline ("gpu_user_annotation", once per
    # stream it launched on)
    ranges = sorted((e for e in events if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation"),
                    key=lambda e: e["ts"])
    lines = [f"==== {title}: {len(ranges)} profiled steps"]
    if len(ranges) != len(kinds):
        return lines + [f"  (step ranges {len(ranges)} != steps {len(kinds)}: not attributed)"]
    starts = [e["ts"] for e in ranges]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= ranges[i]["ts"] + ranges[i]["dur"] else None

    # kernels launched through the driver API (cuBLASLt's GEMMs: cuLaunchKernelEx) correlate to "cuda_driver"
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in API_CATS and "correlation" in e.get("args", {})}
    per_step_kernels: list[list[dict]] = [[] for _ in ranges]
    for e in events:
        if e.get("cat") != "kernel":
            continue
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        i = step_of(ts) if ts is not None else None
        if i is not None:
            per_step_kernels[i].append(e)
    ops = {e["args"]["External id"]: _op_label(e) for e in events
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    per_step_api: list[list[dict]] = [[] for _ in ranges]
    for e in events:
        if e.get("cat") in API_CATS:
            i = step_of(e["ts"])
            if i is not None:
                per_step_api[i].append(e)
    for kind in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        n = len(idx)
        wall = sum(ranges[i]["dur"] for i in idx)
        kernels = [e for i in idx for e in per_step_kernels[i]]
        busy = sum(_busy(per_step_kernels[i]) for i in idx)
        summed = sum(e["dur"] for e in kernels)
        lines.append(f"-- {kind}: {n} steps, host wall {wall / 1e3 / n:.2f} ms/step, GPU busy {busy / 1e3 / n:.2f} "
                     f"ms/step ({100 * busy / wall if wall else 0:.0f}% of the wall), kernel time summed "
                     f"{summed / 1e3 / n:.2f} ms/step, {len(kernels) / n:.0f} kernels/step")
        api = [e for i in idx for e in per_step_api[i]]
        for name, cnt, d in _tally([e for e in api if e["name"] in BLOCKING_CALLS], lambda e: e["name"]):
            lines.append(f"  host blocked in {name}: {cnt / n:.1f}/step, {d / 1e3 / n:.2f} ms/step")
        # every CUDA API call by the host's time in it: a launch that waits for a full queue, an allocation
        # that frees cached memory (cudaFree synchronises the device), a copy from pageable memory
        calls = _tally(api, lambda e: e["name"])
        lines.append(f"  host in CUDA API calls: {sum(d for _, _, d in calls) / 1e3 / n:.2f} ms/step; "
                     + ", ".join(f"{name} {cnt / n:.0f}x {d / 1e3 / n:.2f} ms" for name, cnt, d in calls[:API_ROWS]))
        # ... and by the operator that made them (its input shapes tell e.g. a pool copy from a sampled-token read)
        for (name, op), cnt, d in _tally(api, lambda e: (e["name"], ops.get(e.get("args", {}).get("External id"),
                                                                            "(no op)")))[:API_ROWS]:
            lines.append(f"    {d / 1e3 / n:7.2f} ms/step {cnt / n:6.1f}/step  {name} in {op}")
        if kernels:
            lines += _kernel_lines(kernels, n, rows)
    return lines


def python_lines(stats: dict[str, pstats.Stats], steps: dict[str, int], rows: int = 15) -> list[str]:
    """Per step kind, the Python functions with the most own time (cProfile's tottime) over that kind's profiled
    steps, per step: own ms, cumulative ms, calls. cProfile adds overhead to every Python call, so read shares
    and call counts, not absolute times. On Python 3.12 its events come from every thread (seen on the H200: the
    progress bar's refresh thread, waiting in ``threading.wait``, appears as ``_thread.lock.acquire`` and inside
    unrelated callers' lists): ignore rows of threads that are not the engine's."""
    lines = []
    for kind in sorted(stats):
        n = max(steps.get(kind, 1), 1)
        st = stats[kind].stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
        total = sum(v[2] for v in st.values())
        lines.append(f"-- {kind}: Python own time {total * 1e3 / n:.2f} ms/step under cProfile; top by own time:")

        def where(key) -> str:
            file, line, name = key
            return f"{name}  {os.path.basename(os.path.dirname(file))}/{os.path.basename(file)}:{line}" if line \
                else f"{name}  {file}"

        def row(item) -> str:
            key, (_cc, nc, tt, ct, _callers) = item
            return f"  {tt * 1e3 / n:7.2f} own {ct * 1e3 / n:8.2f} cum ms/step {nc / n:8.0f} calls/step  {where(key)}"

        for i, item in enumerate(sorted(st.items(), key=lambda kv: -kv[1][2])[:rows]):
            lines.append(row(item))
            if i < CALLER_ROWS:  # who spends the top own times: a wait's caller says what it waits for
                callers = sorted(item[1][4].items(), key=lambda kv: -kv[1][2])[:3]
                lines += [f"            {c[2] * 1e3 / n:7.2f} ms/step from {where(k)}" for k, c in callers]
        ours = [it for it in st.items() if any(f"{os.sep}{pkg}{os.sep}" in it[0][0] for pkg in OUR_PACKAGES)]
        lines.append(f"-- {kind}: our functions by cumulative time, the first {CALLEE_ROWS} with what they call:")
        callees = _callees(st)
        for i, item in enumerate(sorted(ours, key=lambda kv: -kv[1][3])[:rows]):
            lines.append(row(item))
            if i < CALLEE_ROWS:
                top = sorted(callees.get(item[0], {}).items(), key=lambda kv: -kv[1])[:6]
                lines += [f"            {ct * 1e3 / n:7.2f} ms/step in {where(k)}" for k, ct in top]
    return lines


def _callees(st: dict) -> dict:
    """caller -> {callee: cumulative time of the callee's calls from that caller}, from pstats' caller lists."""
    out: dict = {}
    for callee, (_cc, _nc, _tt, _ct, callers) in st.items():
        for caller, c in callers.items():
            out.setdefault(caller, {})[callee] = c[3]
    return out


@contextlib.contextmanager
def traced_steps(engine: Any, windows: Windows | None, title: str, path: str | os.PathLike) -> Iterator[None]:
    """Within this context, profile ``engine``'s steps in ``windows`` ((start, count) each, counted from the
    context's first step), one profiler per window; at exit append each window's :func:`step_kind_lines` and
    :func:`python_lines` to ``path`` (exporting and reading a trace takes seconds to minutes: time the run inside
    the context, as :func:`run_point` does). No windows: nothing is changed."""
    if not windows:
        yield
        return
    import torch

    step = engine.step
    n_step = [0]
    # per window: its torch profiler (None until its first step), the kind of each of its steps, Python stats
    traces: list[dict[str, Any]] = [{"prof": None, "kinds": [], "py": {}, "stopped": False, "events": None}
                                    for _ in windows]
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)

    def stop(tr: dict, more: bool = False) -> None:
        """End a profiled window (its trace is summarised at the context's exit, outside the timed run). ``more``:
        another window follows, whose profiler would reset the GPU activity buffers this one's trace still refers
        to (seen on the H200: an earlier window of a run came back with no kernels), so its events are read now,
        inside the timed run (the point is marked traced anyway)."""
        if tr["prof"] is None or tr["stopped"]:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        tr["prof"].__exit__(None, None, None)
        tr["stopped"] = True
        if more:
            tr["events"], tr["prof"] = _events(tr["prof"]), None  # keep the events, let the profiler's buffers go

    def report() -> None:
        for (start, count), tr in zip(windows, traces):
            stop(tr)
            if tr["events"] is None:
                if tr["prof"] is None:
                    continue  # the window was never reached
                tr["events"] = _events(tr["prof"])
            kinds = tr["kinds"]
            label = f"{title} steps {start}-{start + count - 1}" if len(windows) > 1 else title
            lines = step_kind_lines(tr["events"], kinds, label)
            lines += python_lines(tr["py"], {k: kinds.count(k) for k in set(kinds)})
            with open(path, "a") as f:
                f.write("\n".join(lines) + "\n\n")

    def traced_step():
        i = n_step[0]
        n_step[0] += 1
        w = next((j for j, (a, n) in enumerate(windows) if a <= i < a + n), None)
        if w is None:
            return step()
        tr = traces[w]
        if tr["prof"] is None:
            tr["prof"] = torch.profiler.profile(activities=acts, record_shapes=True)
            tr["prof"].__enter__()
        before = engine.stats.num_prefill_steps
        py = cProfile.Profile()
        with torch.profiler.record_function(STEP_RANGE):
            py.enable()
            try:
                out = step()
            finally:
                py.disable()
        kind = "prefill-carrying" if engine.stats.num_prefill_steps > before else "decode-only"
        tr["kinds"].append(kind)
        if kind in tr["py"]:
            tr["py"][kind].add(py)
        else:
            tr["py"][kind] = pstats.Stats(py)
        if i == windows[w][0] + windows[w][1] - 1:
            stop(tr, more=w + 1 < len(windows))
        return out

    engine.step = traced_step
    try:
        yield
    finally:
        del engine.step  # the instance attribute: the class method shows through again
        report()
