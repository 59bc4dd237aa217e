"""``oasisbench paired``: the paired accuracy difference of two settings, from one run or two."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown

from oasisbench.cli.report import fail


def _side(text: str) -> tuple[list[Path], str]:
    run_dirs, sep, name = text.rpartition(":")
    dirs = [Path(d) for d in run_dirs.split(",") if d]
    if not sep or not dirs or not name:
        raise fail(f"expected RUN_DIR[,RUN_DIR...]:SETTING (e.g. results/accuracy-niah/20261206-1409-8c50:oasiskv), "
                   f"got {text!r}")
    return dirs, name


def paired_cmd(
    a: Annotated[str, typer.Argument(help="RUN_DIR:SETTING of A, the setting as the run's report names it "
                                          "(dense, oasiskv, sparse-resident[summary_parts=4], ...); "
                                          "RUN_DIR,RUN_DIR:SETTING pools the setting's documents of several runs "
                                          "(e.g. one run per context length).",
                                     show_default=False)],
    b: Annotated[str, typer.Argument(help="RUN_DIR:SETTING of B; the difference is B - A.", show_default=False)],
    task: Annotated[str, typer.Option("--task", help="A task, or a group (niah: its seven families).")] = "niah",
) -> None:
    """B - A in points over the documents both settings answered, per context length and pooled, with a 95%
    interval paired over those documents: to compare settings that ran in different commands (e.g. oasiskv
    against the exact top-K), which share no dense anchor.

    Example: oasisbench paired results/x/RUN1:sparse-resident[selection_score=attention] results/y/RUN2:oasiskv
    """
    from oasisbench.results.paired import load_samples, paired_diff, pick, render

    sides = []
    for text in (a, b):
        run_dirs, name = _side(text)
        try:
            sides.append((name, [s for d in run_dirs for s in pick(load_samples(d), name, d)]))
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise fail(str(e).strip('"')) from None
    try:
        rows = paired_diff(sides[0][1], sides[1][1], task)
    except ValueError as e:
        raise fail(str(e)) from None
    Console().print(Markdown(render(rows, sides[0][0], sides[1][0], task)))
