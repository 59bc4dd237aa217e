"""The embedded engine's n-gram draft as vLLM's proposer (``oasiskv_runtime/vllm/ngram.py``): the same guesses as
``NgramDraft`` on fresh random sequences (small vocabularies, so matches of every length occur), through the numba
and the plain-Python paths; no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from oasiskv_runtime.drafts.sources import NgramDraft
from oasiskv_runtime.vllm import ngram


def _batch(rng, n_rows, width, vocab):
    lengths = rng.integers(1, width + 1, size=n_rows)
    tokens = np.zeros((n_rows + 2, width + 3), dtype=np.int32)  # vLLM's token array: wider than any request
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(0, vocab, size=n)
    return tokens, lengths


@pytest.mark.parametrize("use_numba", [False, pytest.param(True, marks=[pytest.mark.vllm, pytest.mark.skipif(
    not ngram.HAVE_NUMBA, reason="needs numba (vLLM's dependency)")])])
@pytest.mark.parametrize("max_n", [1, 3, 5])
def test_guesses_equal_the_embedded_engines_ngram_draft(use_numba, max_n):
    rng = np.random.default_rng()
    for vocab in (2, 5, 41):
        tokens, lengths = _batch(rng, 37, 203, vocab)
        rows = rng.permutation(len(lengths))[:29]  # some rows, in another order
        got = ngram.propose_rows(rows, lengths[rows], tokens, max_n, use_numba=use_numba)
        for j, r in enumerate(rows):
            want = NgramDraft(max_n).propose_one(tokens[r, :lengths[r]].tolist())
            assert got[j] == (-1 if want is None else want), (vocab, r)


def test_most_recent_occurrence_of_the_longest_match():
    seq = np.array([[7, 1, 2, 9, 1, 2, 8, 3, 1, 2, 5, 6, 1, 2]], dtype=np.int32)
    # longest suffix seen before: [1, 2] (no earlier [x, 1, 2] with x = 6); its most recent occurrence is followed by 5
    assert ngram.recent_match_next(seq[0], 14, 3) == 5
    assert ngram.recent_match_next(seq[0], 1, 3) == -1  # nothing before
    assert ngram.recent_match_next(np.array([4, 4], dtype=np.int32), 2, 3) == 4


def test_proposer_drafts_one_token_per_row_vllm_asks_for():
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=1),
                          model_config=SimpleNamespace(max_model_len=8))
    p = ngram.NgramProposer(cfg)
    tokens = np.zeros((4, 8), dtype=np.int32)
    tokens[0, :5] = [1, 2, 3, 1, 2]
    tokens[1, :3] = [4, 5, 6]
    tokens[2, :8] = [1, 1, 1, 1, 1, 1, 1, 1]
    tokens[3, :4] = [9, 8, 9, 8]
    out = p.propose([[2], [6], [1], []], np.array([5, 3, 8, 4]), tokens)
    # row 1: no earlier match; row 2: at max_model_len; row 3: sampled nothing (a partial prefill chunk)
    assert out == [[3], [], [], []]
    assert ngram.NgramProposer5.max_n == 5 and issubclass(ngram.NgramProposer5, ngram.NgramProposer)
    assert ngram.proposer_path(5).endswith(".NgramProposer5") and ngram.proposer_path().endswith(".NgramProposer")
    with pytest.raises(AttributeError):
        ngram.NgramProposer0  # noqa: B018
    with pytest.raises(ValueError, match="one token"):
        ngram.NgramProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2),
                                            model_config=cfg.model_config))
