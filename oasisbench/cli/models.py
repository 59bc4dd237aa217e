"""``oasisbench models``: what models this machine can run."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="List available models.", no_args_is_help=True)


@app.command("list")
def list_cmd() -> None:
    """List packaged real models (installed or not) and random-weight presets.

    Example: oasisbench models list
    """
    from oasiskv_runtime.models.assets import PACKAGED
    from oasiskv_runtime.models.presets import preset_config, preset_names

    table = Table(title="models")
    for col in ("name", "weights", "status", "shape", "notes"):
        table.add_column(col)
    seen = set()
    for pm in PACKAGED.values():
        if pm.name in seen:
            continue
        seen.add(pm.name)
        path = pm.path()
        status = f"[green]installed[/] {path}" if path else f"[red]missing[/]: {pm.install}"
        table.add_row(pm.name, "real", status, "", pm.description)
    for name in preset_names():
        c = preset_config(name)
        shape = (f"{c.num_layers}L h{c.hidden_size} {c.num_heads}/{c.num_kv_heads} heads d{c.head_dim} "
                 f"ffn{c.intermediate_size} vocab{c.vocab_size}")
        params_b = c.num_params() / 1e9
        table.add_row(name, "[yellow]RANDOM[/]", "available", shape, f"{params_b:.2f}B params, throughput only")
    Console().print(table)
    Console().print("Any Hugging Face directory (config.json + *.safetensors) or .gguf file works as --model PATH.")
