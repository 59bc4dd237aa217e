"""``oasisbench generate``: one-off generation through the engine (a smoke test for a model and mode)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from oasisbench.cli.options import (DEFAULT_MODEL_NAME, DeviceOpt, DraftOpt, DtypeOpt, FetchRatioOpt, KvGbOpt,
                                    ModelOpt, ModeOpt, SeedOpt, TopKOpt, default_device, default_dtype, engine_default)
from oasisbench.cli.report import fail


def generate_cmd(
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="Prompt text; repeat for a batch.")],
    model: ModelOpt = DEFAULT_MODEL_NAME,
    mode: ModeOpt = "dense",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap prompts in the model's chat template.")] = False,
    device: DeviceOpt = "",
    dtype: DtypeOpt = "",
    kv_cache_gb: KvGbOpt = None,
    top_k_blocks: TopKOpt = engine_default("top_k_blocks"),
    fetch_ratio: FetchRatioOpt = engine_default("fetch_ratio"),
    draft: DraftOpt = "auto",
    seed: SeedOpt = 0,
) -> None:
    """Generate text for one or more prompts.

    Example: oasisbench generate --prompt "The capital of France is" --max-tokens 8
    """
    from oasiskv_runtime import LLM, SamplingParams

    console = Console()
    device = default_device(device)
    try:
        with console.status(f"loading {model} on {device}"):
            llm = LLM(model, device=device, dtype=default_dtype(dtype, device), mode=mode, seed=seed,
                      kv_cache_gb=kv_cache_gb, top_k_blocks=top_k_blocks, fetch_ratio=fetch_ratio, draft=draft)
        prompts = prompt
        if chat:
            if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
                raise ValueError(f"model {model!r} has no chat template")
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                         add_generation_prompt=True) for p in prompt]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        outs = llm.generate(prompts, params)
    except (ValueError, FileNotFoundError, ImportError, MemoryError, TypeError) as e:
        raise fail(str(e)) from None
    for p, o in zip(prompt, outs):
        console.print(f"[bold]{p}[/]", end="")
        console.print(o.text, markup=False, highlight=False)
        m = o.metrics
        console.print(f"[dim]{len(o.token_ids)} tokens, finish={o.finish_reason}, "
                      f"ttft={m['ttft_ms']:.0f} ms, tpot={(m['tpot_ms'] or 0):.1f} ms[/]")
