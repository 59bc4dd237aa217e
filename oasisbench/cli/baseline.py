"""``oasisbench make-baseline``: turn a run into a gate baseline (what ``oasisbench gate`` checks against).

Only deterministic metrics by default (token counts, admitted batch, blocks and bytes, recall): one wall-clock
time is never a gate (see :mod:`oasisbench.results.gate`). Ratio checks measured inside one run are written
by hand; regenerating into an existing file keeps its ``ratio_checks``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from oasisbench.cli.report import RunDirArg, fail, load_run_or_exit
from oasisbench.results.gate import DIRECTIONS, BaselineError, dump_baseline, load_baseline, make_baseline
from oasisbench.results.schema import REQUIRED_POINT_KEYS, Record, point_matches
from oasisbench.results.store import atomic_write_text

#: Exact on a given commit and workload: scheduling, block bookkeeping and token counts are pure Python.
#: The ``:0.1`` metrics depend on greedy tokens and query scores, i.e. on float rounding, which may differ on
#: another CPU; ``equal`` because a jump either way (e.g. fetching nothing) is a behaviour change.
DEFAULT_METRICS = ("completed:0,failed:0,total_input_tokens:0,total_output_tokens:0,max_running_batch:0,"
                   "max_admitted_batch:0,num_preemptions:0,resident_gpu_bytes_per_request:0,"
                   "fetched_blocks_per_step:0.1:equal,deferred_blocks_per_step:0.1:equal,"
                   "prediction_recall:0.1,draft_accuracy:0.1")


def parse_metric_specs(text: str, default_rel: float) -> list[tuple[str, float, str | None]]:
    """``name[:rel_tolerance[:direction]]``, comma separated -> (name, rel, direction or None)."""
    specs: list[tuple[str, float, str | None]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, *rest = item.split(":")
        if len(rest) > 2:
            raise ValueError(f"{item!r}: expected name[:rel_tolerance[:direction]]")
        try:
            rel = float(rest[0]) if rest and rest[0] else default_rel
        except ValueError:
            raise ValueError(f"{item!r}: tolerance {rest[0]!r} is not a number") from None
        direction = rest[1] if len(rest) == 2 else None
        if direction is not None and direction not in DIRECTIONS:
            raise ValueError(f"{item!r}: direction must be one of {', '.join(DIRECTIONS)}")
        specs.append((name, rel, direction))
    if not specs:
        raise ValueError("--metrics is empty")
    return specs


def short_points(records: list[Record]) -> list[dict[str, Any]]:
    """Per record, the partial point that still matches only it: the required keys plus the keys whose value
    varies in the run. Checks then survive a new default key in resolved points, and read at a glance."""
    varying = {k for r in records for k in r["point"]
               if len({repr(x["point"].get(k)) for x in records}) > 1}
    keys = [k for k in records[0]["point"] if k in varying or k in REQUIRED_POINT_KEYS] if records else []
    out = []
    for r in records:
        short = {k: r["point"][k] for k in keys if k in r["point"]}
        unique = sum(point_matches(x["point"], short) for x in records) == 1
        out.append(short if unique else dict(r["point"]))
    return out


def _leading_comments(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if not line.startswith("#"):
            break
        out.append(line)
    return out


def baseline_cmd(
    run_dir: RunDirArg,
    metrics: Annotated[str, typer.Option(
        "--metrics", help="Comma list of name[:rel_tolerance[:direction]]; direction is higher_is_better, "
        "lower_is_better or equal (default: per metric, see oasisbench.results.gate).")] = DEFAULT_METRICS,
    tolerance: Annotated[float, typer.Option(
        "--tolerance", min=0.0, help="Relative tolerance for metrics given without one.")] = 0.05,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Baseline file to write (.yaml, or .json); its ratio_checks are kept. "
        "Its leading # comments are kept too. Default: print YAML.", show_default=False)] = None,
) -> None:
    """Write a gate baseline holding the run's current values of deterministic metrics.

    Example: oasisbench make-baseline results/ci-smoke/20261129-101500-ab12 -o suites/throughput/ci-smoke.baseline.yaml
    """
    run = load_run_or_exit(run_dir)
    failed = [r for r in run.records if r["metrics"].get("error")]
    if failed:
        raise fail(f"{run_dir}: {len(failed)} point(s) failed in this run; a baseline must come from a clean run")
    try:
        specs = parse_metric_specs(metrics, tolerance)
        checks: list[dict[str, Any]] = []
        for name, rel, direction in specs:
            part = make_baseline(run, [name], rel)["checks"]
            for check in part:
                if direction is not None:
                    check["direction"] = direction
            checks += part
    except ValueError as e:  # includes make_baseline's refusal of wall-clock metrics
        raise fail(str(e)) from None
    # Group by point (run order) so a reader sees each point's expectations together.
    point_index = {repr(r["point"]): i for i, r in enumerate(run.records)}
    checks.sort(key=lambda c: point_index.get(repr(c["point"]), len(point_index)))
    shorts = short_points(run.records)
    for check in checks:
        i = point_index.get(repr(check["point"]))
        if i is not None:
            check["point"] = dict(shorts[i])  # a fresh dict each: shared ones become YAML &anchors
    doc = make_baseline(run, [], 0.0)
    doc["checks"] = checks
    header = ""
    if output is not None and output.exists():
        try:
            doc["ratio_checks"] = load_baseline(output).get("ratio_checks") or []
        except (BaselineError, FileNotFoundError, ValueError) as e:
            raise fail(f"cannot keep ratio_checks: {e}") from None
        # The leading comment block explains the gate's choices; keep it across regenerations.
        lines = output.read_text(encoding="utf-8").splitlines(keepends=True)
        header = "".join(line for line in _leading_comments(lines))
    console = Console()
    if output is None:
        console.print(yaml.safe_dump(doc, sort_keys=False), markup=False, highlight=False, end="")
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    if header and output.suffix != ".json":
        atomic_write_text(output, header + yaml.safe_dump(doc, sort_keys=False))
    else:
        dump_baseline(doc, output)
    console.print(f"wrote {escape(str(output))}: {len(checks)} check(s), {len(doc['ratio_checks'])} ratio check(s)")
