"""Train an EAGLE-3-style draft head for a target by self-distillation (``oasisbench train-draft``).

Data: the target runs teacher-forced over the Paul Graham essays (concatenated in the same order as
``oasisbench.runners.recall.essay_windows``). The FIRST ``holdout_tokens`` tokens are held out, because recall
runs take their windows from the start of that same stream; training uses the tokens after them. For every
window we capture the target's residual stream at the head's three aux taps (HF ``hidden_states`` indices,
see :func:`default_aux_layer_ids`) and the target's top-k next-token distribution, and cache both on disk
(one ``.pt`` per window) so a rerun does not recompute them.

Alignment is EAGLE's: head row ``p`` takes ``(h_p, embed(x_{p+1}))`` and is trained towards the target's
distribution at position ``p+1`` (which predicts ``x_{p+2}``), restricted to the draft vocabulary.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from oasiskv_runtime.drafts.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids

TOPK = 8  # soft-target width: the target's top-8 carries nearly all of its mass on text


@dataclass
class TrainDraftConfig:
    model: str = "smollm2-135m"
    output: Path = Path("draft-head")
    steps: int = 2000
    batch_tokens: int = 2048
    lr: float = 1e-3
    draft_vocab: int = 4096
    seq_len: int = 1024
    num_train_tokens: int = 120_000
    holdout_tokens: int = 8192
    eval_tokens: int = 2048
    """Held-out tokens actually captured and scored (the first ones of the holdout)."""
    time_limit_s: float | None = None
    """Stop training (and save) once this much wall time has passed since start."""
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 500
    resume: str | None = None
    """A checkpoint directory, or ``latest`` for the newest ``checkpoint-N`` under ``output``."""
    cache_dir: Path | None = None
    """Captured target states; default ``output/cache``."""
    intermediate_size: int = 1536
    export: Path | None = None
    """Also write the final fp16 head (config.json + model.safetensors only) here."""
    log_every: int = 25


@dataclass
class TrainDraftResult:
    step: int
    losses: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, mean train loss, mean train top-1 agreement) every ``log_every`` steps."""
    heldout: dict[str, Any] = field(default_factory=dict)
    head_bytes: int = 0
    wall_s: float = 0.0


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


def corpus_split(tokenizer: Any, holdout: int, num_train: int) -> tuple[list[int], list[int]]:
    """(held-out, train) token lists: the first ``holdout`` tokens of the essay stream, then ``num_train``."""
    from oasisbench.accuracy.haystack import load_essays

    ids: list[int] = []
    for text in load_essays():  # same concatenation as essay_windows, so the holdout covers recall's windows
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= holdout + num_train:
            break
    if len(ids) <= holdout:
        raise ValueError(f"the essays hold {len(ids)} tokens, not more than the {holdout}-token holdout")
    return ids[:holdout], ids[holdout:holdout + num_train]


class _CausalKV:
    """Single-sequence causal attention backend for a plain teacher-forced forward."""

    def __init__(self, scale: float) -> None:
        from oasiskv_runtime.attention.ref import attend_ref, causal_allowed

        self.scale, self._attend, self._allowed = scale, attend_ref, causal_allowed

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._attend(q, k, v, self.scale, self._allowed(q.shape[0], k.shape[0], q.device))


@torch.inference_mode()
def capture_window(target: Any, mc: Any, ids: list[int], aux_idx: list[int], device: str) -> dict[str, torch.Tensor]:
    """Target states for one window: aux hidden ``[L, 3, H]`` fp16, top-k ids/probs ``[L, k]``, token ids."""
    x = torch.tensor(ids, device=device)
    pos = torch.arange(len(ids), device=device)
    layers = tuple(i - 1 for i in aux_idx)  # HF hidden_states[i] = output of layer i-1
    hidden, cap = target(x, pos, _CausalKV(1.0 / math.sqrt(mc.head_dim)), capture_layers=layers)
    probs = target.compute_logits(hidden).float().softmax(-1)
    top_p, top_i = probs.topk(TOPK, dim=-1)
    aux = torch.stack([cap[layer] for layer in layers], dim=1)
    return {"ids": x.int().cpu(), "aux": aux.half().cpu(), "top_i": top_i.int().cpu(), "top_p": top_p.half().cpu()}


def load_or_capture(target: Any, mc: Any, tokens: list[int], cfg: TrainDraftConfig, aux_idx: list[int], tag: str,
                    progress: Any = None) -> list[dict[str, torch.Tensor]]:
    """Windows of ``seq_len`` tokens over ``tokens``, each loaded from or saved to the cache as one ``.pt``."""
    cache = Path(cfg.cache_dir or cfg.output / "cache")
    cache.mkdir(parents=True, exist_ok=True)
    # The key names everything the cached tensors depend on, so a changed option never reuses stale states.
    key = f"{Path(cfg.model).name}-L{cfg.seq_len}-aux{'_'.join(map(str, aux_idx))}-top{TOPK}-{tag}"
    n = max(1, len(tokens) // cfg.seq_len)
    task = progress.add_task(f"target states ({tag})", total=n, info="") if progress else None
    out = []
    for w in range(n):
        chunk = tokens[w * cfg.seq_len:(w + 1) * cfg.seq_len]
        path = cache / f"{key}-{w:05d}.pt"
        shard = torch.load(path) if path.is_file() else None
        if shard is None or shard["ids"].tolist() != chunk:
            shard = capture_window(target, mc, chunk, aux_idx, cfg.device)
            tmp = path.with_suffix(".tmp")
            torch.save(shard, tmp)
            os.replace(tmp, path)  # atomic: a killed run never leaves a half-written shard
        out.append(shard)
        if progress:
            progress.advance(task)
    return out


def choose_draft_vocab(train_ids: list[int], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent target ids in the training text (ties by id), padded with the lowest unused
    ids when the text has fewer distinct tokens; sorted ascending so ``d2t`` offsets are non-negative."""
    size = min(size, vocab)
    chosen = [t for t, _ in sorted(Counter(train_ids).items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    if len(chosen) < size:
        have = set(chosen)
        chosen += [t for t in range(vocab) if t not in have][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------
# Head
# ----------------------------------------------------------------------------------------------------------


def build_head(target: Any, mc: Any, draft_ids: torch.Tensor, inter: int) -> Eagle3Head:
    """A head shaped like one target layer, warm-started from the target where shapes allow."""
    scaling = mc.rope_scaling if (mc.rope_scaling or {}).get("rope_type") in ("linear", "llama3") else None
    cfg = Eagle3Config(hidden_size=mc.hidden_size, intermediate_size=inter, num_attention_heads=mc.num_heads,
                       num_key_value_heads=mc.num_kv_heads, vocab_size=mc.vocab_size,
                       draft_vocab_size=int(draft_ids.numel()), head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
                       rope_theta=mc.rope_theta, rope_scaling=scaling, num_target_layers=mc.num_layers,
                       # Explicit taps (SpecForge/sglang convention: decoder-layer outputs), so no loader has
                       # to re-derive the default [2, n//2, n-3] hidden-state indices from the target.
                       eagle_aux_hidden_state_layer_ids=[i - 1 for i in default_aux_layer_ids(mc.num_layers)],
                       aux_layer_ids_convention="layer_output")
    head = Eagle3Head(cfg, target_embed=target.embed_tokens)
    head.set_vocab_mapping(draft_ids)
    with torch.no_grad():
        # lm_head/norm from the target's output layer: the head starts out speaking the target's vocabulary.
        out_w = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        head.lm_head.weight.copy_(out_w[draft_ids].float())
        head.norm.weight.copy_(target.norm.weight.float())
        # fc starts as "pass the high tap through" (+ small noise), the best single-tap guess of the future.
        h = mc.hidden_size
        head.fc.weight.normal_(0.0, 0.02 / math.sqrt(3))
        head.fc.weight[:, 2 * h:] += torch.eye(h)
        # Small output projections keep the initial residual close to the (informative) fused state.
        head.midlayer.self_attn.o_proj.weight.mul_(0.1)
        head.midlayer.mlp.down_proj.weight.mul_(0.1)
    return head


def half_copy(head: Eagle3Head) -> Eagle3Head:
    """An fp16 copy sharing the (unsaved) target embedding reference."""
    emb = head._target_embed
    copy = Eagle3Head(head.config, target_embed=emb, own_embedding=head.owns_embedding)
    copy.load_state_dict(head.state_dict())
    return copy.half()


def save_checkpoint(head: Eagle3Head, opt: torch.optim.Optimizer, step: int, losses: list, root: Path) -> Path:
    """``root/checkpoint-N``: fp16 head in the public layout + trainer state; written to a temp dir, renamed."""
    final = root / f"checkpoint-{step}"
    tmp = root / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    half_copy(head).save_pretrained(tmp)
    torch.save({"step": step, "head": head.state_dict(), "optimizer": opt.state_dict(), "losses": losses,
                "rng": torch.get_rng_state()}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def find_resume(cfg: TrainDraftConfig) -> Path | None:
    if not cfg.resume:
        return None
    if cfg.resume != "latest":
        return Path(cfg.resume)
    ckpts = sorted(cfg.output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


# ----------------------------------------------------------------------------------------------------------
# Loss / evaluation
# ----------------------------------------------------------------------------------------------------------


def window_loss(head: Eagle3Head, shard: dict[str, torch.Tensor], t2draft: torch.Tensor,
                start: int, length: int) -> tuple[torch.Tensor, float, int]:
    """Soft cross-entropy of head rows ``start..start+length-1`` against the target's next distribution.

    Returns (summed loss, summed top-1 agreement, rows counted)."""
    ids, dev = shard["ids"].long(), head.device
    p = torch.arange(start, start + length)
    out = head(ids[p + 1], shard["aux"][p].float(), p)
    logp = out.logits.log_softmax(-1)
    tgt = t2draft[shard["top_i"][p + 1].long()].to(dev)  # [n, k] draft ids, -1 outside the draft vocab
    q = shard["top_p"][p + 1].float().to(dev) * (tgt >= 0)
    mass = q.sum(-1, keepdim=True)
    keep = mass.squeeze(-1) > 0
    q = q / mass.clamp_min(1e-9)
    loss = -(q * logp.gather(-1, tgt.clamp_min(0))).sum(-1)[keep].sum()
    hit = ((out.logits.argmax(-1) == tgt[:, 0]) & keep).float().sum().item()
    return loss, hit, int(keep.sum())


@torch.inference_mode()
def heldout_accuracy(head: Eagle3Head, shards: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Next-token accuracy on held-out windows of the head and of the ngram draft on the same positions.

    Position ``p`` (0 <= p <= L-3) guesses ``x_{p+2}``; "vs target" compares with the target's greedy token at
    ``p+1`` (what the head is trained on), "vs text" with the essay's own token (what teacher-forced recall
    runs score as draft accuracy)."""
    from oasiskv_runtime.drafts.sources import NgramDraft

    head.eval()
    n = hit_t = hit_x = ng_t = ng_x = 0
    for shard in shards:
        ids = shard["ids"].long()
        length = ids.numel() - 2
        if length <= 0:
            continue
        p = torch.arange(length)
        out = head(ids[p + 1], shard["aux"][p].float(), p)
        guess = head.draft_to_target(out.logits.argmax(-1)).cpu()
        greedy, text = shard["top_i"][p + 1, 0].long(), ids[p + 2]
        hit_t += int((guess == greedy).sum())
        hit_x += int((guess == text).sum())
        ngram, state, toks = NgramDraft(3), None, ids.tolist()
        for i in range(length):
            g = ngram.propose_one(toks[:i + 2], state)
            state = ngram._last_state
            ng_t += int(g == int(greedy[i]))
            ng_x += int(g == int(text[i]))
        n += length
    head.train()
    d = max(n, 1)
    return {"positions": n, "head_vs_target": hit_t / d, "head_vs_text": hit_x / d,
            "ngram_vs_target": ng_t / d, "ngram_vs_text": ng_x / d}


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def train_draft(cfg: TrainDraftConfig, show_progress: bool = True) -> TrainDraftResult:
    """Capture (or load) target states, train the head, checkpoint, evaluate on the holdout, save."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from oasiskv_runtime.models.loader import load_model

    t0 = time.monotonic()
    torch.manual_seed(cfg.seed)
    cfg.output.mkdir(parents=True, exist_ok=True)
    target, tokenizer, mc = load_model(cfg.model, cfg.device, "float32", seed=cfg.seed)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer: training on text needs one")
    target.requires_grad_(False)  # the target only teaches; no gradients into its (shared) embedding
    aux_idx = default_aux_layer_ids(mc.num_layers)
    held_ids, train_ids = corpus_split(tokenizer, cfg.holdout_tokens, cfg.num_train_tokens)
    if len(train_ids) < cfg.seq_len:
        raise ValueError(f"only {len(train_ids)} training tokens, fewer than --seq-len {cfg.seq_len}")

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeRemainingColumn())
    with Progress(*cols, disable=not show_progress) as progress:
        train = load_or_capture(target, mc, train_ids, cfg, aux_idx, f"train{cfg.holdout_tokens}", progress)
        held = load_or_capture(target, mc, held_ids[:cfg.eval_tokens], cfg, aux_idx, "heldout", progress)

        draft_ids = choose_draft_vocab(train_ids, cfg.draft_vocab, mc.vocab_size)
        head = build_head(target, mc, draft_ids, cfg.intermediate_size).to(cfg.device)
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
        step, losses = 0, []
        ckpt = find_resume(cfg)
        if ckpt is not None:
            state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["optimizer"])
            step, losses = int(state["step"]), list(state["losses"])
            torch.set_rng_state(state["rng"])
        t2draft = torch.full((mc.vocab_size,), -1, dtype=torch.long)
        t2draft[head.draft_to_target(torch.arange(head.config.draft_vocab_size))] = torch.arange(
            head.config.draft_vocab_size)

        # A step trains on random crops of `rows` head rows; the head attends within its crop only.
        rows = max(1, min(cfg.batch_tokens, min(s["ids"].numel() for s in train) - 1))
        per_step = max(1, cfg.batch_tokens // rows)
        warmup = min(100, max(1, cfg.steps // 10))
        task = progress.add_task("training", total=cfg.steps, completed=step, info="")
        acc_loss = acc_hit = acc_n = 0.0
        head.train()
        while step < cfg.steps:
            # Linear warm-up then cosine decay to 10%: stable start for the randomly initialised layer.
            frac = (step - warmup) / max(1, cfg.steps - warmup)
            scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * frac))
            for g in opt.param_groups:
                g["lr"] = cfg.lr * scale
            opt.zero_grad(set_to_none=True)
            total = torch.zeros(())
            count = 0
            for w in torch.randint(len(train), (per_step,)).tolist():
                shard = train[w]
                start = int(torch.randint(shard["ids"].numel() - rows, ()).item())
                loss, hit, k = window_loss(head, shard, t2draft, start, rows)
                total, count = total + loss, count + k
                acc_hit += hit
            (total / max(count, 1)).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            acc_loss += total.item()
            acc_n += count
            if step % cfg.log_every == 0 or step == cfg.steps:
                losses.append((step, acc_loss / max(acc_n, 1), acc_hit / max(acc_n, 1)))
                acc_loss = acc_hit = acc_n = 0.0
                progress.update(task, info=f"loss {losses[-1][1]:.3f} top1 {losses[-1][2]:.3f}")
            progress.update(task, completed=step)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                save_checkpoint(head, opt, step, losses, cfg.output)
            if cfg.time_limit_s is not None and time.monotonic() - t0 > cfg.time_limit_s:
                if not losses or losses[-1][0] != step:
                    losses.append((step, acc_loss / max(acc_n, 1), acc_hit / max(acc_n, 1)))
                break

        if cfg.checkpoint_every and not (cfg.output / f"checkpoint-{step}").is_dir():
            save_checkpoint(head, opt, step, losses, cfg.output)  # so `--resume latest` finds the end state

    heldout = heldout_accuracy(head, held)
    final = half_copy(head)
    final.save_pretrained(cfg.output)
    if cfg.export is not None:
        final.save_pretrained(cfg.export)
    for d in (cfg.output, cfg.export):
        if d is not None:  # safetensors writes 0600; a head meant for the repo must be readable by all
            (Path(d) / "model.safetensors").chmod(0o644)
    res = TrainDraftResult(step=step, losses=losses, heldout=heldout,
                           head_bytes=(cfg.output / "model.safetensors").stat().st_size, wall_s=time.monotonic() - t0)
    summary = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
               "aux_hidden_state_indices": aux_idx, "train_tokens": len(train_ids),
               "heldout_tokens": len(held_ids), **asdict(res)}
    (cfg.output / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return res
