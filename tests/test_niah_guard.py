"""A CI guard on accuracy at a tight budget (issue #34): SmolLM2-135M (real weights) on the CPU, one small
deterministic NIAH point through the accuracy suite's own NIAH loop, dense and oasiskv with every default but the
budget.

The point: single-needle prompts of 1K tokens at the five default depths, K = 16 blocks (a quarter of the
context), 16 generated tokens. Measured on the 2-core dev CPU (float32; ~31 s for both engines): dense 5/5, oasiskv
3/5 (misses at depths 50 and 75). The guard fails, as it must, with the prediction broken (Quest scores negated: 0/5),
with the budget forced down to K = 4 (0/5) and for proxy-prefetch at K = 16 (1/5); an n-gram-only draft scored 3/5,
as the default did, and K = 8 3/5. The single needle is the family whose dense score is full at 1K and whose oasiskv
score held when it ran alone and batched with another family (the topic-switch family moved by two samples).
"""

from __future__ import annotations

import pytest

from oasiskv_runtime import LLM
from oasiskv_runtime.models.assets import SMOLLM2

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(SMOLLM2.path() is None, reason=f"needs {SMOLLM2.install}")]

FAMILY, CONTEXT, TOP_K = "niah_single_needle", 1024, 16
MIN_CORRECT = {"dense": 4, "oasiskv": 2}
"""Samples of the 5 each mode must get right: what each scored on the dev CPU, less one."""


def niah_scores(mode: str, **options) -> list[float]:
    """Per-sample scores of one engine on the guard's point, by the loop ``oasisbench accuracy`` runs NIAH with
    (prompts, greedy decoding, scoring)."""
    from oasisbench.runners.accuracy import AccuracyConfig, _run_niah

    cfg = AccuracyConfig(tasks=(FAMILY,), model="smollm2-135m", limit=5, context_lens=(CONTEXT,), max_gen_toks=16)
    llm = LLM("smollm2-135m", mode=mode, kv_cache_gb=0.3, **options)
    samples, _ = _run_niah(cfg, llm, [FAMILY])
    return [s.score for s in samples]


def test_oasiskv_defaults_keep_their_niah_score_at_a_quarter_budget():
    dense = niah_scores("dense")
    assert len(dense) == 5 and sum(dense) >= MIN_CORRECT["dense"], dense  # the point is answerable at all
    oasiskv = niah_scores("oasiskv", top_k_blocks=TOP_K)
    assert sum(oasiskv) >= MIN_CORRECT["oasiskv"], oasiskv
