"""Draft sources for OasisKV's look-ahead row (see :mod:`oasiskv_runtime.drafts.sources`).

``auto`` (the default draft) resolves per target model: a head shipped under ``drafts/heads/<model name>``
(today SmolLM2-135M's EAGLE-3 head) behind the n-gram draft, ``ngram+eagle3:<head>``, which closes the most
of the recall gap of any draft measured (bench/NOTES.md); the n-gram draft alone for other models.
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
