"""Where in a long window do trained EAGLE-3 heads go wrong? (docs/benchmarks.md, "Draft and recall")

Teacher-forced held-out essays (the first 16,384 tokens of the stream `oasisbench recall` reads: 4 windows of
4,096), SmolLM2-135M real weights, float32, on the CPU. For each head and sliding window, the head's top-1 guess
vs the target's greedy token, bucketed by position (0-1K, 1-2K, 2-3K, 3-4K).

    python bench/head_window_study.py HEAD_DIR [HEAD_DIR ...] --windows 0,2048,1024 --out head-window-study.json
(0 = no window: every cached position.)
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from oasisbench.runners import train_draft as td
from oasiskv_runtime.drafts.eagle3 import Eagle3Head, default_aux_layer_ids
from oasiskv_runtime.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--windows", default="0,2048,1024")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--out", default="head-window-study.json")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    target, tok, mc = load_model("smollm2-135m", "cpu", "float32", seed=0)
    aux = default_aux_layer_ids(mc.num_layers)
    held, _ = td.corpus_split(tok, a.context * a.texts, 1024)
    shards = [td.capture_window(target, mc, held[i * a.context:(i + 1) * a.context], aux, "cpu")
              for i in range(a.texts)]
    buckets = a.context // 1024
    res: dict[str, object] = {"model": "smollm2-135m", "dtype": "float32", "texts": a.texts, "context": a.context,
                              "bucket_tokens": 1024, "accuracy": {}}
    for path in a.heads:
        head = Eagle3Head.from_pretrained(path, target_embed=target.embed_tokens, device="cpu",
                                          dtype=torch.float32, num_target_layers=mc.num_layers).eval()
        for w in (int(x) for x in a.windows.split(",")):
            head.set_sliding_window(w or None)
            hits, cnt = torch.zeros(buckets), torch.zeros(buckets)
            for sh in shards:
                p = torch.arange(sh["ids"].numel() - 2)
                hit = (td.head_guesses(head, sh) == sh["top_i"][p + 1, 0].long()).float()
                b = torch.clamp(p // 1024, max=buckets - 1)
                hits.index_add_(0, b, hit)
                cnt.index_add_(0, b, torch.ones_like(hit))
            acc = [round(x, 4) for x in (hits / cnt).tolist()]
            res["accuracy"][f"{path} window={w or 'all'}"] = acc  # type: ignore[index]
            print(path, w or "all", acc, flush=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
