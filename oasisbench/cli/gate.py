"""``oasisbench gate``: check a run against a baseline file; exit 1 on regression (for CI).

Exit codes: 0 all checks passed, 1 a check failed, 2 the run or the baseline is missing or malformed.
See :mod:`oasisbench.results.gate` for the baseline format and the gating policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oasisbench.cli.report import RunDirArg, fail, load_run_or_exit
from oasisbench.results.gate import GateResult, gate, load_baseline


def _table(result: GateResult) -> Table:
    table = Table(title="gate checks", show_lines=False)
    for column in ("result", "kind", "metric", "point", "expected", "actual", "note"):
        table.add_column(column, overflow="fold")
    # Failures first: in CI logs the reader scrolls to the top for what broke.
    for o in sorted(result.outcomes, key=lambda o: o.passed):
        table.add_row(
            "[green]PASS[/]" if o.passed else "[bold red]FAIL[/]",
            o.kind,
            escape(o.metric),
            escape(o.point),
            escape(o.expected),
            "–" if o.actual is None else f"{o.actual:.6g}",
            escape(o.message),
        )
    return table


def gate_cmd(
    run_dir: RunDirArg,
    baseline: Annotated[
        Path,
        typer.Option(
            "--baseline",
            "-b",
            help="Baseline file (YAML or JSON), e.g. suites/throughput/baselines/smoke.yaml.",
            show_default=False,
        ),
    ],
) -> None:
    """Check a run against a baseline; exit 1 if any check regressed, 2 if an input is missing.

    Example: oasisbench gate results/smoke/20261129-101500-ab12 --baseline suites/throughput/baselines/smoke.yaml
    """
    run = load_run_or_exit(run_dir)
    try:
        doc = load_baseline(baseline)
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e)) from None
    result = gate(run, doc)
    console = Console()
    if not result.outcomes:
        console.print("[yellow]warning:[/] the baseline has no checks; nothing was gated")
        return
    console.print(_table(result))
    failures = len(result.failures)
    if failures:
        console.print(f"[bold red]gate FAILED[/]: {failures} of {len(result.outcomes)} check(s) failed")
        raise typer.Exit(1)
    console.print(f"[green]gate passed[/]: {len(result.outcomes)} check(s)")
