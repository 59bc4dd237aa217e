"""Prediction recall on real text: how well each mode's look-ahead predicts the next step's top-K blocks.

Teacher forcing over Paul Graham essays: the prompt is an essay prefix of ``context_len - num_steps`` tokens,
then ``num_steps`` decode steps append the essay's own next tokens. At every decode step and layer, the set
predicted one step earlier (from the current query in proxy-prefetch, from the draft's query in oasiskv) is
compared with the top-K of the true next query (SPEC item 1: the paper's 98.74% vs 83.9%).
"""

from __future__ import annotations

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


def run_recall(model: str, context_lens: list[int], configs: list[tuple[str, str | None]], top_k_blocks: int | None,
               num_texts: int, num_steps: int, fetch_ratio: float, device: str, dtype: str,
               on_point: Callable[[RecallPoint], None] | None = None) -> list[RecallPoint]:
    """configs: (mode, draft) pairs, e.g. [("proxy-prefetch", None), ("oasiskv", "oracle")]."""
    from oasiskv_runtime import LLM, SamplingParams

    points = []
    tokenizer = None
    for ctx in context_lens:
        budget = top_k_blocks or max(1, ctx // 16 // 8)  # default: 1/8 of the context
        windows = None
        for mode, draft in configs:
            llm = LLM(model, device=device, dtype=dtype, mode=mode, top_k_blocks=budget, measure_recall=True,
                      fetch_ratio=fetch_ratio, draft=draft or "ngram", max_num_seqs=num_texts)
            tokenizer = tokenizer or llm.tokenizer
            if tokenizer is None:
                raise ValueError(f"model {model!r} has no tokenizer: recall on real text needs one")
            if windows is None:
                windows = essay_windows(tokenizer, num_texts, ctx)
            prompts = [w[: ctx - num_steps] for w in windows]
            forced = [w[ctx - num_steps:] for w in windows]
            llm.generate(prompts, SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True),
                         forced_output_ids=forced)
            st = llm.engine.run_stats()
            p = RecallPoint(mode=mode, draft=draft if mode == "oasiskv" else None, context_len=ctx,
                            top_k_blocks=budget, recall=st["prediction_recall"],
                            recall_per_layer=st["recall_per_layer"] or [], draft_accuracy=st["draft_accuracy"],
                            fetched_bytes_per_step=st["fetched_bytes_per_step"],
                            deferred_blocks_per_step=st["deferred_blocks_per_step"], num_texts=num_texts,
                            num_steps=num_steps)
            points.append(p)
            if on_point is not None:
                on_point(p)
    return points
