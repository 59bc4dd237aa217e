"""`oasisbench accuracy`: the lm-eval model, loglikelihood through engine steps, task data, NIAH runner, CLI.

Runs on a tiny random checkpoint, so scores are ~0: the tests check structure, determinism and plumbing.
Needs the eval extra (lm-eval, datasets): skipped without it.
"""

from __future__ import annotations

import json
import random
import statistics
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

from typer.testing import CliRunner  # noqa: E402

from oasisbench.accuracy import tasks as T  # noqa: E402
from oasisbench.accuracy.lm_eval_model import OasisKVLM  # noqa: E402
from oasisbench.accuracy.scoring import dense_loglikelihood, engine_loglikelihood  # noqa: E402
from oasisbench.cli.main import app  # noqa: E402
from oasisbench.runners.accuracy import (AccuracyConfig, Sample, _run_niah, _with_deltas,  # noqa: E402
                                        paired_interval, render_report, run)
from oasiskv_runtime import LLM, SamplingParams  # noqa: E402
from tests.tiny_data import write_aime24  # noqa: E402
from tests.tiny_models import write_tiny, write_tiny_tokenizer  # noqa: E402

runner = CliRunner()
KV_GB = 0.05  # ~9K tokens of the tiny model: every test fits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = write_tiny(tmp_path_factory.mktemp("acc-model"), "llama", max_position_embeddings=1024)
    write_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    # A small step budget so prompts are prefilled in several chunks (the path real long prompts take); a
    # small KV pool because zeroing the 2 GiB CPU default costs seconds per engine.
    return LLM(tiny, max_num_batched_tokens=64, kv_cache_gb=KV_GB)


@pytest.fixture(scope="module")
def aime_dir(tmp_path_factory) -> Path:
    """Three problems in the original Maxwell-Jia/AIME_2024 schema."""
    return write_aime24(tmp_path_factory.mktemp("aime-data"), 3)


def _request(context: str, **gen_kwargs) -> SimpleNamespace:
    return SimpleNamespace(args=(context, gen_kwargs))


@pytest.mark.slow
def test_simple_evaluate_runs_aime_fixture_with_avg_at_k(llm, aime_dir, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    source = T.resolve_data(T.TASKS["aime24"], aime_dir)
    assert source.kind == "file" and source.builder == "json"
    task_dir = T.render_task_yamls({"aime24": source}, tmp_path, seed=0, num_samples=2, max_gen_toks=4)
    lm = OasisKVLM(llm=llm)
    out = simple_evaluate(model=lm, tasks=["aime24"], task_manager=TaskManager(include_path=str(task_dir),
                          include_defaults=False), limit=2, bootstrap_iters=0)
    assert out["results"]["aime24"]["exact_match,all"] == pytest.approx(0.0, abs=1.0)
    logged = out["samples"]["aime24"]
    assert len(logged) == 2 and all(len(s["filtered_resps"][0]) == 2 for s in logged)  # k = 2 responses kept
    stats = lm.throughput()
    assert stats["total_output_tokens"] > 0 and stats["output_throughput"] > 0


def test_generate_until_is_one_batch_and_honours_stop(llm, monkeypatch):
    lm = OasisKVLM(llm=llm)
    free = lm.generate_until([_request("The capital of France is", until=[], max_gen_toks=8)])[0]
    stop = free.strip()[1:3] if len(free.strip()) >= 3 else None
    calls = []
    real = llm.generate
    monkeypatch.setattr(llm, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    reqs = [_request("The capital of France is", until=[stop] if stop else [], max_gen_toks=8),
            _request("Once upon a time", until=["\n\n"], max_gen_toks=3, do_sample=True, temperature=0.7)]
    texts = lm.generate_until(reqs)
    assert len(calls) == 1 and len(texts) == 2  # continuous batching: one engine call for all requests
    if stop:
        assert texts[0] == free[: free.index(stop)]


def test_loglikelihood_matches_dense_reference_and_ranks_greedy_first(llm):
    ctx = llm.encode("The quick brown fox")
    greedy = llm.generate([ctx], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].token_ids
    other = [(t + 7) % llm.engine.model_config.vocab_size for t in greedy]
    got = engine_loglikelihood(llm, [(ctx, greedy), (ctx, other), (ctx * 40, greedy[:2])])
    for (logprob, _), cont, c in zip(got, [greedy, other, greedy[:2]], [ctx, ctx, ctx * 40]):
        assert math.isfinite(logprob) and logprob < 0
        assert logprob == pytest.approx(dense_loglikelihood(llm, c, cont)[0], abs=2e-3)
    assert got[0][1] is True and got[1][1] is False  # the greedy continuation is the argmax at every step
    assert got[0][0] > got[1][0]


def test_sparse_loglikelihood_is_scored_by_decode_steps(tiny):
    """oasiskv at full budget matches the dense reference; with 2 blocks per head the decode steps attend
    sparsely, so the score moves (a dense prefill of context+continuation could never show that)."""
    ctx = [5 + (i * 37) % 300 for i in range(61)]
    cont = [7 + (i * 11) % 300 for i in range(9)]
    full = LLM(tiny, mode="oasiskv", top_k_blocks=64, kv_cache_gb=KV_GB)
    [(full_lp, _)] = engine_loglikelihood(full, [(ctx, cont)])
    assert full_lp == pytest.approx(dense_loglikelihood(full, ctx, cont)[0], abs=2e-3)
    sparse = LLM(tiny, mode="oasiskv", top_k_blocks=2, fetch_ratio=0.5, kv_cache_gb=KV_GB)
    [(sparse_lp, _)] = engine_loglikelihood(sparse, [(ctx, cont)])
    assert math.isfinite(sparse_lp) and abs(sparse_lp - full_lp) > 1e-3


@pytest.mark.slow
def test_lm_eval_loglikelihood_and_rolling(llm):
    lm = OasisKVLM(llm=llm)
    pairs = lm.loglikelihood([SimpleNamespace(args=("The capital of France is ", "Paris.")),
                              SimpleNamespace(args=("", "Paris"))])  # empty context: conditioned on BOS
    assert len(pairs) == 2 and all(math.isfinite(lp) and isinstance(g, bool) for lp, g in pairs)
    lm.max_length = 32  # forces several rolling windows
    text = "The quick brown fox jumps over the lazy dog. " * 4
    [total] = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert math.isfinite(total) and total < 0


def test_missing_data_names_the_dataset_and_how_to_supply_it(tmp_path):
    with pytest.raises(T.MissingDataError, match="Maxwell-Jia/AIME_2024") as e:
        T.resolve_data(T.TASKS["aime24"], tmp_path)
    assert "--data-dir" in str(e.value) and "aime24.jsonl" in str(e.value)
    (tmp_path / "gpqa_diamond.csv").write_text("Question,Correct Answer\nq,a\n")
    with pytest.raises(T.MissingDataError, match="Incorrect Answer 1"):
        T.resolve_data(T.TASKS["gpqa_diamond"], tmp_path)


def test_answer_extraction_and_deterministic_gpqa_shuffle():
    import datasets

    assert T.final_integer("so x = 5, hence \\boxed{\\frac{1}{2} \\cdot 204}. Also 7") == 204
    assert T.final_integer("The answer is 1,024.") == 1024 and T.final_integer("no digits") is None
    assert T.answer_letter("reasoning... (B) looks wrong.\nAnswer: C") == "C"
    assert T.longbench_letter("The correct answer is (D)") == "D" and T.longbench_letter("B. because") == "B"
    assert T.aime_process_results({"Answer": "033"}, [["\\boxed{33}", "34"]]) == {"exact_match": 0.5}
    doc = {"Question": "Q?", "Correct Answer": "right", "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2",
           "Incorrect Answer 3": "w3"}
    ds = datasets.Dataset.from_list([doc])
    a, b, c = (T.gpqa_process_docs(ds, seed=s)[0] for s in (0, 0, 1))
    assert a == b and a[f"choice{'ABCD'.index(a['answer']) + 1}"] == "right"
    assert {c[f"choice{i}"] for i in range(1, 5)} == {"right", "w1", "w2", "w3"}


def test_niah_loop_is_stratified_and_deterministic(llm, tiny, tmp_path):
    cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("dense",), context_lens=(400,),
                         depths=(0.0, 100.0), limit=2, max_gen_toks=2, kv_cache_gb=KV_GB, output_dir=tmp_path)
    first, _ = _run_niah(cfg, llm, ["niah_passkey"])
    second, _ = _run_niah(cfg, llm, ["niah_passkey"])
    assert [(s.doc_id, s.responses, s.score) for s in first] == [(s.doc_id, s.responses, s.score) for s in second]
    assert [s.strata["depth"] for s in first] == [0.0, 100.0]
    lines = []
    outcome = run(cfg, log=lines.append)
    assert any(line.startswith("[dense] 2/2 generations done") for line in lines), lines  # progress of a long run
    rows = {(r["task"], json.dumps(r["stratum"])): r for r in outcome.rows}
    assert ("niah_passkey", "{}") in rows and ("niah_passkey", '{"depth": 100.0}') in rows
    assert all(0.0 <= r["score"] <= 100.0 and r["delta_vs_dense"] == 0.0 for r in outcome.rows)
    assert (outcome.path / "samples-dense.jsonl").exists() and (outcome.path / "report.md").exists()


def test_cli_list_tasks_shows_sources_and_local_data(aime_dir):
    r = runner.invoke(app, ["accuracy", "--list-tasks", "--data-dir", str(aime_dir)], env={"COLUMNS": "240"})
    assert r.exit_code == 0, r.output
    for name in ("aime24", "aime25", "gpqa_diamond", "longbench_v2", "niah_passkey", "niah_drift_stress"):
        assert name in r.output
    assert "Maxwell-Jia/AIME_2024" in r.output and "aime24.jsonl" in r.output


@pytest.mark.slow
def test_cli_aime_fixture_writes_deltas_for_every_mode(tiny, aime_dir, tmp_path):
    r = runner.invoke(app, ["accuracy", "--task", "aime24", "--model", tiny, "--modes", "oasiskv",
                            "--data-dir", str(aime_dir), "--limit", "2", "--max-gen-toks", "3", "--kv-cache-gb", str(KV_GB),
                            "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    [run_dir] = (tmp_path / "accuracy-aime24").iterdir()
    doc = json.loads((run_dir / "accuracy.json").read_text())
    by_mode = {row["mode"]: row for row in doc["rows"] if row["task"] == "aime24" and not row["stratum"]}
    assert list(by_mode) == ["dense", "oasiskv"]  # the dense anchor is added and runs first
    assert by_mode["dense"]["delta_vs_dense"] == 0.0
    assert by_mode["oasiskv"]["delta_vs_dense"] == pytest.approx(by_mode["oasiskv"]["score"] - by_mode["dense"]["score"])
    assert by_mode["oasiskv"]["num_samples"] == 2 and by_mode["oasiskv"]["output_throughput"] > 0
    assert by_mode["oasiskv"]["delta_ci95"] >= 0.0 and by_mode["dense"]["delta_ci95"] is None
    for name in ("config.json", "env.json", "metrics.json", "report.md", "samples-dense.jsonl", "samples-oasiskv.jsonl"):
        assert (run_dir / name).exists(), name


def test_cli_missing_data_exits_nonzero_naming_the_dataset(tmp_path):
    r = runner.invoke(app, ["accuracy", "--task", "aime25", "--data-dir", str(tmp_path), "-o", str(tmp_path)],
                      env={"COLUMNS": "400"})
    assert r.exit_code != 0
    assert "math-ai/aime25" in r.output and "--data-dir" in r.output
    assert not (tmp_path / "accuracy-aime25").exists()  # nothing is loaded or written before data is found


@pytest.mark.slow
def test_sink_blocks_sweep_runs_one_engine_per_value_and_bad_sinks_fail_first(tiny, tmp_path):
    cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("oasiskv",), sweep=("sink_blocks", (0.0, 2.0)),
                         top_k_blocks=8, output_dir=tmp_path)
    assert cfg.settings() == [("dense", {}), ("oasiskv", {"sink_blocks": 0}), ("oasiskv", {"sink_blocks": 2})]
    r = runner.invoke(app, ["accuracy", "--task", "niah_passkey", "--model", tiny, "--modes", "oasiskv",
                            "--context-len", "400", "--depths", "50", "--limit", "1", "--max-gen-toks", "2",
                            "--top-k-blocks", "8", "--sweep", "sink_blocks=1", "--kv-cache-gb", str(KV_GB),
                            "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    [run_dir] = (tmp_path / "accuracy-niah_passkey").iterdir()
    doc = json.loads((run_dir / "accuracy.json").read_text())
    assert {row["label"] for row in doc["rows"]} == {"dense", "oasiskv[sink_blocks=1]"}
    assert {row["setting"].get("sink_blocks") for row in doc["rows"]} == {None, 1}
    assert json.loads((run_dir / "config.json").read_text())["sweep"] == ["sink_blocks", [1]]
    for bad in (["--sink-blocks", "8"], ["--sweep", "sink_blocks=0,9"], ["--sink-blocks", "-1"]):
        r = runner.invoke(app, ["accuracy", "--task", "niah_passkey", "--model", tiny, "--top-k-blocks", "8",
                                *bad, "-o", str(tmp_path / "bad")], env={"COLUMNS": "400"})
        assert r.exit_code != 0 and "sink_blocks" in r.output and "top_k_blocks" in r.output, (bad, r.output)
        assert not (tmp_path / "bad").exists()  # refused before any engine ran


def test_dense_layers_option_and_sweep_reach_the_engine_as_leading_layers(tiny, tmp_path):
    """--dense-layers N / --sweep dense_layers=...: the first N layers attend densely in the sparse modes (the
    engine gets their indices); a count past the model's layers or below 0 is refused before any engine runs."""
    from oasisbench.runners.accuracy import _engine_opts

    cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("sparse-resident",), dense_layers=2,
                         sweep=("dense_layers", (0.0, 3.0)), top_k_blocks=8, output_dir=tmp_path)
    assert cfg.settings() == [("dense", {}), ("sparse-resident", {"dense_layers": 0}),
                              ("sparse-resident", {"dense_layers": 3})]
    assert _engine_opts(cfg, {}, "oasiskv")["dense_layers"] == 2
    assert _engine_opts(cfg, {"dense_layers": 3}, "oasiskv")["dense_layers"] == 3
    assert _engine_opts(cfg, {"dense_layers": 0}, "oasiskv")["dense_layers"] == 0
    for bad in (["--dense-layers", "-1"], ["--sweep", "dense_layers=0,99"]):
        r = runner.invoke(app, ["accuracy", "--task", "niah_passkey", "--model", tiny, "--modes", "sparse-resident",
                                *bad, "-o", str(tmp_path / "bad")], env={"COLUMNS": "400"})
        assert r.exit_code != 0 and "dense_layers" in r.output.replace("-", "_"), (bad, r.output)
        assert not (tmp_path / "bad").exists()


def test_link_gbps_option_and_sweep_reach_the_engine(tiny, tmp_path):
    """--link-gbps / --sweep link_gbps=...: the per-step fetch cap from the link's budget; a negative rate is
    refused before any engine runs."""
    from oasisbench.runners.accuracy import _engine_opts

    cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("oasiskv",), link_gbps=5.0,
                         sweep=("link_gbps", (0.0, 20.0)), top_k_blocks=8, output_dir=tmp_path)
    assert cfg.settings() == [("dense", {}), ("oasiskv", {"link_gbps": 0.0}), ("oasiskv", {"link_gbps": 20.0})]
    assert _engine_opts(cfg, {}, "oasiskv")["link_gbps"] == 5.0
    assert _engine_opts(cfg, {"link_gbps": 20.0}, "oasiskv")["link_gbps"] == 20.0
    for bad in (["--link-gbps", "-1"], ["--sweep", "link_gbps=0,-3"]):
        r = runner.invoke(app, ["accuracy", "--task", "niah_passkey", "--model", tiny, "--modes", "oasiskv",
                                *bad, "-o", str(tmp_path / "bad")], env={"COLUMNS": "400"})
        assert r.exit_code != 0 and "link" in r.output.replace("-", "_"), (bad, r.output)
        assert not (tmp_path / "bad").exists()


def test_every_algorithm_option_and_block_size_can_be_swept(tiny, tmp_path):
    """--sweep takes every option of the config's ``sparse`` section (a new one is sweepable once declared) and
    block_size: each key's default, as the CLI's text, reaches the engine as the option's own type."""
    from oasisbench.runners.accuracy import SWEEP_KEYS
    from oasiskv_runtime.config import EngineConfig

    opts = EngineConfig.options()
    assert set(SWEEP_KEYS) == {n for n, s in opts.items() if s.section == "sparse"} | {"block_size"}
    assert {"recent_blocks", "selection_score", "top_k_blocks", "sink_blocks"} <= set(SWEEP_KEYS)
    for key in SWEEP_KEYS:
        default = opts[key].default
        cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("sparse-resident",), top_k_blocks=8,
                             sweep=(key, (str(default),)), output_dir=tmp_path)
        [(_, setting)] = cfg.settings()[1:]
        assert setting == {key: default} and type(setting[key]) is type(default), key
    cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("sparse-resident",), top_k_blocks=8,
                         sweep=("recent_blocks", ("0", "2")), output_dir=tmp_path)
    assert cfg.settings()[1:] == [("sparse-resident", {"recent_blocks": 0}), ("sparse-resident", {"recent_blocks": 2})]


def test_set_options_reach_every_sparse_setting_before_the_sweep(tiny, tmp_path):
    """--set KEY=VALUE (repeatable): the option, as its own type, in every sparse setting (so in labels and engine
    options), the sweep's value after it; dense runs without it; an unknown key or a bad value is refused before
    any engine runs."""
    cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("oasiskv",), top_k_blocks=8, draft="ngram",
                         options=(("accept_drafts", "true"), ("recent_blocks", "2")),
                         sweep=("fill_query", ("draft", "last")), output_dir=tmp_path)
    assert cfg.settings() == [
        ("dense", {}),
        ("oasiskv", {"accept_drafts": True, "recent_blocks": 2, "fill_query": "draft"}),
        ("oasiskv", {"accept_drafts": True, "recent_blocks": 2, "fill_query": "last"})]
    base = ["accuracy", "--task", "niah_passkey", "--model", tiny, "--modes", "oasiskv", "--top-k-blocks", "8",
            "-o", str(tmp_path / "bad")]
    for extra, words in ((["--set", "accept=true"], ("--set takes KEY=VALUE", "accept_drafts")),
                         (["--set", "recent_blocks"], ("--set: expected KEY=VALUE",)),
                         (["--set", "recent_blocks=x"], ("is not an integer",)),
                         (["--set", "fill_query=first"], ("fill_query",))):
        r = runner.invoke(app, base + extra, env={"COLUMNS": "400"})
        out = " ".join(r.output.split())
        assert r.exit_code != 0 and all(w in out for w in words), (extra, r.output)
        assert not (tmp_path / "bad").exists()


def test_oracle_draft_gets_the_dense_anchors_outputs(tiny, tmp_path, monkeypatch):
    """--draft oracle: the oasiskv setting's look-ahead is the dense anchor's outputs of the same run (a perfect
    draft while its outputs follow dense's), passed per generation in order; refused where there is no anchor to
    take them from (lm-eval tasks, the vLLM engine)."""
    seen = []
    real = LLM.generate

    def spy(self, prompts, params=None, **kw):
        seen.append((self.engine.config.mode.value, kw.get("reference_output_ids")))
        return real(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    cfg = AccuracyConfig(tasks=("niah_passkey",), model=tiny, modes=("oasiskv",), context_lens=(400,),
                         depths=(0.0, 100.0), limit=2, max_gen_toks=3, top_k_blocks=64, draft="oracle",
                         kv_cache_gb=KV_GB, output_dir=tmp_path)
    outcome = run(cfg, log=lambda _: None)
    (_, none), (mode, ref) = seen
    dense = [json.loads(line) for line in (outcome.path / "samples-dense.jsonl").read_text().splitlines()]
    assert none is None and mode == "oasiskv" and len(ref) == len(dense) == 2 and all(len(r) == 3 for r in ref)
    stats = json.loads((outcome.path / "accuracy.json").read_text())["engine_stats"]["oasiskv"]
    assert stats["draft_accuracy"] == 1.0  # a covering budget follows dense: every proposal is the next token
    for kw, words in (({"tasks": ("aime24",)}, "NIAH tasks on the embedded engine only"),
                      ({"engine": "vllm"}, "NIAH tasks on the embedded engine only")):
        with pytest.raises(ValueError, match=words):
            AccuracyConfig(**{**dict(tasks=("niah_passkey",), model=tiny, modes=("oasiskv",), draft="oracle",
                                     output_dir=tmp_path), **kw})


def test_sweep_refusals_name_the_key_before_any_engine_runs(tiny, tmp_path):
    base = ["accuracy", "--task", "niah_passkey", "--model", tiny, "--top-k-blocks", "8", "-o", str(tmp_path / "bad")]
    for extra, words in ((["--modes", "oasiskv", "--sweep", "selection_score=quest,attention"],
                          ("oasiskv[selection_score=attention]", "needs mode sparse-resident")),
                         (["--modes", "sparse-resident", "--sweep", "selection_score=exact"],
                          ("selection_score must be quest, minmax_mass, attention, gauss, quest_rank, quest_half, "
                           "quest_quarter, max_logit, max_logit_b1, max_logit_b2 or max_logit_b4",)),
                         (["--modes", "proxy-prefetch", "--sweep", "recent_blocks=0,8"],
                          ("recent_blocks + attended_blocks must be < top_k_blocks",)),
                         (["--modes", "proxy-prefetch", "--sweep", "recent_blocks=1.5"], ("is not an integer",)),
                         (["--modes", "proxy-prefetch", "--sweep", "recent=1"], ("recent_blocks", "selection_score"))):
        r = runner.invoke(app, base + extra, env={"COLUMNS": "400"})
        out = " ".join(r.output.split())
        assert r.exit_code != 0 and all(w in out for w in words), (extra, r.output)
        assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_selection_score_and_recent_blocks_sweeps_run(tiny, tmp_path):
    """The study's sweeps (issue #34) through the CLI: one sparse-resident engine per value, labelled by it."""
    for sweep, labels in (("selection_score=quest,attention", {"sparse-resident[selection_score=quest]",
                                                               "sparse-resident[selection_score=attention]"}),
                          ("recent_blocks=0,2", {"sparse-resident[recent_blocks=0]",
                                                 "sparse-resident[recent_blocks=2]"})):
        out = tmp_path / sweep.split("=")[0]
        r = runner.invoke(app, ["accuracy", "--task", "niah_passkey", "--model", tiny, "--modes", "sparse-resident",
                                "--context-len", "400", "--depths", "50", "--limit", "1", "--max-gen-toks", "2",
                                "--top-k-blocks", "8", "--sweep", sweep, "--kv-cache-gb", str(KV_GB), "-o", str(out)])
        assert r.exit_code == 0, r.output
        [run_dir] = (out / "accuracy-niah_passkey").iterdir()
        doc = json.loads((run_dir / "accuracy.json").read_text())
        assert {row["label"] for row in doc["rows"]} == {"dense"} | labels


def test_cli_top_k_covering_the_context_is_lowered_or_noted(tiny, tmp_path, monkeypatch):
    """accuracy treats a K that holds the whole context as throughput does: the default K drops to a quarter of the
    shortest context's blocks (1K tokens: 16, not the paper's 128, whose 2,064 tokens would make oasiskv dense), an
    explicit one gets a note; never a silent dense-vs-dense run. --kv-cache-gb -1 is refused in GiB, nothing
    written."""
    import oasisbench.runners.accuracy as acc

    seen: list[AccuracyConfig] = []

    def stop(cfg, log=print):
        seen.append(cfg)
        raise ValueError("stopped before loading a model")

    monkeypatch.setattr(acc, "run", stop)
    base = ["accuracy", "--task", "niah_passkey", "--model", tiny, "-o", str(tmp_path)]
    r = runner.invoke(app, [*base, "--context-len", "1024"], env={"COLUMNS": "400"})
    assert r.exit_code == 2 and "stopped before" in r.output
    assert seen[-1].top_k_blocks == 16 and "note:" not in r.output
    r = runner.invoke(app, [*base, "--context-len", "1024", "--top-k-blocks", "128"], env={"COLUMNS": "400"})
    assert seen[-1].top_k_blocks == 128 and "the whole context at --context-len 1,024" in r.output
    runner.invoke(app, base)
    assert seen[-1].top_k_blocks == 128  # NIAH's default 4,096 tokens: the paper's K leaves 127 blocks out
    r = runner.invoke(app, [*base, "--kv-cache-gb", "-1"], env={"COLUMNS": "400"})
    assert r.exit_code == 2 and "--kv-cache-gb must be a positive number of GiB, got -1" in r.output
    assert "Traceback" not in r.output and len(seen) == 3 and not tmp_path.joinpath("accuracy-niah_passkey").exists()


def test_lm_eval_records_our_commit_quietly_outside_a_checkout(tmp_path, monkeypatch, capfd):
    """lm-eval's simple_evaluate runs `git describe` in the current directory with stderr on the terminal: outside
    a git checkout every accuracy run printed `fatal: not a git repository`. Within quiet_git_hash it gets the
    commit env.json records instead, and the real lookup is put back after."""
    import lm_eval.evaluator as evaluator

    from oasisbench.runners.accuracy import quiet_git_hash
    from oasisbench.runners.throughput import _git_commit

    monkeypatch.chdir(tmp_path)
    real = evaluator.get_git_commit_hash
    with quiet_git_hash():
        recorded = evaluator.get_git_commit_hash()
    assert evaluator.get_git_commit_hash is real
    assert recorded == _git_commit()
    assert "fatal" not in capfd.readouterr().err


def _scored(task: str, n: int, rng: random.Random, depths=(0.0, 50.0)) -> list[Sample]:
    """``n`` documents of ``task`` spread over ``depths``, each scored in [0, 1] in steps of 1/3 (a multi-answer
    task's partial credit)."""
    at = [depths[i % len(depths)] for i in range(n)]
    return [Sample(task, f"2048-{d:g}-{i}", {"context_len": 2048, "depth": d}, rng.randrange(4) / 3, [], [])
            for i, d in enumerate(at)]


def test_paired_interval_is_the_normal_interval_of_per_document_differences():
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    n = rng.randrange(7, 41)
    dense = _scored("niah_multi_key", n, rng)
    mine = [Sample(s.task, s.doc_id, s.strata, rng.randrange(4) / 3, [], []) for s in dense]
    rng.shuffle(mine)  # paired by document, not by position
    diffs = {s.doc_id: 100 * s.score for s in mine}
    for s in dense:
        diffs[s.doc_id] -= 100 * s.score
    want = 1.96 * statistics.stdev(diffs.values()) / math.sqrt(n)
    assert paired_interval(mine, dense) == pytest.approx(want), seed
    # The same answers everywhere: no spread; a constant shift: none either (pairing removes the documents' spread).
    assert paired_interval(dense, dense) == 0.0
    assert paired_interval([Sample(s.task, s.doc_id, s.strata, 1.0, [], []) for s in dense],
                           [Sample(s.task, s.doc_id, s.strata, 0.0, [], []) for s in dense]) == 0.0
    assert paired_interval(mine[:1], dense[:1]) is None  # one document: no spread to estimate
    assert paired_interval(mine[1:], dense) is None  # a document without its pair
    assert paired_interval(mine, dense[1:] + [Sample("niah_multi_key", "x", {}, 0.0, [], [])]) is None


def test_deltas_carry_a_paired_interval_per_task_group_and_stratum():
    """Rows as ``aggregate`` makes them for two NIAH families: each row's interval is over its own documents (the
    ``niah`` group pools the families; a depth row takes that depth's)."""
    from oasisbench.runners.accuracy import aggregate

    rng = random.Random(7)
    dense = _scored("niah_single_needle", 9, rng) + _scored("niah_multi_key", 9, rng)
    mine = [Sample(s.task, s.doc_id, s.strata, rng.randrange(4) / 3, [], []) for s in dense]
    rows = [r | {"mode": m, "label": m, "setting": {}} for m, ss in (("dense", dense), ("oasiskv", mine))
            for r in aggregate(ss, 1)]
    _with_deltas(rows, {"dense": dense, "oasiskv": mine})
    by = {(r["label"], r["task"], json.dumps(r["stratum"])): r for r in rows}
    for task, stratum, keep in (("niah", {}, lambda s: True),
                                ("niah_multi_key", {}, lambda s: s.task == "niah_multi_key"),
                                ("niah", {"depth": 50.0}, lambda s: s.strata["depth"] == 50.0),
                                ("niah_single_needle", {"depth": 0.0},
                                 lambda s: s.task == "niah_single_needle" and s.strata["depth"] == 0.0)):
        row = by["oasiskv", task, json.dumps(stratum)]
        want = paired_interval([s for s in mine if keep(s)], [s for s in dense if keep(s)])
        assert want is not None and row["delta_ci95"] == pytest.approx(want), (task, stratum)
        assert by["dense", task, json.dumps(stratum)]["delta_ci95"] is None  # the anchor has no delta to bound
    text = render_report(rows, "m", "r1", False)
    row = by["oasiskv", "niah", "{}"]
    assert f"({row['delta_vs_dense']:+.1f} ±{row['delta_ci95']:.1f})" in text and "95% interval" in text


def _write_samples(run_dir: Path, mode: str, setting: dict, samples: list[Sample]) -> None:
    from dataclasses import asdict

    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"mode": mode, "setting": setting, "engine": "embedded"} | asdict(s)) for s in samples]
    (run_dir / f"samples-{mode}.jsonl").write_text("\n".join(lines) + "\n")


def test_cli_paired_compares_settings_of_two_runs_over_their_shared_documents(tmp_path):
    """Run 1 holds the exact top-K at two lengths, run 2 oasiskv at the same documents plus one run 1 lacks: the
    difference pairs documents, per length and pooled, and leaves the unpaired one out."""
    from oasisbench.results.paired import load_samples, paired_diff

    rng = random.Random(3)
    exact = [Sample(s.task, s.doc_id.replace("2048", str(n)), {**s.strata, "context_len": n}, s.score, [], [])
             for n in (2048, 4096) for s in _scored("niah_multi_value", 11, rng)]
    mine = [Sample(s.task, s.doc_id, s.strata, rng.randrange(4) / 3, [], []) for s in exact]
    extra = Sample("niah_multi_value", "4096-0-99", {"context_len": 4096, "depth": 0.0}, 1.0, [], [])
    _write_samples(tmp_path / "r1", "sparse-resident", {"selection_score": "attention"}, exact)
    _write_samples(tmp_path / "r2", "oasiskv", {}, [extra] + mine[::-1])
    rows = paired_diff(load_samples(tmp_path / "r1")["sparse-resident[selection_score=attention]"],
                       load_samples(tmp_path / "r2")["oasiskv"])
    assert [(r.context_len, r.num_samples) for r in rows] == [(2048, 11), (4096, 11), (None, 22)]
    for r, keep in zip(rows, (lambda s: s.strata["context_len"] == 2048, lambda s: s.strata["context_len"] == 4096,
                              lambda s: True)):
        a, b = [s for s in exact if keep(s)], [s for s in mine if keep(s)]
        assert r.delta == pytest.approx(100 * (sum(s.score for s in b) - sum(s.score for s in a)) / len(a))
        assert r.ci95 == pytest.approx(paired_interval(b, a))
    out = runner.invoke(app, ["paired", f"{tmp_path / 'r1'}:sparse-resident[selection_score=attention]",
                              f"{tmp_path / 'r2'}:oasiskv"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert f"{rows[2].delta:+.1f} ±{rows[2].ci95:.1f}" in out.output and "4096" in out.output
    # One run per length on A's side pools to the same figures.
    _write_samples(tmp_path / "r1a", "sparse-resident", {"selection_score": "attention"}, exact[:11])
    _write_samples(tmp_path / "r1b", "sparse-resident", {"selection_score": "attention"}, exact[11:])
    out = runner.invoke(app, ["paired", f"{tmp_path / 'r1a'},{tmp_path / 'r1b'}:sparse-resident[selection_score="
                              "attention]", f"{tmp_path / 'r2'}:oasiskv"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and f"{rows[2].delta:+.1f} ±{rows[2].ci95:.1f}" in out.output, out.output
    # Bad input: a setting the run lacks (the message lists what it has), a directory without samples, no shared
    # document, no setting named.
    out = runner.invoke(app, ["paired", f"{tmp_path / 'r1'}:oasiskv", f"{tmp_path / 'r2'}:oasiskv"],
                        env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "sparse-resident[selection_score=attention]" in out.output
    out = runner.invoke(app, ["paired", f"{tmp_path}:dense", f"{tmp_path / 'r2'}:oasiskv"], env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "no samples-*.jsonl" in out.output
    _write_samples(tmp_path / "r3", "dense", {}, [extra])
    out = runner.invoke(app, ["paired", f"{tmp_path / 'r3'}:dense", f"{tmp_path / 'r1'}:sparse-resident"
                              "[selection_score=attention]"], env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "answered by both" in out.output
    out = runner.invoke(app, ["paired", f"{tmp_path / 'r1'},{tmp_path / 'r1a'}:sparse-resident[selection_score="
                              "attention]", f"{tmp_path / 'r2'}:oasiskv"], env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "more than once" in out.output  # one run pooled with a part of itself
    out = runner.invoke(app, ["paired", str(tmp_path / "r1"), f"{tmp_path / 'r2'}:oasiskv"], env={"COLUMNS": "300"})
    assert out.exit_code == 2 and "RUN_DIR[,RUN_DIR...]:SETTING" in out.output
