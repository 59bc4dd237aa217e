"""Draft sources behind one interface, selected by name (``SparseConfig.draft``).

A draft source guesses the token AFTER the one a request computes this step, before the step runs. The
guess rides along as the draft row of look-ahead attention; its query predicts the next step's blocks.
Drafts are never accepted here (the target's own token is always kept), so a draft only steers selection.

- ``ngram[:N[:M]]``: prompt lookup over the request's own tokens (longest suffix match up to N, default 3); with M,
  no guess when the longest match is shorter than M tokens (the step then predicts from the token's own row).
- ``layerskip[:N]``: the target's first N layers (default half) + its final norm and LM head; training-free
  self-drafting with its own dense KV for those layers.
- ``model:<path>``: a small model sharing the tokenizer, with its own dense KV.
- ``eagle3:<path>``: an EAGLE-3 head (public HF layout) fed the target's low/mid/high hidden states.
- ``oracle``: the true next token, from teacher forcing (measurement only).
- ``ngram[:N]+<draft>``: the n-gram guess where an N-token suffix repeats, the other draft elsewhere.
- ``auto``: the model's shipped head behind the n-gram draft, else ``ngram``; ``EngineConfig`` resolves it
  (:func:`oasiskv_runtime.drafts.resolve_draft`) before a source is built.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from oasiskv_runtime.ops.attend import attend_ref, causal_allowed


class Sequence(Protocol):
    """What a draft reads of a request (the engine's ``Sequence`` is one): drafts know no engine."""

    seq_id: int
    num_tokens: int
    output_token_ids: list[int]
    forced_output_ids: list[int] | None
    reference_output_ids: list[int] | None

    def token_at(self, i: int) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class DraftTarget(Protocol):
    """What a draft reads of its target engine (``LLMEngine`` is one): the model, its config, device and dtype."""

    model: Any
    model_config: Any
    config: Any
    dtype: torch.dtype


class DraftSource(Protocol):
    name: str
    capture_layers: tuple[int, ...]

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        """Guess, for each request, the token after its last token. Requests without a guess are omitted."""

    def observe(self, meta: Any, captured: dict[int, torch.Tensor]) -> None:
        """See the step that just ran (hidden states of the captured layers)."""

    def free(self, seq_id: int) -> None:
        ...


class _NoObserve:
    capture_layers: tuple[int, ...] = ()

    def observe(self, meta: Any, captured: dict[int, torch.Tensor]) -> None:
        pass

    def free(self, seq_id: int) -> None:
        pass


class NgramDraft(_NoObserve):
    """Prompt lookup with an incremental n-gram index per request: O(max_n) work per new token."""

    def __init__(self, max_n: int = 3, min_match: int = 1) -> None:
        if not 1 <= min_match <= max_n:
            raise ValueError(f"ngram:{max_n}:{min_match}: the minimum match must be in [1, {max_n}]")
        self.name = f"ngram:{max_n}" + (f":{min_match}" if min_match > 1 else "")
        self.max_n, self.min_match = max_n, min_match
        self.index: dict[int, tuple[int, dict[tuple[int, ...], int]]] = {}

    def propose_one(self, tokens: list[int], state: tuple[int, dict] | None = None) -> int | None:
        """The token that followed the most recent earlier occurrence of the longest matching suffix."""
        return self._advance(len(tokens), tokens.__getitem__, lambda a, b: tokens[a:b], state)

    def _advance(self, n_tok: int, at, window, state: tuple[int, dict] | None) -> int | None:
        """:meth:`propose_one` over a token sequence given by ``at(i)`` and ``window(a, b)`` (tokens a..b-1): only
        the tokens since the last call (and the ``max_n`` before them) are read, so a step costs O(max_n) per
        request, not a copy of its whole context."""
        done, table = state if state is not None else (1, {})
        first = max(done, 1)
        start = max(min(first, n_tok) - self.max_n, 0)
        tail = window(start, n_tok)
        # An n-gram ending at i-1 gets "next token at i" once token i exists; later occurrences overwrite
        # earlier ones (dict.update keeps the last value of a repeated key), so the table always holds the most
        # recent occurrence. Built with zip, not a loop per token: a new request indexes its whole prompt at once
        # (16K tokens: ~2x faster on the dev CPU, and this runs on the host in a step that carries a prefill).
        if n_tok == first + 1 and first >= self.max_n:  # a decode step: one new token, whole n-grams before it
            m = self.max_n
            for n in range(1, m + 1):
                table[tuple(tail[m - n:m])] = first
        elif n_tok > first:
            tail = list(tail)
            for n in range(1, self.max_n + 1):
                lo = max(first, n)  # the first i with a whole n-gram before it
                if lo >= n_tok:
                    continue
                grams = zip(*(tail[lo - n - start + m:n_tok - n - start + m] for m in range(n)))
                table.update(zip(grams, range(lo, n_tok)))
        self._last_state = (n_tok, table)
        self.last_match = 0
        for n in range(min(self.max_n, n_tok - 1), 0, -1):
            nxt = table.get(tuple(tail[len(tail) - n:]))
            if nxt is not None:
                self.last_match = n
                return at(nxt)
        return None

    def propose(self, seqs: list[Sequence], min_match: int | None = None) -> dict[int, int]:
        """Guesses whose suffix match is at least ``min_match`` tokens long (default: the source's own)."""
        min_match = self.min_match if min_match is None else min_match
        out = {}
        for s in seqs:
            # token_at / token_slice: `all_token_ids` would copy each request's whole context every step (~1M list
            # items per step at 60 requests of 16K tokens).
            t = self._advance(s.num_tokens, s.token_at, s.token_slice, self.index.get(s.seq_id))
            self.index[s.seq_id] = self._last_state
            if t is not None and self.last_match >= min_match:
                out[s.seq_id] = t
        return out

    def free(self, seq_id: int) -> None:
        self.index.pop(seq_id, None)


class HybridDraft:
    """``ngram+<draft>``: the n-gram guess where the request's own text repeats a long enough suffix
    (``ngram[:N]`` with a full N-token match, cheap and usually right in repetitive text), the other draft
    (e.g. an EAGLE-3 head) elsewhere. The other draft still observes every step, so its state stays whole."""

    def __init__(self, ngram: NgramDraft, other: Any) -> None:
        self.ngram, self.other = ngram, other
        self.name = f"{ngram.name}+{other.name}"
        self.capture_layers = other.capture_layers

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        out = self.other.propose(seqs)
        out.update(self.ngram.propose(seqs, min_match=self.ngram.max_n))
        return out

    def observe(self, meta: Any, captured: dict[int, torch.Tensor]) -> None:
        self.other.observe(meta, captured)

    def free(self, seq_id: int) -> None:
        self.ngram.free(seq_id)
        self.other.free(seq_id)


class OracleDraft(_NoObserve):
    """The true next token: the teacher-forced continuation (``forced_output_ids``, recall), or a reference run's
    (``reference_output_ids``, e.g. dense's, accuracy) for as long as the request's own outputs follow it; once
    they leave it the request gets no draft (the reference no longer says what comes next)."""

    name = "oracle"

    def __init__(self) -> None:
        self.followed: dict[int, int] = {}
        """Per request: how many of its outputs were checked against its reference (all equal); -1 once one
        differed."""

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        out = {}
        for s in seqs:
            i = len(s.output_token_ids)  # this step's forward computes the last token and samples output i
            truth = s.forced_output_ids
            if truth is None:
                truth = s.reference_output_ids
                if truth is None:
                    raise ValueError("the oracle draft needs the true continuation: generate with forced_output_ids "
                                     "(teacher forcing, as `oasisbench recall` does) or reference_output_ids (a "
                                     "reference run's outputs, as `oasisbench accuracy --draft oracle` passes dense's)")
                done = self.followed.get(s.seq_id, 0)
                if done >= 0 and i > done:  # the outputs since the last step (two when a draft was accepted)
                    same = i <= len(truth) and all(s.output_token_ids[j] == truth[j]
                                                   for j in range(done, i))
                    done = self.followed[s.seq_id] = i if same else -1
                if done < 0:
                    continue
            if i < len(truth):
                out[s.seq_id] = truth[i]
        return out

    def free(self, seq_id: int) -> None:
        self.followed.pop(seq_id, None)


class _ContiguousKV:
    """A dense per-request KV cache for a draft model: per layer, [n, Hkv, D] tensors."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}
        self.current: int | None = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ks, vs = self.k.setdefault(self.current, []), self.v.setdefault(self.current, [])
        if len(ks) <= layer:
            ks.append(k)
            vs.append(v)
        else:
            ks[layer] = torch.cat([ks[layer], k])
            vs[layer] = torch.cat([vs[layer], v])
        n = ks[layer].shape[0]
        allowed = causal_allowed(q.shape[0], n, q.device) if q.shape[0] > 1 else None
        return attend_ref(q, ks[layer], vs[layer], self.scale, allowed)

    def num_cached(self, seq_id: int) -> int:
        ks = self.k.get(seq_id)
        return ks[0].shape[0] if ks else 0

    def free(self, seq_id: int) -> None:
        self.k.pop(seq_id, None)
        self.v.pop(seq_id, None)


class _TruncatedLM(torch.nn.Module):
    """The target's embedding, first ``n`` layers, final norm and LM head (early exit)."""

    def __init__(self, target: torch.nn.Module, n: int) -> None:
        super().__init__()
        self.target, self.n = target, n

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, backend: Any) -> torch.Tensor:
        t = self.target
        x = t.embed_tokens(ids)
        cos, sin = t.rotary(pos, x.dtype)
        for layer in t.layers[: self.n]:
            x = layer(x, cos, sin, backend)
        return t.compute_logits(t.norm(x[-1:]))


class _FullLM(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, backend: Any) -> torch.Tensor:
        hidden, _ = self.model(ids, pos, backend)
        return self.model.compute_logits(hidden[-1:])


class ModelDraft(_NoObserve):
    """Greedy next token from a separate (or truncated) model that keeps its own dense KV."""

    def __init__(self, name: str, lm: torch.nn.Module, head_dim: int, device: torch.device) -> None:
        self.name = name
        self.lm = lm
        self.cache = _ContiguousKV(1.0 / math.sqrt(head_dim))
        self.device = device

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        out = {}
        for s in seqs:
            n = s.num_tokens
            start = self.cache.num_cached(s.seq_id)
            if start >= n:  # recomputed after preemption: rebuild
                self.cache.free(s.seq_id)
                start = 0
            self.cache.current = s.seq_id
            ids = torch.tensor(s.token_slice(start, n), device=self.device)  # the new tokens only, no context copy
            pos = torch.arange(start, n, device=self.device)
            out[s.seq_id] = int(self.lm(ids, pos, self.cache).argmax(-1).item())
        return out

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)


class Eagle3Source:
    """EAGLE-3 head: at position p it takes the target's hidden states of p and the token at p+1."""

    def __init__(self, path: str, engine: DraftTarget) -> None:
        from oasiskv_runtime.drafts.eagle3 import Eagle3Drafter, Eagle3Head

        n = engine.model_config.num_layers
        head = Eagle3Head.from_pretrained(path, target_embed=engine.model.embed_tokens, device=engine.config.device,
                                          dtype=engine.dtype, num_target_layers=n)
        idx = head.config.aux_hidden_state_indices(n)
        if min(idx) < 1 or max(idx) >= n:
            raise ValueError(f"EAGLE-3 head wants hidden states {idx}; supported are layer outputs 1..{n - 1}")
        # HF hidden_states[i] is the input of layer i = the output of layer i-1, which is what we capture.
        self.capture_layers = tuple(i - 1 for i in idx)
        self.name = f"eagle3:{path}"
        self.drafter = Eagle3Drafter(head)
        self.pending: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        """Per request: positions whose hidden states were seen but not yet fed (their next token unknown)."""
        self.fed: dict[int, int] = {}

    def observe(self, meta: Any, captured: dict[int, torch.Tensor]) -> None:
        for s in meta.seqs:
            rows = slice(s.query_start, s.query_start + s.num_query)
            h = torch.stack([captured[l][rows] for l in self.capture_layers], dim=1)  # [n, 3, H]
            positions, hidden = self.pending.setdefault(s.seq_id, ([], []))
            first = s.context_len - s.num_query
            positions.extend(range(first, s.context_len))
            hidden.extend(h.unbind(0))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        out = {}
        for s in seqs:
            positions, hidden = self.pending.get(s.seq_id, ([], []))
            n = s.num_tokens
            fed = self.fed.get(s.seq_id, -1)
            keep = [i for i, p in enumerate(positions) if fed < p and p + 1 < n]
            if not keep:
                continue
            pos = [positions[i] for i in keep]
            ids = torch.tensor([s.token_at(p + 1) for p in pos], device=hidden[0].device)
            aux = torch.stack([hidden[i] for i in keep])
            out[s.seq_id] = self.drafter.propose(s.seq_id, ids, aux, torch.tensor(pos, device=aux.device))
            self.fed[s.seq_id] = pos[-1]
            self.pending[s.seq_id] = ([], [])
        return out

    def free(self, seq_id: int) -> None:
        self.drafter.free(seq_id)
        self.pending.pop(seq_id, None)
        self.fed.pop(seq_id, None)


def make_draft_source(spec: str, engine: DraftTarget) -> Any:
    """Build a draft source from its name (see module docstring)."""
    head, plus, rest = spec.partition("+")
    if plus:
        first = make_draft_source(head, engine)
        if not isinstance(first, NgramDraft) or "+" in rest:
            raise ValueError(f"hybrid draft {spec!r}: write ngram[:N]+<draft>")
        return HybridDraft(first, make_draft_source(rest, engine))
    kind, _, arg = spec.partition(":")
    mc = engine.model_config
    device = torch.device(engine.config.device)
    if kind == "ngram":
        n, _, m = arg.partition(":")
        return NgramDraft(int(n) if n else 3, int(m) if m else 1)
    if kind == "oracle":
        return OracleDraft()
    if kind == "layerskip":
        n = int(arg) if arg else max(1, mc.num_layers // 2)
        if not 1 <= n < mc.num_layers:
            raise ValueError(f"layerskip:{n}: need 1 <= N < {mc.num_layers}")
        return ModelDraft(f"layerskip:{n}", _TruncatedLM(engine.model, n), mc.head_dim, device)
    if kind == "model":
        if not arg:
            raise ValueError("model draft needs a path: model:<path>")
        from oasiskv_runtime.models.loader import load_model

        net, _, cfg = load_model(arg, engine.config.device, engine.config.dtype)
        if cfg.vocab_size != mc.vocab_size:
            raise ValueError(f"draft model {arg} has vocab {cfg.vocab_size}, the target {mc.vocab_size}: "
                             "a draft model must share the tokenizer")
        return ModelDraft(f"model:{arg}", _FullLM(net), cfg.head_dim, device)
    if kind == "eagle3":
        if not arg:
            raise ValueError("eagle3 draft needs a path: eagle3:<path>")
        return Eagle3Source(arg, engine)
    raise ValueError(f"unknown draft source {spec!r}; choose ngram[:N], layerskip[:N], model:<path>, "
                     "eagle3:<path>, oracle, or ngram[:N]+<one of those>")
