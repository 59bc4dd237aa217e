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

from oasisbench.results.schema import MODES, Record, Run, metric_value, normalize_value, order_modes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
RUNNING_BATCH_PNG = "running_batch_vs_concurrency.png"
TPOT_PNG = "tpot_vs_concurrency.png"
ROOFLINE_PNG = "roofline.png"

#: (file name, metric, y label) of the per-concurrency line plots.
LINE_PLOTS: tuple[tuple[str, str, str], ...] = (
    (THROUGHPUT_PNG, "output_throughput", "output throughput (tok/s)"),
    (RUNNING_BATCH_PNG, "max_running_batch", "max running batch (requests)"),
    (TPOT_PNG, "median_tpot_ms", "median TPOT (ms)"),
)

# One fixed color per mode so every plot of every run reads the same way.
_MODE_COLORS = dict(zip(MODES, ("tab:gray", "tab:blue", "tab:red", "tab:orange", "tab:green"), strict=True))
_EXTRA_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


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
    """Stable color for a mode; unknown modes cycle through spare colors."""
    if mode in _MODE_COLORS:
        return _MODE_COLORS[mode]
    extras = [m for m in all_modes if m not in _MODE_COLORS]
    return _EXTRA_COLORS[extras.index(mode) % len(_EXTRA_COLORS)] if mode in extras else "black"


def _varying_keys(records: list[Record], exclude: set[str]) -> list[str]:
    """Point keys whose value differs between records: the ones a legend must name."""
    keys = sorted({k for r in records for k in r["point"]} - exclude)
    return [k for k in keys if len({repr(normalize_value(r["point"].get(k))) for r in records}) > 1]


def _title(run: Run, what: str) -> str:
    title = f"{run.suite} / {run.run_id}: {what}"
    # Random-weight runs measure the runtime, not the model: say so on the figure itself, since PNGs
    # get pasted into slides without the report around them.
    return title + " [RANDOM WEIGHTS]" if run.env.get("random_weights") else title


def _save(fig: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    # Fixed margins instead of tight/constrained layout: those re-draw the figure to measure it, which
    # doubles the cost of every plot in a report over a long sweep.
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.11, top=0.92)
    fig.savefig(path, dpi=100)
    return path


def plot_metric_vs_concurrency(run: Run, metric: str, ylabel: str, path: Path) -> Path | None:
    """One line per (mode, context_len, other varying point keys) of ``metric`` against concurrency.

    Returns None, writing nothing, when no record has the metric.
    """
    records = [r for r in run.records if metric_value(r, metric) is not None]
    if not records:
        return None
    modes = order_modes({r["point"]["mode"] for r in records})
    contexts = sorted({int(r["point"]["context_len"]) for r in records})
    extra_keys = _varying_keys(records, {"mode", "context_len", "concurrency"})

    series: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    for r in records:
        p = r["point"]
        key = (p["mode"], int(p["context_len"]), *(repr(normalize_value(p.get(k))) for k in extra_keys))
        series.setdefault(key, []).append((float(p["concurrency"]), metric_value(r, metric) or 0.0))

    fig = _new_figure(8, 5)
    ax = fig.add_subplot()
    for key in sorted(series, key=lambda k: (modes.index(k[0]), *k[1:])):
        mode, ctx = key[0], key[1]
        xs = [x for x, _ in sorted(series[key])]
        ys = [y for _, y in sorted(series[key])]
        extras = zip(extra_keys, key[2:], strict=True)
        label = f"{mode} ctx={ctx}" + "".join(f" {k}={v}" for k, v in extras if v != "None")
        ax.plot(
            xs,
            ys,
            color=mode_color(mode, modes),
            linestyle=_LINESTYLES[contexts.index(ctx) % len(_LINESTYLES)],
            marker=_MARKERS[contexts.index(ctx) % len(_MARKERS)],
            label=label,
        )
    # Concurrency sweeps are usually powers of two; log2 spacing keeps 1..256 readable.
    concurrencies = sorted({float(r["point"]["concurrency"]) for r in records})
    if len(concurrencies) > 1 and concurrencies[0] > 0 and concurrencies[-1] / concurrencies[0] >= 8:
        ax.set_xscale("log", base=2)
        # Label the measured concurrencies themselves (1, 4, 16), not 2^0, 2^2, 2^4.
        ax.set_xticks(concurrencies, labels=[f"{c:g}" for c in concurrencies])
        ax.xaxis.set_minor_formatter("")
    ax.set_xlabel("concurrency (requests)")
    ax.set_ylabel(ylabel)
    ax.set_title(_title(run, metric), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
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


def plot_roofline(run: Run, path: Path) -> Path | None:
    """The paper's Fig. 1: output throughput against token-KV intensity, log-log, one dot per record,
    colored by mode, marker by context length. Returns None when no record has both values."""
    points: list[tuple[str, int, float, float]] = []
    for r in run.records:
        x, y = roofline_intensity(r), metric_value(r, "output_throughput")
        if x is not None and y is not None and y > 0:
            points.append((r["point"]["mode"], int(r["point"]["context_len"]), x, y))
    if not points:
        return None
    modes = order_modes({p[0] for p in points})
    contexts = sorted({p[1] for p in points})

    fig = _new_figure(7, 5)
    ax = fig.add_subplot()
    for mode in modes:
        for ctx in contexts:
            sel = [(x, y) for m, c, x, y in points if m == mode and c == ctx]
            if sel:
                xs, ys = [x for x, _ in sel], [y for _, y in sel]
                ax.scatter(
                    xs,
                    ys,
                    color=mode_color(mode, modes),
                    marker=_MARKERS[contexts.index(ctx) % len(_MARKERS)],
                    label=f"{mode} ctx={ctx}",
                    alpha=0.85,
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    # Minor tick labels on a log axis spanning less than a decade overlap into a smear.
    ax.xaxis.set_minor_formatter("")
    ax.yaxis.set_minor_formatter("")
    ax.set_xlabel("token-KV intensity (output tokens per resident KV byte per step)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title(_title(run, "throughput vs token-KV intensity"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
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
    written = [plot_metric_vs_concurrency(run, metric, ylabel, target / name) for name, metric, ylabel in LINE_PLOTS]
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
