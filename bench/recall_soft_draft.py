"""Offline study for issue #8: does the draft head's distribution, not just its top-1 token, predict the next
step's top-K blocks better?

The engine's look-ahead row carries the draft's top-1 token. When the head is unsure (it is right ~half the time
on SmolLM2's own text), a wrong token's query points elsewhere. Two cheap alternatives use the head's top-k
tokens and their probabilities p_i (renormalised over the k):

- ``soft-k``: ONE look-ahead row whose input embedding is sum_i p_i * E[t_i] (no extra rows, same cost as top-1);
- ``mix-k``: k look-ahead rows, block scores sum_i p_i * score(q_i) (k times the look-ahead rows: an upper bound
  for what spending more rows on the draft buys).

Setup (an approximation of the engine's recall, stated so the figures are not mistaken for engine runs): the
look-ahead row at position t+1 attends densely to the whole prefix (the engine propagates it through the resident
set only, so its oracle scores 0.98, here 1.0 by construction). Blocks of 16 tokens, Quest scores (per KV head:
max over its query heads of sum_d max(q*kmin, q*kmax)) over the full blocks of positions 0..t, top-K per KV head.
Recall = |predicted top-K & the real next query's top-K| / K, mean over layers, KV heads and positions. The proxy
is the current token's query (position t). The continuation is the model's own greedy text (``--continuation
self`` of ``oasisbench recall``): the prefix is essay text, then ``--steps`` greedy tokens, scored there.

    python bench/recall_soft_draft.py --context 2048 --texts 4 --top-k 16 --out recall-soft-draft-2k.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from oasiskv_runtime.ops.attend import attend_ref
from oasiskv_runtime.drafts.eagle3 import Eagle3Head
from oasiskv_runtime.models.loader import load_model
from oasiskv_runtime.ops.score_topk import quest_scores_ref
from oasisbench.runners.recall import essay_windows
from oasisbench.runners.train_draft import _CausalKV


class Recorder(_CausalKV):
    """Causal attention over one sequence that keeps every layer's post-rotary q and k (and v)."""

    def __init__(self, scale: float) -> None:
        super().__init__(scale)
        self.q, self.k, self.v = {}, {}, {}

    def forward(self, layer: int, q, k, v):
        self.q[layer], self.k[layer], self.v[layer] = q, k, v
        return super().forward(layer, q, k, v)


class LookAhead:
    """One look-ahead row per query: row r sits at position ``pos[r]`` and attends to the recorded keys before it
    and to itself (what the engine's draft row does, densely)."""

    def __init__(self, rec: Recorder, pos: torch.Tensor) -> None:
        self.rec, self.pos, self.q = rec, pos, {}

    def forward(self, layer: int, q, k, v):
        self.q[layer] = q
        ck, cv = self.rec.k[layer], self.rec.v[layer]
        outs = []
        for r in range(q.shape[0]):  # each row its own prefix; rows are few
            p = int(self.pos[r])
            kk = torch.cat([ck[:p], k[r:r + 1]])
            vv = torch.cat([cv[:p], v[r:r + 1]])
            outs.append(attend_ref(q[r:r + 1], kk, vv, self.rec.scale))
        return torch.cat(outs)


def run_rows(model, embeds: torch.Tensor, pos: torch.Tensor, rec: Recorder) -> dict[int, torch.Tensor]:
    """Forward look-ahead rows from given input embeddings; returns each layer's post-rotary queries."""
    la = LookAhead(rec, pos)
    x = embeds
    cos, sin = model.rotary(pos, x.dtype)
    for layer in model.layers:
        x = layer(x, cos, sin, la)
    return la.q


def block_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, nblocks: int, top_k: int,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """q: [m, Hq, D] (m look-ahead rows mixed by ``weights`` [m], or m = 1); kmin/kmax: [NB, Hkv, D] ->
    top-K block ids per KV head [Hkv, K] over the first ``nblocks`` blocks, by the engine's reference Quest
    scores (the summaries as one page of NB rows)."""
    m = q.shape[0]
    s = quest_scores_ref(q, kmin[None], kmax[None], torch.zeros(m, 1, dtype=torch.long),
                         torch.full((m,), nblocks), kmin.shape[1], max_candidates=nblocks)  # [m, Hkv, nblocks]
    if weights is not None:
        s = (weights[:, None, None] * s).sum(0, keepdim=True)
    return s[0].topk(min(top_k, nblocks), dim=-1).indices


def recall(pred: torch.Tensor, true: torch.Tensor) -> float:
    hits = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(pred, true))
    return hits / true.numel()


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="oasiskv_runtime/drafts/heads/smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.time()
    model, tok, mc = load_model(args.model, "cpu", "float32")
    head = Eagle3Head.from_pretrained(args.head, target_embed=model.embed_tokens, device="cpu",
                                      dtype=torch.float32, num_target_layers=mc.num_layers)
    aux_layers = tuple(i - 1 for i in head.config.aux_hidden_state_indices(mc.num_layers))
    scale = 1.0 / math.sqrt(mc.head_dim)
    ks = [int(x) for x in args.ks.split(",")]
    names = ["proxy", "top1"] + [f"soft{k}" for k in ks] + [f"mix{k}" for k in ks] + ["oracle"]
    sums = {n: 0.0 for n in names}
    head_hits = count = 0
    for w, window in enumerate(essay_windows(tok, args.texts, args.context)):
        ids = window[: args.context - args.steps]
        for _ in range(args.steps):  # the model's own greedy continuation (full recompute: few steps)
            rec = Recorder(scale)
            h, _ = model(torch.tensor(ids), torch.arange(len(ids)), rec)
            ids.append(int(model.compute_logits(h[-1:]).argmax()))
        rec = Recorder(scale)
        x = torch.tensor(ids)
        h, cap = model(x, torch.arange(len(ids)), rec, capture_layers=aux_layers)
        aux = torch.stack([cap[layer] for layer in aux_layers], dim=1)
        bs = args.block
        nb_all = len(ids) // bs
        kmin = {l: rec.k[l][: nb_all * bs].view(nb_all, bs, *rec.k[l].shape[1:]).amin(1) for l in rec.k}
        kmax = {l: rec.k[l][: nb_all * bs].view(nb_all, bs, *rec.k[l].shape[1:]).amax(1) for l in rec.k}
        # Decode steps: the current token x_t at position t, the next x_{t+1} unknown. The head's row t-1 (fed
        # x_t and the target's states at t-1) guesses x_{t+1}.
        ts = list(range(args.context - args.steps, len(ids) - 1))
        p = torch.tensor(ts) - 1
        probs = head(x[p + 1], aux[p].float(), p).logits.softmax(-1)
        kmax_k = max(ks)
        top_p, top_d = probs.topk(kmax_k, dim=-1)
        top_t = head.draft_to_target(top_d)
        head_hits += int((top_t[:, 0] == x[torch.tensor(ts) + 1]).sum())
        emb = model.embed_tokens.weight
        for i, t in enumerate(ts):
            nblocks = (t + 1) // bs  # full blocks of positions 0..t
            if nblocks < args.top_k + 1:
                continue
            pos1 = torch.tensor([t + 1])
            rows = {"top1": emb[top_t[i, :1]], "oracle": emb[x[t + 1: t + 2]]}
            for k in ks:
                wk = top_p[i, :k] / top_p[i, :k].sum()
                rows[f"soft{k}"] = (wk[:, None] * emb[top_t[i, :k]]).sum(0, keepdim=True)
            keys = list(rows)
            q_single = run_rows(model, torch.cat([rows[n] for n in keys]), pos1.repeat(len(keys)), rec)
            q_multi = run_rows(model, emb[top_t[i, :kmax_k]], pos1.repeat(kmax_k), rec)
            for layer in range(mc.num_layers):
                true = block_topk(rec.q[layer][t + 1: t + 2], kmin[layer], kmax[layer], nblocks, args.top_k)
                preds = {"proxy": block_topk(rec.q[layer][t: t + 1], kmin[layer], kmax[layer], nblocks, args.top_k)}
                for j, n in enumerate(keys):
                    preds[n] = block_topk(q_single[layer][j: j + 1], kmin[layer], kmax[layer], nblocks, args.top_k)
                for k in ks:
                    wk = top_p[i, :k] / top_p[i, :k].sum()
                    preds[f"mix{k}"] = block_topk(q_multi[layer][:k], kmin[layer], kmax[layer], nblocks, args.top_k,
                                                  weights=wk)
                for n in names:
                    sums[n] += recall(preds[n], true) / mc.num_layers
            count += 1
        print(f"text {w}: {count} positions, {time.time() - t0:.0f} s, "
              + ", ".join(f"{n} {sums[n] / max(count, 1):.3f}" for n in names), flush=True)
    res = {n: sums[n] / count for n in names}
    gap = res["oracle"] - res["proxy"]
    out = {"model": args.model, "head": args.head, "context": args.context, "texts": args.texts,
           "steps": args.steps, "top_k": args.top_k, "block": args.block, "positions": count,
           "head_top1_accuracy": head_hits / max(1, args.texts * (args.steps - 1)),
           "recall": res, "gap_closed": {n: (res[n] - res["proxy"]) / gap for n in names},
           "seconds": time.time() - t0}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
