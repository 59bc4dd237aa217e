"""Tiny task data files in their datasets' original schemas, for accuracy-runner tests (no hub download)."""

from __future__ import annotations

import json
from pathlib import Path


def write_aime24(directory: Path, n: int) -> Path:
    """``directory/aime24.jsonl``: ``n`` problems in Maxwell-Jia/AIME_2024's schema (problem i asks for i + 1);
    returns ``directory`` (the ``--data-dir``)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"ID": f"2024-I-{i}", "Problem": f"Find {i} plus one.", "Solution": "...", "Answer": str(i + 1)}
            for i in range(n)]
    (directory / "aime24.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory
