"""``oasisbench recall``: per-layer prediction recall of proxy-prefetch vs oasiskv drafts on real text."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from oasisbench.cli.options import (DEFAULT_MODEL_NAME, DeviceOpt, DtypeOpt, FetchRatioOpt, ModelOpt, default_device,
                                    default_dtype, engine_default, engine_option)
from oasisbench.cli.report import fail


def recall_cmd(
    model: ModelOpt = DEFAULT_MODEL_NAME,
    context_len: Annotated[str, typer.Option("--context-len", help="Comma list of context lengths.")] = "2048",
    drafts: Annotated[str, typer.Option("--drafts", help="Comma list of oasiskv drafts to compare with "
                                        "proxy-prefetch.")] = "ngram,layerskip,oracle",
    top_k_blocks: Annotated[int | None, engine_option("top_k_blocks", note="Here 1/8 of the context's blocks by "
                                                      "default.")] = None,
    num_texts: Annotated[int, typer.Option("--num-texts", help="Essay windows (requests).")] = 2,
    num_steps: Annotated[int, typer.Option("--num-steps", help="Teacher-forced decode steps per text.")] = 32,
    continuation: Annotated[str, typer.Option("--continuation", help="Comma list of forced continuations: "
                                              "'self' (the model's own greedy tokens, as in serving) and/or "
                                              "'text' (the essay's next tokens).")] = "self",
    fetch_ratio: FetchRatioOpt = engine_default("fetch_ratio"),
    proxy: Annotated[bool, typer.Option("--proxy/--no-proxy", help="Include the proxy-prefetch "
                                        "baseline.")] = True,
    device: DeviceOpt = "",
    dtype: DtypeOpt = "",
    output_dir: Annotated[Path, typer.Option("--output-dir")] = Path("results"),
) -> None:
    """Measure how well each look-ahead predicts the next step's top-K blocks, per layer.

    Example: oasisbench recall --context-len 2048,4096 --drafts ngram,layerskip,oracle --continuation self,text
    """
    from oasisbench.results.store import atomic_write_json
    from oasisbench.runners.recall import gap_closed, run_recall

    device = default_device(device)
    try:
        ctxs = [int(x) for x in context_len.split(",") if x]
    except ValueError:
        raise fail(f"--context-len must be a comma list of integers, got {context_len!r}") from None
    configs = [("proxy-prefetch", None)] * proxy + [("oasiskv", d) for d in drafts.split(",") if d]
    if not configs:
        raise fail("nothing to measure: --no-proxy and no --drafts")
    conts = tuple(c for c in continuation.split(",") if c)
    if not conts:
        raise fail("--continuation needs at least one of: self, text")
    console = Console()
    table = Table(title=f"prediction recall, {model}")
    for col in ("context", "K", "continuation", "mode", "draft", "recall", "min layer", "draft acc",
                "fetched KB/step"):
        table.add_column(col)
    run_dir = output_dir / "recall" / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    done = []

    def on_point(p) -> None:
        done.append(dataclasses.asdict(p))
        atomic_write_json(run_dir / "recall.json", {"schema_version": 1, "model": model, "device": device,
                                                     "points": done})
        layers = [r for r in p.recall_per_layer if r is not None]
        table.add_row(str(p.context_len), str(p.top_k_blocks), p.continuation, p.mode, p.draft or "-",
                      f"{p.recall:.4f}" if p.recall is not None else "n/a",
                      f"{min(layers):.4f}" if layers else "n/a",
                      f"{p.draft_accuracy:.3f}" if p.draft_accuracy is not None else "-",
                      f"{p.fetched_bytes_per_step / 1024:.1f}")
        console.print(f"done: ctx {p.context_len} {p.continuation} {p.mode} {p.draft or ''} recall={p.recall}")

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        points = run_recall(model, ctxs, configs, top_k_blocks, num_texts, num_steps, fetch_ratio, device,
                            default_dtype(dtype, device), on_point, conts)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise fail(str(e)) from None
    console.print(table)
    gaps = gap_closed(points)
    if gaps:  # needs proxy-prefetch and the oracle beside the drafts
        atomic_write_json(run_dir / "recall.json", {"schema_version": 1, "model": model, "device": device,
                                                     "points": done, "gap_closed": gaps})
        gt = Table(title="share of the proxy-to-oracle recall gap closed (95% interval: bootstrap over texts)")
        for col in ("context", "continuation", "draft", "gap closed", "95% interval", "texts"):
            gt.add_column(col)
        for g in gaps:
            lo, hi = g["ci95"]
            gt.add_row(str(g["context_len"]), g["continuation"], g["draft"],
                       f"{100 * g['gap_closed']:.1f}%" if g["gap_closed"] is not None else "n/a",
                       f"{100 * lo:.1f}-{100 * hi:.1f}%" if lo is not None else "n/a", str(g["num_texts"]))
        console.print(gt)
    console.print(f"results: {run_dir / 'recall.json'}")
