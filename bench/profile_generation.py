"""Where the time of train-draft's self-distillation generation goes (docs/benchmarks.md, "Kernels").

The same engine set-up and requests as ``train-draft``'s generation (dense, float32, ``--batch`` requests at once,
16,384 batched tokens per step, excerpts of 128-1,024 essay tokens, a quarter each greedy / chat / sampled),
prefilled first (its first ``--prefill-steps`` steps of 16,384 tokens under ``torch.profiler``), then ``--steps``
decode steps under it. Prints wall ms per step, the device's busy time per step, and the top operators by device
and by host time, for both phases; ``--out`` saves them as JSON.

    python bench/profile_generation.py --model smollm2-135m --device cuda --batch 1024 --steps 10 --out prof.json

On the CPU (no device time) the split means nothing for the H200; it checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=320)
    ap.add_argument("--warmup", type=int, default=3, help="decode steps after the prefill, before profiling")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill-steps", type=int, default=3, help="prefill steps profiled (the first ones)")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from oasisbench.runners.train_draft import TrainDraftConfig, corpus_split, gen_requests, generation_llm
    from oasiskv_runtime import SamplingParams

    cfg = TrainDraftConfig(model=args.model, output=Path("/tmp"), device=args.device, seed=0,
                           gen_prompt_tokens=args.prompt_max, gen_prompt_min_tokens=args.prompt_min,
                           gen_tokens=args.gen_tokens, gen_batch=args.batch)
    # train-draft's engine; the requests need its tokenizer, so the KV is sized for the longest excerpt plus
    # room for a chat template (256 tokens) instead of the longest request
    llm = generation_llm(cfg, args.prompt_max + 256, args.batch)
    _, train_ids = corpus_split(llm.tokenizer, 16384, 200_000)
    eng = llm.engine
    for i, (ids, p) in enumerate(gen_requests(llm.tokenizer, train_ids, args.batch, cfg, seed=0)):
        eng.add_request(ids, SamplingParams(**p), request_id=str(i))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])

    def prefilling() -> bool:
        return any(s.num_pending_tokens > 1 for s in eng.scheduler.running) or bool(eng.scheduler.waiting)

    def profiled(steps: int, phase: str) -> dict:
        """``steps`` engine steps under the profiler (fewer if the prefill ends first): wall and device ms per
        step, top operators."""
        sync()
        n = 0
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            while n < steps and (phase == "decode" or prefilling()):
                eng.step()
                n += 1
            sync()
            wall = (time.perf_counter() - t0) / max(n, 1)
        events = prof.key_averages()
        dev_attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
        dev_us = sum(getattr(e, "self_" + dev_attr, 0) for e in events)

        def top(key: str) -> list[dict]:
            rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:args.rows]
            return [{"op": e.key, "calls_per_step": e.count / max(n, 1),
                     "host_ms_per_step": e.self_cpu_time_total / 1e3 / max(n, 1),
                     "device_ms_per_step": getattr(e, "self_" + dev_attr, 0) / 1e3 / max(n, 1)} for e in rows]

        res = {"steps": n, "ms_per_step": wall * 1e3, "device_busy_ms_per_step": dev_us / 1e3 / max(n, 1),
               "top_by_device": top("self_" + dev_attr), "top_by_host": top("self_cpu_time_total")}
        print(f"{phase}: {n} steps, {res['ms_per_step']:.1f} ms per step, device busy "
              f"{res['device_busy_ms_per_step']:.1f} ms")
        for title, key in (("by device time", "top_by_device"), ("by host time", "top_by_host")):
            print(title)
            for r in res[key]:
                print(f"  {r['device_ms_per_step']:8.2f} dev {r['host_ms_per_step']:8.2f} host ms/step "
                      f"{r['calls_per_step']:7.1f} calls  {r['op'][:70]}")
        return res

    t0 = time.perf_counter()
    prefill = profiled(args.prefill_steps, "prefill")
    while prefilling():
        eng.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        eng.step()
    running = len(eng.scheduler.running)
    decode = profiled(args.steps, "decode")
    out = {"model": args.model, "device": args.device, "batch": args.batch, "running": running,
           "prefill_s": prefill_s, "prefill": prefill, "decode_ms_per_step": decode["ms_per_step"],
           "device_busy_ms_per_step": decode["device_busy_ms_per_step"],
           "top_by_device": decode["top_by_device"], "top_by_host": decode["top_by_host"]}
    print(f"{args.model} on {args.device}: {running} running requests; prefill {prefill_s:.1f} s (profiled steps "
          f"included); decode {out['decode_ms_per_step']:.1f} ms per step")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
