"""Suite files: what a benchmark sweeps, as YAML, validated with file:line errors.

Example suite::

    name: throughput-smoke
    description: dense vs oasiskv at two context lengths
    kind: throughput
    defaults: {model: smollm2-135m, modes: [dense, oasiskv], output_len: 64, fetch_ratio: 0.05}
    grid:
      context_len: [1024, 4096]
      concurrency: [1, 8, 32]
    points:
      - {mode: oasiskv, context_len: 4096, concurrency: 32, top_k_blocks: 64}
    gate: baselines/throughput-smoke.yaml      # relative to this file

Expansion: every grid combination overlaid on ``defaults``, then every explicit point overlaid on
``defaults`` (the grid does not apply to explicit points). With no grid and some explicit points, only the
explicit points run. A ``modes`` list becomes one point per mode; a layer that sets ``mode`` overrides an
inherited ``modes`` and vice versa. Duplicate points are dropped.

Errors point at ``file:line`` because suites are edited by hand and a sweep that dies an hour in on a
typo is the failure we most want to avoid: we compose YAML's node tree (which keeps marks) rather than
``safe_load`` (which throws them away).
"""

from __future__ import annotations

import copy
import difflib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from oasisbench.results.schema import ENGINES, MODES, point_id
from oasiskv_runtime.config import EngineConfig

KINDS = ("throughput", "accuracy")
TOP_LEVEL_KEYS = ("name", "description", "kind", "defaults", "grid", "points", "gate")


class SuiteError(ValueError):
    """A suite file is missing, malformed or invalid; the message starts with ``file:line:``."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_modes(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(m in MODES for m in v)


_Validator = tuple[Callable[[Any], bool], str]

def _engine_spec(name: str) -> _Validator:
    """An engine option's check and meaning, from the runtime's config tree (None: the engine's default)."""
    spec = EngineConfig.options()[name]
    return (lambda v: v is None or spec.check(v)), spec.expect


#: Engine options a suite may set, by the same names and rules as the runtime (``EngineConfig.options()``); the byte
#: budgets are given in GiB here (``kv_cache_gb``, ``host_kv_gb``) and ``max_num_seqs`` is the point's concurrency.
ENGINE_KEYS: tuple[str, ...] = tuple(name for name, spec in EngineConfig.options().items()
                                     if spec.section not in ("pd",)
                                     and name not in ("kv_cache_bytes", "host_kv_bytes", "max_num_seqs"))

#: Allowed option keys in defaults, grid and points: (validator, what the value must be).
OPTION_SPECS: dict[str, _Validator] = {
    "model": (lambda v: isinstance(v, str) and bool(v), "a model name or path"),
    "modes": (_is_modes, f"a non-empty list of modes ({', '.join(MODES)})"),
    "mode": (lambda v: v in MODES, f"one of {', '.join(MODES)}"),
    "engine": (lambda v: v in ENGINES, f"one of {', '.join(ENGINES)} (vllm: plain vLLM for dense, the OasisKV plug-in "
               "for the other modes)"),
    "context_len": (lambda v: _is_int(v) and v >= 1, "a positive integer (tokens)"),
    "output_len": (lambda v: _is_int(v) and v >= 1, "a positive integer (tokens)"),
    "concurrency": (lambda v: _is_int(v) and v >= 1, "a positive integer (requests)"),
    "num_requests": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "kv_cache_gb": (lambda v: _is_num(v) and v > 0, "a positive number (GiB): the device KV budget"),
    "host_kv_gb": (lambda v: _is_num(v) and v > 0, "a positive number (GiB): the host KV pool of host-pool modes"),
    "device_tier_gb": (lambda v: _is_num(v) and v > 0, "a positive number (GiB; engine vllm, host-pool modes, with "
                       "host_kv_gb): device memory beside vLLM's cache for full-KV rows past the host pool's"),
    "device": (lambda v: isinstance(v, str) and bool(v), "a device string such as cuda:0"),
    "dtype": (lambda v: v in ("float32", "float16", "bfloat16"), "one of float32, float16, bfloat16"),
    "seed": (_is_int, "an integer"),
    "random_weights": (lambda v: isinstance(v, bool), "true or false"),
    "speculate": (lambda v: v is None or isinstance(v, bool),
                  "true or false (engine vllm, mode dense: plain vLLM with the point's draft as its one-token "
                  "speculative decoding, the speculation oasiskv runs with, without the plug-in)"),
    **{name: _engine_spec(name) for name in ENGINE_KEYS},
}

#: Keys a throughput point must end up with (``mode`` may come from ``modes``).
_THROUGHPUT_REQUIRED = ("mode", "context_len", "concurrency")


@dataclass(frozen=True)
class Suite:
    """A parsed, validated suite file."""

    name: str
    kind: str
    """``throughput`` or ``accuracy``."""
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Key -> values; expanded as a cartesian product in file order."""
    points: list[dict[str, Any]] = field(default_factory=list)
    """Explicit extra points, each overlaid on ``defaults``."""
    gate: Path | None = None
    """Baseline file for ``oasisbench gate``, resolved relative to the suite file."""
    path: Path | None = None

    def expand(self) -> list[dict[str, Any]]:
        """Resolved points in run order; see the module docstring for the rules."""
        layers: list[dict[str, Any]] = []
        if self.grid or not self.points:
            keys = list(self.grid)
            combos = itertools.product(*(self.grid[k] for k in keys))
            layers += [dict(zip(keys, combo, strict=True)) for combo in combos]
        resolved = [_overlay(self.defaults, layer) for layer in layers]
        resolved += [_overlay(self.defaults, p) for p in self.points]
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        for r in resolved:
            # Modes vary innermost, so all modes of one (context, concurrency) run back to back: ratios
            # between them then share the same thermal and background-load conditions.
            for point in _split_modes(r):
                pid = point_id(point)
                if pid not in seen:
                    seen.add(pid)
                    out.append(copy.deepcopy(point))
        return out


def _overlay(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    if "mode" in layer:
        out.pop("modes", None)
    if "modes" in layer:
        out.pop("mode", None)
    out.update(layer)
    return out


def _split_modes(resolved: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if "modes" not in resolved:
        yield resolved
        return
    rest = {k: v for k, v in resolved.items() if k != "modes"}
    for mode in resolved["modes"]:
        yield {**rest, "mode": mode}


class _Parser:
    """Walks the composed node tree, turning nodes into values and errors into ``file:line`` messages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.constructor = SafeConstructor()

    def error(self, node: Node | None, message: str) -> SuiteError:
        line = node.start_mark.line + 1 if node is not None else 1
        return SuiteError(f"{self.path}:{line}: {message}")

    def value(self, node: Node) -> Any:
        return self.constructor.construct_object(node, deep=True)

    def mapping(self, node: Node, what: str) -> list[tuple[str, Node, Node]]:
        """(key, key node, value node) of a mapping, rejecting non-string and duplicate keys (YAML would
        silently keep the last duplicate, hiding half of an edit)."""
        if not isinstance(node, MappingNode):
            raise self.error(node, f"{what} must be a mapping")
        self.constructor.flatten_mapping(node)  # resolve `<<: *anchor` merges before walking keys
        items: list[tuple[str, Node, Node]] = []
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = self.value(key_node)
            if not isinstance(key, str):
                raise self.error(key_node, f"{what}: keys must be strings, got {key!r}")
            if key in seen:
                raise self.error(key_node, f"{what}: duplicate key '{key}' (first on line {seen[key]})")
            seen[key] = key_node.start_mark.line + 1
            items.append((key, key_node, value_node))
        return items

    def unknown_key(self, key: str, key_node: Node, what: str, allowed: tuple[str, ...] | list[str]) -> SuiteError:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (allowed: {', '.join(allowed)})"
        return self.error(key_node, f"unknown key '{key}' in {what}{hint}")

    def option(self, key: str, key_node: Node, value_node: Node, what: str) -> Any:
        if key not in OPTION_SPECS:
            raise self.unknown_key(key, key_node, what, list(OPTION_SPECS))
        value = self.value(value_node)
        check, expected = OPTION_SPECS[key]
        if not check(value):
            raise self.error(value_node, f"{what}.{key} must be {expected}, got {value!r}")
        return value

    def options(self, node: Node, what: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, key_node, value_node in self.mapping(node, what):
            if (key == "mode" and "modes" in out) or (key == "modes" and "mode" in out):
                raise self.error(key_node, f"{what} sets both 'mode' and 'modes'; keep one")
            out[key] = self.option(key, key_node, value_node, what)
        return out

    def grid(self, node: Node) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for key, key_node, value_node in self.mapping(node, "grid"):
            if key not in OPTION_SPECS:
                raise self.unknown_key(key, key_node, "grid", list(OPTION_SPECS))
            if not isinstance(value_node, SequenceNode) or not value_node.value:
                raise self.error(value_node, f"grid.{key} must be a non-empty list of values to sweep")
            if key == "modes" and all(isinstance(n, ScalarNode) for n in value_node.value):
                raise self.error(
                    value_node, "grid.modes sweeps lists of modes; to sweep single modes write 'mode: [...]'"
                )
            out[key] = [self.option(key, key_node, item, "grid") for item in value_node.value]
        if "mode" in out and "modes" in out:
            raise self.error(node, "grid sweeps both 'mode' and 'modes'; keep one")
        return out


def load_suite(path: Path) -> Suite:
    """Parse and validate a suite file.

    Raises:
        SuiteError: missing file, malformed YAML, unknown keys, wrong types or missing required keys;
            the message starts with ``<file>:<line>:``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SuiteError(f"{path}: suite file not found") from None
    p = _Parser(path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is None:
            raise SuiteError(f"{path}:1: empty suite file")
        return _build(p, root)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 1
        message = e.problem or e.context or "parse error"
        # The problem is often found a line after its cause (an unclosed '[' is noticed at the next
        # key), so name where the enclosing construct started too.
        if e.problem and e.context and e.context_mark is not None:
            message += f" ({e.context}, started on line {e.context_mark.line + 1})"
        raise SuiteError(f"{path}:{line}: malformed YAML: {message}") from None
    except yaml.YAMLError as e:
        raise SuiteError(f"{path}: malformed YAML: {e}") from None


def _build(p: _Parser, root: Node) -> Suite:
    fields: dict[str, tuple[Node, Node]] = {}
    for key, key_node, value_node in p.mapping(root, "suite"):
        if key not in TOP_LEVEL_KEYS:
            raise p.unknown_key(key, key_node, "suite", TOP_LEVEL_KEYS)
        fields[key] = (key_node, value_node)

    def scalar(key: str, default: str | None) -> str | None:
        if key not in fields:
            if default is None:
                raise p.error(root, f"suite needs '{key}'")
            return default
        value = p.value(fields[key][1])
        if key == "description" and value is None:  # `description:` left blank
            return ""
        if not isinstance(value, str) or (key != "description" and not value):
            raise p.error(fields[key][1], f"'{key}' must be a non-empty string, got {value!r}")
        return value

    name = scalar("name", None)
    description = scalar("description", "")
    kind = scalar("kind", "throughput")
    if kind not in KINDS:
        raise p.error(fields["kind"][1], f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    defaults = p.options(fields["defaults"][1], "defaults") if "defaults" in fields else {}
    grid = p.grid(fields["grid"][1]) if "grid" in fields else {}

    points: list[dict[str, Any]] = []
    point_nodes: list[Node] = []
    if "points" in fields:
        seq = fields["points"][1]
        if not isinstance(seq, SequenceNode):
            raise p.error(seq, "points must be a list of mappings")
        for i, item in enumerate(seq.value):
            points.append(p.options(item, f"points[{i}]"))
            point_nodes.append(item)

    if kind == "throughput":
        # Check required keys now, not when the runner reaches the point that lacks them.
        def missing(keys: set[str]) -> list[str]:
            have = keys | ({"mode"} if "modes" in keys else set())
            return [k for k in _THROUGHPUT_REQUIRED if k not in have]

        if grid or not points:
            gap = missing(set(defaults) | set(grid))
            if gap:
                at = fields.get("grid", fields.get("defaults", (root, root)))[0]
                raise p.error(at, f"throughput points need {', '.join(gap)} (set in defaults or grid)")
        for i, (point, node) in enumerate(zip(points, point_nodes, strict=True)):
            gap = missing(set(defaults) | set(point))
            if gap:
                raise p.error(node, f"points[{i}] needs {', '.join(gap)} (set in the point or defaults)")

    gate_path = None
    if "gate" in fields:
        gate_path = Path(scalar("gate", None) or "")
        gate_path = gate_path if gate_path.is_absolute() else p.path.parent / gate_path
    return Suite(
        name=name or "",
        kind=kind or "throughput",
        description=description or "",
        defaults=defaults,
        grid=grid,
        points=points,
        gate=gate_path,
        path=p.path,
    )
