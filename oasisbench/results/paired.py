"""Paired accuracy differences between two settings that answered the same documents, in one run or two.

A study compares settings run by different commands (oasiskv in one run, the exact top-K in another): their
``report.md`` deltas are each against their own run's dense anchor, and a difference of two scores says nothing about
how many documents it rests on. :func:`paired_diff` reads both runs' ``samples-*.jsonl`` (every scored document, with
its setting), keeps the documents both settings answered and gives the mean difference with its paired 95% interval
(:func:`oasisbench.runners.accuracy.paired_interval`), per context length and pooled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from oasisbench.accuracy import tasks as T
from oasisbench.runners.accuracy import Sample, label, paired_interval


@dataclass
class PairedRow:
    context_len: int | None
    """None: every length pooled."""
    num_samples: int
    score_a: float
    score_b: float
    delta: float
    """``score_b - score_a``, points."""
    ci95: float | None


def load_samples(run_dir: Path) -> dict[str, list[Sample]]:
    """Every scored document of an accuracy run, by setting label (as the run's report names them)."""
    files = sorted(Path(run_dir).glob("samples-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no samples-*.jsonl (not an accuracy run directory?)")
    out: dict[str, list[Sample]] = {}
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                name = label(d["mode"], d.get("setting") or {}, d.get("engine", "embedded"))
                s = Sample(d["task"], d["doc_id"], d.get("strata") or {}, float(d["score"]), d.get("target"), [])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{f}:{n}: not a scored sample ({e})") from None
            out.setdefault(name, []).append(s)
    return out


def pick(samples: dict[str, list[Sample]], name: str, run_dir: Path) -> list[Sample]:
    if name not in samples:
        raise KeyError(f"{run_dir} has no setting {name!r}; it has: {', '.join(samples)}")
    return samples[name]


def paired_diff(a: list[Sample], b: list[Sample], task: str = "niah") -> list[PairedRow]:
    """``b - a`` over the documents of ``task`` (a group such as ``niah`` pools its families) both answered: one row
    per context length, then the pooled row when there are several. Raises ValueError when none pair or a side
    answers a document twice."""
    tasks = set(T.GROUPS.get(task, [task]))
    for side, samples in (("A", a), ("B", b)):
        keys = [(s.task, s.doc_id) for s in samples if s.task in tasks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{side} answers some documents more than once (two runs of one length pooled?)")
    a_by = {(s.task, s.doc_id): s for s in a if s.task in tasks}
    common = [s for s in b if s.task in tasks and (s.task, s.doc_id) in a_by]
    if not common:
        raise ValueError(f"no document of {task!r} was answered by both settings")
    lengths = sorted({s.strata.get("context_len") for s in common}, key=lambda x: (x is None, x))
    groups = [(n, [s for s in common if s.strata.get("context_len") == n]) for n in lengths]
    if len(groups) > 1:
        groups.append((None, common))
    rows = []
    for n, bs in groups:
        as_ = [a_by[s.task, s.doc_id] for s in bs]
        sa, sb = (100.0 * sum(s.score for s in x) / len(x) for x in (as_, bs))
        rows.append(PairedRow(n, len(bs), sa, sb, sb - sa, paired_interval(bs, as_)))
    return rows


def render(rows: list[PairedRow], name_a: str, name_b: str, task: str) -> str:
    out = [f"`{task}`: A = `{name_a}`, B = `{name_b}`; B - A in points, 95% interval paired over the same "
           "documents", "",
           "| context | n | A | B | B - A |", "|---|---|---|---|---|"]
    for r in rows:
        ci = "" if r.ci95 is None else f" ±{r.ci95:.1f}"
        out.append(f"| {'all' if r.context_len is None else r.context_len} | {r.num_samples} | {r.score_a:.1f} | "
                   f"{r.score_b:.1f} | {r.delta:+.1f}{ci} |")
    return "\n".join(out) + "\n"
