"""Prediction recall on real text: how well each mode's look-ahead predicts the next step's top-K blocks.

Teacher forcing over Paul Graham essays: the prompt is an essay prefix of ``context_len - num_steps`` tokens,
then ``num_steps`` decode steps append a forced continuation. At every decode step and layer, the set
predicted one step earlier (from the current query in proxy-prefetch, from the draft's query in oasiskv) is
compared with the top-K of the true next query (SPEC item 1: the paper's 98.74% vs 83.9%).

The continuation is either the essay's own next tokens (``text``) or the model's own greedy continuation of
the prefix (``self``: one dense greedy run per context length, then forced for every mode, so all modes see
the same token stream). ``self`` is what serving sees: the model decodes its own tokens, so the next query is
the one after the model's token, and a draft that predicts the model's next token (the ``oracle`` here, a head
trained on the model's outputs) is scored against what it was built for. ``text`` scores drafts against the
essay's tokens, which the model itself predicts only about half the time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from oasisbench.accuracy.haystack import load_essays


@dataclass
class RecallPoint:
    mode: str
    draft: str | None
    context_len: int
    top_k_blocks: int
    recall: float | None
    recall_per_layer: list[float | None] = field(default_factory=list)
    draft_accuracy: float | None = None
    fetched_bytes_per_step: float = 0.0
    deferred_blocks_per_step: float = 0.0
    num_texts: int = 0
    num_steps: int = 0
    continuation: str = "text"
    forced_sha1: str = ""
    """Digest of the forced continuations: equal digests mean two points saw the same token streams."""
    per_text: list[dict[str, Any]] = field(default_factory=list)
    """Per text, in window order: ``recall_hits`` and ``recall_total`` (summed over layers and steps; ``recall``
    is their ratio over all texts) and ``draft_accuracy``. What :func:`gap_closed` resamples."""


CONTINUATIONS = ("text", "self")
PER_TEXT = ("recall_hits", "recall_total", "draft_accuracy")  # request metrics kept per text


def essay_windows(tokenizer: Any, num_texts: int, length: int) -> list[list[int]]:
    """``num_texts`` token windows of ``length`` tokens from the essays (concatenated, deterministic)."""
    ids: list[int] = []
    for text in load_essays():
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= num_texts * length:
            break
    if len(ids) < num_texts * length:
        raise ValueError(f"the essays hold {len(ids)} tokens, fewer than {num_texts} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(num_texts)]


def _pool_sizes(model: str, dtype: str, num_texts: int, ctx: int) -> dict[str, int]:
    """KV pools sized to the texts (4x their full KV on the device, 2x in the host pool, at least 256 MiB),
    not the engine's defaults (90% of free GPU memory, 64 GiB of pinned host memory with CUDA), so recall runs
    start fast and several can share one GPU."""
    import torch

    from oasiskv_runtime.models.loader import DTYPES, model_config_for

    mc, _, _ = model_config_for(model)
    need = num_texts * (ctx + 64) * mc.kv_bytes_per_token(torch.tensor([], dtype=DTYPES[dtype]).element_size())
    return {"kv_cache_bytes": max(256 << 20, 4 * need), "host_kv_bytes": max(256 << 20, 2 * need)}


def self_continuations(model: str, prompts: list[list[int]], num_steps: int, device: str, dtype: str,
                       pools: dict[str, int] | None = None) -> list[list[int]]:
    """The model's own greedy continuation of each prompt (dense attention, ``num_steps`` tokens, EOS ignored)."""
    from oasiskv_runtime import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, mode="dense", max_num_seqs=len(prompts), **(pools or {}))
    outs = llm.generate(prompts, SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def _digest(forced: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(forced).encode()).hexdigest()[:12]


def run_recall(model: str, context_lens: list[int], configs: list[tuple[str, str | None]], top_k_blocks: int | None,
               num_texts: int, num_steps: int, fetch_ratio: float, device: str, dtype: str,
               on_point: Callable[[RecallPoint], None] | None = None,
               continuations: tuple[str, ...] = ("text",)) -> list[RecallPoint]:
    """configs: (mode, draft) pairs, e.g. [("proxy-prefetch", None), ("oasiskv", "oracle")]; continuations:
    any of ``text`` (the essay's next tokens) and ``self`` (the model's own greedy continuation)."""
    from oasiskv_runtime import LLM, SamplingParams

    for c in continuations:
        if c not in CONTINUATIONS:
            raise ValueError(f"unknown continuation {c!r}; choose from {', '.join(CONTINUATIONS)}")
    points = []
    tokenizer = None
    for ctx in context_lens:
        budget = top_k_blocks or max(1, ctx // 16 // 8)  # default: 1/8 of the context
        pools = _pool_sizes(model, dtype, num_texts, ctx)
        windows = None
        for cont in continuations:
            forced = None
            for mode, draft in configs:
                llm = LLM(model, device=device, dtype=dtype, mode=mode, top_k_blocks=budget, measure_recall=True,
                          fetch_ratio=fetch_ratio, draft=draft or "ngram", max_num_seqs=num_texts, **pools)
                tokenizer = tokenizer or llm.tokenizer
                if tokenizer is None:
                    raise ValueError(f"model {model!r} has no tokenizer: recall on real text needs one")
                if windows is None:
                    windows = essay_windows(tokenizer, num_texts, ctx)
                prompts = [w[: ctx - num_steps] for w in windows]
                if forced is None:
                    forced = ([w[ctx - num_steps:] for w in windows] if cont == "text" else
                              self_continuations(model, prompts, num_steps, device, dtype, pools))
                outs = llm.generate(prompts, SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True),
                                    forced_output_ids=forced)
                st = llm.engine.run_stats()
                p = RecallPoint(mode=mode, draft=draft if mode == "oasiskv" else None, context_len=ctx,
                                top_k_blocks=budget, recall=st["prediction_recall"],
                                recall_per_layer=st["recall_per_layer"] or [], draft_accuracy=st["draft_accuracy"],
                                fetched_bytes_per_step=st["fetched_bytes_per_step"],
                                deferred_blocks_per_step=st["deferred_blocks_per_step"], num_texts=num_texts,
                                num_steps=num_steps, continuation=cont, forced_sha1=_digest(forced),
                                per_text=[{k: o.metrics.get(k) for k in PER_TEXT} for o in outs])
                del llm  # free its pools before the next mode allocates its own
                points.append(p)
                if on_point is not None:
                    on_point(p)
    return points


def _gap(hits: dict[str, list[int]], totals: dict[str, list[int]], texts: list[int], draft: str) -> float | None:
    r = {k: sum(hits[k][i] for i in texts) / max(1, sum(totals[k][i] for i in texts))
         for k in ("proxy", "oracle", draft)}
    span = r["oracle"] - r["proxy"]
    return (r[draft] - r["proxy"]) / span if span > 0 else None


def gap_closed(points: list[RecallPoint], resamples: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """Share of the recall gap between proxy-prefetch and the ``oracle`` draft that each other draft closes,
    ``(draft - proxy) / (oracle - proxy)``, per context length and continuation, with a 95% interval from a paired
    bootstrap over texts (the same resampled texts for the three recalls, as they saw the same streams).

    Only groups holding proxy-prefetch, the oracle and per-text counts for every point are reported; a point
    without per-text counts (e.g. every block fit the budget) leaves its group out."""
    import random

    groups: dict[tuple[int, str], dict[str, RecallPoint]] = {}
    for p in points:
        key = "proxy" if p.mode == "proxy-prefetch" else ("oracle" if p.draft == "oracle" else p.draft or "")
        groups.setdefault((p.context_len, p.continuation), {})[key] = p
    rows = []
    rng = random.Random(seed)
    for (ctx, cont), g in groups.items():
        if "proxy" not in g or "oracle" not in g:
            continue
        n = g["proxy"].num_texts
        if any(len(p.per_text) != n or any(t.get("recall_total") is None for t in p.per_text) for p in g.values()):
            continue
        hits = {k: [t["recall_hits"] for t in p.per_text] for k, p in g.items()}
        totals = {k: [t["recall_total"] for t in p.per_text] for k, p in g.items()}
        draws = [[rng.randrange(n) for _ in range(n)] for _ in range(resamples)]
        for draft in g:
            if draft in ("proxy", "oracle"):
                continue
            value = _gap(hits, totals, list(range(n)), draft)
            boot = sorted(v for v in (_gap(hits, totals, d, draft) for d in draws) if v is not None)
            lo, hi = (boot[int(0.025 * (len(boot) - 1))], boot[int(0.975 * (len(boot) - 1))]) if boot else (None, None)
            rows.append({"context_len": ctx, "continuation": cont, "draft": draft, "gap_closed": value,
                         "ci95": [lo, hi], "num_texts": n, "resamples": resamples})
    return rows
