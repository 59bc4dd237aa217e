"""Option aliases shared by every command that builds an engine (huggingface_hub CLI style)."""

from __future__ import annotations

from typing import Annotated

import typer

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
TopKOpt = Annotated[int, typer.Option("--top-k-blocks", help="Working-set blocks per KV head (+1 local).")]
FetchRatioOpt = Annotated[float, typer.Option("--fetch-ratio", help="Per-step admission cap as a fraction of "
                                              "top-k-blocks.")]
LinkGbpsOpt = Annotated[float, typer.Option(
    "--link-gbps", min=0.0, help="Prefetch modes: size each decode step's fetch cap by the link, the paper's "
    "C_token = B_link x T_decode: the copies this many GB/s move in one step (measured, by kind), shared by its "
    "requests, never below the --fetch-ratio cap. 0: the fixed cap. Set it below the rate the prefetch reaches "
    "(an H200: ~43 GB/s).")]
DraftOpt = Annotated[str, typer.Option("--draft", help="Draft source for oasiskv: auto (the model's shipped "
                                       "EAGLE-3 head behind the n-gram draft, ngram+eagle3:<head>, where one ships: "
                                       "smollm2-135m; else ngram), ngram[:N], layerskip[:N], model:<path>, "
                                       "eagle3:<path>, oracle, ngram[:N]+<draft>.")]
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
