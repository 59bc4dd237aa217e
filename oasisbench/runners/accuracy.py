"""The accuracy suite: every task, in every mode, on one engine, scored against the dense anchor.

Dense always runs first: an accuracy delta is only meaningful against the same stack's own full-attention
anchor (SPEC, Table 1). Each (mode, sweep value) loads one engine; lm-eval tasks go through
``simple_evaluate`` with our in-process model, NIAH tasks through our own loop, each as one continuous batch.
After every engine the run directory is rewritten (atomically), so a long sweep that dies keeps what it did.

Writes ``<output_dir>/accuracy-<task>/<run-id>/``: config.json, env.json, accuracy.json (rows below),
metrics.json (one record per task and mode, for ``oasisbench gate``), samples-<mode>.jsonl, report.md and
the rendered lm-eval task YAMLs.

Example::

    cfg = AccuracyConfig(tasks=("niah",), model="smollm2-135m", modes=("dense", "oasiskv"),
                         context_lens=(4096,), limit=5)
    outcome = run(cfg)      # outcome.path / "accuracy.json"
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import platform
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from oasisbench.accuracy import tasks as T
from oasisbench.results.store import RunStore, atomic_write_json, atomic_write_text
from oasiskv_runtime.config import EngineConfig

_OPTIONS = EngineConfig.options()
SWEEP_KEYS = tuple(name for name, spec in _OPTIONS.items() if spec.section == "sparse") + ("block_size",)
"""What ``--sweep`` may vary: every option of the algorithm (the config's ``sparse`` section, so a new one is
sweepable as soon as it is declared) and the block size (the granularity of selection)."""
DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
#: NIAH samples per (task, context length) when --limit is not given: two per default depth.
DEFAULT_NIAH_LIMIT = 10
#: NIAH context length when --context-len is not given: beyond the default working set (128 blocks = 2,048
#: tokens), so the sparse modes really select.
DEFAULT_NIAH_CONTEXT = 4096
#: What ``--engine`` takes: our engine, or vLLM (with the plug-in for the sparse modes).
ENGINES = ("embedded", "vllm")
#: Seconds one vLLM setting (its engine start included) may take before its process is killed.
VLLM_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class AccuracyConfig:
    tasks: tuple[str, ...]
    """Task or group names (see ``oasisbench accuracy --list-tasks``)."""
    model: str = "smollm2-135m"
    modes: tuple[str, ...] = ("dense", "oasiskv")
    """Dense is added first when missing: it is the anchor of every delta."""
    limit: int | None = None
    """lm-eval: documents per task; NIAH: samples per (task, context length), cycled over depths."""
    num_samples: int = 1
    """k generations per document; k > 1 samples (temperature 0.6, top-p 0.95) and reports avg@k."""
    data_dir: Path | None = None
    context_lens: tuple[int, ...] = ()
    """NIAH prompt lengths; LongBench v2 truncation budgets. Ignored by AIME and GPQA."""
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    device: str = "cpu"
    dtype: str = "float32"
    top_k_blocks: int = 128
    fetch_ratio: float = 0.05
    link_gbps: float = 0.0
    """Prefetch modes: the per-step fetch cap from the link's budget (``SparseConfig.link_gbps``); 0: fixed."""
    sink_blocks: int = 0
    """Leading blocks every sparse mode always attends (attention sinks); part of the top-K budget."""
    dense_layers: int = 0
    """The first N layers attend over the whole context in every sparse mode (Quest keeps its first two dense);
    the paper's configuration has none."""
    recent_blocks: int = 0
    """The last N full blocks every sparse mode always keeps (part of the top-K budget)."""
    selection_score: str = "quest"
    """How the sparse modes rank blocks (``SparseConfig.selection_score``): ``quest``, ``minmax_mass``,
    ``attention`` (sparse-resident only: the ceiling of any block selection) or ``gauss`` (sparse-resident only: a
    study of a mean-and-variance ranking). The dense anchor runs without it."""
    draft: str = "auto"
    kv_cache_gb: float | None = None
    max_num_seqs: int = 256
    max_gen_toks: int | None = None
    """Override every task's generation budget (smoke runs)."""
    sweep: tuple[str, tuple[Any, ...]] | None = None
    """(key, values): one run per value for each sparse mode; dense runs once. Values may be the CLI's text: they
    become the option's type (:func:`sweep_value`)."""
    options: tuple[tuple[str, Any], ...] = ()
    """(key, value) options of the algorithm every sparse setting runs with (``--set``; keys as ``--sweep``'s),
    before the sweep's override; dense runs without them."""
    seed: int = 0
    output_dir: Path = Path("results")
    engine: str = "embedded"
    """Whose generations are scored: ``embedded`` (our engine) or ``vllm`` (plain vLLM for dense, vLLM with the
    OasisKV plug-in for the sparse modes; one vLLM process per generation batch; NIAH and generative lm-eval
    tasks)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(T.expand_tasks(list(self.tasks))))
        from oasiskv_runtime.config import Mode

        modes = [Mode.parse(m).value for m in self.modes if m != "dense"]  # unknown names fail before any run
        object.__setattr__(self, "modes", ("dense", *dict.fromkeys(modes)))
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.dense_layers < 0:
            raise ValueError(f"--dense-layers must be >= 0, got {self.dense_layers}")
        if self.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {self.num_samples}")
        if any(n < 64 for n in self.context_lens):
            raise ValueError(f"--context-len values must be >= 64 tokens, got {list(self.context_lens)}")
        if self.sweep is not None:
            key, values = self.sweep
            if key not in SWEEP_KEYS or not values:
                raise ValueError(f"--sweep takes KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}")
            object.__setattr__(self, "sweep", (key, tuple(sweep_value(key, v) for v in values)))
        for key, _ in self.options:
            if key not in SWEEP_KEYS:
                raise ValueError(f"--set takes KEY=VALUE with KEY one of {', '.join(SWEEP_KEYS)}, got {key!r}")
        object.__setattr__(self, "options", tuple((k, sweep_value(k, v)) for k, v in self.options))
        most_dense = max(st.get("dense_layers", self.dense_layers) for _, st in self.settings())
        if most_dense:  # the engine checks layer indices only once the model is loaded: here before dense runs
            from oasiskv_runtime.models.loader import model_config_for

            layers = model_config_for(self.model)[0].num_layers
            if most_dense > layers:
                raise ValueError(f"dense_layers={most_dense}: the model has {layers} layers")
        for mode, setting in self.settings():  # the engine's own checks, before any engine loads (not after dense ran)
            try:
                EngineConfig.from_overrides(self.model, device=self.device, dtype=self.dtype, mode=mode,
                                            seed=self.seed, **_engine_opts(self, setting, mode))
            except ValueError as e:
                raise ValueError(f"{label(mode, setting)}: {e}") from None
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if any(self.oracle(mode, setting) for mode, setting in self.settings()) and (
                self.engine != "embedded" or any(T.TASKS[n].kind != "niah" for n in self.tasks)):
            raise ValueError("draft 'oracle' proposes the dense anchor's outputs of the same run as the look-ahead "
                             "(a perfect draft while the outputs follow dense's): NIAH tasks on the embedded engine "
                             "only")
        if self.engine == "vllm":
            for mode, setting in self.settings():
                try:
                    _vllm_plan(self, mode, setting)
                except ValueError as e:
                    raise ValueError(f"{label(mode, setting, self.engine)}: {e}") from None

    def settings(self) -> list[tuple[str, dict[str, Any]]]:
        """(mode, overrides: ``--set``'s then the sweep's) pairs in run order: the dense anchor first."""
        out: list[tuple[str, dict[str, Any]]] = []
        fixed = dict(self.options)
        for mode in self.modes:
            if mode == "dense":
                out.append((mode, {}))
            elif self.sweep is None:
                out.append((mode, dict(fixed)))
            else:
                key, values = self.sweep
                out += [(mode, {**fixed, key: v}) for v in values]
        return out

    def oracle(self, mode: str, setting: dict[str, Any]) -> bool:
        """Whether a setting drafts with ``oracle`` (alone or behind ``ngram``): it needs the dense anchor's outputs."""
        draft = setting.get("draft", self.draft)
        return mode != "dense" and bool(draft) and "oracle" in str(draft).split("+")

    def suite_name(self) -> str:
        return "accuracy-" + "+".join(self.tasks if len(self.tasks) <= 3 else (*self.tasks[:3], "more"))


def sweep_value(key: str, value: Any) -> Any:
    """A sweep value as its option's type (the type of its default): ``"2"`` or ``2.0`` -> 2 for an integer option,
    ``"0.25"`` -> 0.25, ``"true"`` / ``"off"`` for a switch, text as it is for a name (``selection_score``). Whether
    the value is valid is the engine config's to say (checked for every setting before any engine loads)."""
    default = _OPTIONS[key].default
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            return {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}[str(value).lower()]
        if isinstance(default, int):
            number = float(value)
            if not number.is_integer():
                raise ValueError(value)
            return int(number)
        if isinstance(default, float):
            return float(value)
    except (KeyError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}[type(default)]
        raise ValueError(f"--sweep {key}: {value!r} is not {kind}") from None
    return str(value)


@dataclass
class Sample:
    """One scored document of one setting."""

    task: str
    doc_id: str
    strata: dict[str, Any]
    score: float
    """Mean over the k responses, in [0, 1]."""
    target: Any
    responses: list[str]


@dataclass
class RunOutcome:
    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)


def label(mode: str, setting: dict[str, Any], engine: str = "embedded") -> str:
    """A setting's name in rows and reports: ``oasiskv[top_k_blocks=8]``; on vLLM ``vllm:oasiskv[...]``."""
    prefix = "" if engine == "embedded" else f"{engine}:"
    return prefix + mode + "".join(f"[{k}={v}]" for k, v in setting.items())


def _env(cfg: AccuracyConfig) -> dict[str, Any]:
    import torch
    import transformers

    from oasisbench.runners.throughput import _git_commit

    commit = _git_commit()
    try:
        import lm_eval

        lm_eval_version = lm_eval.__version__
    except ImportError:
        lm_eval_version = None
    return {"git_commit": commit, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "lm_eval": lm_eval_version, "device": cfg.device,
            "model": cfg.model, "hostname": platform.node(),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _engine_opts(cfg: AccuracyConfig, setting: dict[str, Any], mode: str) -> dict[str, Any]:
    """The engine options of one setting: the run's, then the sweep's override."""
    opts = dict(top_k_blocks=cfg.top_k_blocks, fetch_ratio=cfg.fetch_ratio, link_gbps=cfg.link_gbps,
                sink_blocks=cfg.sink_blocks, recent_blocks=cfg.recent_blocks,
                dense_layers=cfg.dense_layers, draft=cfg.draft, kv_cache_gb=cfg.kv_cache_gb,
                max_num_seqs=cfg.max_num_seqs) | setting
    if mode != "dense":  # a sparse-resident ranking; the anchor attends everything
        opts.setdefault("selection_score", cfg.selection_score)
    return opts


def _engine(cfg: AccuracyConfig, mode: str, setting: dict[str, Any]) -> Any:
    from oasiskv_runtime import LLM

    llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, mode=mode, seed=cfg.seed,
              **_engine_opts(cfg, setting, mode))
    if llm.tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer (a random-weight preset): accuracy tasks need "
                         "text; use a real model such as smollm2-135m or a checkpoint directory")
    return llm


def _niah_context_lens(cfg: AccuracyConfig) -> tuple[int, ...]:
    return cfg.context_lens or (DEFAULT_NIAH_CONTEXT,)


def _vllm_plan(cfg: AccuracyConfig, mode: str, setting: dict[str, Any]) -> Any:
    """The vLLM engine of one setting. Its window: NIAH's longest prompt plus the longest generation; with lm-eval
    tasks the model's own window, as the embedded engine has (their prompts are fitted into it)."""
    from oasiskv_runtime.models.loader import model_config_for

    from oasisbench.runners.accuracy_vllm import plan_setting

    window = 0
    niah = [n for n in cfg.tasks if T.TASKS[n].kind == "niah"]
    if niah:
        window = max(_niah_context_lens(cfg)) + (cfg.max_gen_toks or max(T.TASKS[n].max_gen_toks for n in niah))
    if len(niah) < len(cfg.tasks):
        window = max(window, model_config_for(cfg.model)[0].max_position_embeddings)
    return plan_setting(cfg.model, cfg.device, cfg.dtype, cfg.seed, mode, _engine_opts(cfg, setting, mode), window)


def _vllm_engine(cfg: AccuracyConfig, mode: str, setting: dict[str, Any], log_path: Path) -> Any:
    from oasisbench.runners.accuracy_vllm import VllmEngine

    return VllmEngine(cfg.model, cfg.device, _vllm_plan(cfg, mode, setting), log_path, VLLM_TIMEOUT_S)


@contextmanager
def quiet_git_hash() -> Iterator[None]:
    """Within this context lm-eval records our commit (None outside a git checkout) as its ``git_hash``:
    ``simple_evaluate`` runs ``git describe`` from the current directory with stderr left on the terminal, which
    printed ``fatal: not a git repository`` in every run started outside a checkout."""
    import lm_eval.evaluator as evaluator

    from oasisbench.runners.throughput import _git_commit

    real = evaluator.get_git_commit_hash
    commit = _git_commit()
    evaluator.get_git_commit_hash = lambda: commit
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = real


def _run_lm_eval(cfg: AccuracyConfig, llm: Any, task_dir: Path, names: list[str]) -> tuple[list[Sample], dict]:
    """All lm-eval tasks of one engine; LongBench v2 once per truncation budget."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from oasisbench.accuracy.lm_eval_model import OasisKVLM

    lm = OasisKVLM(llm=llm, seed=cfg.seed)
    chat = bool(getattr(llm.tokenizer, "chat_template", None))  # instruct models are evaluated as chats
    groups: list[tuple[list[str], int | None]] = [([n for n in names if n != "longbench_v2"], None)]
    if "longbench_v2" in names:
        groups += [(["longbench_v2"], n) for n in (cfg.context_lens or (None,))]
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    samples: list[Sample] = []
    for group, budget in groups:
        if not group:
            continue
        lm.max_length = min(budget, llm.max_model_len) if budget else llm.max_model_len
        by_lm_name = {T.TASKS[n].lm_eval_task: n for n in group}
        with quiet_git_hash():
            out = simple_evaluate(model=lm, tasks=list(by_lm_name), task_manager=manager, limit=cfg.limit,
                                  bootstrap_iters=0, apply_chat_template=chat, random_seed=cfg.seed,
                                  numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
                                  fewshot_random_seed=cfg.seed)
        for lm_name, logged in (out or {}).get("samples", {}).items():
            task = by_lm_name[lm_name]
            for s in logged:
                doc = s["doc"]
                strata = {k: doc[k] for k in T.TASKS[task].strata if k in doc}
                if budget:
                    strata = {"context_len": budget} | strata
                key = next((str(doc[k]) for k in ("ID", "id", "_id") if k in doc), str(s["doc_id"]))
                resps = [r for fr in s["filtered_resps"] for r in (fr if isinstance(fr, list) else [fr])]
                samples.append(Sample(task, key, strata, float(s["exact_match"]), s["target"], resps))
    return samples, lm.throughput()


def _run_niah(cfg: AccuracyConfig, llm: Any, names: list[str], reference: list[list[int]] | None = None,
              keep: list[list[int]] | None = None, log: Callable[[str], None] | None = None,
              ) -> tuple[list[Sample], dict]:
    """Every NIAH sample of every task and length as one continuous batch; k generations per prompt.

    reference: per generation (in this function's order), a reference run's output tokens for the ``oracle`` draft;
    keep: a list this run's output tokens are appended to (the reference of a later setting); log: progress lines
    (generations done, at most one a minute; the caller gives it for the embedded engine only: ``on_finish`` is
    its ``generate``'s, and vLLM's child reports its own phases)."""
    from oasiskv_runtime import SamplingParams

    from oasisbench.accuracy.niah import encode_prompt, string_match_all

    limit = cfg.limit or DEFAULT_NIAH_LIMIT
    items = [(name, s) for name, n in itertools.product(names, _niah_context_lens(cfg))
             for s in T.niah_samples(llm.tokenizer, name, n, list(cfg.depths), limit, cfg.seed)]
    prompts, params = [], []
    for name, s in items:
        ids = encode_prompt(llm.tokenizer, s.prompt, s.use_chat_template)
        for rep in range(cfg.num_samples):
            seed = zlib.crc32(f"{cfg.seed}|{rep}|{s.prompt}".encode()) & 0x7FFFFFFF
            sampling = T.AVG_AT_K_SAMPLING if cfg.num_samples > 1 else {"temperature": 0.0}
            params.append(SamplingParams(max_tokens=cfg.max_gen_toks or T.TASKS[name].max_gen_toks, seed=seed,
                                         **{k: v for k, v in sampling.items() if k != "do_sample"}))
            prompts.append(ids)
    start = time.perf_counter()
    kw: dict[str, Any] = {} if reference is None else {"reference_output_ids": reference}
    if log is not None:
        done, shown = 0, start

        def progress(_: Any) -> None:
            nonlocal done, shown
            done += 1
            now = time.perf_counter()
            if now - shown >= 60 or done == len(prompts):
                shown = now
                log(f"{done}/{len(prompts)} generations done ({now - start:.0f} s)")

        kw["on_finish"] = progress
    outs = llm.generate(prompts, params, **kw)
    if keep is not None:
        keep += [list(o.token_ids) for o in outs]
    # On vLLM the generation's own time: the child's wall time also holds the engine start.
    secs = getattr(llm, "generate_seconds", None) or time.perf_counter() - start
    samples = []
    for i, (name, s) in enumerate(items):
        texts = [o.text for o in outs[i * cfg.num_samples:(i + 1) * cfg.num_samples]]
        score = sum(string_match_all(t, s.answers) for t in texts) / len(texts)
        strata = {"context_len": s.context_tokens, "depth": s.depth_percent}
        samples.append(Sample(name, f"{s.context_tokens}-{s.depth_percent:g}-{s.index}", strata, score,
                              s.answers, texts))
    num_out = sum(len(o.token_ids) for o in outs)
    return samples, {"output_throughput": num_out / secs if secs > 0 else None, "total_output_tokens": num_out,
                     "total_input_tokens": sum(len(p) for p in prompts), "duration": secs}


def aggregate(samples: list[Sample], k: int) -> list[dict[str, Any]]:
    """Score rows (percent) per task and stratum: overall, each varying stratum key alone, and all of them.

    A key with one value in a task (a single context length) adds nothing and is left out. The group
    ``niah`` gets its own rows: the sample mean over its tasks (they have equal sample counts).
    """
    by_task: dict[str, list[Sample]] = {}
    for s in samples:
        by_task.setdefault(s.task, []).append(s)
    niah = [s for s in samples if s.task in T.GROUPS["niah"]]
    if len({s.task for s in niah}) > 1:
        by_task["niah"] = niah
    rows = []
    for task, group in by_task.items():
        keys = [key for key in dict.fromkeys(k2 for s in group for k2 in s.strata)
                if len({json.dumps(s.strata.get(key)) for s in group}) > 1]
        subsets = [()] + [(key,) for key in keys] + ([tuple(keys)] if len(keys) > 1 else [])
        for subset in subsets:
            cells: dict[str, list[Sample]] = {}
            for s in group:
                cells.setdefault(json.dumps([s.strata.get(key) for key in subset]), []).append(s)
            for cell_key, members in sorted(cells.items(), key=lambda kv: _sort_key(json.loads(kv[0]))):
                score = 100.0 * sum(m.score for m in members) / len(members)
                lengths = {m.strata.get("context_len") for m in members}
                rows.append({"task": task, "stratum": dict(zip(subset, json.loads(cell_key))), "score": score,
                             "num_samples": len(members), "k": k, "avg_at_k": score if k > 1 else None,
                             "context_len": lengths.pop() if len(lengths) == 1 else None})
    return rows


def _sort_key(values: list[Any]) -> list[tuple[int, Any]]:
    order = {"short": 0, "medium": 1, "long": 2, "easy": 0, "hard": 1}
    return [(0, v) if isinstance(v, (int, float)) else (1, order.get(v, 9), str(v)) for v in values]


def _with_deltas(rows: list[dict[str, Any]],
                 samples: dict[str, list[Sample]] | None = None) -> list[dict[str, Any]]:
    """Delta in points against the dense row of the same task and stratum (None when dense lacks it), and with
    ``samples`` (label -> that setting's scored documents) ``delta_ci95``: the half-width of a 95% interval of that
    delta, paired over the documents both settings answered (:func:`paired_interval`)."""
    dense = {(r["task"], json.dumps(r["stratum"], sort_keys=True)): r for r in rows if r["mode"] == "dense"}
    for r in rows:
        anchor = dense.get((r["task"], json.dumps(r["stratum"], sort_keys=True)))
        r["delta_vs_dense"] = None if anchor is None else r["score"] - anchor["score"]
        if samples is not None:
            r["delta_ci95"] = None if anchor is None or r["mode"] == "dense" else paired_interval(
                _members(samples.get(r["label"], []), r["task"], r["stratum"]),
                _members(samples.get(anchor["label"], []), r["task"], r["stratum"]))
    return rows


def _members(samples: list[Sample], task: str, stratum: dict[str, Any]) -> list[Sample]:
    """The documents a row of :func:`aggregate` scored (``niah``: every NIAH family's)."""
    tasks = set(T.GROUPS.get(task, [task]))
    return [s for s in samples if s.task in tasks and all(s.strata.get(k) == v for k, v in stratum.items())]


def paired_interval(mine: list[Sample], anchor: list[Sample]) -> float | None:
    """Half-width, in points, of a 95% interval of ``mean(mine) - mean(anchor)`` over the same documents: the
    normal approximation over per-document differences (both settings saw each document, so what varies between
    documents cancels and the interval is far narrower than either score's own). None when a document lacks its
    pair or fewer than two documents remain."""
    base = {(s.task, s.doc_id): s.score for s in anchor}
    if len(mine) < 2 or len(base) != len(mine) or any((s.task, s.doc_id) not in base for s in mine):
        return None
    diffs = [100.0 * (s.score - base[s.task, s.doc_id]) for s in mine]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return 1.96 * math.sqrt(var / len(diffs))


def run(cfg: AccuracyConfig, log: Callable[[str], None] = print) -> RunOutcome:
    """Run the suite; raises :class:`~oasisbench.accuracy.tasks.MissingDataError` before loading anything
    when a task's data is missing."""
    sources = {n: T.resolve_data(T.TASKS[n], cfg.data_dir) for n in cfg.tasks}
    lm_names = [n for n in cfg.tasks if T.TASKS[n].kind == "lm_eval"]
    niah_names = [n for n in cfg.tasks if T.TASKS[n].kind == "niah"]
    if lm_names:
        import lm_eval  # noqa: F401  (fail on a missing eval extra before loading a model or writing a run)
    store = RunStore(cfg.output_dir, cfg.suite_name())
    config = asdict(cfg) | {"settings": [label(m, s, cfg.engine) for m, s in cfg.settings()],
                            "data_sources": {n: asdict(s) for n, s in sources.items()}}
    store.write_config(config)
    env = _env(cfg)
    store.write_env(env)
    task_dir = T.render_task_yamls({n: sources[n] for n in lm_names}, store.path, cfg.seed, cfg.num_samples,
                                   cfg.max_gen_toks) if lm_names else None
    outcome = RunOutcome(store.path)
    samples_by_mode: dict[str, list[str]] = {}
    samples_by_label: dict[str, list[Sample]] = {}
    engine_stats: dict[str, dict[str, Any]] = {}
    dense_out: list[list[int]] = []  # the anchor's NIAH outputs: the oracle draft's reference
    for i, (mode, setting) in enumerate(cfg.settings()):
        name = label(mode, setting, cfg.engine)
        log(f"[{name}] loading {cfg.model} on {cfg.device}")
        runs = []
        if cfg.engine == "vllm":
            from oasisbench.runners.accuracy_vllm import VllmRunError

            llm = _vllm_engine(cfg, mode, setting, store.path / f"vllm-{i}.log")
            env["random_weights"] = llm.random_weights
            try:
                if lm_names:
                    runs.append(_run_lm_eval(cfg, llm, task_dir, lm_names))
                if niah_names:
                    runs.append(_run_niah(cfg, llm, niah_names))
            except VllmRunError as e:  # recorded; the next setting runs
                engine_stats[name] = {"error": str(e)}
                _write(cfg, store, env, outcome, engine_stats)
                log(f"[{name}] FAILED: {e}")
                continue
            engine_stats[name] = llm.run_stats()
        else:
            llm = _engine(cfg, mode, setting)
            env["random_weights"] = bool(llm.engine.model_config.random_weights)
            if lm_names:
                runs.append(_run_lm_eval(cfg, llm, task_dir, lm_names))
            if niah_names:
                runs.append(_run_niah(cfg, llm, niah_names, reference=dense_out if cfg.oracle(mode, setting) else None,
                                      keep=dense_out if mode == "dense" else None,
                                      log=lambda line, name=name: log(f"[{name}] {line}")))
            engine_stats[name] = llm.engine.run_stats()
        del llm
        gc.collect()  # one engine's KV pools at a time
        for samples, throughput in runs:
            for row in aggregate(samples, cfg.num_samples):
                outcome.rows.append(row | {"mode": mode, "setting": setting, "label": name, "engine": cfg.engine}
                                    | throughput)
            samples_by_label.setdefault(name, []).extend(samples)
            lines = samples_by_mode.setdefault(mode, [])
            lines += [json.dumps({"mode": mode, "setting": setting, "engine": cfg.engine} | asdict(s), default=str)
                      for s in samples]
        atomic_write_text(store.path / f"samples-{mode}.jsonl", "\n".join(samples_by_mode[mode]) + "\n")
        _with_deltas(outcome.rows, samples_by_label)
        _write(cfg, store, env, outcome, engine_stats)
        log(f"[{name}] done: " + ", ".join(f"{r['task']} {r['score']:.1f}" for r in outcome.rows
                                             if r["label"] == name and not r["stratum"]))
    return outcome


def _write(cfg: AccuracyConfig, store: RunStore, env: dict, outcome: RunOutcome,
           engine_stats: dict[str, dict[str, Any]]) -> None:
    store.write_env(env)
    atomic_write_json(store.path / "accuracy.json", {
        "schema_version": 1, "suite": store.suite, "run_id": store.run_id, "model": cfg.model,
        "random_weights": env.get("random_weights"), "anchor_mode": "dense",
        "score_unit": "percent; delta_vs_dense in points", "k": cfg.num_samples, "engine": cfg.engine,
        "sweep": None if cfg.sweep is None else {"key": cfg.sweep[0], "values": list(cfg.sweep[1])},
        "set": dict(cfg.options),
        "rows": outcome.rows, "engine_stats": engine_stats})
    for r in outcome.rows:
        # Per task (and per context length), for `oasisbench compare/gate`; strata stay in accuracy.json.
        if set(r["stratum"]) - {"context_len"}:
            continue
        # context_len 0: the task's own lengths (AIME, GPQA) or several lengths pooled.
        point = {"task": r["task"], "mode": r["mode"], "context_len": int(r.get("context_len") or 0),
                 "concurrency": cfg.max_num_seqs, **r["setting"]}
        if cfg.engine != "embedded":  # the default engine stays out of the point: older runs keep their ids
            point["engine"] = cfg.engine
        stats = engine_stats.get(r["label"], {})
        metrics = {k: r.get(k) for k in ("score", "delta_vs_dense", "delta_ci95", "num_samples", "avg_at_k",
                                         "output_throughput", "total_output_tokens", "duration")}
        metrics |= {k: stats.get(k) for k in ("num_preemptions", "fetched_bytes_per_step", "prediction_recall",
                                              "draft_accuracy")}
        store.add_record(point, metrics)
    errors = {name: st["error"] for name, st in engine_stats.items() if st.get("error")}
    atomic_write_text(store.path / "report.md", render_report(outcome.rows, cfg.model, store.run_id,
                                                              env.get("random_weights"), cfg.engine, errors))


def render_report(rows: list[dict[str, Any]], model: str, run_id: str, random_weights: bool | None,
                  engine: str = "embedded", errors: dict[str, str] | None = None) -> str:
    """Markdown: one row per task and stratum, one column per mode (score, and delta vs dense in points),
    then generated tokens/s per task and mode, then the settings that failed (``errors``: label -> why)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    keys = list(dict.fromkeys(k for r in rows for k in r["stratum"]))
    cells: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["task"], json.dumps(r["stratum"])), {})[r["label"]] = r
    warn = " **Random weights: scores carry no meaning.**" if random_weights else ""
    on = {"embedded": "", "vllm": " on vLLM"}.get(engine, f" on {engine}")
    out = [f"# Accuracy: {model}{on}", "",
           f"Run `{run_id}`. Scores in percent; `(+x.x ±y.y)` is the delta in points against the dense anchor of the "
           f"same engine (deltas compare only within one stack) and the half-width of its 95% interval, paired over "
           f"the same documents (normal approximation).{warn}", "",
           "| " + " | ".join(["task", *keys, *labels]) + " |", "|" + "---|" * (1 + len(keys) + len(labels))]
    for (task, stratum_text), by_label in cells.items():
        stratum = json.loads(stratum_text)
        strata = [f"{stratum[k]:g}" if isinstance(stratum.get(k), float) else str(stratum.get(k, "all"))
                  for k in keys]
        scores = []
        for name in labels:
            r = by_label.get(name)
            ci = "" if r is None or r.get("delta_ci95") is None else f" ±{r['delta_ci95']:.1f}"
            delta = "" if r is None or r["mode"] == "dense" or r["delta_vs_dense"] is None \
                else f" ({r['delta_vs_dense']:+.1f}{ci})"
            scores.append("-" if r is None else f"{r['score']:.1f}{delta}")
        n = max((r["num_samples"] for r in by_label.values()), default=0)
        out.append("| " + " | ".join([f"{task} (n={n})", *strata, *scores]) + " |")
    out += ["", "Generated tokens/s (each mode's whole batch for the task):", "",
            "| " + " | ".join(["task", *labels]) + " |", "|" + "---|" * (1 + len(labels))]
    for (task, stratum_text), by_label in cells.items():
        if stratum_text == "{}":
            tps = [by_label[n].get("output_throughput") if n in by_label else None for n in labels]
            out.append("| " + " | ".join([task, *("-" if v is None else f"{v:.1f}" for v in tps)]) + " |")
    if errors:
        out += ["", "Failed settings (no rows):", "", *(f"- `{name}`: {why.splitlines()[0]}" for name, why in
                                                         errors.items())]
    return "\n".join(out) + "\n"
