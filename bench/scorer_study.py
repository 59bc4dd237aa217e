"""Offline study (issue #34): how much of a step's true attention mass each per-block scorer's top-K keeps.

SmolLM2-135M (real weights, float32, CPU), NIAH prompts from the project's generator. For each prompt: one dense
prefill, then greedy decode steps; at each query position (the last prompt token and each decoded token), layer
and KV head, the candidates are the full blocks before the active one (what the engine ranks). Every scorer ranks
them, its top-K keeps some of the exact per-block mass (:func:`oasiskv_runtime.ops.attention_mass`'s definition:
softmax over the candidates' keys, summed over the GQA group); reported relative to the exact top-K (the ceiling,
1.0). "Needle recall": at the (layer, KV head) pairs that put the most mass on the answer needles' blocks, the
share of those blocks each scorer's top-K holds.

    PYTHONPATH=$PWD python bench/scorer_study.py --out /tmp/scorer-study   # ~10 min on 2 cores

Scorers read per-block summaries only (except ``exact`` and ``max_logit``, references): ``quest`` Quest's bound
from min/max; ``quest_half`` the same on 8-token halves, max of the two; ``mean`` q . (mean key); ``mean_var``
the Gaussian log-mass of a block, ``scale * q.mu + scale^2 / 2 * sum_d q_d^2 var_d``; ``mid`` q . (min + max) / 2;
``mid_quest_c`` q . mid + c * sum_d |q_d| (max - min)_d / 2 (c = 1 is Quest); ``uniform`` the Gaussian log-mass
with the variance of a uniform spread over [min, max]. Group aggregation ``max`` takes the group's max (Quest's);
``*_sm`` scorers turn each query head's scores into a softmax over the candidates (an estimated mass share per head
at attention's scale) and sum over the group, as the exact mass does.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from oasiskv_runtime.ops.attention_mass import block_attention_mass
from oasiskv_runtime.ops.score_topk import quest_scores_ref, select_topk

SHARES = (1 / 16, 1 / 8, 1 / 4)


def captured_mass(mass: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mass ``[H, J]`` kept by the top-``k`` of ``scores [H, J]`` per row (ties to the lower block, as the engine
    ranks): ``[H]``."""
    ids, _ = select_topk(scores.float().unsqueeze(0), torch.tensor([scores.shape[-1]]), k)
    ids = ids[0].long()
    return mass.gather(1, ids.clamp_min(0)).masked_fill(ids < 0, 0).sum(1)


def group_softmax_sum(per_head: torch.Tensor, hkv: int, scale: float) -> torch.Tensor:
    """Per query head log-scores ``[Hq, J]`` (in logit units) -> a softmax over the candidates per head, summed over
    each KV head's group: ``[Hkv, J]``."""
    return torch.softmax(per_head * scale, dim=-1).view(hkv, -1, per_head.shape[-1]).sum(1)


def block_stats(keys: torch.Tensor, bs: int) -> dict[str, torch.Tensor]:
    """``keys [J * bs, Hkv, D]`` -> per-block summaries ``[J, Hkv, D]`` (half-blocks ``[2J, ...]``)."""
    kb = keys.view(-1, bs, *keys.shape[1:])
    kh = keys.view(-1, bs // 2, *keys.shape[1:])
    return {"min": kb.amin(1), "max": kb.amax(1), "mean": kb.mean(1), "var": kb.var(1, unbiased=False),
            "hmin": kh.amin(1), "hmax": kh.amax(1)}


def quest_per_head(q: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, hkv: int) -> torch.Tensor:
    """Quest's bound per query head ``[Hq, J]`` (q ``[Hq, D]``, summaries ``[J, Hkv, D]``)."""
    g = q.shape[0] // hkv
    mn_q, mx_q = mn.repeat_interleave(g, dim=1), mx.repeat_interleave(g, dim=1)     # [J, Hq, D]
    return torch.maximum(q * mn_q, q * mx_q).sum(-1).t()


def scorers(q: torch.Tensor, keys: torch.Tensor, st: dict[str, torch.Tensor], hkv: int, scale: float
            ) -> dict[str, torch.Tensor]:
    """Every scorer's ``[Hkv, J]`` for one layer and step. ``q [Hq, D]``, ``keys [J * bs, Hkv, D]``."""
    hq, d = q.shape
    g, J = hq // hkv, st["min"].shape[0]
    rep = lambda t: t.repeat_interleave(g, dim=1)                                      # noqa: E731  [J, Hq, D]
    gmax = lambda s: s.view(hkv, g, -1).amax(1)                                        # noqa: E731
    dot = lambda t: (q.unsqueeze(0) * rep(t)).sum(-1).t()                              # noqa: E731  [Hq, J]
    quest = quest_per_head(q, st["min"], st["max"], hkv)
    half = quest_per_head(q, st["hmin"], st["hmax"], hkv).view(hq, J, 2).amax(-1)
    mid, rad = (st["min"] + st["max"]) / 2, (st["max"] - st["min"]) / 2
    q_mid = dot(mid)
    l1_rad = (q.abs().unsqueeze(0) * rep(rad)).sum(-1).t()
    mean, var = dot(st["mean"]), (q.square().unsqueeze(0) * rep(st["var"])).sum(-1).t()
    uvar = (q.square().unsqueeze(0) * rep(rad.square() / 3)).sum(-1).t()             # uniform on [min, max]
    logits = torch.einsum("hd,thd->ht", q, rep(keys.view(-1, hkv, d))).view(hq, J, -1)
    mean_var = mean + scale / 2 * var
    uniform = q_mid + scale / 2 * uvar
    out = {"quest": gmax(quest), "quest_sm": group_softmax_sum(quest, hkv, scale),
           "quest_half": gmax(half), "quest_half_sm": group_softmax_sum(half, hkv, scale),
           "mean": gmax(mean), "mean_sm": group_softmax_sum(mean, hkv, scale),
           "mean_var": gmax(mean_var), "mean_var_sm": group_softmax_sum(mean_var, hkv, scale),
           "mid": gmax(q_mid), "uniform": gmax(uniform), "uniform_sm": group_softmax_sum(uniform, hkv, scale),
           "max_logit": gmax(logits.amax(-1)), "max_logit_sm": group_softmax_sum(logits.amax(-1), hkv, scale)}
    for c in (0.25, 0.5):
        s = q_mid + c * l1_rad
        out[f"mid_quest_{c}"], out[f"mid_quest_{c}_sm"] = gmax(s), group_softmax_sum(s, hkv, scale)
    return out


class Capture:
    """A dense attention backend that keeps every layer's keys/values and the last query row."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.q: list[torch.Tensor | None] = [None] * num_layers

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        prev = self.k[layer]
        self.k[layer] = k if prev is None else torch.cat([prev, k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])
        self.q[layer] = q[-1]
        kk, vv = self.k[layer], self.v[layer]
        hq, hkv = q.shape[1], kk.shape[1]
        kq = kk.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)                       # [Hq, S, D]
        vq = vv.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kq, vq, is_causal=prev is None)
        return out.transpose(0, 1)


def needle_token_blocks(tok, sample, bs: int) -> set[int]:
    """Blocks holding any token of the needles that carry an answer."""
    blocks: set[int] = set()
    for start, text in zip(sample.needle_token_positions, sample.needles):
        if any(a in text for a in sample.answers):
            n = len(tok.encode(text, add_special_tokens=False))
            blocks.update(range(start // bs, (start + n - 1) // bs + 1))
    return blocks


def analyse_step(net, cap: Capture, cfg, pos: int, needle_blocks: set[int], top_pairs: int, acc: dict) -> None:
    bs, hkv = 16, cfg.num_kv_heads
    scale = 1.0 / math.sqrt(cfg.head_dim)
    J = pos // bs                                # full blocks before the active one (the token at pos is in it)
    total_blocks = math.ceil((pos + 1) / bs)
    ks = {share: max(1, round(total_blocks * share)) for share in SHARES}
    needle = sorted(b for b in needle_blocks if b < J)
    pair_rows = []
    for layer in range(cfg.num_layers):
        keys = cap.k[layer][:J * bs].float()
        q = cap.q[layer].float()
        mass = block_attention_mass(q.unsqueeze(0), keys.view(J, bs, hkv, -1), torch.arange(J).view(1, J),
                                    torch.tensor([J]), hkv, scale, J)[0]               # [Hkv, J]
        scores = {"exact": mass, **scorers(q, keys, block_stats(keys, bs), hkv, scale)}
        for share, k in ks.items():
            ceiling = captured_mass(mass, mass, k)
            for name, s in scores.items():
                kept = captured_mass(mass, s, k)
                acc.setdefault((name, share), []).extend((kept / ceiling).tolist())
        if needle:
            on_needle = mass[:, needle].sum(1)
            for h in range(hkv):
                pair_rows.append((float(on_needle[h]), layer, h, {n: s[h] for n, s in scores.items()}))
    for _, layer, h, row in sorted(pair_rows, key=lambda r: -r[0])[:top_pairs]:
        for share, k in ks.items():
            for name, s in row.items():
                ids, _ = select_topk(s.view(1, 1, -1), torch.tensor([J]), k)
                chosen = set(ids.flatten().tolist())
                acc.setdefault(("recall", name, share), []).append(sum(b in chosen for b in needle) / len(needle))


def run_prompt(net, tok, cfg, sample, steps: int, top_pairs: int, acc: dict) -> None:
    from oasisbench.accuracy.niah import encode_prompt

    ids = encode_prompt(tok, sample.prompt, sample.use_chat_template)
    needle_blocks = needle_token_blocks(tok, sample, 16)
    cap = Capture(cfg.num_layers)
    tokens = torch.tensor(ids)
    positions = torch.arange(len(ids))
    with torch.no_grad():
        for step in range(steps):
            hidden, _ = net(tokens, positions, cap)
            analyse_step(net, cap, cfg, int(positions[-1]), needle_blocks, top_pairs, acc)
            nxt = int(net.compute_logits(hidden[-1:]).argmax(-1))
            tokens, positions = torch.tensor([nxt]), positions[-1:] + 1


def summarise(acc: dict) -> dict:
    names = sorted({k[0] for k in acc if k[0] != "recall"})
    out = {"mass_vs_exact": {}, "needle_recall": {}}
    for name in names:
        out["mass_vs_exact"][name] = {f"1/{round(1 / s)}": sum(acc[(name, s)]) / len(acc[(name, s)]) for s in SHARES}
        if ("recall", name, SHARES[0]) in acc:
            out["needle_recall"][name] = {f"1/{round(1 / s)}": sum(acc[("recall", name, s)]) /
                                          len(acc[("recall", name, s)]) for s in SHARES}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="run directory for study.json and study.md")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--families", default="single_needle,multi_key,variable_tracking,drift_stress")
    ap.add_argument("--depths", default="0,25,50,75,100", help="cycled over the families")
    ap.add_argument("--steps", type=int, default=3, help="query positions per prompt (last prompt token + decodes)")
    ap.add_argument("--top-pairs", type=int, default=8, help="(layer, KV head) pairs per step for needle recall")
    args = ap.parse_args()
    from oasisbench.accuracy.niah import generate_samples
    from oasiskv_runtime.models.loader import load_model

    torch.manual_seed(0)
    net, tok, cfg = load_model("smollm2-135m", "cpu", "float32")
    depths = [float(d) for d in args.depths.split(",")]
    acc: dict = {}
    prompts = []
    t0 = time.time()
    for length in (int(x) for x in args.lengths.split(",")):
        for i, fam in enumerate(args.families.split(",")):
            depth = depths[i % len(depths)]
            sample = generate_samples(tok, fam, length, [depth], 1, seed=0)[0]
            run_prompt(net, tok, cfg, sample, args.steps, args.top_pairs, acc)
            prompts.append({"family": fam, "context": length, "depth": depth})
            print(f"[{time.time() - t0:6.0f}s] {fam} {length} depth {depth:g}", flush=True)
    result = {"prompts": prompts, "steps": args.steps, "top_pairs": args.top_pairs, "dtype": "float32",
              "model": "smollm2-135m", **summarise(acc)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(result, indent=1))
    (out / "study.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    shares = list(next(iter(result["mass_vs_exact"].values())))
    head = "| scorer | " + " | ".join(f"mass K={s}" for s in shares) + " | " + \
        " | ".join(f"needle recall K={s}" for s in shares) + " |\n|---|" + "---|" * (2 * len(shares)) + "\n"
    rows = []
    for name, m in sorted(result["mass_vs_exact"].items(), key=lambda kv: -kv[1][shares[0]]):
        r = result["needle_recall"].get(name, {})
        rows.append(f"| {name} | " + " | ".join(f"{m[s]:.3f}" for s in shares) + " | " +
                    " | ".join(f"{r[s]:.3f}" if s in r else "-" for s in shares) + " |")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
