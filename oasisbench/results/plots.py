"""PNG plots of one run: throughput, running batch and TPOT against concurrency, and the roofline.

Figures are drawn through ``FigureCanvasAgg`` directly rather than pyplot: no global backend switch
(other code in the process may use pyplot interactively) and no figure registry to leak memory in long
sweeps. A plot whose metrics no record carries is skipped, not drawn empty. matplotlib is the optional
``plots`` extra (the GPU machine lacks it), so it is imported only when drawing: reports, compare and gate
work without it.

Example::

    paths = write_plots(load_run(Path("results/throughput-smoke/20261129-101500-ab12")))
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oasisbench.results.schema import (MODES, Record, Run, label_mode, metric_value, normalize_value, order_modes,
                                       series_label)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
RUNNING_BATCH_PNG = "running_batch_vs_concurrency.png"
TPOT_PNG = "tpot_vs_concurrency.png"
ROOFLINE_PNG = "roofline.png"

#: (file name, metric, y label, title) of the per-concurrency line plots.
LINE_PLOTS: tuple[tuple[str, str, str, str], ...] = (
    (THROUGHPUT_PNG, "output_throughput", "output throughput (tokens/s)", "output throughput"),
    (RUNNING_BATCH_PNG, "max_running_batch", "most requests decoding at once", "requests the KV budget admitted"),
    (TPOT_PNG, "median_tpot_ms", "median time per output token (ms)", "time per output token"),
)

# One fixed color and marker per mode so every plot of every run reads the same way. The baseline is drawn
# last, small and filled, over the hollow markers of the other modes: equal values show both, never one. A mode on
# vLLM (label ``vllm:<mode>``) keeps its mode's color with a marker of its own, so an engine's points are told apart
# by shape and a mode's by color.
_MODE_COLORS = dict(zip(MODES, ("tab:gray", "tab:blue", "tab:red", "tab:orange", "tab:green"), strict=True))
_MODE_MARKERS = dict(zip(MODES, ("o", "s", "^", "D", "X"), strict=True))
_EXTRA_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
_LINESTYLES = ("-", "--", ":", "-.")
_ENGINE_MARKERS = {"vllm": "v"}


def plots_available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def mode_color(mode: str, all_modes: list[str]) -> str:
    """Stable color for a mode label (:func:`series_label`: a mode's color on every engine); unknown modes cycle
    through spare colors."""
    if label_mode(mode) in _MODE_COLORS:
        return _MODE_COLORS[label_mode(mode)]
    extras = [m for m in all_modes if m not in _MODE_COLORS]
    return _EXTRA_COLORS[extras.index(mode) % len(_EXTRA_COLORS)] if mode in extras else "black"


def _mode_style(mode: str, all_modes: list[str]) -> dict[str, Any]:
    """Line and marker keywords of one mode label: dense small, filled and on top; the others larger and hollow."""
    color = mode_color(mode, all_modes)
    rank = all_modes.index(mode) if mode in all_modes else len(all_modes)
    base = mode == "dense"
    engine = mode.rpartition(":")[0]
    marker = _ENGINE_MARKERS.get(engine, "P") if engine else _MODE_MARKERS.get(mode, "P")
    return dict(color=color, marker=marker, markersize=6 if base else 10,
                markerfacecolor=color if base else "none", markeredgewidth=1.5, linewidth=2.2 if base else 1.6,
                zorder=10 - rank if not base else 20)


def _series_keys(records: list[Record]) -> list[str]:
    """Point keys that tell two series of one mode apart: those taking more than one value among the records of
    one (mode, context_len, concurrency). Keys that only follow the concurrency (``num_requests`` defaults to it)
    or only differ between modes (sparse settings dense does not have) would split each mode's line into dots."""
    groups: dict[tuple[Any, ...], list[Record]] = {}
    for r in records:
        p = r["point"]
        groups.setdefault((series_label(p), int(p["context_len"]), p["concurrency"]), []).append(r)
    keys = sorted({k for r in records for k in r["point"]} - {"mode", "engine", "context_len", "concurrency"})
    return [k for k in keys
            if any(len({repr(normalize_value(r["point"].get(k))) for r in g}) > 1 for g in groups.values())]


def _title(run: Run, what: str) -> str:
    title = f"{what}\n{run.suite} / {run.run_id}"
    # Random-weight runs measure the runtime, not the model: say so on the figure itself, since PNGs
    # get pasted into slides without the report around them.
    return title + " [RANDOM WEIGHTS]" if run.env.get("random_weights") else title


def _save(fig: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    # Fixed margins instead of tight/constrained layout: those re-draw the figure to measure it, which
    # doubles the cost of every plot in a report over a long sweep.
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.84, wspace=0.25)
    fig.savefig(path, dpi=100)
    return path


def _ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else f"{ctx:,}"


def _concurrency_axis(ax: Any, concurrencies: list[float]) -> None:
    """Ticks at the measured concurrencies themselves (1, 4, 16), log2-spaced when they span 8x or more."""
    if len(concurrencies) > 1 and concurrencies[0] > 0 and concurrencies[-1] / concurrencies[0] >= 8:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_formatter("")
    ax.set_xticks(concurrencies, labels=[f"{c:g}" for c in concurrencies])
    ax.set_xlabel("concurrency (requests in flight)")


def plot_metric_vs_concurrency(run: Run, metric: str, ylabel: str, path: Path, what: str | None = None) -> Path | None:
    """``metric`` against concurrency: one panel per context length, one line per mode (and per value of any
    other key swept within a mode), one legend entry per line. Returns None, writing nothing, when no record
    has the metric."""
    records = [r for r in run.records if metric_value(r, metric) is not None]
    if not records:
        return None
    modes = order_modes({series_label(r["point"]) for r in records})
    contexts = sorted({int(r["point"]["context_len"]) for r in records})
    extra_keys = _series_keys(records)

    series: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    for r in records:
        p = r["point"]
        key = (series_label(p), int(p["context_len"]), *(repr(normalize_value(p.get(k))) for k in extra_keys))
        series.setdefault(key, []).append((float(p["concurrency"]), metric_value(r, metric) or 0.0))
    variants = sorted({k[2:] for k in series})

    fig = _new_figure(min(16, 4.5 + 3.5 * len(contexts)), 5)
    axes = [fig.add_subplot(1, len(contexts), i + 1) for i in range(len(contexts))]
    concurrencies = sorted({float(r["point"]["concurrency"]) for r in records})
    for ax, ctx in zip(axes, contexts, strict=True):
        for key in sorted(series, key=lambda k: (modes.index(k[0]), *k[2:])):
            if key[1] != ctx:
                continue
            mode, pts = key[0], sorted(series[key])
            label = mode + "".join(f" {k}={v}" for k, v in zip(extra_keys, key[2:], strict=True) if v != "None")
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=label,
                    linestyle=_LINESTYLES[variants.index(key[2:]) % len(_LINESTYLES)], **_mode_style(mode, modes))
        if metric == "max_running_batch":  # the ceiling: every request in flight admitted
            from matplotlib.ticker import MaxNLocator

            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.plot(concurrencies, concurrencies, color="black", linewidth=0.8, linestyle=":", zorder=1)
            ax.text(0.98, 0.02, "dotted: = concurrency (every request admitted)", transform=ax.transAxes,
                    ha="right", va="bottom", fontsize=8)
        _concurrency_axis(ax, concurrencies)
        ax.set_ylim(bottom=0)
        ax.set_title(f"context {ctx:,} tokens", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(ylabel)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:  # a line present only in a later panel still gets its one entry
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    axes[0].legend(handles, labels, fontsize=8)
    fig.suptitle(_title(run, what or metric), fontsize=10)
    return _save(fig, path)


def roofline_intensity(record: Record) -> float | None:
    """Token-KV intensity: output tokens per byte of resident KV read per decode step.

    A step emits ``B`` tokens (B = running batch) and reads ``B * resident_gpu_bytes_per_request``
    bytes of resident KV, so the batch cancels and the intensity is ``1 / resident_gpu_bytes_per_request``.
    Sparse modes raise it by reading a small working set; dense sits far left. None when unknown.
    """
    resident = metric_value(record, "resident_gpu_bytes_per_request")
    if resident is None or resident <= 0:
        return None
    return 1.0 / resident


def _log_axis(axis: Any, values: list[float]) -> None:
    """Plain-number tick labels on a log axis (1, 2, 5 x 10^n), so one spanning less than a decade is numbered
    too (the default leaves it with no label at all)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:.3g}"))
    axis.set_minor_formatter(NullFormatter())
    lo, hi = min(values), max(values)
    axis.axes.set_xlim(lo / 2, hi * 2) if axis is axis.axes.xaxis else axis.axes.set_ylim(lo / 2, hi * 2)


def plot_roofline(run: Run, path: Path) -> Path | None:
    """The paper's Fig. 1: output throughput against token-KV intensity, log-log, one point per record, one
    marker and color per mode (one legend entry each), every point labelled with its concurrency (and context
    length when the run has several). Returns None when no record has both values."""
    points: list[tuple[str, int, int, float, float]] = []
    for r in run.records:
        x, y = roofline_intensity(r), metric_value(r, "output_throughput")
        if x is not None and y is not None and y > 0:
            p = r["point"]
            points.append((series_label(p), int(p["context_len"]), int(p["concurrency"]), x * 2**30, y))
    if not points:
        return None
    modes = order_modes({p[0] for p in points})
    several_contexts = len({p[1] for p in points}) > 1

    fig = _new_figure(8, 5.5)
    ax = fig.add_subplot()
    for mode in modes:
        sel = [p for p in points if p[0] == mode]
        style = _mode_style(mode, modes)
        ax.plot([p[3] for p in sel], [p[4] for p in sel], linestyle="none", label=mode, **style)
        for _, ctx, conc, x, y in sel:
            text = f"c={conc}" + (f" {_ctx_label(ctx)}" if several_contexts else "")
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(7, -3 if mode == "dense" else 5),
                        fontsize=8, color=style["color"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    _log_axis(ax.xaxis, [p[3] for p in points])
    _log_axis(ax.yaxis, [p[4] for p in points])
    ax.set_xlabel("token-KV intensity (output tokens per GiB of resident KV read per step; = 1 / resident GiB "
                  "per request)", fontsize=9)
    ax.set_ylabel("output throughput (tokens/s)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, title="mode (points: c = concurrency)", title_fontsize=8)
    fig.suptitle(_title(run, "throughput vs token-KV intensity (right: a smaller working set per request)"),
                 fontsize=10)
    return _save(fig, path)


def write_plots(run: Run, out_dir: Path | None = None) -> list[Path]:
    """Write every plot the run's metrics allow into ``out_dir`` (default: the run directory).

    Returns the written paths; skipped plots are simply absent from the list, and without matplotlib
    the list is empty (with a warning).
    """
    if not plots_available():
        warnings.warn("matplotlib is not installed (pip install 'oasiskv[plots]'); plots skipped", stacklevel=2)
        return []
    target = Path(out_dir) if out_dir is not None else run.path
    if target is None:
        raise ValueError("run has no directory; pass out_dir")
    target.mkdir(parents=True, exist_ok=True)
    written = [plot_metric_vs_concurrency(run, metric, ylabel, target / name, what)
               for name, metric, ylabel, what in LINE_PLOTS]
    written.append(plot_roofline(run, target / ROOFLINE_PNG))
    return [p for p in written if p is not None]


PD_BANDWIDTH_PNG = "pd_bandwidth.png"
PD_BYTES_PNG = "pd_bytes_per_request.png"


def write_pd_plots(run_dir: Path, records: list[Record]) -> list[Path]:
    """``oasisbench pd``: the KV-read bandwidth timeline of every point (from its timeline-*.json), and the
    bytes each request moved at admission and during decode per (mode, transfer, context)."""
    import json

    out = []
    series = sorted(Path(run_dir).glob("timeline-*.json"))
    if series:
        fig = _new_figure(8, 4)
        ax = fig.add_subplot(1, 1, 1)
        for path in series:
            pts = json.loads(path.read_text())
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=path.stem.removeprefix("timeline-"))
        ax.set_xlabel("seconds since the point's first KV read (50 ms bins)")
        ax.set_ylabel("KV read bandwidth (GB/s)")
        ax.set_title("prefill -> decode KV traffic")
        ax.legend(fontsize="small")
        out.append(_save(fig, Path(run_dir) / PD_BANDWIDTH_PNG))
    rows = [r for r in records if metric_value(r, "admission_bytes_per_request") is not None]
    if rows:
        fig = _new_figure(8, 4)
        ax = fig.add_subplot(1, 1, 1)
        labels = [f"{r['point']['mode']}\n{r['point']['transfer']} {r['point']['context_len']}" for r in rows]
        adm = [metric_value(r, "admission_bytes_per_request") / 2**20 for r in rows]
        dec = [(metric_value(r, "decode_fetch_bytes_per_request") or 0) / 2**20 for r in rows]
        xs = range(len(rows))
        ax.bar(xs, adm, label="at admission")
        ax.bar(xs, dec, bottom=adm, label="during decode (RPF misses)")
        ax.set_xticks(list(xs), labels, fontsize="small")
        ax.set_ylabel("MiB per request")
        ax.set_title("KV bytes moved per request")
        ax.legend(fontsize="small")
        out.append(_save(fig, Path(run_dir) / PD_BYTES_PNG))
    return out
