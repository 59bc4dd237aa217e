"""``oasisbench recall``'s runner on a tiny random target with a tokenizer: both forced continuations, and
``self`` forces the model's own greedy tokens, identically for every mode (so the oracle draft is exact)."""

from __future__ import annotations

import pytest

from oasisbench.runners.recall import RecallPoint, essay_windows, gap_closed, run_recall, self_continuations
from oasiskv_runtime import LLM, SamplingParams
from tests.tiny_models import write_tiny_with_tokenizer

CTX, STEPS, TEXTS = 96, 6, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny-recall"))


@pytest.mark.slow
def test_self_continuation_is_the_dense_greedy_output(tiny):
    windows = essay_windows(LLM(tiny).tokenizer, TEXTS, CTX)
    prompts = [w[: CTX - STEPS] for w in windows]
    dense = [o.token_ids for o in LLM(tiny).generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                                              ignore_eos=True))]
    assert self_continuations(tiny, prompts, STEPS, "cpu", "float32") == dense
    assert dense != [w[CTX - STEPS:] for w in windows]  # a random model does not reproduce the essay


@pytest.mark.slow
def test_recall_reports_both_continuations(tiny):
    configs = [("proxy-prefetch", None), ("oasiskv", "oracle")]
    points = run_recall(tiny, [CTX], configs, top_k_blocks=2, num_texts=TEXTS, num_steps=STEPS, fetch_ratio=0.5,
                        device="cpu", dtype="float32", continuations=("text", "self"))
    assert [(p.continuation, p.mode) for p in points] == [("text", "proxy-prefetch"), ("text", "oasiskv"),
                                                          ("self", "proxy-prefetch"), ("self", "oasiskv")]
    for p in points:
        assert p.recall is not None and 0.0 <= p.recall <= 1.0 and p.num_texts == TEXTS
    text, self_ = points[:2], points[2:]
    # every mode of one continuation saw the same streams; the two continuations differ
    assert text[0].forced_sha1 == text[1].forced_sha1 != self_[0].forced_sha1 == self_[1].forced_sha1
    assert text[1].draft_accuracy == self_[1].draft_accuracy == 1.0  # the oracle knows the forced token
    for p in points:  # per-text counts add up to the run's recall
        assert len(p.per_text) == TEXTS and all(t["recall_total"] > 0 for t in p.per_text)
        hits, total = sum(t["recall_hits"] for t in p.per_text), sum(t["recall_total"] for t in p.per_text)
        assert hits / total == pytest.approx(p.recall)
    assert [t["draft_accuracy"] for t in self_[1].per_text] == [1.0] * TEXTS
    assert all(t["draft_accuracy"] is None for t in self_[0].per_text)  # proxy-prefetch has no draft


def _point(draft, hits, totals=None, ctx=2048, mode="oasiskv"):
    totals = totals or [100] * len(hits)
    return RecallPoint(mode=mode, draft=draft, context_len=ctx, top_k_blocks=16, recall=sum(hits) / sum(totals),
                       num_texts=len(hits), continuation="self",
                       per_text=[{"recall_hits": h, "recall_total": t, "draft_accuracy": None}
                                 for h, t in zip(hits, totals)])


def test_gap_closed_and_its_interval():
    proxy = _point(None, [70, 80, 75, 77, 71], mode="proxy-prefetch")
    oracle = _point("oracle", [98, 97, 99, 98, 96])
    head = _point("eagle3:h", [90, 93, 80, 96, 85])
    (g,) = gap_closed([proxy, oracle, head], resamples=500)
    expected = (sum(head.per_text[i]["recall_hits"] for i in range(5)) - 373) / (488 - 373)
    assert g["draft"] == "eagle3:h" and g["gap_closed"] == pytest.approx(expected)
    lo, hi = g["ci95"]
    assert lo < g["gap_closed"] < hi and hi - lo > 0.05  # the texts disagree: a real spread
    # texts that all say the same give no spread
    same = [_point(None, [70] * 4, mode="proxy-prefetch"), _point("oracle", [98] * 4), _point("x", [91] * 4)]
    (g,) = gap_closed(same, resamples=200)
    assert g["ci95"] == [pytest.approx(0.75), pytest.approx(0.75)] and g["gap_closed"] == pytest.approx(0.75)
    # the reference points of another context do not count; a group without the oracle is left out
    assert gap_closed([proxy, head, _point("oracle", [98] * 5, ctx=4096)]) == []
    # a point without per-text counts leaves its group out rather than guessing
    bare = RecallPoint(mode="oasiskv", draft="y", context_len=2048, top_k_blocks=16, recall=0.9, num_texts=5,
                       continuation="self")
    assert gap_closed([proxy, oracle, head, bare]) == []


def test_unknown_continuation_is_an_error(tiny):
    with pytest.raises(ValueError, match="unknown continuation"):
        run_recall(tiny, [CTX], [("proxy-prefetch", None)], 2, TEXTS, STEPS, 0.5, "cpu", "float32",
                   continuations=("essay",))


@pytest.mark.slow
def test_recall_cli_continuations_and_no_proxy(tiny, tmp_path):
    import json

    from typer.testing import CliRunner

    from oasisbench.cli.main import app

    args = ["recall", "--model", tiny, "--context-len", str(CTX), "--num-texts", str(TEXTS), "--num-steps",
            str(STEPS), "--top-k-blocks", "2", "--fetch-ratio", "0.5", "--device", "cpu", "--dtype", "float32"]
    r = CliRunner().invoke(app, args + ["--drafts", "oracle", "--no-proxy", "--continuation", "self,text",
                                        "--output-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    (out,) = tmp_path.glob("recall/*/recall.json")
    points = json.loads(out.read_text())["points"]
    assert [(p["continuation"], p["mode"], p["draft"]) for p in points] == [("self", "oasiskv", "oracle"),
                                                                         ("text", "oasiskv", "oracle")]
    r = CliRunner().invoke(app, args + ["--drafts", "", "--no-proxy", "--output-dir", str(tmp_path / "x")])
    assert r.exit_code != 0 and "nothing to measure" in r.output
    # with proxy-prefetch and the oracle beside a draft, the gap each draft closes is reported and saved
    r = CliRunner().invoke(app, args + ["--drafts", "oracle,ngram", "--output-dir", str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    (out,) = (tmp_path / "g").glob("recall/*/recall.json")
    (gap,) = json.loads(out.read_text())["gap_closed"]
    assert gap["draft"] == "ngram" and gap["num_texts"] == TEXTS and "gap closed" in r.output


def test_merge_recall_takes_references_from_an_earlier_file_of_the_same_streams(tmp_path):
    """bench/merge_recall.py: a --no-proxy run of a new head gets proxy-prefetch and the oracle of an earlier file;
    its gap equals gap_closed over all points; files of other streams are refused."""
    import dataclasses
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("merge_recall", Path(__file__).parents[1] / "bench" / "merge_recall.py")
    mr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mr)
    proxy = _point(None, [70, 80, 75, 77, 71], mode="proxy-prefetch")
    oracle, old, new = _point("oracle", [98, 97, 99, 98, 96]), _point("a", [90, 93, 80, 96, 85]), _point("b", [91] * 5)
    for p in (proxy, oracle, old, new):
        p.forced_sha1 = "s1"
    doc = lambda *ps: {"schema_version": 1, "model": "m", "device": "cpu",  # noqa: E731
                       "points": [dataclasses.asdict(p) for p in ps]}
    merged = mr.merge([doc(proxy, oracle, old), doc(new)])
    assert {p["draft"] for p in merged["points"]} == {None, "oracle", "a", "b"}
    assert merged["gap_closed"] == gap_closed([proxy, oracle, old, new])
    (tmp_path / "a.json").write_text(json.dumps(doc(proxy, oracle, old)))
    other = dataclasses.replace(new, forced_sha1="s2")
    with pytest.raises(SystemExit, match="different streams"):
        mr.merge([json.loads((tmp_path / "a.json").read_text()), doc(other)])
