"""The ``oasisbench`` command: one module per command group, registered here."""

from __future__ import annotations

import signal
from types import FrameType

import typer

from oasisbench.cli import models
from oasisbench.cli.accuracy import accuracy_cmd
from oasisbench.cli.baseline import baseline_cmd
from oasisbench.cli.compare import compare_cmd
from oasisbench.cli.gate import gate_cmd
from oasisbench.cli.generate import generate_cmd
from oasisbench.cli.paired import paired_cmd
from oasisbench.cli.pd import pd_cmd
from oasisbench.cli.recall import recall_cmd
from oasisbench.cli.report import report_cmd
from oasisbench.cli.throughput import run_cmd, throughput_cmd
from oasisbench.cli.train_draft import train_draft_cmd

app = typer.Typer(
    name="oasisbench",
    help="Benchmark OasisKV (look-ahead sparse KV prefetching) against dense and sparse baselines in one engine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("generate")(generate_cmd)
app.add_typer(models.app, name="models")
app.command("report")(report_cmd)
app.command("compare")(compare_cmd)
app.command("gate")(gate_cmd)
app.command("throughput")(throughput_cmd)
app.command("run")(run_cmd)
app.command("make-baseline")(baseline_cmd)
app.command("accuracy")(accuracy_cmd)
app.command("recall")(recall_cmd)
app.command("train-draft")(train_draft_cmd)
app.command("pd")(pd_cmd)
app.command("paired")(paired_cmd)


def _terminate_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    # `timeout`, `kill` and job schedulers stop a run with SIGTERM: it is handled as Ctrl-C, so a sweep records what it
    # finished, prints how to resume, and kills its vLLM child (a session of its own, which would keep the GPU)
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    app()


if __name__ == "__main__":
    main()
