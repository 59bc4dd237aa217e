"""Offline study for issue #8: how often is SmolLM2's next greedy token guessed by the EAGLE-3 head, by the n-gram
draft, by either, and by rules that pick one of the two per step from what the engine knows at that step (the
head's top-1 probability, the n-gram's suffix match length)?

Prediction recall follows draft accuracy (docs/benchmarks.md), so a better pick between two drafts that are right on
different tokens is a cheap way to raise it. Rules are tuned on half of the windows and scored on the other half.

Setup: essay windows from the heads' holdout (the first 8,192 essay tokens); the prefix is essay text, then the
model's own greedy continuation of ``--steps`` tokens (what serving sees), scored there.

    python bench/draft_selector_study.py --windows 8 --length 1024 --steps 128 --out draft-selector-study.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.drafts.eagle3 import Eagle3Head
from oasiskv_runtime.drafts.sources import NgramDraft
from oasisbench.runners.recall import essay_windows
from oasisbench.runners.train_draft import capture_window

MAX_N = 6


def rule_accuracy(rows: list[dict], rule) -> float:
    return sum(int(r["ngram_ok"] if rule(r) else r["head_ok"]) for r in rows) / max(1, len(rows))


def rules() -> dict[str, object]:
    """name -> predicate 'use the n-gram guess here'."""
    out = {"head": lambda r: False,
           "ngram (any match, else head)": lambda r: r["match"] >= 1}
    for m in range(1, MAX_N + 1):
        out[f"ngram if match >= {m}"] = (lambda m: lambda r: r["match"] >= m)(m)
    for m, tau in itertools.product(range(1, MAX_N + 1), (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)):
        out[f"ngram if match >= {m} and head p < {tau}"] = (
            lambda m, tau: lambda r: r["match"] >= m and r["p"] < tau)(m, tau)
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="oasiskv_runtime/drafts/heads/smollm2-135m")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.time()
    llm = LLM(args.model, mode="dense", device="cpu", dtype="float32")
    eng = llm.engine
    model, tok, mc = eng.model, eng.tokenizer, eng.model_config
    head = Eagle3Head.from_pretrained(args.head, target_embed=model.embed_tokens, device="cpu",
                                      dtype=torch.float32, num_target_layers=mc.num_layers)
    aux_idx = head.config.aux_hidden_state_indices(mc.num_layers)
    prefixes = [w[: args.length - args.steps] for w in essay_windows(tok, args.windows, args.length)]
    outs = llm.generate(prefixes, SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True))
    print(f"generated {args.windows} x {args.steps} tokens in {time.time() - t0:.0f} s", flush=True)
    per_window = []
    for prefix, o in zip(prefixes, outs):
        ids = prefix + list(o.token_ids)
        shard = capture_window(model, mc, ids, aux_idx, "cpu")
        x = shard["ids"].long()
        p = torch.arange(x.numel() - 2)
        probs = head(x[p + 1], shard["aux"][p].float(), p).logits.softmax(-1)
        top_p, top_d = probs.max(-1)
        guess = head.draft_to_target(top_d)
        ng, state, rows = NgramDraft(MAX_N), None, []
        for i in p.tolist():  # row i guesses x_{i+2} from x_0..x_{i+1}
            g = ng.propose_one(ids[: i + 2], state)
            state = ng._last_state
            if i + 2 < len(prefix):
                continue  # score the generated tokens only
            rows.append({"step": i + 2 - len(prefix), "head_ok": int(guess[i]) == ids[i + 2], "p": float(top_p[i]),
                         "match": ng.last_match if g is not None else 0, "ngram_ok": g == ids[i + 2]})
        per_window.append(rows)
    half = len(per_window) // 2
    tune = [r for w in per_window[:half] for r in w]
    test = [r for w in per_window[half:] for r in w]
    every = tune + test
    table = {name: {"tune": rule_accuracy(tune, rule), "test": rule_accuracy(test, rule),
                    "all": rule_accuracy(every, rule),
                    "first_32_steps": rule_accuracy([r for r in every if r["step"] < 32], rule)}
             for name, rule in rules().items()}
    best = max((n for n in table if "head p" in n), key=lambda n: table[n]["tune"])
    either = sum(int(r["head_ok"] or r["ngram_ok"]) for r in every) / len(every)
    by_match = {m: {"positions": sum(1 for r in every if r["match"] == m),
                    "ngram_acc": sum(r["ngram_ok"] for r in every if r["match"] == m)
                    / max(1, sum(1 for r in every if r["match"] == m)),
                    "head_acc": sum(r["head_ok"] for r in every if r["match"] == m)
                    / max(1, sum(1 for r in every if r["match"] == m))} for m in range(MAX_N + 1)}
    out = {"model": args.model, "head": args.head, "windows": args.windows, "length": args.length,
           "steps": args.steps, "positions": len(every), "either_right": either,
           "ngram_right_only_ngram_matched": sum(r["ngram_ok"] for r in every) / len(every),
           "best_gated_rule_on_tune": best, "best_gated": table[best], "shipped_hybrid": table["ngram if match >= 3"],
           "head_only": table["head"], "by_match_length": by_match, "rules": table, "seconds": time.time() - t0}
    print(json.dumps({k: v for k, v in out.items() if k != "rules"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
