"""Draft sources for OasisKV's look-ahead row (see :mod:`oasiskv_runtime.drafts.sources`).

``auto`` (the default draft) resolves per target model: a head shipped under ``drafts/heads/<model name>``
(today SmolLM2-135M's EAGLE-3 head) behind the n-gram draft, ``ngram+eagle3:<head>``: on the H200 it closed 77.3%
of the proxy-to-oracle recall gap at 2K and 76.6% at 4K, where the head alone closed 76.0% and 82.0%
(docs/benchmarks.md, "Draft and recall"); the n-gram draft alone for other models.
"""

from __future__ import annotations

from pathlib import Path

HEADS_DIR = Path(__file__).parent / "heads"


def shipped_head(model: str) -> Path | None:
    """The head shipped for ``model`` (a preset name, or a path whose last part is one), if any."""
    d = HEADS_DIR / Path(model).name
    return d if (d / "config.json").is_file() and (d / "model.safetensors").is_file() else None


def resolve_draft(spec: str, model: str) -> str:
    """``spec`` with ``auto`` replaced by what it means for ``model``; any other spec unchanged."""
    if spec != "auto":
        return spec
    head = shipped_head(model)
    return f"ngram+eagle3:{head}" if head is not None else "ngram"
