"""The embedded engine's n-gram draft as a vLLM proposer, so both front ends look ahead with the same tokens.

vLLM's own n-gram proposer (``method='ngram'``) drafts from the EARLIEST earlier occurrence of the longest suffix
match; the embedded engine's ``NgramDraft`` from the MOST RECENT one. The draft is OasisKV's look-ahead: its query
picks the next step's blocks, so a different draft is a different prefetch. Measured on SmolLM2 NIAH at 2K (n-gram,
K = 32): vLLM's proposer was accepted 46.0% of the time and oasiskv scored 44.1 through vLLM, against 60.7% and 49.9
on the embedded engine. ``engine_args(draft='ngram')`` therefore runs this class through vLLM's
``custom_class`` speculative method (``speculative_config.model`` is its import path; vLLM 0.26 and 0.32 call
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``); ``draft='vllm-ngram'`` keeps
vLLM's proposer.

The match: the longest suffix of a request's tokens (1..N tokens) that occurred earlier, its most recent earlier
occurrence, and the token that followed it (``NgramDraft.propose_one``). vLLM hands the proposer its input batch's
token array, not request ids (rows are reordered between steps), so each call scans back from the end instead of
keeping an index per request: jitted with numba (vLLM's dependency; one request per thread) where it imports, else
plain Python; a scan stops at the first whole-N match, so it reads a request's whole context only when nothing matches.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from typing import Any

import numpy as np

DEFAULT_MAX_N = 3
"""Suffix matches of up to 3 tokens (``NgramDraft``'s default)."""
HAVE_NUMBA = importlib.util.find_spec("numba") is not None
"""numba is importable (vLLM's dependency): the proposer's scan is jitted."""


def recent_match_next(tokens: np.ndarray, n_tok: int, max_n: int) -> int:
    """The token after the most recent earlier occurrence of the longest suffix (<= ``max_n`` tokens) of
    ``tokens[:n_tok]``; -1 when no suffix of one token or more occurred before."""
    best_len, best_next = 0, -1
    last = n_tok - 1
    for end in range(n_tok - 2, -1, -1):  # an occurrence ending at `end`, followed by tokens[end + 1]
        m = 0
        while m < max_n and m <= end and tokens[end - m] == tokens[last - m]:
            m += 1
        if m > best_len:
            best_len, best_next = m, int(tokens[end + 1])
            if m == max_n or m == last:  # nothing longer can exist further back
                break
    return best_next


@functools.cache
def _numba_batch() -> Any:
    """:func:`recent_match_next` over rows, jitted with numba (one request per thread); None without numba. Compiled
    on first use, so importing this module (``engine_args`` does, for :func:`proposer_path`) stays cheap."""
    if not HAVE_NUMBA:
        return None
    from numba import njit, prange

    match = njit(nogil=True)(recent_match_next)

    @njit(parallel=True, nogil=True)
    def batch(rows, lengths, tokens, max_n, out):  # pragma: no cover - compiled
        for j in prange(rows.shape[0]):
            out[j] = match(tokens[rows[j]], lengths[j], max_n)

    return batch


def propose_rows(rows: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, max_n: int,
                 use_numba: bool | None = None) -> np.ndarray:
    """The next-token guess (or -1) of each listed row of ``tokens`` (``[batch, max_len]``), row ``rows[j]``
    holding ``lengths[j]`` tokens: numba where it imports, else the same function in plain Python (slow on long
    contexts; vLLM always brings numba)."""
    out = np.full(rows.shape[0], -1, dtype=np.int64)
    if rows.shape[0] == 0:
        return out
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if HAVE_NUMBA if use_numba is None else use_numba:
        _numba_batch()(rows, lengths, tokens, max_n, out)
    else:
        for j in range(rows.shape[0]):
            out[j] = recent_match_next(tokens[rows[j]], int(lengths[j]), max_n)
    return out


def is_proposer_path(model: str | None) -> bool:
    """Whether ``speculative_config.model`` names this module's proposer (no draft model, no KV of its own)."""
    return str(model or "").startswith(__name__ + ".NgramProposer")


class NgramProposer:
    """vLLM ``custom_class`` proposer: one draft token per request from the most recent suffix match (up to
    :data:`DEFAULT_MAX_N` tokens; ``NgramProposer<N>`` in this module for up to N)."""

    max_n = DEFAULT_MAX_N

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        if spec.num_speculative_tokens != 1:
            raise ValueError(f"OasisKV's n-gram proposer drafts one token (the look-ahead row), got "
                             f"num_speculative_tokens={spec.num_speculative_tokens}")
        self.max_model_len = vllm_config.model_config.max_model_len
        propose_rows(np.zeros(1, np.int64), np.full(1, 4, np.int64), np.zeros((1, 4), np.int32), self.max_n)  # jit now

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model (vLLM's CPU runner calls it on every drafter)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: Any = None, **kwargs: Any) -> list[list[int]]:
        """A draft per batch row: none for a row that sampled nothing this step (a partial prefill chunk) or that
        reached ``max_model_len``, as vLLM's own proposer."""
        rows = [i for i, s in enumerate(sampled_token_ids) if s and num_tokens_no_spec[i] < self.max_model_len]
        idx = np.asarray(rows, dtype=np.int64)
        guesses = propose_rows(idx, np.asarray(num_tokens_no_spec)[idx], token_ids_cpu, self.max_n)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        for i, g in zip(rows, guesses.tolist()):
            if g >= 0:
                out[i] = [g]
        return out


def proposer_path(max_n: int = DEFAULT_MAX_N) -> str:
    """``speculative_config.model`` for :class:`NgramProposer` with suffix matches of up to ``max_n`` tokens."""
    if max_n < 1:
        raise ValueError(f"n-gram drafts need N >= 1, got {max_n}")
    return f"{__name__}.NgramProposer" + ("" if max_n == DEFAULT_MAX_N else str(max_n))


def __getattr__(name: str) -> type:
    """``NgramProposer<N>``: the proposer with suffix matches of up to N tokens (vLLM imports it by that path)."""
    m = re.fullmatch(r"NgramProposer(\d+)", name)
    if m is None or int(m.group(1)) < 1:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = type(name, (NgramProposer,), {"max_n": int(m.group(1)), "__module__": __name__})
    globals()[name] = cls
    return cls
