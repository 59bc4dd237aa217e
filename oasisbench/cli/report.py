"""``oasisbench report``: plots and a markdown report for one run directory.

Also holds the run-directory argument and loader the ``compare`` and ``gate`` commands share.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape

from oasisbench.results.plots import plots_available, write_plots
from oasisbench.results.report import render_report
from oasisbench.results.schema import Run
from oasisbench.results.store import atomic_write_text, load_run

#: Exit code for unusable input (missing or corrupt run dir / baseline), distinct from a failed gate (1).
EXIT_BAD_INPUT = 2

RunDirArg = Annotated[
    Path,
    typer.Argument(
        help="Run directory holding metrics.json, e.g. results/throughput-smoke/20261129-101500-ab12.",
        show_default=False,
    ),
]


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    """Print ``error: message`` on stderr and return the Exit to raise (``raise fail(...)``)."""
    # escape(): paths and point ids contain '[' which rich would read as markup.
    # soft_wrap: never break a path across lines; users copy it.
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


def load_run_or_exit(run_dir: Path) -> Run:
    """:func:`load_run`, turning a missing or corrupt run into a clear message and exit code 2."""
    try:
        return load_run(run_dir)
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e)) from None


def report_cmd(
    run_dir: RunDirArg,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Where to write the markdown. Default: <run_dir>/report.md."),
    ] = None,
) -> None:
    """Regenerate a run's plots, write report.md, and print the report.

    Example: oasisbench report results/throughput-smoke/20261129-101500-ab12
    """
    run = load_run_or_exit(run_dir)
    console = Console()
    if plots_available():
        plots = write_plots(run)
    else:
        plots = []
        console.print("[yellow]note:[/] matplotlib is not installed (pip install 'oasiskv[plots]'); plots skipped")
    target = output if output is not None else run_dir / "report.md"
    # Plot links are relative to the report, so a report saved elsewhere still finds the PNGs.
    prefix = ""
    if target.resolve().parent != run_dir.resolve():
        prefix = os.path.relpath(run_dir.resolve(), target.resolve().parent) + "/"
    text = render_report(run, plot_link_prefix=prefix)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, text)
    console.print(Markdown(text))
    console.print(f"wrote {escape(str(target))} and {len(plots)} plot(s) in {escape(str(run_dir))}")
