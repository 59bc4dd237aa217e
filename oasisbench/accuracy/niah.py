"""Needle-in-a-haystack sample generator (RULER task families), offline and deterministic.

A sample is a prompt of (almost exactly) ``context_tokens`` tokens made of a long
filler *haystack* with one or more *needles* (short facts holding random values)
inserted at sentence boundaries, followed by a question about the needles and
the chat template's assistant turn.  The model's continuation is scored with
:func:`string_match_all` (RULER's metric): the fraction of expected answers that
appear in the output.

Why these design choices:

* **Token-exact sizing.**  Sparse-KV policies behave differently at different
  sequence lengths, so the prompt is built by *tokens* of the model's own
  tokenizer: the haystack budget is the context minus the template, question and
  needles, and a short calibration loop trims/extends until the prompt length is
  within 1% below ``context_tokens`` (never above it).
* **Depth in tokens.**  ``depth_percent`` is measured in haystack tokens
  (0 = first haystack token, 100 = after the last), because that is what decides
  which KV blocks the needle lands in.  Needles snap to the nearest sentence
  boundary so the text stays natural.
* **Determinism.**  Every random choice comes from a ``random.Random`` seeded with
  a *string* (seeded via SHA-512, unlike ``hash()`` which is salted per process),
  so the same arguments give byte-identical samples in any process.  Sample ``i``
  uses the same needles and haystack start at every depth, so a depth sweep
  varies only the depth.

Only :mod:`oasisbench.accuracy.haystack` data is used; nothing is downloaded.
"""

from __future__ import annotations

import bisect
import random
import string
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from oasisbench.accuracy.haystack import NOISE_SENTENCES, essay_dir, essay_sentences

__all__ = [
    "HAYSTACKS",
    "NiahSample",
    "families",
    "family_info",
    "generate_samples",
    "string_match_all",
    "encode_prompt",
]

#: Filler kinds accepted by :func:`generate_samples`.
HAYSTACKS: tuple[str, ...] = ("essay", "noise")

_FAMILY_INFO: dict[str, str] = {
    "single_needle": "One key/7-digit-number needle in the haystack; ask for its number.",
    "multi_key": "Several needles with different uuid keys; ask for the number of one key (others distract).",
    "multi_value": "One key with several numbers in separate needles; every number must be returned.",
    "multi_query": "Several key/number needles; all keys are asked at once and every number must be returned.",
    "passkey": "Classic pass-key retrieval: 'The pass key is N. Remember it.' hidden in noise.",
    "variable_tracking": "Chain VAR A = N, VAR B = VAR A, ...; list every variable equal to N (plus a distractor chain).",
    "drift_stress": "Haystack switches topic (essays -> other essays or noise) at the depth; needle right after the switch.",
}

# Family default haystack when the caller passes ``haystack=None``.
_DEFAULT_HAYSTACK: dict[str, str] = {f: "essay" for f in _FAMILY_INFO} | {"passkey": "noise"}

# Fixed word lists for human-readable needle keys (RULER draws adjective-noun
# keys from the ``wonderwords`` package; a frozen list keeps us dependency-free
# and the keys stable across versions).
_ADJECTIVES: tuple[str, ...] = (
    "amber", "ancient", "bitter", "brave", "brisk", "calm", "clever", "crimson", "curious",
    "dusty", "eager", "elegant", "faint", "fierce", "gentle", "gleaming", "golden", "hollow",
    "humble", "icy", "jagged", "jolly", "lively", "lonely", "lucky", "mellow", "misty",
    "narrow", "noisy", "odd", "pale", "proud", "quiet", "rapid", "restless", "rusty",
    "shiny", "silent", "silver", "sleepy", "smooth", "solemn", "steady", "stormy", "sturdy",
    "swift", "tender", "tidy", "vivid", "wandering", "wild", "witty", "wooden", "young",
)
_NOUNS: tuple[str, ...] = (
    "anchor", "badger", "banjo", "beacon", "blossom", "canyon", "castle", "cedar", "comet",
    "compass", "crater", "dolphin", "ember", "falcon", "fern", "fjord", "glacier", "harbor",
    "hedgehog", "island", "kettle", "lantern", "lighthouse", "meadow", "mirror", "orchard",
    "otter", "pebble", "pepper", "piano", "quarry", "quartz", "raven", "river", "saddle",
    "sparrow", "spruce", "summit", "teapot", "thistle", "tiger", "trumpet", "tulip",
    "valley", "violin", "walnut", "willow", "window", "zeppelin",
)

# Number of needles for the multi-needle families (RULER's defaults are 4).
_MULTI_N = 4
# Variable-tracking chain: RULER default 4 hops -> 5 variables per chain.
_VT_HOPS = 4


def families() -> list[str]:
    """Return the supported task families, in a stable order."""
    return list(_FAMILY_INFO)


def family_info() -> dict[str, str]:
    """Return a one-line description of each family (for ``--help`` / reports)."""
    return dict(_FAMILY_INFO)


@dataclass(frozen=True)
class NiahSample:
    """One generated prompt with its expected answers.

    ``(family, haystack, context_tokens, depth_percent, seed, index)`` identifies
    the sample; ``index`` is the replicate number at that depth (replicate ``i``
    shares needles and haystack start across depths).

    ``needle_token_positions[j]`` is the index, in :func:`encode_prompt` of
    ``prompt``, of the first token of ``needles[j]``.  Answer-bearing needles
    come first (the first one sits at ``depth_percent``), distractors after.
    """

    family: str
    haystack: str
    context_tokens: int
    depth_percent: float
    seed: int
    index: int
    prompt: str
    answers: list[str]
    needle_token_positions: list[int]
    # Extra (defaulted so the core fields above keep their documented order).
    needles: list[str] = field(default_factory=list)
    use_chat_template: bool = True


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER ``string_match_all``: fraction of ``answers`` found in ``prediction``.

    Case-insensitive substring match, as in RULER; partial credit when only some
    of a multi-answer sample's answers are produced.
    """
    if not answers:
        raise ValueError("answers must not be empty")
    pred = prediction.lower()
    return sum(1.0 for a in answers if a.lower() in pred) / len(answers)


def encode_prompt(tokenizer: Any, prompt: str, use_chat_template: bool = True) -> list[int]:
    """Tokenize a generated prompt exactly as the generator measured it.

    With a chat template the rendered text already contains BOS/role tokens, so
    no special tokens are added (adding them would double the BOS); a raw prompt
    gets the tokenizer's usual special tokens.
    """
    return list(tokenizer.encode(prompt, add_special_tokens=not use_chat_template))


# --------------------------------------------------------------------------- needles


@dataclass
class _Spec:
    """What a family contributes: the needles and the question around them."""

    instruction: str
    question: str
    answer_prefix: str
    answers: list[str]
    primary: list[str]  # answer-bearing needles, placed at the requested depth in order
    distractors: list[str] = field(default_factory=list)  # placed at random boundaries


class _Draw:
    """Unique random needle values from one seeded RNG."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._used: set[str] = set()

    def _unique(self, make: Callable[[], str]) -> str:
        # Rejection sampling; the value spaces are huge so this ends at once.
        while True:
            v = make()
            if v not in self._used:
                self._used.add(v)
                return v

    def number(self, digits: int = 7) -> str:
        lo, hi = 10 ** (digits - 1), 10**digits - 1
        return self._unique(lambda: str(self.rng.randint(lo, hi)))

    def word_key(self) -> str:
        return self._unique(lambda: f"{self.rng.choice(_ADJECTIVES)}-{self.rng.choice(_NOUNS)}")

    def uuid_key(self) -> str:
        # uuid-like but from the seeded RNG (uuid4() would use os.urandom).
        return self._unique(lambda: str(uuid.UUID(int=self.rng.getrandbits(128), version=4)))

    def var_name(self) -> str:
        return self._unique(lambda: "".join(self.rng.choice(string.ascii_uppercase) for _ in range(5)))


# RULER's niah wording (scripts/data/synthetic/constants.py).
_NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards."
)


def _niah_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah_spec(query: str, answers: list[str], primary: list[str], distractors: list[str] | None = None) -> _Spec:
    return _Spec(
        instruction=_NIAH_INSTRUCTION,
        question=f"What are all the special magic numbers for {query} mentioned in the provided text?",
        answer_prefix=f"The special magic numbers for {query} mentioned in the provided text are",
        answers=answers,
        primary=primary,
        distractors=distractors or [],
    )


def _join_keys(keys: list[str]) -> str:
    return ", ".join(keys[:-1]) + f", and {keys[-1]}" if len(keys) > 1 else keys[0]


def _spec_single(d: _Draw) -> _Spec:
    key, value = d.word_key(), d.number()
    return _niah_spec(key, [value], [_niah_needle(key, value)])


def _spec_multi_key(d: _Draw) -> _Spec:
    keys = [d.uuid_key() for _ in range(_MULTI_N)]
    values = [d.number() for _ in range(_MULTI_N)]
    target = d.rng.randrange(_MULTI_N)
    needles = [_niah_needle(k, v) for k, v in zip(keys, values)]
    others = [n for i, n in enumerate(needles) if i != target]
    return _niah_spec(keys[target], [values[target]], [needles[target]], others)


def _spec_multi_value(d: _Draw) -> _Spec:
    key = d.word_key()
    values = [d.number() for _ in range(_MULTI_N)]
    return _niah_spec(key, values, [_niah_needle(key, v) for v in values])


def _spec_multi_query(d: _Draw) -> _Spec:
    keys = [d.word_key() for _ in range(_MULTI_N)]
    values = [d.number() for _ in range(_MULTI_N)]
    return _niah_spec(_join_keys(keys), values, [_niah_needle(k, v) for k, v in zip(keys, values)])


def _spec_passkey(d: _Draw) -> _Spec:
    # Wording of the original passkey task (Mohtashami & Jaggi 2023 / LongLoRA).
    n = d.number()
    return _Spec(
        instruction=(
            "There is an important info hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the important information there."
        ),
        question="What is the pass key?",
        answer_prefix="The pass key is",
        answers=[n],
        primary=[f"The pass key is {n}. Remember it. {n} is the pass key."],
    )


def _vt_chain(d: _Draw, value: str) -> tuple[list[str], list[str]]:
    names = [d.var_name() for _ in range(_VT_HOPS + 1)]
    needles = [f"VAR {names[0]} = {value}."]
    needles += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    return names, needles


def _spec_variable_tracking(d: _Draw) -> _Spec:
    # 5-digit values as in RULER's variable_tracking; a second chain with a
    # different value forces the model to actually follow the assignments.
    value, other = d.number(5), d.number(5)
    names, chain = _vt_chain(d, value)
    _, distractor_chain = _vt_chain(d, other)
    return _Spec(
        instruction="Memorize and track the chain(s) of variable assignment hidden in the following text.",
        question=f"Question: Find all variables that are assigned the value {value} in the text above.",
        answer_prefix=(
            "Answer: According to the chain(s) of variable assignment in the text above, "
            f"{len(names)} variables are assigned the value {value}, they are:"
        ),
        answers=names,
        primary=chain,
        distractors=distractor_chain,
    )


_SPECS: dict[str, Callable[[_Draw], _Spec]] = {
    "single_needle": _spec_single,
    "multi_key": _spec_multi_key,
    "multi_value": _spec_multi_value,
    "multi_query": _spec_multi_query,
    "passkey": _spec_passkey,
    "variable_tracking": _spec_variable_tracking,
    "drift_stress": _spec_single,
}

# --------------------------------------------------------------------------- haystack


class _Source:
    """A cyclic stream of sentence units whose token ids are computed lazily.

    Cached per tokenizer (see :func:`_source`) so each sentence is tokenized at
    most once per process, and only as far as the requested contexts reach.  It
    deliberately holds no reference to the tokenizer: the cache is a
    ``WeakKeyDictionary`` keyed by the tokenizer, and a strong reference from the
    value would keep the tokenizer alive forever.
    """

    _BATCH = 256

    def __init__(self, sentences: Sequence[str]) -> None:
        if not sentences:
            raise ValueError("haystack source has no sentences")
        self.sentences = list(sentences)
        self._ids: list[list[int] | None] = [None] * len(self.sentences)

    def __len__(self) -> int:
        return len(self.sentences)

    def ids(self, tokenizer: Any, i: int) -> list[int]:
        i %= len(self.sentences)
        cached = self._ids[i]
        if cached is None:
            stop = min(i + self._BATCH, len(self.sentences))
            # Leading space: inside the haystack every sentence follows a space,
            # and BPE tokenizers fold that space into the first token.
            batch = [" " + s for s in self.sentences[i:stop]]
            enc = _batch_encode(tokenizer, batch)
            for j, ids in enumerate(enc):
                self._ids[i + j] = ids
            cached = enc[0]
        return cached

    def take(self, tokenizer: Any, start: int, budget: int, partial: bool = True) -> list[tuple[str, int]]:
        """Return ``(text, n_tokens)`` units from ``start`` filling ``budget`` tokens.

        Whole sentences while they fit; then, if ``partial``, a word-trimmed prefix
        of the next sentence so short contexts are not left a sentence short
        (RULER likewise truncates its haystack by tokens).
        """
        units: list[tuple[str, int]] = []
        used, i = 0, start
        # Bound the walk: if nothing fits for a full cycle we would loop forever.
        for _ in range(budget + len(self.sentences)):
            if used >= budget:
                break
            ids = self.ids(tokenizer, i)
            if used + len(ids) <= budget:
                units.append((self.sentences[i % len(self.sentences)], len(ids)))
                used += len(ids)
                i += 1
                continue
            rem = budget - used
            if partial and rem > 1:
                words = tokenizer.decode(ids[:rem]).strip().split(" ")
                # The last decoded word may be cut mid-token; drop it.
                text = " ".join(words[:-1]).strip()
                if text:
                    units.append((text, len(_batch_encode(tokenizer, [" " + text])[0])))
            break
        return units


def _batch_encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if getattr(tokenizer, "is_fast", False):
        return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def _corpus(kind: str, part: str = "all") -> list[str]:
    """Sentences of a haystack kind; ``part`` selects an essay subset for drift."""
    if kind == "noise":
        return list(NOISE_SENTENCES)
    essays = essay_sentences()
    if part == "even":
        essays = essays[0::2]
    elif part == "odd":
        essays = essays[1::2]
    return [s for e in essays for s in e]


# tokenizer -> {source name -> _Source}.  Weak keys: the cache must not keep
# tokenizers (and their vocabularies) alive after the caller drops them.
_SOURCE_CACHE: weakref.WeakKeyDictionary[Any, dict[str, _Source]] = weakref.WeakKeyDictionary()


def _sources_for(tokenizer: Any) -> dict[str, _Source]:
    """Source memo shared by every call with this tokenizer (per-call if uncacheable)."""
    try:
        return _SOURCE_CACHE.setdefault(tokenizer, {})
    except TypeError:  # unhashable / not weak-referenceable tokenizer object
        return {}


def _source(sources: dict[str, _Source], kind: str, part: str) -> _Source:
    # The essay directory is part of the key (and looked up every call) so a
    # missing/changed install raises or refreshes instead of hitting stale cache.
    name = "noise" if kind == "noise" else f"essay:{essay_dir()}:{part}"
    if name not in sources:
        sources[name] = _Source(_corpus(kind, part))
    return sources[name]


# --------------------------------------------------------------------------- assembly


def _render(tokenizer: Any, spec: _Spec, context: str, use_chat_template: bool) -> str:
    user = f"{spec.instruction}\n{context}\n{spec.question}"
    if not use_chat_template:
        return f"{user} {spec.answer_prefix}"
    # add_generation_prompt opens the assistant turn; the answer prefix after it
    # makes the model start with the answer instead of chatting (RULER does this).
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    return f"{rendered}{spec.answer_prefix}"


def _nearest_boundary(units: list[tuple[str, int]], depth_percent: float) -> int:
    """Boundary index (0..len(units)) whose token offset is closest to the depth."""
    cum = [0]
    for _, n in units:
        cum.append(cum[-1] + n)
    target = depth_percent / 100.0 * cum[-1]
    j = bisect.bisect_left(cum, target)
    if j >= len(cum):
        return len(cum) - 1
    if j > 0 and target - cum[j - 1] <= cum[j] - target:
        return j - 1
    return j


def _layout(
    units: list[tuple[str, int]],
    anchor: int,
    spec: _Spec,
    rng: random.Random,
) -> dict[int, list[str]]:
    """Map boundary index -> needles inserted there.

    Answer needles go at consecutive boundaries starting at ``anchor`` (one
    haystack sentence apart, so they all sit at the requested depth without being
    glued together); distractors go at random other boundaries.
    """
    n = len(units)
    k = len(spec.primary)
    start = max(0, min(anchor, n - (k - 1)))
    placement: dict[int, list[str]] = {}
    used: set[int] = set()
    for j, needle in enumerate(spec.primary):
        b = min(start + j, n)
        placement.setdefault(b, []).append(needle)
        used.add(b)
    free = [b for b in range(n + 1) if b not in used]
    m = len(spec.distractors)
    if len(free) >= m:
        spots = rng.sample(free, m)
    else:  # tiny haystack: share boundaries rather than fail
        spots = [rng.randrange(n + 1) for _ in range(m)]
    # Sorted so that ordered distractors (a variable-tracking chain) keep their
    # order in the text, like RULER's chains.
    for b, needle in zip(sorted(spots), spec.distractors):
        placement.setdefault(b, []).append(needle)
    return placement


def _join(units: list[tuple[str, int]], placement: dict[int, list[str]]) -> str:
    parts: list[str] = []
    for b in range(len(units) + 1):
        parts.extend(placement.get(b, []))
        if b < len(units):
            parts.append(units[b][0])
    return " ".join(parts)


def _needle_positions(
    tokenizer: Any, prompt: str, needles: list[str], use_chat_template: bool
) -> tuple[list[int], int]:
    """Token index of each needle's first character, and the prompt length."""
    add_special = not use_chat_template
    char_pos: list[int] = []
    for nd in needles:
        c = prompt.find(nd)
        if c < 0 or prompt.find(nd, c + 1) >= 0:  # needles carry random values: unique
            raise RuntimeError(f"needle not found exactly once in prompt: {nd!r}")
        char_pos.append(c)
    if getattr(tokenizer, "is_fast", False):
        # Offsets give exact token indices in a single pass.
        enc = tokenizer(prompt, add_special_tokens=add_special, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        ends = [e for _, e in offsets]
        # First token whose span ends after the needle's first char contains it
        # (the leading space may be folded into that token, so compare ends).
        positions = [bisect.bisect_right(ends, c) for c in char_pos]
        return positions, len(enc["input_ids"])
    # Slow tokenizers have no offsets: the token count of the text before the
    # needle (minus the separating space, which BPE attaches to the needle).
    positions = [
        len(tokenizer.encode(prompt[:c].rstrip(" "), add_special_tokens=add_special)) for c in char_pos
    ]
    return positions, len(encode_prompt(tokenizer, prompt, use_chat_template))


def _build_one(
    tokenizer: Any,
    family: str,
    kind: str,
    context_tokens: int,
    depth_percent: float,
    seed: int,
    index: int,
    use_chat_template: bool,
    sources: dict[str, _Source],
) -> NiahSample:
    # A string seed is hashed with SHA-512 by random.Random -> stable across
    # processes and Python versions, independent of PYTHONHASHSEED.  The key has
    # no depth/length, so replicate ``index`` is the same needle set everywhere.
    key = f"oasisbench-niah|{seed}|{family}|{kind}|{index}"
    rng = random.Random(key)
    spec = _SPECS[family](_Draw(rng))
    all_needles = spec.primary + spec.distractors
    drift = family == "drift_stress"

    # Drift: topic A is always essays (even-indexed files); topic B is the other
    # essays for kind "essay" or noise for kind "noise".
    if drift:
        src_a = _source(sources, "essay", "even")
        src_b: _Source | None = _source(sources, kind, "odd")
        start_a = rng.randrange(len(src_a))
        start_b = rng.randrange(len(src_b)) if kind == "essay" else 0
    else:
        src_a = _source(sources, kind, "all")
        src_b, start_b = None, 0
        # Random essay start varies the text between replicates; noise always
        # starts at "The grass is green." as in RULER.
        start_a = rng.randrange(len(src_a)) if kind == "essay" else 0

    overhead = len(encode_prompt(tokenizer, _render(tokenizer, spec, "", use_chat_template), use_chat_template))
    needle_cost = sum(len(x) for x in _batch_encode(tokenizer, [" " + n for n in all_needles]))
    budget = context_tokens - overhead - needle_cost
    if budget < max(16, context_tokens // 4):
        raise ValueError(
            f"context_tokens={context_tokens} is too small for family {family!r}: the template, "
            f"question and needles alone take {overhead + needle_cost} tokens"
        )

    # Join effects (merges across spaces, template tokens) make the first guess
    # a few tokens off; re-fit the budget until the prompt lands within `slack`
    # below the target, never above it.
    slack = max(1, context_tokens // 100)
    best: tuple[str, list[int], int] | None = None
    for _attempt in range(8):
        if drift:
            a_units = src_a.take(tokenizer, start_a, round(depth_percent / 100.0 * budget), partial=False)
            a_tokens = sum(n for _, n in a_units)
            units = a_units + src_b.take(tokenizer, start_b, budget - a_tokens)  # type: ignore[union-attr]
            anchor = len(a_units)  # needle right after the topic switch
        else:
            units = src_a.take(tokenizer, start_a, budget)
            anchor = _nearest_boundary(units, depth_percent)
        # Fresh RNG per attempt so distractor placement doesn't depend on how
        # many calibration rounds were needed.
        placement = _layout(units, anchor, spec, random.Random(key + "|place"))
        prompt = _render(tokenizer, spec, _join(units, placement), use_chat_template)
        positions, length = _needle_positions(tokenizer, prompt, all_needles, use_chat_template)
        if length <= context_tokens:
            if best is None or length > best[2]:
                best = (prompt, positions, length)
            if length >= context_tokens - slack:
                break
        budget += context_tokens - length
    if best is None:
        raise RuntimeError(f"could not fit a {family!r} prompt into {context_tokens} tokens")
    prompt, positions, _ = best
    return NiahSample(
        family=family,
        haystack=kind,
        context_tokens=context_tokens,
        depth_percent=float(depth_percent),
        seed=seed,
        index=index,
        prompt=prompt,
        answers=list(spec.answers),
        needle_token_positions=positions,
        needles=all_needles,
        use_chat_template=use_chat_template,
    )


def generate_samples(
    tokenizer: Any,
    family: str,
    context_tokens: int,
    depths: list[float],
    num_samples: int,
    seed: int,
    haystack: str | None = None,
    use_chat_template: bool = True,
) -> list[NiahSample]:
    """Generate ``len(depths) * num_samples`` samples, ordered depth-major.

    Args:
        tokenizer: any Hugging Face tokenizer (``encode``/``decode``, plus
            ``apply_chat_template`` when ``use_chat_template``).  Fast tokenizers
            give exact needle positions via offsets; slow ones use prefix counts.
        family: one of :func:`families`.
        context_tokens: target prompt length; the result is at most this long and
            normally within 1% below it.
        depths: needle depths in percent of the haystack's tokens (0..100).
        num_samples: replicates per depth.
        seed: base seed; the same arguments always give identical samples.
        haystack: ``"essay"`` or ``"noise"``; ``None`` picks the family default
            (noise for ``passkey``, essays otherwise).  For ``drift_stress`` it
            selects topic B: other essays (``"essay"``) or noise (``"noise"``).
        use_chat_template: wrap the text in the tokenizer's chat template and
            open the assistant turn; ``False`` gives a raw completion prompt.
    """
    if family not in _SPECS:
        raise ValueError(f"unknown family {family!r}; choose from {families()}")
    kind = _DEFAULT_HAYSTACK[family] if haystack is None else haystack
    if kind not in HAYSTACKS:
        raise ValueError(f"unknown haystack {kind!r}; choose from {list(HAYSTACKS)}")
    if context_tokens <= 0:
        raise ValueError("context_tokens must be positive")
    if num_samples < 0:
        raise ValueError("num_samples must be >= 0")
    for d in depths:
        if not 0.0 <= float(d) <= 100.0:
            raise ValueError(f"depth {d} outside [0, 100]")
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        # Failing loudly beats silently benchmarking an instruct model on a raw prompt.
        raise ValueError("tokenizer has no chat template; pass use_chat_template=False")

    sources = _sources_for(tokenizer)
    return [
        _build_one(tokenizer, family, kind, context_tokens, float(d), seed, i, use_chat_template, sources)
        for d in depths
        for i in range(num_samples)
    ]
