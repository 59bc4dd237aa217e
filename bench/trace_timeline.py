#!/usr/bin/env python3
"""Per-layer timeline of profiled decode steps: when each layer's prefetch could start and when it ran.

    python bench/trace_timeline.py TRACE.json.gz [--gap-us 300]

TRACE: a raw torch.profiler chrome trace, e.g. the ``*-trace-first.json.gz`` that ``bench_decode.py --trace``
writes beside its text summary (two decode steps as they run, graph replays included). Per layer of every step
(the n-th launch of each kernel below is layer n's): the main stream's attention kernel, the prediction
stream's score kernel, the selection kernel and the UVA gather, in ms from the first kernel; the gather's
duration; and ``link idle``: how long the transfer stream sat idle before this gather (0 when the gathers queue
back to back, i.e. the link sets the pace). Then per step: the main stream's span, the gathers' summed time and
the main stream's mean time per layer.

Reading it: a gather that starts right after its selection, with the link idle before it, means the
prefetch waits on the step's own progress (the link has room); gathers back to back, later and later after
their selections, mean the link is the bottleneck.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict

#: The kernels a layer of the sparse decode step is told by: attention (main stream), score (prediction stream),
#: selection and the UVA gather (transfer stream).
ATTENTION, SCORE = "_sparse_attn_fwd", "_quest_score_kernel"
SELECT, GATHER = "_select_plan_kernel", "_uva_gather_kernel"


def load_kernels(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def _end(e: dict) -> float:
    return e["ts"] + e["dur"]


def split_steps(kernels: list[dict], main_stream, gap_us: float) -> list[tuple[float, float]]:
    """(start, end) of each run of main-stream kernels with no gap over ``gap_us`` between them, in us."""
    spans: list[list[float]] = []
    for e in (k for k in kernels if k["args"].get("stream") == main_stream):
        if spans and e["ts"] - spans[-1][1] <= gap_us:
            spans[-1][1] = max(spans[-1][1], _end(e))
        else:
            spans.append([e["ts"], _end(e)])
    return [(a, b) for a, b in spans]


def timeline(kernels: list[dict], gap_us: float = 300.0) -> dict:
    """Layer rows and step rows (module docstring) of a trace's kernels; times in ms from the first kernel."""
    if not kernels:
        raise ValueError("the trace holds no kernels")
    by = defaultdict(list)
    for e in kernels:
        by[e["name"]].append(e)
    if not by[ATTENTION]:
        raise ValueError(f"no {ATTENTION} kernel in the trace: not a sparse decode step")
    t0 = kernels[0]["ts"]
    ms = lambda t: (t - t0) / 1e3  # noqa: E731
    streams = [a["args"].get("stream") for a in by[ATTENTION]]
    main = max(set(streams), key=streams.count)  # the stream most attention kernels ran on
    steps = [s for s in split_steps(kernels, main, gap_us) if any(s[0] <= a["ts"] <= s[1] for a in by[ATTENTION])]
    layers = []
    gathers = by[GATHER]
    for i, a in enumerate(by[ATTENTION]):
        row = {"layer": i, "attention_start": ms(a["ts"]), "attention_end": ms(_end(a))}
        for key, name in (("score_end", SCORE), ("select_end", SELECT)):
            if i < len(by[name]):
                row[key] = ms(_end(by[name][i]))
        if i < len(gathers):
            g = gathers[i]
            row.update(gather_start=ms(g["ts"]), gather_end=ms(_end(g)), gather_ms=g["dur"] / 1e3)
            if i > 0:
                row["link_idle_ms"] = max(0.0, (g["ts"] - _end(gathers[i - 1])) / 1e3)
        layers.append(row)
    step_rows = []
    for a, b in steps:
        n_attn = sum(1 for x in by[ATTENTION] if a <= x["ts"] <= b)
        g_in = [g for g in gathers if a <= g["ts"] <= b + gap_us]
        step_rows.append({"start": ms(a), "end": ms(b), "main_span_ms": (b - a) / 1e3, "layers": n_attn,
                          "main_ms_per_layer": (b - a) / 1e3 / max(1, n_attn),
                          "gathers": len(g_in), "gather_ms": sum(g["dur"] for g in g_in) / 1e3})
    return {"layers": layers, "steps": step_rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--gap-us", type=float, default=300.0,
                    help="a main-stream gap longer than this separates two steps (default 300)")
    args = ap.parse_args(argv)
    try:
        t = timeline(load_kernels(args.trace), args.gap_us)
    except (OSError, ValueError) as e:
        print(f"trace_timeline: {e}", file=sys.stderr)
        return 2
    cols = ("attention_start", "attention_end", "score_end", "select_end", "gather_start", "gather_end",
            "gather_ms", "link_idle_ms")
    print("layer " + " ".join(f"{c:>15}" for c in cols))
    for r in t["layers"]:
        print(f"{r['layer']:5} " + " ".join(f"{r[c]:15.3f}" if c in r else f"{'-':>15}" for c in cols))
    for i, s in enumerate(t["steps"]):
        print(f"step {i}: main stream {s['start']:.2f}-{s['end']:.2f} ms ({s['main_span_ms']:.2f} ms, {s['layers']} "
              f"layers, {s['main_ms_per_layer']:.3f} ms/layer); {s['gathers']} gathers, {s['gather_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
