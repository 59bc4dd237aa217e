#!/usr/bin/env python3
"""Merge `oasisbench recall` files that scored the same forced streams, and recompute the gap closed.

    python bench/merge_recall.py OUT.json base.json new.json [...]

A recall run of a new head needs proxy-prefetch and the oracle beside it to report the share of the gap it
closes; those two cost as much as the head itself on the CPU. With ``--no-proxy`` and without ``oracle`` a run
scores only the new drafts; this script takes proxy-prefetch and the oracle from an earlier file of the same
model, contexts, step count and continuation, and checks that every merged point saw the same token streams
(``forced_sha1``) before it recomputes :func:`oasisbench.runners.recall.gap_closed`. Later files win where two
files hold the same (mode, draft, context, continuation). Prints the gap table; writes OUT atomically.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oasisbench.results.store import atomic_write_json  # noqa: E402
from oasisbench.runners.recall import RecallPoint, gap_closed  # noqa: E402


def merge(docs: list[dict]) -> dict:
    models = {d["model"] for d in docs}
    if len(models) != 1:
        raise SystemExit(f"merge_recall: files of different models {sorted(models)}")
    points: dict[tuple, dict] = {}
    for d in docs:
        for p in d["points"]:
            points[(p["mode"], p["draft"], p["context_len"], p["continuation"])] = p
    streams: dict[tuple, set] = {}
    for p in points.values():
        streams.setdefault((p["context_len"], p["continuation"], p["num_texts"], p["num_steps"]), set()).add(
            p["forced_sha1"])
    bad = {k: v for k, v in streams.items() if len(v) > 1}
    if bad:
        raise SystemExit(f"merge_recall: points of one context saw different streams: {bad}")
    kept = list(points.values())
    gaps = gap_closed([RecallPoint(**p) for p in kept])
    devices = sorted({d["device"] for d in docs})
    return {"schema_version": 1, "model": docs[0]["model"], "device": ",".join(devices), "points": kept,
            "gap_closed": gaps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    args = ap.parse_args()
    doc = merge([json.loads(p.read_text()) for p in args.inputs])
    atomic_write_json(args.out, doc)
    for g in doc["gap_closed"]:
        acc = next(p["draft_accuracy"] for p in doc["points"] if p["draft"] == g["draft"]
                   and p["context_len"] == g["context_len"] and p["continuation"] == g["continuation"])
        lo, hi = g["ci95"]
        print(f"{g['context_len']:5d} {g['continuation']:4s} {g['draft']:60s} gap closed "
              f"{100 * g['gap_closed']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] draft accuracy {acc:.3f} "
              f"({g['num_texts']} texts)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
