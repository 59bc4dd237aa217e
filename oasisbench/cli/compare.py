"""``oasisbench compare``: two runs side by side, matched point by point, with B/A ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape

from oasisbench.cli.report import load_run_or_exit
from oasisbench.results.report import compare_runs
from oasisbench.results.store import atomic_write_text


def compare_cmd(
    run_a: Annotated[
        Path,
        typer.Argument(
            help="Reference run directory (A), e.g. results/smoke/20261128-090000-1a2b.", show_default=False
        ),
    ],
    run_b: Annotated[
        Path,
        typer.Argument(help="Candidate run directory (B); ratios are B/A.", show_default=False),
    ],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Also write the comparison markdown to this file."),
    ] = None,
) -> None:
    """Compare two runs point by point (B/A ratios) and list points found in only one of them.

    Example: oasisbench compare results/smoke/20261128-090000-1a2b results/smoke/20261129-101500-ab12
    """
    a = load_run_or_exit(run_a)
    b = load_run_or_exit(run_b)
    text = compare_runs(a, b)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output, text)
    console = Console()
    console.print(Markdown(text))
    if output is not None:
        console.print(f"wrote {escape(str(output))}")
