"""Log-likelihood of a continuation, scored inside the engine (through decode steps) or with a dense reference.

The engine has no logprob output. :func:`engine_loglikelihood` adds one from the outside, without touching
the runtime: it teacher-forces the continuation (``Sequence.forced_output_ids``), steps the engine itself
(``engine.add_request`` / ``engine.step``), and for the duration of the call replaces the model's
``compute_logits`` with a tap that keeps the log-softmax row of each sampled position. The prompt is
prefilled once; every continuation token after the first is scored by a *decode* step, so in the sparse modes
the numbers come from the sparse attention path that is being evaluated (a dense prefill of
context+continuation would never exercise it).

:func:`dense_loglikelihood` is the reference: one causal forward over the whole sequence, outside the engine,
with plain attention. The two agree in dense mode; a gap in a sparse mode is the sparse error.

Example::

    llm = LLM("smollm2-135m", mode="oasiskv")
    ctx, cont = llm.encode("The capital of France is"), llm.encode(" Paris.")
    [(logprob, is_greedy)] = engine_loglikelihood(llm, [(ctx, cont)])
    ref_logprob, _ = dense_loglikelihood(llm, ctx, cont)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from oasiskv_runtime.ops.attend import attend_ref, causal_allowed
from oasiskv_runtime.sampling_params import SamplingParams

__all__ = ["engine_loglikelihood", "dense_loglikelihood"]


class _LogitsTap:
    """Replaces ``model.compute_logits`` on the instance while active and records, per request and output
    position, (log-probability of the forced token, whether it was the argmax).

    The runner sets ``last_meta`` before it computes logits, and logits rows follow the order of the step's
    completing requests; that is how a row is matched to its request.
    """

    def __init__(self, llm: Any, targets: dict[int, tuple[Any, list[int]]]) -> None:
        self.runner = llm.engine.runner
        self.model = self.runner.model
        self.targets = targets  # seq_id -> (Sequence, continuation ids)
        self.scores: dict[int, dict[int, tuple[float, bool]]] = {sid: {} for sid in targets}

    def __enter__(self) -> _LogitsTap:
        original = self.model.compute_logits

        def tap(hidden: torch.Tensor) -> torch.Tensor:
            logits = original(hidden)
            self._record(logits)
            return logits

        # An instance attribute shadows the method; nn.Module.__setattr__ stores plain callables in __dict__.
        self.model.compute_logits = tap
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.__dict__.pop("compute_logits", None)

    def _record(self, logits: torch.Tensor) -> None:
        meta = self.runner.last_meta
        completing = [s.seq_id for s in meta.seqs if s.completes] if meta is not None else []
        if len(completing) != logits.shape[0]:
            # A runner that also scores draft rows (speculative verification) breaks the row <-> request map.
            raise RuntimeError(f"logits tap: {logits.shape[0]} logits rows for {len(completing)} completing "
                               "requests; this engine step layout is not supported by engine_loglikelihood")
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        best = logprobs.argmax(dim=-1)
        for row, sid in enumerate(completing):
            if sid not in self.targets:
                continue
            seq, cont = self.targets[sid]
            pos = len(seq.output_token_ids)  # the token this row predicts; the engine appends it next
            if pos < len(cont):
                # A preempted request recomputes and re-scores the same position: the last value wins.
                self.scores[sid][pos] = (float(logprobs[row, cont[pos]]), bool(int(best[row]) == cont[pos]))


def engine_loglikelihood(llm: Any, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """Sum of log p(continuation | context) and whether the continuation is the greedy one, per pair.

    All pairs run as one continuous batch. Context + continuation must fit the model's context window
    (callers truncate). The engine must be idle: other requests would share its steps.
    """
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("engine_loglikelihood needs an idle engine")
    targets: dict[int, tuple[Any, list[int]]] = {}
    seqs = []
    for i, (ctx, cont) in enumerate(pairs):
        if not ctx or not cont:
            raise ValueError(f"pair {i}: context and continuation must be non-empty")
        # ignore_eos: a continuation may contain the EOS token and must still be scored to its end.
        params = SamplingParams(max_tokens=len(cont), temperature=0.0, ignore_eos=True)
        seq = engine.add_request(list(ctx), params, request_id=f"loglik-{i}")
        seq.forced_output_ids = list(cont)
        targets[seq.seq_id] = (seq, list(cont))
        seqs.append(seq)
    with _LogitsTap(llm, targets) as tap:
        while engine.has_unfinished():
            engine.step()
    out = []
    for seq in seqs:
        cont, got = targets[seq.seq_id][1], tap.scores[seq.seq_id]
        if len(got) != len(cont):
            raise RuntimeError(f"request {seq.request_id}: scored {len(got)} of {len(cont)} continuation tokens")
        out.append((math.fsum(lp for lp, _ in got.values()), all(g for _, g in got.values())))
    return out


class _CausalBackend:
    """Attention backend for one plain causal forward (no KV cache): the reference numerics of the engine."""

    def __init__(self, num_tokens: int, scale: float, device: torch.device) -> None:
        self.allowed = causal_allowed(num_tokens, num_tokens, device)
        self.scale = scale

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_ref(q, k, v, self.scale, self.allowed)


@torch.inference_mode()
def dense_loglikelihood(llm: Any, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Reference log-likelihood: one dense causal forward of ``context + continuation`` through the engine's
    model weights, outside the engine (never exercises sparse decode)."""
    model = llm.engine.model
    ids = list(context) + list(continuation)
    device = next(model.parameters()).device
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    positions = torch.arange(len(ids), device=device)
    scale = 1.0 / math.sqrt(llm.engine.model_config.head_dim)
    hidden, _ = model(input_ids, positions, _CausalBackend(len(ids), scale, device))
    # Row t predicts token t+1: the continuation is predicted by rows len(ctx)-1 .. len(ids)-2.
    rows = hidden[len(context) - 1: len(ids) - 1]
    logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
    target = torch.tensor(continuation, device=device)
    picked = logprobs.gather(1, target[:, None]).squeeze(1)
    return float(picked.sum()), bool((logprobs.argmax(dim=-1) == target).all())
