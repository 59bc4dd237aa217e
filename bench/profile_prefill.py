"""Where a prefill step's time goes, per mode: the engine's own steps under torch.profiler (random weights).

In the end-to-end runs (docs/benchmarks.md, "Prefill path") an oasiskv step that carries an 8,192-token
prefill chunk costs ~200 ms more than dense's. This script runs the same kind of step in each mode in one
process and prints, per mode: the wall time of every step (prefill or decode), then the profiler's top ops by
GPU time and by host time over the profiled steps.

    python bench/profile_prefill.py --model qwen3-8b --context 16384 --chunk 8192 --modes dense,oasiskv \
        [--decode-rows 40 --decode-context 4096] [--sync-sites] \
        --out prefill-profile.txt
"""

from __future__ import annotations

import argparse
import collections
import gc
import time
import traceback
import warnings

import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.models.loader import model_config_for
from oasisbench.runners.accuracy import sweep_value
from oasisbench.runners.step_trace import trace_lines

GiB = 1 << 30
TOP_K = 128  # blocks per KV head in the sparse modes


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steps_of(llm: LLM, prompts: list[list[int]], new_tokens: int, until=None) -> list[tuple[str, float]]:
    """Run ``prompts`` to completion (or until ``until(seqs)``) one engine step at a time; (kind, ms) per
    step, kind "prefill" while any of them is still prefilling."""
    eng = llm.engine
    seqs = [eng.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
            for p in prompts]
    out = []
    limit = 4 * (sum(len(p) for p in prompts) // eng.config.scheduler.max_num_batched_tokens + len(prompts) + new_tokens) + 64
    while eng.has_unfinished() and not (until is not None and until(seqs)):
        if len(out) >= limit:  # e.g. prompts never admitted beside the decoders: fail instead of decoding on
            raise RuntimeError(f"{len(out)} steps and the prompts are not done: the KV budget or the host pool "
                               "cannot hold them beside the decoding requests (--kv-gb / --host-gb)")
        kind = "prefill" if any(s.num_computed_tokens < len(s.prompt_token_ids) for s in seqs
                                if not s.is_finished) else "decode"
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        out.append((kind, (time.perf_counter() - t0) * 1e3))
    return out


def mixed_steps(llm: LLM, decoders: list[list[int]], prompts: list[list[int]], new_tokens: int,
                decode_steps: int) -> list[tuple[str, float]]:
    """Like :func:`steps_of`, but the prompts arrive while ``decoders`` are decoding (the end-to-end runs'
    prefill-carrying steps also carry up to a batch of decode rows): the decoders are prefilled first, not
    timed, and aborted once the prompts have finished (``decode_steps`` bounds their outputs, so that the KV
    budget can be sized for them)."""
    eng = llm.engine
    longs = [eng.add_request(d, SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True))
             for d in decoders]
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in longs):
        eng.step()
    out = steps_of(llm, prompts, new_tokens, until=lambda seqs: all(s.is_finished for s in seqs))
    for s in longs:
        if not s.is_finished:
            eng.abort(s, "profile done")
    while eng.has_unfinished():
        eng.step()
    return out


def sync_sites(run) -> list[tuple[int, str]]:
    """Call ``run()`` (one profiled workload) with torch's sync debug mode on: (count, where) of every host
    synchronisation, by the innermost frames of this project that triggered it."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "oasiskv_runtime" in f.filename]
        where = " <- ".join(f"{f.filename.split('oasiskv_runtime/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        sites[where or f"{filename}:{lineno}"] += 1

    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return [(n, w) for w, n in sites.most_common()]


def ab_variants(ab: str) -> list[dict]:
    """``--ab``'s engine options per run: NAME (True, then False) or NAME=A,B,... (each value as the option's type,
    as ``--sweep`` reads it)."""
    if not ab:
        return [{}]
    name, sep, values = ab.partition("=")
    if not sep:
        return [{ab: True}, {ab: False}]
    return [{name: sweep_value(name, v)} for v in values.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--modes", default="dense,oasiskv")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--kv-gb", type=float, default=24.0)
    ap.add_argument("--host-gb", type=float, default=8.0)
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--sync-sites", action="store_true", help="also list where the steps synchronise with the host")
    ap.add_argument("--decode-rows", type=int, default=0,
                    help="requests already decoding when the prompts arrive (mixed steps, as end to end)")
    ap.add_argument("--decode-context", type=int, default=4096, help="prompt tokens of each decoding request")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (timings mean nothing)")
    ap.add_argument("--out", default="prefill-profile.txt")
    ap.add_argument("--ab", default="", help="an engine option (e.g. copy_engine_prefill): each mode runs with it "
                    "True, then False, in this process (an A/B measured side by side); NAME=A,B runs it at A, then B "
                    "(e.g. fill_window=32,0)")
    ap.add_argument("--no-profile", action="store_true", help="only the timed run (no torch.profiler run)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    mc, src, _ = model_config_for(args.model)
    weights = "random weights" if src.kind == "preset" else "its weights"
    report = [f"model {args.model} ({weights}), {args.requests} requests x {args.context} tokens, chunk "
              f"{args.chunk}, {args.decode_rows} requests of {args.decode_context} tokens decoding meanwhile, "
              f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}"]
    # Budgets that hold the whole workload: the decoders (with room for the steps they decode meanwhile) and the
    # prompts, in dense's device KV and in oasiskv's host pool alike; --kv-gb / --host-gb only raise them. Too
    # small a budget leaves the prompts waiting while the decoders decode on (the first mixed-step run on the
    # H200 hung so: 40 x 4K decoders took the 24 GiB default).
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    gb_per_token = 1.1 * mc.kv_bytes_per_token(getattr(torch, dtype).itemsize) / GiB  # with a 10% margin
    steps = args.requests * (args.context // args.chunk + 1) + args.new_tokens + 64
    need_gb = gb_per_token * (args.decode_rows * (args.decode_context + steps) + args.requests * args.context)
    working_sets_gb = gb_per_token * (args.decode_rows + args.requests) * (TOP_K + 2) * 16  # oasiskv: K + 2 blocks
    kv_gb, host_gb = max(args.kv_gb, need_gb, working_sets_gb), max(args.host_gb, need_gb)
    report[0] += f"; device KV {kv_gb:.1f} GiB, host pool {host_gb:.1f} GiB"
    print(report[0], flush=True)
    variants = ab_variants(args.ab)
    for mode, variant in ((m, v) for m in args.modes.split(",") for v in variants):
        llm = LLM(args.model, device=args.device, dtype=dtype, mode=mode, kv_cache_gb=kv_gb,
                  host_kv_bytes=int(host_gb * GiB), max_num_batched_tokens=args.chunk, top_k_blocks=TOP_K,
                  fetch_ratio=0.05, max_num_seqs=max(8, args.requests + args.decode_rows), **variant)
        label = mode + "".join(f" {k}={v}" for k, v in variant.items())
        vocab = llm.engine.model_config.vocab_size

        def prompts() -> list[list[int]]:
            return [torch.randint(10, vocab, (args.context - args.new_tokens,), generator=gen).tolist()
                    for _ in range(args.requests)]

        def run() -> list[tuple[str, float]]:
            if not args.decode_rows:
                return steps_of(llm, prompts(), args.new_tokens)
            decoders = [torch.randint(10, vocab, (args.decode_context,), generator=gen).tolist()
                        for _ in range(args.decode_rows)]
            return mixed_steps(llm, decoders, prompts(), args.new_tokens, steps)

        warm = run()  # Triton compilation, first captures
        timed = run()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                        if args.device == "cuda" else [])
        prof = None
        profiled = []
        if not args.no_profile:
            with torch.profiler.profile(activities=acts) as prof:
                profiled = run()
        first_line = len(report)
        pre = [ms for k, ms in timed if k == "prefill"]
        dec = [ms for k, ms in timed if k == "decode"]
        report.append(f"\n==== {label}: prefill steps {len(pre)} x {sum(pre) / max(1, len(pre)):.1f} ms "
                      f"({', '.join(f'{x:.0f}' for x in pre)}); decode steps {len(dec)} x "
                      f"{sum(dec) / max(1, len(dec)):.1f} ms; warm-up run {sum(ms for _, ms in warm):.0f} ms; "
                      f"profiled run {sum(ms for _, ms in profiled):.0f} ms (profiler overhead included)")
        if prof is not None:
            if args.device == "cuda":  # per stream and per kernel, as the steps ran
                report += trace_lines(prof, f"{label} profiled run", len(profiled), args.rows)
            ka = prof.key_averages()
            if args.device == "cuda":
                report.append(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
            report.append(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if args.sync_sites and args.device == "cuda":
            report.append("host synchronisations (count, innermost project frames):")
            report += [f"  {n:5d}  {w}" for n, w in sync_sites(run)]
        print("\n".join(report[first_line:]), flush=True)  # this run's lines
        with open(args.out, "w") as f:
            f.write("\n".join(report) + "\n")
        del llm, prof
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
