"""Option aliases shared by every command that builds an engine (huggingface_hub CLI style)."""

from __future__ import annotations

from typing import Annotated

import typer

from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.models.assets import DEFAULT_MODEL

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Packaged model name, random-weight preset "
                                       "(qwen3-8b, llama-3.1-8b, qwen3-32b), HF directory or .gguf file.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N. Default: cuda when present.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16. Default: bfloat16 on "
                                       "CUDA, float32 on CPU.")]
ModeOpt = Annotated[str, typer.Option("--mode", help="dense, sparse-resident, fetch-on-demand, proxy-prefetch, "
                                      "oasiskv.")]
KvGbOpt = Annotated[float | None, typer.Option("--kv-cache-gb", help="Device KV budget in GiB (the HBM "
                                               "capacity wall).")]
HostGbOpt = Annotated[float | None, typer.Option(
    "--host-kv-gb", min=0.0, help="Host KV pool of the offloading modes in GiB (pinned on CUDA, as one region "
    "of exactly this size). Default: 64, or half the free RAM where that is less; 8 on CPU.", show_default=False)]
ENGINE_OPTIONS = EngineConfig.options()
"""Every engine option's default, valid values and meaning, declared once in ``oasiskv_runtime.config``."""


def engine_option(name: str, *, flag: str = "", note: str = "") -> typer.Option:
    """A CLI flag for engine option ``name``: the config's one-line doc as help (plus ``note``: what this command
    does differently), its check as the flag's validation (a bad value exits 2 naming the flag)."""
    spec = ENGINE_OPTIONS[name]

    def check(value):
        if value is not None:
            try:
                spec.validate(value)
            except ValueError as e:
                raise typer.BadParameter(str(e)) from None
        return value

    return typer.Option(flag or "--" + name.replace("_", "-"), help=" ".join(x for x in (spec.doc, note) if x),
                        callback=check)


def engine_default(name: str):
    """The engine's default of option ``name`` (a flag that keeps it writes this, not a copy of its own)."""
    return ENGINE_OPTIONS[name].default


TOP_K_NOTE = ("Default: the engine's, or a quarter of the shortest context's blocks where K + 1 blocks would hold it "
              "whole (1K tokens: 16), so sparse modes stay sparse.")
TopKOpt = Annotated[int, engine_option("top_k_blocks")]
FetchRatioOpt = Annotated[float, engine_option("fetch_ratio")]
LinkGbpsOpt = Annotated[float, engine_option("link_gbps")]
DraftOpt = Annotated[str, engine_option("draft")]
SinkBlocksOpt = Annotated[int, engine_option("sink_blocks")]
DenseLayersOpt = Annotated[int, engine_option("dense_layers")]
RecentBlocksOpt = Annotated[int, engine_option("recent_blocks")]
SelectionScoreOpt = Annotated[str, engine_option("selection_score")]
BlockSizeOpt = Annotated[int, engine_option("block_size")]
MaxSeqsOpt = Annotated[int, engine_option("max_num_seqs")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Engine and workload seed.")]

DEFAULT_MODEL_NAME = DEFAULT_MODEL


def default_device(device: str | None) -> str:
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(dtype: str | None, device: str) -> str:
    if dtype:
        return dtype
    return "float32" if device == "cpu" else "bfloat16"
