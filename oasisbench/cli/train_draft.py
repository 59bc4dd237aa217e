"""``oasisbench train-draft``: train an EAGLE-3-style draft head for a target by self-distillation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from oasisbench.cli.options import DEFAULT_MODEL_NAME, DeviceOpt, ModelOpt, SeedOpt, default_device
from oasisbench.cli.report import fail


def train_draft_cmd(
    model: ModelOpt = DEFAULT_MODEL_NAME,
    output: Annotated[Path, typer.Option("--output", "-o", help="Run directory: final head, checkpoint-N/, "
                                         "train_summary.json, cache/.")] = Path("draft-head"),
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 2000,
    batch_tokens: Annotated[int, typer.Option("--batch-tokens", help="Head positions per optimizer step.")] = 2048,
    lr: Annotated[float, typer.Option("--lr", help="Peak AdamW learning rate (warm-up, cosine to 10%).")] = 1e-3,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="Draft vocabulary: the D most frequent "
                                             "training-text tokens.")] = 4096,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per captured window.")] = 1024,
    num_train_tokens: Annotated[int, typer.Option("--num-train-tokens", help="Training tokens (after the "
                                                  "holdout).")] = 120_000,
    holdout_tokens: Annotated[int, typer.Option("--holdout-tokens", help="First tokens of the essay stream, "
                                                "kept out of training (recall runs read them).")] = 8192,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="Held-out tokens scored (the first ones "
                                             "of the holdout).")] = 2048,
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="Stop training after this many "
                                                     "seconds of wall time (then save as usual).")] = None,
    intermediate_size: Annotated[int, typer.Option("--intermediate-size", help="Head MLP width.")] = 1536,
    seed: SeedOpt = 0,
    device: DeviceOpt = "",
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Steps between checkpoints "
                                                  "(0: none).")] = 500,
    resume: Annotated[str | None, typer.Option("--resume", help="Checkpoint dir to continue from, or "
                                               "'latest'.")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Captured target states (default "
                                                   "OUTPUT/cache).")] = None,
    export: Annotated[Path | None, typer.Option("--export", help="Also write the final fp16 head "
                                                "(config.json + model.safetensors) here.")] = None,
    time_schedule: Annotated[bool, typer.Option("--time-schedule", help="With --time-limit: the LR schedule "
                                                "also advances with time, so a stopped run ends at its "
                                                "floor.")] = False,
    gen_samples: Annotated[int, typer.Option("--gen-samples", help="Self-distillation: samples the target "
                                             "generates from training-text excerpts (plain and chat, greedy "
                                             "and sampled), added to the training text.")] = 0,
    gen_prompt_tokens: Annotated[int, typer.Option("--gen-prompt-tokens", help="Excerpt length per "
                                                   "sample (the longest, with --gen-prompt-min-tokens).")] = 384,
    gen_prompt_min_tokens: Annotated[int | None, typer.Option("--gen-prompt-min-tokens", help="Shortest "
                                                              "excerpt: lengths are drawn from [this, "
                                                              "--gen-prompt-tokens].")] = None,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", help="Most new tokens per sample.")] = 256,
    gen_batch: Annotated[int, typer.Option("--gen-batch", help="Samples generated at once.")] = 512,
    gen_time_limit: Annotated[float | None, typer.Option("--gen-time-limit", help="Stop generating after this "
                                                         "many seconds (samples keep what they have).")] = None,
    gen_eval_samples: Annotated[int, typer.Option("--gen-eval-samples", help="Greedy samples from holdout "
                                                  "excerpts, scored but never trained on.")] = 0,
    gen_only: Annotated[bool, typer.Option("--gen-only", help="Stop after generating (and caching) the "
                                           "self-distillation text; a later run without it trains.")] = False,
    crop_rows: Annotated[int | None, typer.Option("--crop-rows", help="Head rows per training crop, also the "
                                                  "head's sliding window. Default: the shortest window minus "
                                                  "one, at most --batch-tokens.")] = None,
    compare_head: Annotated[Path | None, typer.Option("--compare-head", help="Also score this existing head "
                                                      "on the same held-out text.")] = None,
) -> None:
    """Train an EAGLE-3 head from the target's own outputs on the essays; use it as --draft eagle3:OUTPUT.

    Example: oasisbench train-draft --model smollm2-135m --output runs/eagle3 --steps 2000
    """
    from oasisbench.runners.train_draft import TrainDraftConfig, train_draft

    cfg = TrainDraftConfig(model=model, output=output, steps=steps, batch_tokens=batch_tokens, lr=lr,
                           draft_vocab=draft_vocab, seq_len=seq_len, num_train_tokens=num_train_tokens,
                           holdout_tokens=holdout_tokens, seed=seed, device=default_device(device),
                           checkpoint_every=checkpoint_every, resume=resume, cache_dir=cache_dir,
                           intermediate_size=intermediate_size, export=export, eval_tokens=eval_tokens,
                           time_limit_s=time_limit, time_schedule=time_schedule, gen_samples=gen_samples,
                           gen_prompt_tokens=gen_prompt_tokens,
                           gen_prompt_min_tokens=gen_prompt_min_tokens, gen_tokens=gen_tokens, gen_batch=gen_batch,
                           gen_time_limit_s=gen_time_limit, gen_eval_samples=gen_eval_samples,
                           compare_head=compare_head, crop_rows=crop_rows, gen_only=gen_only)
    for name in ("steps", "batch_tokens", "draft_vocab", "seq_len", "num_train_tokens", "intermediate_size",
                 "gen_prompt_tokens", "gen_tokens", "gen_batch"):
        if getattr(cfg, name) <= 0:
            raise fail(f"--{name.replace('_', '-')} must be positive")
    if crop_rows is not None and not 1 <= crop_rows < seq_len:
        raise fail(f"--crop-rows must be in [1, --seq-len {seq_len}), got {crop_rows}")
    if gen_prompt_min_tokens is not None and not 1 <= gen_prompt_min_tokens <= gen_prompt_tokens:
        raise fail(f"--gen-prompt-min-tokens must be in [1, --gen-prompt-tokens {gen_prompt_tokens}]")
    for name in ("gen_samples", "gen_eval_samples"):
        if getattr(cfg, name) < 0:
            raise fail(f"--{name.replace('_', '-')} must not be negative")
    try:
        res = train_draft(cfg)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise fail(str(e)) from None
    console = Console()
    if gen_only:
        console.print(f"generated the self-distillation text in {res.wall_s:.0f} s, cached in "
                      f"{cfg.cache_path}; run again without --gen-only to train")
        return
    curve = Table(title="training loss (soft CE vs target, draft vocab)")
    for col in ("step", "loss", "top-1 agreement"):
        curve.add_column(col)
    stride = max(1, len(res.losses) // 10)  # about ten rows whatever the run length
    rows = res.losses[::stride]
    if res.losses and rows[-1] != res.losses[-1]:
        rows.append(res.losses[-1])
    for s, loss, acc in rows:
        curve.add_row(str(s), f"{loss:.4f}", f"{acc:.3f}")
    console.print(curve)
    for title, h in (("held-out essay text", res.heldout), ("held-out self-generated text", res.heldout_gen)):
        if not h:
            continue
        drafts = [d for d in ("head", "ngram", "layerskip") if f"{d}_vs_target" in h]
        console.print(f"{title} ({h['positions']} positions), next-token accuracy vs the target's greedy token "
                      f"(vs the text): " + "; ".join(f"{d} {h[d + '_vs_target']:.3f} ({h[d + '_vs_text']:.3f})"
                                                     for d in drafts))
    console.print(f"head: {output / 'model.safetensors'} ({res.head_bytes / 1e6:.2f} MB fp16), "
                  f"{res.step} steps, {res.wall_s:.0f} s")
