"""Markdown reports: one run (:func:`render_report`) and two runs side by side (:func:`compare_runs`).

Example::

    run = load_run(Path("results/throughput-smoke/20261129-101500-ab12"))
    (run.path / "report.md").write_text(render_report(run))
    print(compare_runs(baseline_run, run))
"""

from __future__ import annotations

from typing import Any

from oasisbench.results.plots import LINE_PLOTS, ROOFLINE_PNG
from oasisbench.results.schema import (
    SPARSE_ONLY_POINT_KEYS,
    Record,
    Run,
    metric_value,
    normalize_value,
    point_id,
    series_label,
)

#: (metric, column header) of the per-context tables; bytes are shown in MiB to stay readable.
REPORT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("completed", "done"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("max_running_batch", "max batch"),
    ("max_admitted_batch", "admitted"),
    ("fetched_bytes_per_step", "fetch MiB/step"),
    ("prediction_recall", "recall"),
    ("spec_decode_acceptance_rate", "accepted %"),
    ("tokens_per_step", "tok/step"),
    ("peak_device_memory_bytes", "peak MiB"),
    # oasisbench pd
    ("admission_bytes_per_request", "admit MiB/req"),
    ("decode_fetch_bytes_per_request", "decode-fetch MiB/req"),
    ("decode_host_bytes_per_request", "decode-host MiB/req"),
    ("admission_reduction", "full/admit"),
    ("prefix_hit_tokens_per_request", "prefix hit tok/req"),
    ("duplicate_block_reads", "dup reads"),
)
_PERCENT_METRICS = {"spec_decode_acceptance_rate"}
_MIB_METRICS = {"fetched_bytes_per_step", "peak_device_memory_bytes", "resident_gpu_bytes_per_request",
                "admission_bytes_per_request", "decode_fetch_bytes_per_request", "decode_host_bytes_per_request"}

#: Metrics :func:`compare_runs` tabulates by default.
COMPARE_METRICS: tuple[str, ...] = (
    "output_throughput",
    "median_tpot_ms",
    "median_ttft_ms",
    "max_running_batch",
    "max_admitted_batch",
    "fetched_bytes_per_step",
    "prediction_recall",
    "total_output_tokens",
)


def fmt_number(value: Any) -> str:
    """Compact cell text: ``–`` for missing, ints as-is, floats to about four significant digits."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    return str(value)


def _cell(record: Record | None, metric: str) -> str:
    if record is None:
        return "–"
    number = metric_value(record, metric)
    if metric in _MIB_METRICS and number is not None:
        return fmt_number(number / 2**20)
    if metric in _PERCENT_METRICS and number is not None:  # 0.9998 is not "1"
        return f"{100 * number:.2f}"
    return fmt_number(record["metrics"].get(metric))


def _ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den == 0:
        return "–"
    return f"{num / den:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _sort_value(value: Any) -> tuple[int, float, str]:
    """Sort key mixing numbers (numerically, so 4096 after 512) and other values (by text)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, repr(value))


def _varying_keys(records: list[Record], exclude: set[str]) -> list[str]:
    keys = sorted({k for r in records for k in r["point"]} - exclude)
    return [k for k in keys if len({repr(normalize_value(r["point"].get(k))) for r in records}) > 1]


def _env_lines(run: Run) -> list[str]:
    env = run.env
    lines = []
    if env.get("random_weights"):
        lines += ["> **RANDOM WEIGHTS**: this run used random weights; throughput and memory are real, "
                  "recall and accuracy say nothing about the model.", ""]
    lines.append(f"- run id: `{run.run_id}`")
    fields = (
        ("commit", "git_commit"),
        ("device", "device"),
        ("model", "model"),
        ("host", "hostname"),
        ("created", "created_at"),
        ("python", "python"),
        ("torch", "torch"),
        ("transformers", "transformers"),
    )
    lines += [f"- {label}: `{env[key]}`" for label, key in fields if env.get(key) not in (None, "")]
    if not env:
        lines.append("- env: unknown (no env.json)")
    return lines


def ratio_rows(run: Run, numerator: str, denominator: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ``numerator / denominator`` mode table.

    Records pair up on every point key except ``mode`` and the sparse-only settings (dense has no
    top-K), so each oasiskv variant is set against the dense record of the same context and concurrency.
    """
    pairs = _paired(run, numerator, denominator)
    dens = {id(n): d for n, d in pairs}
    nums = [n for n, _ in pairs]
    shown = ["context_len", "concurrency"] + _varying_keys(nums, {"mode", "engine", "context_len", "concurrency"})
    header = shown + [
        f"{numerator} tok/s",
        f"{denominator} tok/s",
        "throughput ratio",
        f"{numerator} max batch",
        f"{denominator} max batch",
        "batch ratio",
    ]
    rows = []
    for r in sorted(nums, key=lambda r: tuple(_sort_value(r["point"].get(k)) for k in shown)):
        d = dens[id(r)]
        rows.append(
            [fmt_number(r["point"].get(k)) for k in shown]
            + [_cell(r, "output_throughput"), _cell(d, "output_throughput")]
            + [_ratio(metric_value(r, "output_throughput"), metric_value(d, "output_throughput"))]
            + [_cell(r, "max_running_batch"), _cell(d, "max_running_batch")]
            + [_ratio(metric_value(r, "max_running_batch"), metric_value(d, "max_running_batch"))]
        )
    return header, rows


def _paired(run: Run, numerator: str, denominator: str) -> list[tuple[Record, Record]]:
    """(numerator record, denominator record) of every point both mode labels (:func:`series_label`) ran, matched
    as in :func:`ratio_rows` (the engine is part of the label, not of the match: ``oasiskv`` pairs with
    ``vllm:dense``)."""
    ignore = {"mode", "engine", "speculate", *SPARSE_ONLY_POINT_KEYS}

    def key(r: Record, budget: bool = True) -> str:
        return point_id({k: v for k, v in r["point"].items() if k not in ignore and (budget or k != "kv_cache_gb")})

    den_recs = [r for r in run.records if series_label(r["point"]) == denominator]
    dens = {key(r): r for r in den_recs}
    # A suite may give each mode its own device KV budget (paper-qwen3-8b-vllm: the plug-in's working sets sit beside
    # vLLM's cache, so its cache is smaller); such a point pairs with the one denominator point that differs only so.
    by_shape: dict[str, list[Record]] = {}
    for r in den_recs:
        by_shape.setdefault(key(r, budget=False), []).append(r)
    pairs = []
    for r in run.records:
        if series_label(r["point"]) != numerator:
            continue
        partner = dens.get(key(r))
        if partner is None:
            same_shape = by_shape.get(key(r, budget=False), [])
            partner = same_shape[0] if len(same_shape) == 1 else None
        if partner is not None:
            pairs.append((r, partner))
    return pairs


#: The ratio tables a report gives where both sides ran: OasisKV against dense on each engine, and the embedded
#: engine's OasisKV against plain vLLM (the baseline serving engineers compare with).
RATIO_PAIRS: tuple[tuple[str, str], ...] = (("oasiskv", "dense"), ("vllm:oasiskv", "vllm:dense"),
                                            ("vllm:oasiskv", "vllm:dense+ngram"), ("oasiskv", "vllm:dense"))


def ratio_pairs(run: Run) -> list[tuple[str, str]]:
    """The :data:`RATIO_PAIRS` with at least one point run on both sides."""
    return [(a, b) for a, b in RATIO_PAIRS if _paired(run, a, b)]


def _values(records: list[Record], key: str, spec: str | None = None) -> str:
    """The distinct values of a point key, in order, comma-separated."""
    vals = sorted({normalize_value(r["point"].get(key)) for r in records} - {None}, key=_sort_value)
    return ", ".join(format(v, spec) if spec else fmt_number(v) for v in vals)


def reading_lines(run: Run, numerator: str = "oasiskv", denominator: str = "dense") -> list[str]:
    """Three lines saying what the run compared, what the batch ratio shows and how to read the throughput ratio
    (printed at the end of ``oasisbench throughput`` and heading the report's ratio table). Empty when the run
    has no point that both modes ran."""
    pairs = _paired(run, numerator, denominator)
    if not pairs:
        return []
    recs = [r for pair in pairs for r in pair]
    gbs = {normalize_value(r["point"].get("kv_cache_gb")) for r in recs}
    nums, dens = [a for a, _ in pairs], [b for _, b in pairs]
    if gbs == {None}:
        budget = "the default device KV budget for each"
    elif len(gbs) == 1:
        budget = f"{_values(recs, 'kv_cache_gb', '.3g')} GiB of device KV for each"
    else:
        budget = (f"{_values(dens, 'kv_cache_gb', '.3g')} GiB of device KV for {denominator}, "
                  f"{_values(nums, 'kv_cache_gb', '.3g')} GiB for {numerator}")
    shape = f"{_values(recs, 'context_len')} tokens"
    if {r["point"].get("output_len") for r in recs} - {None}:
        shape += f", {_values(recs, 'output_len')} generated"
    compared = (f"Compared {denominator} and {numerator} on the same requests ({shape}; concurrency "
                f"{_values(recs, 'concurrency')}) with {budget}.")
    ok = [(a, b) for a, b in pairs if not a["metrics"].get("error") and not b["metrics"].get("error")]
    failed = f" {len(pairs) - len(ok)} point(s) failed in one mode: no ratio there." if len(ok) < len(pairs) else ""
    if not ok:
        return [compared, f"Capacity: no point ran in both modes.{failed}",
                "Nothing to compare: fix the failures above (e.g. a larger --kv-cache-gb) and run again."]

    def ratio(a: Record, b: Record, metric: str) -> float | None:
        va, vb = metric_value(a, metric), metric_value(b, metric)
        return va / vb if va is not None and vb else None

    # The point where the budget separated the modes most (the largest batch ratio, then the largest concurrency).
    a, b = max(ok, key=lambda ab: (ratio(*ab, "max_running_batch") or 0.0, ab[0]["point"]["concurrency"],
                                   ab[0]["point"]["context_len"]))
    batch_ratio = ratio(a, b, "max_running_batch")
    where = f"c={a['point']['concurrency']}" + (f", {fmt_number(a['point']['context_len'])} tokens"
                                                 if len({r['point']['context_len'] for r in recs}) > 1 else "")
    if batch_ratio is not None and batch_ratio <= 1.0 and numerator.startswith("vllm:"):
        capacity = (f"Capacity: at {where} {_cell(a, 'max_running_batch')} {numerator} and "
                    f"{_cell(b, 'max_running_batch')} {denominator} requests ran at once: the plug-in admits by "
                    f"working set, so its host pool's rows (host_pool_gb), max_num_seqs or scheduler_reserve_full_isl "
                    f"bounded it here, not the device budget.{failed}")
    elif batch_ratio is not None and batch_ratio > 1.0:
        capacity = (f"Capacity: at {where} the budget fit {_cell(b, 'max_running_batch')} {denominator} requests at "
                    f"once and {_cell(a, 'max_running_batch')} {numerator} ({batch_ratio:.2f}x): {numerator} keeps "
                    f"only a working set per request on the device.{failed}")
    else:
        capacity = (f"Capacity: the budget fit every request in both modes (1.00x): no capacity wall here; lower "
                    f"--kv-cache-gb or raise --concurrency to see one.{failed}")
    tput = ratio(a, b, "output_throughput")
    cpu = str(run.env.get("device") or "").startswith("cpu")
    bigger = batch_ratio is not None and batch_ratio > 1.0
    why = ("" if tput is None else f" (the bigger batch outweighed {numerator}'s per-step selection cost)"
           if tput >= 1 and bigger else f" ({numerator}'s per-step selection cost outweighed the bigger batch here)"
           if bigger else "")
    steps_a, steps_b = metric_value(a, "tokens_per_step") or 1.0, metric_value(b, "tokens_per_step") or 1.0
    if steps_a > steps_b + 0.05:  # accepted drafts: more than one token a step, which the denominator lacks
        why += (f"; {numerator} emitted {steps_a:.2f} tokens a step from accepted drafts, {denominator} "
                f"{steps_b:.2f}: that part is speculation, which plain vLLM runs too (a point's speculate: true)")
    reading = (f"Throughput: {numerator}/{denominator} tok/s at {where} = {'–' if tput is None else f'{tput:.2f}x'}"
               f"{why}. " + ("CPU timings are noisy and a CPU step is compute-bound, not memory-bound as a GPU's "
                             "decode: trust the batch ratio." if cpu else "Runs compare with `oasisbench compare`."))
    return [compared, capacity, reading]


def render_report(run: Run, plot_link_prefix: str = "") -> str:
    """Markdown report of one run: env header, a table per context length, the oasiskv / dense ratios,
    and links to the plots that exist in the run directory.

    ``plot_link_prefix`` is prepended to plot file names, for a report saved outside the run directory
    (e.g. ``"../results/smoke/<run-id>/"``).
    """
    lines = [f"# oasisbench report: {run.suite}", ""]
    lines += _env_lines(run)
    lines.append(f"- points: {len(run.records)}")
    lines.append("")
    if not run.records:
        lines += ["No records yet.", ""]
        return "\n".join(lines)

    modes = run.modes()
    for ctx in run.context_lens():
        recs = [r for r in run.records if int(r["point"]["context_len"]) == ctx]
        extra = _varying_keys(recs, {"mode", "engine", "context_len", "concurrency"})
        recs.sort(
            key=lambda r: (
                modes.index(series_label(r["point"])),
                int(r["point"]["concurrency"]),
                *(_sort_value(r["point"].get(k)) for k in extra),
            )
        )
        columns = [(m, h) for m, h in REPORT_COLUMNS if any(m in r["metrics"] for r in recs)]
        header = ["mode", "concurrency", *extra, *(h for _, h in columns)]
        rows = [
            [series_label(r["point"]), str(r["point"]["concurrency"])]
            + [fmt_number(r["point"].get(k)) for k in extra]
            + [_cell(r, m) for m, _ in columns]
            for r in recs
        ]
        lines += [f"## context_len = {ctx:,}", ""] + _table(header, rows) + [""]

    failed = [r for r in run.records if r["metrics"].get("error")]
    if failed:
        lines += ["## Failed points", ""]
        lines += [f"- {series_label(r['point'])} ctx={r['point']['context_len']} c={r['point']['concurrency']}: "
                  f"{r['metrics']['error']}" for r in failed] + [""]

    for numerator, denominator in ratio_pairs(run):
        header, rows = ratio_rows(run, numerator, denominator)
        lines += [f"## {numerator} / {denominator}", ""]
        # two spaces: a markdown line break
        lines += [line + "  " for line in reading_lines(run, numerator, denominator)] + [""]
        lines += _table(header, rows) + [""]

    if run.path is not None:
        names = [name for name, *_ in LINE_PLOTS] + [ROOFLINE_PNG]
        plots = [n for n in names if (run.path / n).exists()]
        if plots:
            lines += ["## Plots", ""]
            for n in plots:  # one paragraph each, or renderers put the images side by side
                lines += [f"![{n.removesuffix('.png')}]({plot_link_prefix}{n})", ""]
    return "\n".join(lines)


def _run_label(run: Run) -> str:
    env = run.env
    extra = ", ".join(f"{k} `{env[k]}`" for k in ("git_commit", "device", "model") if env.get(k))
    rw = " **RANDOM WEIGHTS**" if env.get("random_weights") else ""
    return f"`{run.suite}/{run.run_id}`" + (f" ({extra})" if extra else "") + rw


#: Short names of the point keys most compare rows differ in.
_SHORT_KEYS = {"context_len": "ctx", "concurrency": "c"}


def compare_runs(run_a: Run, run_b: Run, metrics: tuple[str, ...] | list[str] = COMPARE_METRICS) -> str:
    """Markdown comparison of two runs: per metric, a table of points present in both with A, B and B/A,
    then the points found in only one run. Points match by :func:`point_id`."""
    a_by, b_by = run_a.by_point_id(), run_b.by_point_id()
    common = [pid for pid in a_by if pid in b_by]
    lines = ["# oasisbench compare", "", f"- A: {_run_label(run_a)}", f"- B: {_run_label(run_b)}"]
    lines.append(f"- matched points: {len(common)}")
    # Cross-machine or cross-suite ratios are easy to misread as regressions: say so up front.
    for key, what in (("device", "devices"), ("model", "models"), ("random_weights", "weights")):
        if run_a.env.get(key) != run_b.env.get(key):
            lines.append(f"- **warning**: different {what}: {run_a.env.get(key)!r} vs {run_b.env.get(key)!r}")
    if run_a.suite != run_b.suite:
        lines.append(f"- **warning**: different suites: {run_a.suite!r} vs {run_b.suite!r}")
    lines.append("")

    # Full point ids run to a dozen keys, and a terminal cuts table cells: label each row by its mode and the keys
    # that differ between points, and list the keys every point shares once.
    matched = [a_by[pid]["point"] for pid in common]
    by_mode: dict[str, list[Record]] = {}
    for pid in common:
        by_mode.setdefault(series_label(a_by[pid]["point"]), []).append(a_by[pid])
    # keys that only differ between modes (a sparse setting dense lacks) add nothing to a row that names its mode
    varying = sorted({k for recs in by_mode.values() for k in _varying_keys(recs, {"mode", "engine"})})
    varying.sort(key=lambda k: (k not in _SHORT_KEYS, list(_SHORT_KEYS).index(k) if k in _SHORT_KEYS else 0, k))
    shared = {k: v for k, v in (matched[0].items() if matched else ())
              if k not in ("mode", "engine") and k not in varying and all(normalize_value(m.get(k)) == normalize_value(v)
                                                          for m in matched)}
    if any(v is not None for v in shared.values()):
        lines.insert(-1, "- every matched point: " + point_id(shared).replace(",", ", "))

    def label(point: dict[str, Any]) -> str:
        parts = [f"{_SHORT_KEYS.get(k, k)}={point_id({k: point.get(k)}).partition('=')[2] or '–'}" for k in varying]
        return " ".join([series_label(point), *parts])

    for metric in metrics:
        rows = []
        for pid in common:
            a, b = a_by[pid], b_by[pid]
            va, vb = metric_value(a, metric), metric_value(b, metric)
            if va is None and vb is None:
                continue
            rows.append([label(a["point"]), _cell(a, metric), _cell(b, metric), _ratio(vb, va)])
        if rows:
            unit = " (MiB)" if metric in _MIB_METRICS else ""
            lines += [f"## {metric}{unit}", ""] + _table(["point", "A", "B", "B/A"], rows) + [""]

    only_a = [pid for pid in a_by if pid not in b_by]
    only_b = [pid for pid in b_by if pid not in a_by]
    for title, pids in (("Only in A", only_a), ("Only in B", only_b)):
        if pids:
            lines += [f"## {title}", ""] + [f"- `{pid}`" for pid in pids] + [""]
    return "\n".join(lines)
