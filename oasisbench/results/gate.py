"""CI regression gate: check a run against a baseline file.

Policy: gate only on what is deterministic on a given commit and workload (token counts, bytes and blocks
fetched, admitted batch, preemptions, prediction recall, draft accuracy) and on *ratios measured side by
side in one run* (oasiskv / dense throughput on the same machine, same minute). Never gate on one
wall-clock time (a TTFT, a TPOT, a throughput): CI machines are shared and noisy, and such a gate either
flakes or is set so loose it catches nothing. :func:`make_baseline` refuses wall-clock metrics unless
asked explicitly.

Baseline format (YAML or JSON)::

    schema_version: 1
    suite: throughput-smoke
    checks:
      - point: {mode: oasiskv, context_len: 4096, concurrency: 8}   # partial match
        metric: fetched_bytes_per_step
        expected: 1.5e6
        tolerance: {rel: 0.05, abs: 0}          # allowed = max(rel * |expected|, abs)
        direction: lower_is_better             # | higher_is_better | equal
    ratio_checks:
      - metric: output_throughput
        numerator: {mode: oasiskv}
        denominator: {mode: dense}
        match_on: [context_len, concurrency]
        min: 0.5                               # and/or max

A check whose partial point matches several records must hold for each of them; a check matching no
record, or a record lacking the metric, fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from oasisbench.results.schema import SCHEMA_VERSION, Record, Run, metric_value, point_id, point_matches
from oasisbench.results.store import atomic_write_json, atomic_write_text

DIRECTIONS = ("higher_is_better", "lower_is_better", "equal")

#: Direction :func:`make_baseline` gives each metric; unlisted metrics default to ``equal``.
DEFAULT_DIRECTIONS: dict[str, str] = {
    "completed": "higher_is_better",
    "failed": "lower_is_better",
    "num_preemptions": "lower_is_better",
    "fetched_bytes_per_step": "lower_is_better",
    "fetched_blocks_per_step": "lower_is_better",
    "deferred_blocks_per_step": "lower_is_better",
    "resident_gpu_bytes_per_request": "lower_is_better",
    "peak_device_memory_bytes": "lower_is_better",
    "prediction_recall": "higher_is_better",
    "draft_accuracy": "higher_is_better",
    "max_admitted_batch": "higher_is_better",
    "max_running_batch": "higher_is_better",
    "total_output_tokens": "equal",
    "total_input_tokens": "equal",
}

#: Metrics that are one wall-clock measurement; see the module policy.
WALL_CLOCK_METRICS: frozenset[str] = frozenset(
    ["duration", "output_throughput", "request_throughput", "total_token_throughput"]
    + [f"{s}_{m}_ms" for s in ("mean", "median", "p99", "std") for m in ("ttft", "tpot", "itl")]
)


class BaselineError(ValueError):
    """The baseline file is missing fields or malformed; the message names the file and the check."""


@dataclass
class CheckOutcome:
    """Result of one check against one record (or one ratio against one record pair)."""

    kind: str
    """``check`` or ``ratio``."""
    metric: str
    point: str
    """Point id of the record checked, or the partial point when nothing matched."""
    expected: str
    """Human-readable expectation, e.g. ``<= 1.5e6 (+5%)`` or ``>= 0.5``."""
    actual: float | None
    passed: bool
    message: str = ""


@dataclass
class GateResult:
    """All outcomes of a gate; ``passed`` only when every outcome passed."""

    outcomes: list[CheckOutcome] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outcomes)

    @property
    def failures(self) -> list[CheckOutcome]:
        return [o for o in self.outcomes if not o.passed]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_baseline(path: Path) -> dict[str, Any]:
    """Read and validate a baseline file (``.json`` as JSON, anything else as YAML)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: baseline file not found")
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise BaselineError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    return validate_baseline(doc, str(path))


def validate_baseline(doc: Any, where: str = "baseline") -> dict[str, Any]:
    """Check a baseline's structure up front, so a typo fails loudly instead of silently passing."""
    if not isinstance(doc, dict):
        raise BaselineError(f"{where}: expected a mapping at top level")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise BaselineError(f"{where}: schema_version {doc.get('schema_version')!r} is not {SCHEMA_VERSION}")
    for i, check in enumerate(doc.get("checks") or []):
        at = f"{where}: checks[{i}]"
        if not isinstance(check, dict) or not isinstance(check.get("point"), dict):
            raise BaselineError(f"{at}: needs a 'point' mapping")
        if not isinstance(check.get("metric"), str):
            raise BaselineError(f"{at}: needs a 'metric' name")
        if not _is_number(check.get("expected")):
            raise BaselineError(f"{at}: 'expected' must be a number, got {check.get('expected')!r}")
        if check.get("direction", "equal") not in DIRECTIONS:
            raise BaselineError(f"{at}: direction must be one of {', '.join(DIRECTIONS)}")
        tol = check.get("tolerance", {})
        if not isinstance(tol, dict) or set(tol) - {"rel", "abs"} or not all(_is_number(v) for v in tol.values()):
            raise BaselineError(f"{at}: tolerance must be a mapping with numeric 'rel' and/or 'abs'")
    for i, check in enumerate(doc.get("ratio_checks") or []):
        at = f"{where}: ratio_checks[{i}]"
        if not isinstance(check, dict) or not isinstance(check.get("metric"), str):
            raise BaselineError(f"{at}: needs a 'metric' name")
        for side in ("numerator", "denominator"):
            if not isinstance(check.get(side), dict):
                raise BaselineError(f"{at}: needs a '{side}' point mapping")
        if not isinstance(check.get("match_on", []), list):
            raise BaselineError(f"{at}: match_on must be a list of point keys")
        if not any(_is_number(check.get(b)) for b in ("min", "max")):
            raise BaselineError(f"{at}: needs a numeric 'min' and/or 'max'")
    return doc


def _check_record(check: dict[str, Any], record: Record) -> CheckOutcome:
    metric, expected = check["metric"], float(check["expected"])
    direction = check.get("direction", "equal")
    tol = check.get("tolerance", {})
    allowed = max(float(tol.get("rel", 0.0)) * abs(expected), float(tol.get("abs", 0.0)))
    symbol = {"higher_is_better": ">=", "lower_is_better": "<=", "equal": "=="}[direction]
    want = f"{symbol} {expected:g}" + (f" ±{allowed:g}" if allowed else "")
    pid = point_id(record["point"])
    actual = metric_value(record, metric)
    if actual is None:
        return CheckOutcome("check", metric, pid, want, None, False, "metric missing or not a number")
    if direction == "higher_is_better":
        ok = actual >= expected - allowed
    elif direction == "lower_is_better":
        ok = actual <= expected + allowed
    else:
        ok = abs(actual - expected) <= allowed
    msg = "" if ok else f"regressed: {actual:g} vs expected {expected:g} (allowed {allowed:g})"
    return CheckOutcome("check", metric, pid, want, actual, ok, msg)


def _ratio_outcomes(check: dict[str, Any], run: Run) -> list[CheckOutcome]:
    metric, match_on = check["metric"], list(check.get("match_on", []))
    lo = float(check["min"]) if _is_number(check.get("min")) else None
    hi = float(check["max"]) if _is_number(check.get("max")) else None
    bounds = (f">= {lo:g}" if lo is not None else "", f"<= {hi:g}" if hi is not None else "")
    want = " and ".join(b for b in bounds if b)
    label = f"{point_id(check['numerator'])} / {point_id(check['denominator'])}"
    nums = [r for r in run.records if point_matches(r["point"], check["numerator"])]
    if not nums:
        return [CheckOutcome("ratio", metric, label, want, None, False, "no record matches the numerator")]
    outcomes = []
    for num in nums:
        keys = {k: num["point"][k] for k in match_on if k in num["point"]}
        dens = [r for r in run.records if point_matches(r["point"], {**check["denominator"], **keys})]
        pid = point_id(num["point"])
        if len(dens) != 1:
            why = "no denominator record" if not dens else f"{len(dens)} denominator records match; extend match_on"
            outcomes.append(CheckOutcome("ratio", metric, pid, want, None, False, f"{why} for {point_id(keys)}"))
            continue
        a, b = metric_value(num, metric), metric_value(dens[0], metric)
        if a is None or b is None or b == 0:
            outcomes.append(CheckOutcome("ratio", metric, pid, want, None, False, "metric missing or zero denominator"))
            continue
        ratio = a / b
        ok = (lo is None or ratio >= lo) and (hi is None or ratio <= hi)
        msg = "" if ok else f"ratio {ratio:.3g} out of range"
        outcomes.append(CheckOutcome("ratio", metric, pid, want, ratio, ok, msg))
    return outcomes


def gate(run: Run, baseline: dict[str, Any] | Path) -> GateResult:
    """Evaluate every check and ratio check of ``baseline`` (a dict or a file path) against ``run``."""
    doc = load_baseline(baseline) if isinstance(baseline, (str, Path)) else validate_baseline(baseline)
    result = GateResult()
    if doc.get("suite") not in (None, run.suite):
        result.outcomes.append(
            CheckOutcome("check", "suite", run.suite, str(doc["suite"]), None, False, "baseline is for another suite")
        )
    for check in doc.get("checks") or []:
        matches = [r for r in run.records if point_matches(r["point"], check["point"])]
        if not matches:
            result.outcomes.append(
                CheckOutcome("check", check["metric"], point_id(check["point"]), f"{check['expected']:g}", None, False,
                             "no record matches this point")
            )
        result.outcomes += [_check_record(check, r) for r in matches]
    for check in doc.get("ratio_checks") or []:
        result.outcomes += _ratio_outcomes(check, run)
    return result


def make_baseline(
    run: Run,
    metrics: list[str],
    tolerance_rel: float = 0.0,
    *,
    tolerance_abs: float = 0.0,
    allow_wall_clock: bool = False,
) -> dict[str, Any]:
    """A baseline with one check per (record, metric) holding the run's current value.

    Directions come from :data:`DEFAULT_DIRECTIONS`. Metrics a record lacks (or has as null) are
    skipped for that record. Raises ``ValueError`` for wall-clock metrics unless ``allow_wall_clock``
    (see the module policy).
    """
    timed = [m for m in metrics if m in WALL_CLOCK_METRICS]
    if timed and not allow_wall_clock:
        raise ValueError(
            f"refusing to gate on wall-clock metric(s) {', '.join(timed)}: gate on counts, or on a ratio "
            "check measured in one run (ratio_checks)"
        )
    checks = []
    for record in run.records:
        for metric in metrics:
            value = record["metrics"].get(metric)
            if not _is_number(value):
                continue
            checks.append(
                {
                    "point": dict(record["point"]),
                    "metric": metric,
                    "expected": value,
                    "tolerance": {"rel": tolerance_rel, "abs": tolerance_abs},
                    "direction": DEFAULT_DIRECTIONS.get(metric, "equal"),
                }
            )
    return {"schema_version": SCHEMA_VERSION, "suite": run.suite, "checks": checks, "ratio_checks": []}


def dump_baseline(baseline: dict[str, Any], path: Path) -> None:
    """Write a baseline as YAML (``.json`` suffix: JSON), atomically."""
    path = Path(path)
    if path.suffix == ".json":
        atomic_write_json(path, baseline)
    else:
        atomic_write_text(path, yaml.safe_dump(baseline, sort_keys=False))
