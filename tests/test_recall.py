"""``oasisbench recall``'s runner on a tiny random target with a tokenizer: both forced continuations, and
``self`` forces the model's own greedy tokens, identically for every mode (so the oracle draft is exact)."""

from __future__ import annotations

import pytest

from oasisbench.runners.recall import essay_windows, run_recall, self_continuations
from oasiskv_runtime import LLM, SamplingParams
from tests.tiny_models import write_tiny_with_tokenizer

CTX, STEPS, TEXTS = 96, 6, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny-recall"))


def test_self_continuation_is_the_dense_greedy_output(tiny):
    windows = essay_windows(LLM(tiny).tokenizer, TEXTS, CTX)
    prompts = [w[: CTX - STEPS] for w in windows]
    dense = [o.token_ids for o in LLM(tiny).generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                                              ignore_eos=True))]
    assert self_continuations(tiny, prompts, STEPS, "cpu", "float32") == dense
    assert dense != [w[CTX - STEPS:] for w in windows]  # a random model does not reproduce the essay


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


def test_unknown_continuation_is_an_error(tiny):
    with pytest.raises(ValueError, match="unknown continuation"):
        run_recall(tiny, [CTX], [("proxy-prefetch", None)], 2, TEXTS, STEPS, 0.5, "cpu", "float32",
                   continuations=("essay",))


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
