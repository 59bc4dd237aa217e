"""Plain vLLM against vLLM with the OasisKV plug-in on the same requests: decode step time and greedy-token agreement.

Each mode runs in its own process (one vLLM engine per process). The decode step is measured by difference: the
same requests generate ``--output-len`` tokens, then 1 token (prefill only), both timed end to end; the step is
``(T_full - T_prefill) / (output_len - 1)`` at the batch of all requests decoding together. Greedy tokens of each
mode are kept, and the report gives each plug-in mode's agreement with plain vLLM (positions equal, and the mean
length of the common prefix). Dummy weights at real shapes (RANDOM WEIGHTS: with near-uniform logits a bf16 rounding
flips a greedy token easily, and everything after it differs).

    python bench/vllm_decode.py --model qwen3-8b --batch 16 --context 16384,32768 --out vllm-decode.json
    python bench/vllm_decode.py --model /path/to/hf_dir --modes plain,sparse-resident --device cpu --dtype float32 ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from oasiskv_runtime.vllm.models import vllm_model


def one_mode(a: argparse.Namespace) -> dict:
    """Run in the child: one engine, every context length, timed twice per context."""
    import torch
    import vllm

    from oasiskv_runtime.vllm import engine_args

    extra = {} if a.mode == "plain" else engine_args(mode=a.mode, top_k_blocks=a.top_k, draft="none",
                                                     platform="cuda" if a.device == "cuda" else "cpu")
    max_len = max(a.context) + 16
    t0 = time.perf_counter()
    llm = vllm.LLM(model=a.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=a.dtype, seed=0,
                   max_model_len=max_len, max_num_seqs=a.batch, kv_cache_memory_bytes=int(a.kv_gb * (1 << 30)),
                   max_num_batched_tokens=a.batched_tokens, **extra)
    out = {"mode": a.mode, "engine_start_s": time.perf_counter() - t0, "points": []}
    vocab = json.load(open(Path(a.model_dir) / "config.json"))["vocab_size"]
    for ctx in a.context:
        g = torch.Generator().manual_seed(ctx)
        prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (ctx - a.output_len,), generator=g).tolist()}
                   for _ in range(a.batch)]
        timed = {}
        for n in (a.output_len, 1, a.output_len):  # the first full run warms the shapes up
            params = vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            timed[n] = time.perf_counter() - t
        step_ms = (timed[a.output_len] - timed[1]) * 1e3 / (a.output_len - 1)
        out["points"].append({"context": ctx, "batch": a.batch, "full_s": timed[a.output_len], "prefill_s": timed[1],
                              "decode_step_ms": step_ms,
                              "tokens": [list(r.outputs[0].token_ids) for r in res]})
        print(json.dumps({k: v for k, v in out["points"][-1].items() if k != "tokens"}), flush=True)
    if a.mode != "plain":  # the plug-in's own counters (traffic, fills, rows served sparse), summed over layers
        try:
            from oasiskv_runtime.vllm.backend import collect_stats

            out["plugin_stats"] = json.loads(json.dumps(llm.apply_model(collect_stats)[0], default=str))
        except Exception as e:  # noqa: BLE001 - a report without them is still a report
            out["plugin_stats"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(min(len(ra), len(rb)) for ra, rb in zip(a, b))
    prefix = []
    for ra, rb in zip(a, b):
        n = 0
        while n < min(len(ra), len(rb)) and ra[n] == rb[n]:
            n += 1
        prefix.append(n)
    return {"positions_equal": same / total if total else None, "mean_common_prefix": sum(prefix) / len(prefix),
            "identical_requests": sum(p == len(r) for p, r in zip(prefix, a))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", help="a random-weight preset or an HF directory")
    ap.add_argument("--modes", default="plain,sparse-resident")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", default="16384,32768", help="prompt + output tokens, comma list")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=128)
    ap.add_argument("--kv-gb", type=float, default=60.0, help="vLLM's KV cache (kv_cache_memory_bytes) in GiB")
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mode")
    ap.add_argument("--out", default="vllm-decode.json")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # the child: JSON args
    a = ap.parse_args()
    if a.one:
        child = argparse.Namespace(**json.loads(a.one))
        print("RESULT " + json.dumps(one_mode(child)), flush=True)
        return
    root = Path(tempfile.mkdtemp(prefix="vllm-decode-"))
    mdir = str(vllm_model(a.model, root).path)  # the weights are vLLM's dummy ones here, whatever the model
    results = {"model": a.model, "random_weights": True, "batch": a.batch,
               "top_k_blocks": a.top_k, "output_len": a.output_len, "modes": {}}
    for mode in a.modes.split(","):
        child = dict(mode=mode, model_dir=mdir, batch=a.batch, context=[int(x) for x in a.context.split(",")],
                     output_len=a.output_len, top_k=a.top_k, kv_gb=a.kv_gb, batched_tokens=a.batched_tokens,
                     device=a.device, dtype=a.dtype)
        try:
            env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model sends a function
            p = subprocess.run([sys.executable, __file__, "--one", json.dumps(child)], capture_output=True, text=True,
                               timeout=a.timeout, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            results["modes"][mode] = (json.loads(lines[-1][7:]) if lines else
                                      {"error": f"exit {p.returncode}: {p.stderr[-3000:]}"})
        except subprocess.TimeoutExpired as e:
            results["modes"][mode] = {"error": f"timed out after {a.timeout:.0f} s: {str(e.stderr)[-2000:]}"}
        print(mode, json.dumps({k: v for k, v in results["modes"][mode].items() if k != "points"})[:3000], flush=True)
        Path(a.out).write_text(json.dumps(results, indent=1))
    plain = results["modes"].get("plain", {})
    for mode, r in results["modes"].items():
        for i, pt in enumerate(r.get("points", [])):
            ref = plain.get("points", [])[i] if i < len(plain.get("points", [])) else None
            if ref is not None and mode != "plain":
                pt["agreement_with_plain"] = agreement(ref["tokens"], pt["tokens"])
                pt["step_vs_plain"] = pt["decode_step_ms"] / ref["decode_step_ms"]
            summary = {k: v for k, v in pt.items() if k != "tokens"}
            print(mode, json.dumps(summary), flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
