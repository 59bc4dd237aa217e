"""Decode step time at real shapes (random weights), every mode in ONE process on one copy of the weights.

Requests are placed directly in the decode phase (no prefill): their KV state is synthesized. Device KV
and the host pool hold zeros, the key summaries random values, so predictions move from step to step:
with random weights attention is near uniform and selections drift far more than with a trained model, a
worst case for transfer traffic. Host block tables are aliased into one pinned pool (the machine has
128 GiB of RAM; B=128 x 32K tokens of Qwen3-8B KV would need 576 GiB): the copies are real (random
4 KiB (block, head) slices over PCIe), only their contents are shared.

    python bench/bench_decode.py --model qwen3-8b --batch 16,64,128 --context 16384,32768 --out decode.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
from dataclasses import replace

import torch

from oasiskv_runtime.config import EngineConfig
from oasisbench.runners.step_trace import trace_lines
from oasiskv_runtime.engine.kv_cache_manager import RequestBlocks, cdiv
from oasiskv_runtime.engine.llm_engine import LLMEngine
from oasiskv_runtime.engine.sequence import Sequence, SequenceStatus
from oasiskv_runtime.sampling_params import SamplingParams

GiB = 1 << 30
MODES = ["dense", "sparse-resident", "fetch-on-demand", "oasiskv", "oasiskv-no-transfer"]


def build(model: str, mode: str, preloaded, args) -> LLMEngine:
    base, _, extra = mode.partition("+")
    if extra not in ("", "attended", "b2"):
        raise SystemExit(f"mode {mode!r}: the suffixes are +attended and +b2 (selection_score=max_logit_b2: the 2-bit "
                         f"key codes kept on the device)")
    real_mode = "oasiskv" if base == "oasiskv-no-transfer" else base
    cfg = EngineConfig.from_overrides(model, device="cuda", dtype="bfloat16", mode=real_mode,
                                      kv_cache_gb=args.kv_gb, host_kv_bytes=int(args.host_gb * GiB),
                                      top_k_blocks=args.top_k, fetch_ratio=args.fetch_ratio,
                                      max_num_seqs=max(args.batch_list), draft="ngram",
                                      attended_blocks=args.attended_blocks if extra == "attended" else 0,
                                      selection_score="max_logit_b2" if extra == "b2" else "quest",
                                      disable_transfers=base == "oasiskv-no-transfer")
    return LLMEngine(cfg, preloaded=preloaded)


def place_requests(eng: LLMEngine, batch: int, ctx: int, gen: torch.Generator) -> list[Sequence]:
    """Put ``batch`` requests of ``ctx`` tokens straight into decode; raises MemoryError when they do not fit."""
    kv, bs, mode = eng.kv, eng.config.cache.block_size, eng.config.mode
    be = eng.backend
    seqs = []
    nb = cdiv(ctx + 64, bs)
    for i in range(batch):
        prompt = torch.randint(10, eng.model_config.vocab_size, (ctx - 1,), generator=gen).tolist()
        seq = Sequence(prompt, SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True))
        seq.output_token_ids = [int(torch.randint(10, min(1000, eng.model_config.vocab_size), (1,), generator=gen))]
        seq.num_computed_tokens = ctx - 1
        seq.status = SequenceStatus.RUNNING
        rb = RequestBlocks()
        need_dev = (be.head_map.k_slots + 1 if mode.uses_host_pool else nb) + (cdiv(nb, bs) if mode.is_sparse else 0)
        need_dev += kv.code_blocks_for(nb)
        if need_dev > kv.device_pool.num_free:
            raise MemoryError(f"{batch} x {ctx} tokens do not fit the device KV budget in mode {mode.value}")
        if mode.uses_host_pool:
            rb.ws_blocks = kv.device_pool.allocate(be.head_map.k_slots + 1)
            start = int(torch.randint(0, max(1, kv.host_pool.num_blocks - nb), (1,), generator=gen))
            rb.host_blocks = [(start + j) % kv.host_pool.num_blocks for j in range(nb)]  # aliased
        else:
            rb.device_blocks = kv.device_pool.allocate(nb)
        if mode.is_sparse:
            rb.summary_blocks = kv.device_pool.allocate(cdiv(nb, bs))
            kv._take_code_blocks(rb, kv.code_blocks_for(nb))  # +b2: random codes (below), scored every step
        kv.requests[seq.seq_id] = rb
        eng.scheduler.running.append(seq)
        seqs.append(seq)
        if mode.is_sparse:
            row = be.head_map.row(seq.seq_id)
            be.head_map.ready.add(seq.seq_id)
            if mode.uses_host_pool:
                full = (ctx - 1) // bs
                for layer in range(eng.model_config.num_layers):
                    perm = torch.randperm(full, generator=gen)[: be.head_map.k_slots]
                    be.head_map.slot_map[row, layer, :, : perm.numel()] = perm.to(be.head_map.slot_map.device)
    if mode.is_sparse:  # random summaries: predictions change from step to step
        held = [kv.requests[s.seq_id] for s in seqs]
        ids = torch.tensor(sorted({b for r in held for b in r.summary_blocks + r.code_blocks}), device="cuda")
        for layer in range(eng.model_config.num_layers):
            for t in (eng.backend.dev_cache.k[layer], eng.backend.dev_cache.v[layer]):
                t[ids] = torch.randn_like(t[ids])
    return seqs


def time_steps(eng: LLMEngine, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def profile_steps(eng: LLMEngine, title: str, path: str, steps: int = 3) -> None:
    """Where a step's host time goes (the engine is eager: Python and launch overhead show up here)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    with open(path, "a") as f:
        f.write(f"==== {title}, {steps} steps\n{out.getvalue()}\n")


def _torch_profile(eng: LLMEngine, steps: int):
    """torch.profiler (CPU and CUDA) over ``steps`` steps, after one step outside it (a path may be cold)."""
    eng.step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    return prof


def kernel_profile(eng: LLMEngine, title: str, path: str, steps: int = 3, rows: int = 25) -> None:
    """Where a step's GPU time goes, by op: ``steps`` steps under torch.profiler with graphs off (a replay's
    kernels carry no op to attribute them to), the top ``rows`` ops by self CUDA time, appended to ``path``."""
    graphs, eng.runner.graphs = eng.runner.graphs, None
    try:
        prof = _torch_profile(eng, steps)
    finally:
        eng.runner.graphs = graphs
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)
    with open(path, "a") as f:
        f.write(f"==== {title}, {steps} eager steps\n{table}\n")


def replay_trace(eng: LLMEngine, title: str, path: str, steps: int = 2, rows: int = 12) -> None:
    """:func:`trace_lines` of ``steps`` engine steps as they run, appended to ``path`` as text; the raw trace of
    the first point goes beside it (.json.gz)."""
    import os

    prof = _torch_profile(eng, steps)
    lines = trace_lines(prof, title, steps, rows, raw_copy=os.path.splitext(path)[0] + "-first.json.gz")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n\n")


def reset(eng: LLMEngine) -> None:
    for seq in list(eng.scheduler.running):
        if hasattr(eng.backend, "free_request"):
            eng.backend.free_request(seq.seq_id)
        eng.runner.forget(seq.seq_id)
        rb = eng.kv.requests.pop(seq.seq_id)
        eng.kv.device_pool.free(rb.held_device_blocks)  # host blocks are aliased here: not kv.free
    eng.scheduler.running.clear()


def _values(text: str, cast) -> list:
    """A list option ("32,16", "0,30", a switch "1,0") as its values by ``cast``; "" -> [None] (the engine's
    default)."""
    return [cast(x) for x in text.split(",")] if text else [None]


def _switch(x: str) -> bool:
    return bool(int(x))


def _demand(x: str) -> dict:
    """``off`` -> no demand fetch; N -> demand_fetch with demand_fetch_cap N (0: every miss of the step's top-K)."""
    x = x.strip()
    return {"demand_fetch": False, "demand_fetch_cap": 0} if x == "off" else {"demand_fetch": True,
                                                                              "demand_fetch_cap": int(x)}


#: A/B engine settings of the gathering modes: (option, engine option, type of its values, help).
VARIANT_OPTIONS = (
    ("--gather-ctas", "gather_ctas", int, "UVA gather grids (0: one CTA per copy), e.g. 32,16"),
    ("--gather-copies", "gather_copies", int, "copies in flight per CTA of the UVA gather, e.g. 1,4"),
    ("--select-kernel", "select_kernel", _switch,
     "the fused selection + plan kernel (1) against its PyTorch composition (0), e.g. 1,0"),
    ("--gather-hint", "gather_hint", str, "cache hints of the UVA gather (see KernelConfig.gather_hint), e.g. "
     "',stream,cv' (an empty item: none)"),
    ("--pipeline-priority", "pipeline_priority", int,
     "CUDA priorities of the prefetch pipeline's streams (lower is higher), e.g. 0,-1"),
    ("--link-gbps", "link_gbps", float, "per-step fetch caps from the link's budget in GB/s (0: the fixed cap), "
     "e.g. 0,30"),
    ("--early-fetch-ratio", "early_fetch_ratio", float, "a larger cap for each request's first early_steps decode "
     "steps (0: off); requests placed here never had a prefill, so this times the wider copy plan alone, e.g. 0,0.25"),
    ("--demand-fetch", "demand_fetch", _demand, "oasiskv's copies of the step's own top-K misses on the critical path "
     "(off, or demand_fetch_cap N: at most N blocks per request, layer and KV head; 0: every miss), e.g. off,1,2,0"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batch", default="16,64,128")
    ap.add_argument("--context", default="16384,32768")
    ap.add_argument("--top-k", type=int, default=128)
    ap.add_argument("--fetch-ratio", type=float, default=0.05)
    ap.add_argument("--sweep", default="0.01,0.05,0.1,0.25,1.0", help="fetch ratios at --sweep-shape")
    ap.add_argument("--sweep-shape", default="64,16384")
    ap.add_argument("--attended-blocks", type=int, default=0,
                    help="attended_blocks of the modes named with +attended, e.g. --modes oasiskv,oasiskv+attended "
                         "(0: top_k // 4); fixed when an engine starts, so a mode of its own, not an A/B variant")
    ap.add_argument("--kv-gb", type=float, default=100.0)
    ap.add_argument("--host-gb", type=float, default=40.0)
    ap.add_argument("--warmup", type=int, default=3, help=">= 2 with graphs: a key is captured on its second step")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="decode.json")
    ap.add_argument("--profile", default="", help="write a cProfile summary of a few steps per point here")
    ap.add_argument("--kernel-profile", default="",
                    help="append a torch.profiler table (top ops by GPU time, eager steps) per point to this file")
    for flag, _key, _parse, text in VARIANT_OPTIONS:
        ap.add_argument(flag, default="", help=f"{text}; compared per point in oasiskv / fetch-on-demand; "
                                               "default: the engine's")
    ap.add_argument("--fused-norm-rope", default="",
                    help="compare RMSNorm and q/k norm + rotary as one kernel each (1) with their PyTorch composition "
                         "(0) per point, in every mode, e.g. 1,0; default: the engine's")
    ap.add_argument("--trace", default="",
                    help="append, per point run with graphs, a summary of a torch.profiler trace of steps as they "
                         "run (graph replays included: busy vs idle GPU time, kernels per stream) to this file")
    ap.add_argument("--graphs", default="off,auto",
                    help="decode-step execution per point, side by side on one engine: off (eager), auto (CUDA graphs)")
    args = ap.parse_args()
    args.attended_blocks = args.attended_blocks or args.top_k // 4  # what +attended modes run with
    args.batch_list = [int(x) for x in args.batch.split(",")]
    # Every combination of the A/B options given (an option left out is the engine's default, not a key here).
    choices = [[(key, v) for v in _values(getattr(args, key), cast)] for _flag, key, cast, _text in VARIANT_OPTIONS]
    # A value that is a dict sets several engine options at once (--demand-fetch: demand_fetch and its cap).
    variants = [{kk: vv for k, v in combo if v is not None for kk, vv in (v.items() if isinstance(v, dict)
                                                                       else [(k, v)])}
                for combo in itertools.product(*choices)]
    fused_list = _values(args.fused_norm_rope, _switch)
    gen = torch.Generator().manual_seed(0)
    results = {"model": args.model, "random_weights": True, "device": torch.cuda.get_device_name(),
               "top_k_blocks": args.top_k, "fetch_ratio": args.fetch_ratio, "attended_blocks": args.attended_blocks,
               "points": [], "sweep": []}
    preloaded = None

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    graph_settings = args.graphs.split(",")
    for mode in args.modes.split(","):
        eng = build(args.model, mode, preloaded, args)
        preloaded = preloaded or (eng.model, eng.tokenizer, eng.model_config)
        kv_bytes_per_token = eng.model_config.kv_bytes_per_token(2)
        graphs = eng.runner.graphs
        base = mode.partition("+")[0]
        gathering = base in ("oasiskv", "fetch-on-demand")  # the modes whose steps run the UVA gather
        mode_variants = variants if base == "oasiskv" else list({json.dumps(v, sort_keys=True): v for v in (
            {k: x for k, x in v.items() if not k.startswith("demand_fetch")} for v in variants)}.values())
        for ctx in [int(x) for x in args.context.split(",")]:
            for batch in args.batch_list:
                for setting, variant, fused in ((s_, v_, f_) for s_ in graph_settings
                                                for v_ in (mode_variants if gathering else [{}]) for f_ in fused_list):
                    eng.runner.graphs = graphs if setting == "auto" else None
                    point = {"mode": mode, "batch": batch, "context": ctx, "cuda_graphs": setting, **variant}
                    if variant:
                        eng.backend.configure(**variant)
                    if fused is not None:  # a graph key includes it: each setting is captured on its own
                        kernels = replace(eng.runner.config.kernels, fused_norm_rope=fused)
                        eng.runner.config = replace(eng.runner.config, kernels=kernels)
                        point["fused_norm_rope"] = fused
                    try:
                        place_requests(eng, batch, ctx, gen)
                        if hasattr(eng.backend, "reset_counters"):
                            eng.backend.reset_counters()
                        replays0 = graphs.num_replays if graphs is not None else 0
                        ms = time_steps(eng, args.warmup, args.steps)
                        if args.profile:
                            profile_steps(eng, f"{mode} B={batch} ctx={ctx} graphs={setting} ({ms:.1f} ms/step)",
                                          args.profile)
                        st = eng.run_stats()  # before the profiled steps: the counters cover the timed ones
                        if args.kernel_profile and setting == graph_settings[-1]:
                            kernel_profile(eng, f"{mode} B={batch} ctx={ctx} ({ms:.1f} ms/step with graphs="
                                           f"{setting})", args.kernel_profile)
                        if args.trace and setting == "auto":
                            replay_trace(eng, f"{mode} B={batch} ctx={ctx} {variant}"
                                         f"{'' if fused is None else f' fused_norm_rope={int(fused)}'} ({ms:.1f} ms/step)",
                                         args.trace)
                        steps = args.warmup + args.steps
                        point.update(step_ms=ms, tokens_per_s=batch * 1e3 / ms,
                                     fetched_bytes_per_step=st["fetched_bytes_per_step"],
                                     deferred_blocks_per_step=st["deferred_blocks_per_step"],
                                     demand_fetched_blocks_per_step=st.get("demand_fetched_blocks_per_step"),
                                     mean_fetch_cap=st.get("mean_fetch_cap"),
                                     pcie_budget_bytes_per_step=50e9 * ms / 1e3,
                                     dense_kv_bytes=batch * ctx * kv_bytes_per_token, steps=steps)
                        if setting == "auto":
                            point.update(graph_replays=(graphs.num_replays - replays0) if graphs else 0,
                                         graphs_disabled=graphs.disabled_reason if graphs else "no graphs")
                    except (MemoryError, torch.OutOfMemoryError) as e:
                        point.update(error=str(e).splitlines()[0][:200])
                    reset(eng)
                    torch.cuda.empty_cache()
                    results["points"].append(point)
                    print(json.dumps(point), flush=True)
                    save()
        eng.runner.graphs = graphs
        if gathering and mode_variants[0]:
            eng.backend.configure(**mode_variants[0])  # the fetch-ratio sweep's settings
        if mode == "oasiskv" and args.sweep:
            batch, ctx = (int(x) for x in args.sweep_shape.split(","))
            for ratio in [float(x) for x in args.sweep.split(",")]:
                eng.backend.configure(fetch_ratio=ratio)
                place_requests(eng, batch, ctx, gen)
                eng.backend.reset_counters()
                ms = time_steps(eng, args.warmup, args.steps)
                st = eng.run_stats()
                point = {"fetch_ratio": ratio, "cap": eng.backend.sparse.fetch_cap, "batch": batch, "context": ctx,
                         "step_ms": ms, "tokens_per_s": batch * 1e3 / ms,
                         "fetched_bytes_per_step": st["fetched_bytes_per_step"],
                         "fetch_gb_per_s": st["fetched_bytes_per_step"] / (ms / 1e3) / 1e9}
                reset(eng)
                results["sweep"].append(point)
                print(json.dumps(point), flush=True)
                save()
            eng.backend.configure(fetch_ratio=args.fetch_ratio)
        del eng, graphs  # the runner and its graphs refer to each other: collect the cycle before the next mode
        gc.collect()
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
