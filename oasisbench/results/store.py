"""Writing and reading run directories (``results/<suite>/<run-id>/``), crash-safe.

``metrics.json`` is rewritten atomically after every point, so a sweep killed at any moment leaves either
the previous or the new complete file, never a torn one; ``--resume`` then skips
:meth:`RunStore.finished_point_ids`.

Example::

    store = RunStore(Path("results"), "throughput-smoke")
    store.write_config(cfg_dict)
    store.write_env(env_dict)
    for point in points:
        if point_id(point) in store.finished_point_ids():
            continue
        store.add_record(point, run_point(point))
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from oasisbench.results.schema import (
    CONFIG_FILE,
    ENV_FILE,
    METRICS_FILE,
    SCHEMA_VERSION,
    Record,
    Run,
    point_id,
    validate_record,
)

__all__ = [
    "Run",
    "RunStore",
    "atomic_write_json",
    "atomic_write_text",
    "load_run",
    "new_run_id",
    "to_jsonable",
]


def new_run_id() -> str:
    """UTC timestamp plus a short random suffix: sorts by time, and two runs started in the same second
    (e.g. parallel CI jobs) still get distinct directories."""
    now = datetime.now(timezone.utc)  # not datetime.UTC: that needs 3.11, we support 3.10
    return now.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so readers see the old or the new file, never a partial one.

    The temp file lives in the same directory because ``os.replace`` is only atomic within one
    filesystem; fsync before the rename so a power cut cannot leave a renamed-but-empty file.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # KeyboardInterrupt included: an interrupted sweep must not leave temp files behind.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself; best effort, since some platforms cannot open directories."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def to_jsonable(obj: Any) -> Any:
    """Plain-JSON copy of ``obj``: numpy/torch scalars via ``.item()``, arrays via ``.tolist()``, paths as
    strings, and NaN/inf as null (standard JSON has no NaN, and jq or browsers reject it)."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy arrays and scalars, torch tensors
        return to_jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    raise TypeError(f"cannot store {type(obj).__name__} in JSON: {obj!r}")


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON (see :func:`to_jsonable`)."""
    atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2) + "\n")


class RunStore:
    """Creates or reopens ``<root>/<suite>/<run_id>/`` and records points into it.

    Reopening an existing run id (``--resume``) loads its records; ``add_record`` for a point already
    present replaces it, so a run holds one record per point id.
    """

    def __init__(self, root: Path, suite: str, run_id: str | None = None) -> None:
        if not suite or "/" in suite or suite in (".", ".."):
            raise ValueError(f"suite name {suite!r} cannot be a directory name")
        self.suite = suite
        self.run_id = run_id or new_run_id()
        self.path = Path(root) / suite / self.run_id
        self.path.mkdir(parents=True, exist_ok=True)
        self._records: list[Record] = []
        if (self.path / METRICS_FILE).exists():
            existing = load_run(self.path)
            if existing.suite != suite:
                raise ValueError(f"{self.path / METRICS_FILE}: belongs to suite {existing.suite!r}, not {suite!r}")
            self._records = existing.records
        else:
            # Write the empty file now: a run dir is loadable from the moment it exists.
            self._flush()

    @property
    def records(self) -> list[Record]:
        """Copy of the records stored so far."""
        return list(self._records)

    def write_config(self, config: dict[str, Any]) -> Path:
        """Store the fully resolved config as ``config.json``."""
        target = self.path / CONFIG_FILE
        atomic_write_json(target, config)
        return target

    def write_env(self, env: dict[str, Any]) -> Path:
        """Store the environment description as ``env.json``."""
        target = self.path / ENV_FILE
        atomic_write_json(target, env)
        return target

    def add_record(self, point: dict[str, Any], metrics: dict[str, Any]) -> Record:
        """Append (or replace, by point id) one record and rewrite ``metrics.json`` atomically."""
        record = validate_record({"point": to_jsonable(point), "metrics": to_jsonable(metrics)}, "add_record")
        pid = point_id(record["point"])
        self._records = [r for r in self._records if point_id(r["point"]) != pid]
        self._records.append(record)
        self._flush()
        return record

    def finished_point_ids(self) -> set[str]:
        """Ids of points already recorded, for skipping them on ``--resume``."""
        return {point_id(r["point"]) for r in self._records}

    def load(self) -> Run:
        """The run as stored on disk now."""
        return load_run(self.path)

    def _flush(self) -> None:
        atomic_write_json(
            self.path / METRICS_FILE,
            {"schema_version": SCHEMA_VERSION, "suite": self.suite, "run_id": self.run_id, "records": self._records},
        )


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: corrupt JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def load_run(path: Path) -> Run:
    """Load a run directory (or its ``metrics.json``).

    ``metrics.json`` is required; ``config.json`` and ``env.json`` may be absent (a sweep killed before
    writing them still has results worth reading) and then load as ``{}``, but corrupt ones are errors.

    Raises:
        FileNotFoundError: the directory or ``metrics.json`` is missing (the message names it).
        ValueError: a file is corrupt, or ``schema_version`` is not one this version reads.
    """
    path = Path(path)
    run_dir = path.parent if path.name == METRICS_FILE else path
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: run directory not found")
    metrics_path = run_dir / METRICS_FILE
    doc = _read_json_object(metrics_path)
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{metrics_path}: schema_version {version!r} is not supported "
            f"(this oasisbench reads schema_version {SCHEMA_VERSION})"
        )
    for key in ("suite", "run_id"):
        if not isinstance(doc.get(key), str):
            raise ValueError(f"{metrics_path}: '{key}' must be a string")
    raw_records = doc.get("records")
    if not isinstance(raw_records, list):
        raise ValueError(f"{metrics_path}: 'records' must be a list")
    records = [validate_record(r, f"{metrics_path}: records[{i}]") for i, r in enumerate(raw_records)]

    optional: dict[str, dict[str, Any]] = {}
    for name in (CONFIG_FILE, ENV_FILE):
        file = run_dir / name
        optional[name] = _read_json_object(file) if file.exists() else {}
    return Run(
        suite=doc["suite"],
        run_id=doc["run_id"],
        config=optional[CONFIG_FILE],
        env=optional[ENV_FILE],
        records=records,
        path=run_dir,
    )
