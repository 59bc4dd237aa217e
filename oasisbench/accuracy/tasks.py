"""The accuracy task registry: what each task is, where its data comes from, and how answers are scored.

Two kinds of tasks:

* ``lm_eval`` tasks (``aime24``, ``aime25``, ``gpqa_diamond``, ``longbench_v2``) are generative, so they decode
  (log-likelihood variants never exercise sparse decoding). Their lm-eval YAMLs live in ``suites/accuracy/``
  with the hub dataset as ``dataset_path``; :func:`render_task_yamls` copies them into a run directory with
  the resolved data source (a local file under ``--data-dir`` in the dataset's original schema, or the hub
  copy when a ``datasets``/hub cache holds it), the repeat count and generation settings.
* ``niah`` tasks (one per RULER family of :mod:`oasisbench.accuracy.niah`, plus the group ``niah``) are
  generated offline and run through our own loop, scored with ``string_match_all``.

Example::

    spec = TASKS["aime24"]
    source = resolve_data(spec, Path("data"))     # DataSource(kind="file", ...) or raises MissingDataError
    yaml_dir = render_task_yamls({"aime24": source}, run_dir, seed=0, num_samples=1)
"""

from __future__ import annotations

import csv
import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from oasisbench.accuracy.niah import families, family_info

#: Our lm-eval task YAML templates (a repository directory, next to the throughput suites).
SUITE_DIR = Path(__file__).resolve().parents[2] / "suites" / "accuracy"
#: Extensions accepted for a local data file, in lookup order, with the ``datasets`` builder reading them.
DATA_BUILDERS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
#: Sampling settings for avg@k (k > 1): the usual reasoning-model recipe (Qwen3 / DeepSeek-R1 evaluations).
AVG_AT_K_SAMPLING: dict[str, Any] = {"do_sample": True, "temperature": 0.6, "top_p": 0.95}


@dataclass(frozen=True)
class TaskSpec:
    """One task of ``oasisbench accuracy``."""

    name: str
    kind: str
    """'lm_eval' or 'niah'."""
    description: str
    hub: tuple[str, ...] = ()
    """Hub dataset names, first one used when its cache is found."""
    hub_config: str | None = None
    local_names: tuple[str, ...] = ()
    """File stems accepted under --data-dir (any extension of DATA_BUILDERS)."""
    columns: tuple[str, ...] = ()
    """Original-schema columns a local file must have."""
    yaml_file: str | None = None
    """Template in SUITE_DIR; its ``task:`` is the lm-eval task name."""
    lm_eval_task: str | None = None
    strata: tuple[str, ...] = ()
    """Per-sample fields reports are stratified by (besides the task)."""
    family: str | None = None
    """NIAH family."""
    max_gen_toks: int = 32
    """NIAH: tokens to generate (enough for the answers; RULER uses 30-128)."""


def _niah_specs() -> dict[str, TaskSpec]:
    long_answers = {"multi_value", "multi_query"}  # four 7-digit numbers with separators
    return {f"niah_{f}": TaskSpec(f"niah_{f}", "niah", d, family=f, strata=("length", "depth"),
                                  max_gen_toks=64 if f in long_answers else 32)
            for f, d in family_info().items()}


TASKS: dict[str, TaskSpec] = {
    "aime24": TaskSpec("aime24", "lm_eval", "AIME 2024, 30 problems; exact match on the final integer (\\boxed{})",
                       hub=("Maxwell-Jia/AIME_2024",), local_names=("aime24", "AIME_2024", "aime_2024_problems"),
                       columns=("ID", "Problem", "Solution", "Answer"), yaml_file="aime24.yaml",
                       lm_eval_task="aime24"),
    "aime25": TaskSpec("aime25", "lm_eval", "AIME 2025, 30 problems; exact match on the final integer (\\boxed{})",
                       hub=("math-ai/aime25",), local_names=("aime25", "aime_2025"),
                       columns=("problem", "answer", "id"), yaml_file="aime25.yaml", lm_eval_task="aime25"),
    "gpqa_diamond": TaskSpec("gpqa_diamond", "lm_eval",
                             "GPQA-Diamond, 198 questions; chain of thought ending in 'Answer: X'",
                             hub=("Idavidrein/gpqa",), hub_config="gpqa_diamond",
                             local_names=("gpqa_diamond", "gpqa-diamond"),
                             columns=("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                                      "Incorrect Answer 3"),
                             yaml_file="gpqa_diamond_cot_gen.yaml", lm_eval_task="gpqa_diamond_cot_gen"),
    "longbench_v2": TaskSpec("longbench_v2", "lm_eval", "LongBench v2, 503 long-context questions; model writes "
                             "the answer letter", hub=("THUDM/LongBench-v2", "recursal/longbench-v2"),
                             local_names=("longbench_v2", "longbench-v2", "LongBench-v2"),
                             columns=("_id", "domain", "sub_domain", "difficulty", "length", "question",
                                      "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context"),
                             yaml_file="longbench_v2_gen.yaml", lm_eval_task="longbench_v2_gen",
                             strata=("context_len", "length", "difficulty")),
    **_niah_specs(),
}
#: Task groups: a name that expands to several tasks.
GROUPS: dict[str, list[str]] = {"niah": [f"niah_{f}" for f in families()]}


class MissingDataError(FileNotFoundError):
    """A task's dataset is not available offline; the message says which dataset and how to supply it."""


class DataSchemaError(MissingDataError):
    """A local data file lacks columns of the dataset's original schema."""


@dataclass(frozen=True)
class DataSource:
    kind: str
    """'file' (local, original schema), 'hub' (hub copy in a local cache) or 'builtin' (NIAH)."""
    location: str
    """File path, hub dataset name, or the haystack directory."""
    builder: str = ""
    """``datasets`` builder for files: json, parquet or csv."""


def expand_tasks(names: list[str]) -> list[str]:
    """Expand groups, validate names, keep order, drop duplicates."""
    out: list[str] = []
    for n in names:
        for t in GROUPS.get(n, [n]):
            if t not in TASKS:
                known = ", ".join(sorted(TASKS) + sorted(GROUPS))
                raise ValueError(f"unknown task {n!r}; known tasks: {known}")
            if t not in out:
                out.append(t)
    return out


def _hub_cached(name: str) -> bool:
    """True when a hub download of ``name`` sits in the huggingface_hub or ``datasets`` cache."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
        import datasets.config
    except ImportError:
        return False
    org, _, base = name.partition("/")
    wanted = {f"datasets--{org}--{base}".lower(), f"{org}___{base}".lower()}
    for root in (Path(HF_HUB_CACHE), Path(datasets.config.HF_DATASETS_CACHE)):
        if root.is_dir() and any(p.name.lower() in wanted for p in root.iterdir()):
            return True
    return False


def _file_columns(path: Path) -> set[str] | None:
    """Column names of a data file, read cheaply; None when that would mean parsing a huge JSON array."""
    suffix = path.suffix
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "{}")
        return set(json.loads(first))
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return set(next(csv.reader(f), []))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return set(pq.read_schema(path).names)
    if path.stat().st_size > 64 << 20:  # LongBench v2's data.json is ~465 MB: let `datasets` check it
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    rows = doc if isinstance(doc, list) else doc.get("data", [doc]) if isinstance(doc, dict) else []
    return set(rows[0]) if rows and isinstance(rows[0], dict) else set()


def _how_to_supply(spec: TaskSpec) -> str:
    names = ", ".join(f"{n}.jsonl" for n in spec.local_names[:2])
    hub = " or ".join(spec.hub)
    return (f"supply it with --data-dir DIR holding {names} (also .json, .parquet or .csv) in the original schema "
            f"(columns: {', '.join(spec.columns)}), or a `datasets` cache holding the hub copy "
            f"(download it where the hub is reachable: datasets.load_dataset({spec.hub[0]!r}"
            + (f", {spec.hub_config!r}" if spec.hub_config else "") + f")); hub dataset: {hub}")


def find_local_file(spec: TaskSpec, data_dir: Path | None) -> Path | None:
    if data_dir is None:
        return None
    for stem in spec.local_names:
        for ext in DATA_BUILDERS:
            p = Path(data_dir) / f"{stem}{ext}"
            if p.is_file():
                return p
    return None


def resolve_data(spec: TaskSpec, data_dir: Path | None) -> DataSource:
    """Where a task's data comes from; raises :class:`MissingDataError` naming the dataset when nowhere."""
    if spec.kind == "niah":
        from oasisbench.accuracy.haystack import essay_dir

        return DataSource("builtin", str(essay_dir()))  # raises with the pip install hint when missing
    path = find_local_file(spec, data_dir)
    if path is not None:
        cols = _file_columns(path)
        missing = [c for c in spec.columns if cols is not None and c not in cols]
        if missing:
            raise DataSchemaError(f"{path}: task {spec.name} expects the original {spec.hub[0]} schema; "
                                   f"missing column(s) {', '.join(missing)}")
        return DataSource("file", str(path.resolve()), DATA_BUILDERS[path.suffix])
    for name in spec.hub:
        if _hub_cached(name):
            return DataSource("hub", name)
    where = f"no file in {data_dir}" if data_dir is not None else "no --data-dir given"
    raise MissingDataError(f"task {spec.name} needs dataset {spec.hub[0]} ({where}, and no hub cache; this "
                           f"machine has no Hugging Face hub access): " + _how_to_supply(spec))


# ---- lm-eval YAML rendering -----------------------------------------------------------------------------
class _Function(str):
    """A ``!function`` reference kept verbatim while we edit a template."""


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
_Dumper.add_representer(_Function, lambda dumper, data: dumper.represent_scalar("!function", str(data)))

_SEED_MODULE = '''"""Generated by oasisbench accuracy: binds the run's seed for deterministic choice shuffling."""
from oasisbench.accuracy.tasks import gpqa_process_docs as _process

SEED = {seed}


def gpqa_process_docs(dataset):
    return _process(dataset, seed=SEED)
'''


def render_task_yamls(sources: dict[str, DataSource], out_dir: Path, seed: int, num_samples: int,
                      max_gen_toks: int | None = None) -> Path:
    """Write concrete lm-eval YAMLs for ``sources`` (task name -> data source) into ``out_dir/lm_eval_tasks``.

    lm-eval needs absolute ``data_files`` and one YAML per task, so each run gets its own copy (kept with
    the results: it documents exactly what ran). ``num_samples`` > 1 turns on sampling and avg@k.
    """
    task_dir = Path(out_dir) / "lm_eval_tasks"
    if task_dir.exists():
        shutil.rmtree(task_dir)
    task_dir.mkdir(parents=True)
    (task_dir / "_oasis_seed.py").write_text(_SEED_MODULE.format(seed=int(seed)), encoding="utf-8")
    for name, src in sources.items():
        spec = TASKS[name]
        cfg = yaml.load((SUITE_DIR / spec.yaml_file).read_text(encoding="utf-8"), Loader=_Loader)
        if src.kind == "file":
            cfg.pop("dataset_name", None)
            cfg.update(dataset_path=src.builder, dataset_kwargs={"data_files": {"train": src.location}},
                       test_split="train")
        else:
            cfg["dataset_path"] = src.location
        if "process_docs" in cfg and name == "gpqa_diamond":
            cfg["process_docs"] = _Function("_oasis_seed.gpqa_process_docs")
        cfg["repeats"] = int(num_samples)
        # Keep every repeat for process_results (the default filter would keep only the first): avg@k.
        cfg["filter_list"] = [{"name": "all", "filter": [{"function": "take_first_k", "k": int(num_samples)}]}]
        gen = dict(cfg.get("generation_kwargs") or {})
        if num_samples > 1:
            gen.update(AVG_AT_K_SAMPLING)
        if max_gen_toks is not None:
            gen["max_gen_toks"] = int(max_gen_toks)
        cfg["generation_kwargs"] = gen
        # Data settings first, as in lm-eval's own YAMLs: a reader sees at once what the run read.
        head = ("task", "dataset_path", "dataset_name", "dataset_kwargs", "test_split")
        cfg = {k: cfg[k] for k in head if k in cfg} | {k: v for k, v in cfg.items() if k not in head}
        text = yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
        (task_dir / spec.yaml_file).write_text(text, encoding="utf-8")
    return task_dir


# ---- answer extraction and per-document scoring (referenced by the YAMLs) --------------------------------
def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


_INT = re.compile(r"-?\d[\d,]*")


def final_integer(text: str) -> int | None:
    """The final integer answer: the last integer inside the last ``\\boxed{}``, else the last in the text."""
    boxed = last_boxed(text)
    for source in ([boxed] if boxed is not None else []) + [text]:
        found = _INT.findall(source)
        if found:
            try:
                return int(found[-1].replace(",", ""))
            except ValueError:
                return None
    return None


def answer_letter(text: str) -> str | None:
    """GPQA: the letter of the last ``Answer: X`` line (A-D), or None."""
    found = re.findall(r"answer\s*(?:is)?\s*[:：]\s*\**\(?\s*([A-D])\b", text, flags=re.IGNORECASE)
    return found[-1].upper() if found else None


def longbench_letter(text: str) -> str | None:
    """LongBench v2: the official ``The correct answer is (X)`` extraction, or a bare leading letter."""
    for pattern in (r"The correct answer is \(([A-D])\)", r"The correct answer is ([A-D])",
                    r"^\s*\(?([A-D])\)?(?:[\s.,:)]|$)"):
        m = re.search(pattern, text)
        if m:
            return m.group(1)
    return None


def _responses(results: list[Any]) -> list[str]:
    """Flatten lm-eval's results (our take_first_k filter hands one list of k responses)."""
    flat: list[str] = []
    for r in results:
        flat.extend(r if isinstance(r, (list, tuple)) else [r])
    return [str(r) for r in flat]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def aime_process_results(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """exact_match averaged over the k responses (avg@k; plain accuracy when k = 1)."""
    target = int(str(doc.get("Answer", doc.get("answer"))).strip())
    return {"exact_match": _mean([float(final_integer(r) == target) for r in _responses(results)])}


def gpqa_process_docs(dataset: Any, seed: int = 0) -> Any:
    """Shuffle the four choices of each question deterministically per (seed, question)."""

    def one(doc: dict[str, Any]) -> dict[str, Any]:
        choices = [str(doc[f"Incorrect Answer {i}"]).strip() for i in (1, 2, 3)]
        correct = str(doc["Correct Answer"]).strip()
        choices.append(correct)
        # A string seed goes through SHA-512 in random.Random: stable across processes (hash() is salted).
        random.Random(f"gpqa|{seed}|{doc['Question']}").shuffle(choices)
        return {**{f"choice{i + 1}": c for i, c in enumerate(choices)}, "answer": "ABCD"[choices.index(correct)]}

    return dataset.map(one)


def gpqa_process_results(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    return {"exact_match": _mean([float(answer_letter(r) == doc["answer"]) for r in _responses(results)])}


def longbench_process_docs(dataset: Any) -> Any:
    """Accept the original schema (choice_A..choice_D) and copies that store a ``choices`` list."""

    def one(doc: dict[str, Any]) -> dict[str, Any]:
        if "choice_A" in doc:
            return {}
        return {f"choice_{c}": doc["choices"][i] for i, c in enumerate("ABCD")}

    return dataset.map(one)


def longbench_process_results(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    target = str(doc["answer"]).strip().strip("()")
    return {"exact_match": _mean([float(longbench_letter(r) == target) for r in _responses(results)])}


def niah_samples(tokenizer: Any, task: str, context_len: int, depths: list[float], limit: int,
                 seed: int) -> list[Any]:
    """``limit`` samples of a NIAH task at one length, cycling over ``depths``: sample i sits at depth
    ``depths[i % D]`` (replicate ``i // D``), so ``limit >= D`` covers every depth and replicates share
    needles across depths (a depth sweep varies only the depth)."""
    from oasisbench.accuracy.niah import generate_samples

    spec = TASKS[task]
    chat = bool(getattr(tokenizer, "chat_template", None))  # a base model without a template gets raw text
    per_depth = -(-limit // len(depths))
    grid = generate_samples(tokenizer, spec.family, context_len, depths, per_depth, seed, use_chat_template=chat)
    # generate_samples is depth-major: grid[d * per_depth + r].
    return [grid[(i % len(depths)) * per_depth + i // len(depths)] for i in range(limit)]
