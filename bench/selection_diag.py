"""Engine-side check of the block rankings (issue #34): the offline scorer study (``scorer_study.py``) re-measured on
the queries and keys sparse-resident really decodes with, to tell an integration error from a ranking that is
simply worse.

One sparse-resident engine (SmolLM2-135M, CPU, float32) decodes NIAH prompts one at a time, its selections made by
``--drive``. At every decode step and layer the predictor is called once per ranking on the same query and keys
(``sink_blocks`` applies to all), and for each ranking::

    mass     attention mass its K blocks hold (softmax over the candidate blocks, summed over the GQA group),
             relative to the exact top-K's
    block0   share of (layer, KV head) pairs whose K blocks hold block 0 (the attention sink)
    needle   at the 8 (layer, KV head) pairs per step that put the most mass on the answer needles' blocks, the
             share of those blocks it holds (the study's "needle recall")
    out_err  per query head, |o_K - o| / |o|: o attends every candidate block, o_K only the ranking's K (its
             softmax renormalised); the active block is left out of both

    PYTHONPATH=$PWD python bench/selection_diag.py --drive attention --families niah_single_needle,niah_multi_key
"""

from __future__ import annotations

import argparse
import collections

import torch

from bench.scorer_study import needle_token_blocks
from oasiskv_runtime.ops.attention_mass import block_attention_mass

RANKINGS = ("attention", "quest", "minmax_mass", "gauss")
TOP_PAIRS = 8


def measure(be, pred, real, layer: int, query: torch.Tensor, batch, needle: list[int], k: int, acc: dict,
            pairs: list) -> None:
    """One request's (``B = 1``) step at one layer: every ranking's selection against the exact mass."""
    hkv, (hq, d), bs = pred.hkv, query.shape[1:], be.dev_cache.block_size
    g, J = hq // hkv, int(batch.num_candidates[0])
    if J <= k:
        return
    mass = block_attention_mass(query, pred.keys[layer], batch.primary_table, batch.num_candidates, hkv, pred.scale,
                                batch.max_candidates)[0, :, :J]                                  # [Hkv, J]
    ceiling = mass.topk(k, dim=-1).values.sum(-1)
    blocks = batch.primary_table[0, :J].long()
    kq = be.dev_cache.k[layer][blocks].float().view(J * bs, hkv, d).repeat_interleave(g, 1)    # [T, Hq, D]
    vq = be.dev_cache.v[layer][blocks].float().view(J * bs, hkv, d).repeat_interleave(g, 1)
    p = torch.softmax(torch.einsum("hd,thd->ht", query[0].float(), kq) * pred.scale, -1)        # [Hq, T]
    o = torch.einsum("ht,thd->hd", p, vq)
    needle = [b for b in needle if b < J]
    held = {}
    for name in RANKINGS:
        pred.selection_score = name
        ids = real(layer, query, batch, False)[0]                                                 # [Hkv, K]
        sel = torch.zeros(hkv, J, dtype=torch.bool)
        for h in range(hkv):
            sel[h, ids[h][ids[h] >= 0]] = True
        acc[(name, "mass")] += ((mass * sel).sum(-1) / ceiling).tolist()
        acc[(name, "block0")] += sel[:, 0].float().tolist()
        w = (p.view(hq, J, bs) * sel.repeat_interleave(g, 0).unsqueeze(-1)).view(hq, -1)
        o_k = torch.einsum("ht,thd->hd", w / w.sum(-1, keepdim=True), vq)
        acc[(name, "out_err")] += ((o_k - o).norm(dim=-1) / o.norm(dim=-1)).tolist()
        held[name] = sel
    if needle:
        on_needle = mass[:, needle].sum(-1)
        for h in range(hkv):
            pairs.append((float(on_needle[h]), {n: float(s[h, needle].float().mean()) for n, s in held.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drive", default="attention", help="the ranking whose selections the engine decodes with")
    ap.add_argument("--families", default="niah_single_needle,niah_multi_key")
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=5, help="prompts per family (depths 0, 25, 50, 75, 100 cycled)")
    ap.add_argument("--top-k-blocks", type=int, default=8)
    ap.add_argument("--sink-blocks", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()
    from oasisbench.accuracy import tasks as T
    from oasisbench.accuracy.niah import encode_prompt, string_match_all
    from oasiskv_runtime import LLM, SamplingParams

    torch.set_num_threads(1)
    k = args.top_k_blocks
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", mode="sparse-resident", top_k_blocks=k,
              sink_blocks=args.sink_blocks, selection_score=args.drive, kv_cache_gb=0.5)
    be = llm.engine.backend
    pred, real = be.predictor, be.predictor.predict
    acc: dict = collections.defaultdict(list)
    state: dict = {}

    def spy(layer, query, batch, next_step, int32=False):
        with torch.no_grad():
            measure(be, pred, real, layer, query, batch, state["needle"], k, acc, state["pairs"])
        pred.selection_score = args.drive
        if layer == be.num_layers - 1:  # a step done: keep its top needle pairs
            for _, row in sorted(state["pairs"], key=lambda r: -r[0])[:TOP_PAIRS]:
                for name in RANKINGS:
                    acc[(name, "needle")].append(row[name])
            state["pairs"] = []
        return real(layer, query, batch, next_step, int32)

    pred.predict = spy
    scores = []
    for fam in args.families.split(","):
        for smp in T.niah_samples(llm.tokenizer, fam, args.context_len, [0.0, 25.0, 50.0, 75.0, 100.0],
                                  args.limit, 0):
            state.update(needle=sorted(needle_token_blocks(llm.tokenizer, smp, be.dev_cache.block_size)), pairs=[])
            ids = encode_prompt(llm.tokenizer, smp.prompt, smp.use_chat_template)
            out = llm.generate([ids], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))[0]
            scores.append(string_match_all(out.text, smp.answers))
    mean = lambda v: sum(v) / max(1, len(v))
    pct = lambda v, f: sorted(v)[int(f * (len(v) - 1))]
    print(f"drive {args.drive}, sink_blocks {args.sink_blocks}, K {k}, {len(scores)} prompts, "
          f"{args.max_tokens} tokens: NIAH {100 * mean(scores):.1f} (partial answers at this length)")
    print("| ranking | mass vs exact | block 0 kept | needle recall | out_err mean | out_err p90 | out_err p99 |")
    print("|---|---|---|---|---|---|---|")
    for name in RANKINGS:
        e = acc[(name, "out_err")]
        print(f"| {name} | {mean(acc[(name, 'mass')]):.3f} | {mean(acc[(name, 'block0')]):.3f} | "
              f"{mean(acc[(name, 'needle')]):.3f} | {mean(e):.3f} | {pct(e, .9):.3f} | {pct(e, .99):.3f} |")


if __name__ == "__main__":
    main()
