"""Host time of decode steps on the static layout (what a CUDA-graph replay leaves to Python), on any device.

A tiny random Qwen3 (2 layers; written to --model-dir once) keeps the model's own compute small, so the profile
shows the engine's per-request Python: scheduling, the draft, laying the step out on the static buffers.
``python bench/profile_host.py --mode oasiskv --batch 57`` prints ms per step and our functions by cumulative time
(cProfile over --steps decode steps, after every prompt is prefilled). CPU timings say where host time goes and
compare two trees on one machine; they are not the GPU host's figures (docs/benchmarks.md, "Host-side costs")."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oasiskv_runtime import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402

#: Functions that are the model's compute or the attention math, left out of the host listing.
COMPUTE = ("models/", "ops/", "core/predictor", "core/pipeline", "_sparse_decode", "transfer/")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="oasiskv")
    ap.add_argument("--batch", type=int, default=57)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--model-dir", default="/tmp/oasiskv-host-profile-model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        write_tiny(path, "qwen3", num_hidden_layers=2, max_position_embeddings=8192)
    kw = dict(block_size=16, cuda_graphs="static", max_num_seqs=max(64, args.batch),
              max_num_batched_tokens=args.batch * args.prompt_len, kv_cache_gb=1)
    if args.mode != "dense":
        kw.update(top_k_blocks=8, draft="ngram", host_kv_bytes=1 << 30)
    eng = LLM(str(path), mode=args.mode, **kw).engine
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        eng.add_request(torch.randint(10, 390, (args.prompt_len,), generator=gen).tolist(),
                        SamplingParams(max_tokens=args.steps + 20, temperature=0.0, ignore_eos=True))
    while eng.stats.num_prefill_steps == 0 or any(s.num_pending_tokens > 1 for s in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    print(f"{args.mode}, batch {args.batch}: {1e3 * (time.perf_counter() - t0) / args.steps:.2f} ms per decode step "
          f"(profiled)")
    rows = []
    for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
        where = f"{f.split('oasiskv_runtime/')[-1]}:{line}"
        if "oasiskv_runtime" in f and not any(c in where or c == name for c in COMPUTE):
            rows.append((ct, tt, nc, where, name))
    n = args.steps
    for ct, tt, nc, where, name in sorted(rows, reverse=True)[:args.rows]:
        print(f"{ct / n * 1e3:7.3f} cum {tt / n * 1e3:7.3f} own ms/step {nc / n:6.0f} calls/step  {where} {name}")


if __name__ == "__main__":
    main()
