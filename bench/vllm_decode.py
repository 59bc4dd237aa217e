"""Plain vLLM against vLLM with the OasisKV plug-in on the same requests: decode step time and greedy-token agreement.

Each mode runs in its own process (one vLLM engine per process). The decode step is timed step by step: after a
short warm-up, the requests are added to the engine and it is stepped by hand (``LLMEngine.step``; our engine's
``step`` for the embedded modes); the steps in which every request decodes (all prefills done, none finished) are
the window: the median step there, the output tokens per request per step (above 1 when vLLM accepts a draft) and
their ratio, the time per output token (``decode_window``). Greedy tokens of each
mode are kept, and the report gives each plug-in mode's agreement with plain vLLM (positions equal, and the mean
length of the common prefix). Dummy weights at real shapes (RANDOM WEIGHTS: with near-uniform logits a bf16 rounding
flips a greedy token easily, and everything after it differs).

Modes: ``plain`` (vLLM without the plug-in; ``plain+ngram`` with speculative decoding of one token from the n-gram
drafts oasiskv runs with, ``engine_args(mode='dense', draft='ngram')``, to separate their cost from ours), the
plug-in's ``sparse-resident``, ``proxy-prefetch``, ``oasiskv``, and
our own engine's ``embedded-dense`` / ``embedded-oasiskv`` on the same prompts (its own random weights: its dense vs
oasiskv agreement is the within-engine bar for the plug-in's agreement with plain vLLM). A plug-in mode with
``+piecewise`` (``sparse-resident+piecewise``) runs with ``cuda_graphs='off'``: attention eager between vLLM's
piecewise graphs, beside the full-graph decode of ``cuda_graphs='auto'``; ``+full`` (``oasiskv+full``) with
``cuda_graphs='full'`` (the same as ``auto`` since the host-pool modes' full graphs became the default); ``+b2``
(``oasiskv+b2``) with issue #34's setting (:data:`ISSUE34_SETTING`: key codes, demand fetch).
``MODE@GiB`` (``plain@55``) gives a mode its own KV budget (``--capacity`` runs: plain vLLM's cache against the
plug-in's cache plus the working sets and summaries it allocates beside it, ``plugin_stats.oasiskv.device_bytes``;
the host pool holds ``--host-pool-gb`` worth of requests at once, the rest wait). ``--profile`` replaces the
timing by a profile of each mode at the first context (host syncs of our code, top CUDA / CPU ops).

    python bench/vllm_decode.py --model qwen3-8b --batch 16 --context 16384,32768 --out vllm-decode.json
    python bench/vllm_decode.py --modes sparse-resident,oasiskv --context 16384 --profile --out profile.json
    python bench/vllm_decode.py --model /path/to/hf_dir --modes plain,sparse-resident --device cpu --dtype float32 ...
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from oasiskv_runtime.vllm.models import vllm_model


def prompts_for(ctx: int, a: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The same seeded random prompts for every mode and engine (prompt + :func:`run_length` tokens = ``ctx``; in a
    ``--capacity`` run prompt + ``output_len``; the committed capacity run predates that: 15,198-token prompts)."""
    import torch

    g = torch.Generator().manual_seed(ctx)
    n = max(1, ctx - (a.output_len if getattr(a, "capacity", False) else run_length(a, ctx)))
    return [torch.randint(10, vocab - 10, (n,), generator=g).tolist() for _ in range(a.batch)]


def decode_window(rows: list[tuple[float, list[int], list[int]]], n: int) -> dict:
    """Summary of a stepped run: ``rows`` = per engine step (seconds since the previous step returned, output tokens
    per request before it, after it); ``n`` = each request's output length.

    The decode window is the steps that start with every request holding at least one output token (every prefill
    done) and none finished: the whole batch decodes in them. ``decode_step_ms`` is their median duration;
    ``tokens_per_step`` the output tokens per request per window step (above 1 when drafts are accepted);
    ``ms_per_token`` = step / tokens per step, the time per output token of a request. ``prefill_s``: from the
    start until every request has its first token."""
    t, prefill_s, window = 0.0, None, []
    for dt, before, after in rows:
        t += dt
        if prefill_s is None and min(after) >= 1:
            prefill_s = t
        if min(before) >= 1 and max(before) < n:
            window.append((dt, sum(a - b for a, b in zip(after, before))))
    out = {"prefill_s": prefill_s, "total_s": t, "steps": len(rows), "decode_steps": len(window)}
    if window:
        times = [dt for dt, _ in window]
        step = statistics.median(times)
        per_req = sum(k for _, k in window) / (len(window) * len(rows[0][1]))
        out.update(decode_step_ms=step * 1e3, decode_step_ms_mean=statistics.fmean(times) * 1e3,
                   tokens_per_step=per_req, ms_per_token=step * 1e3 / per_req if per_req else None)
    return out


def capacity_summary(rows: list[tuple[float, list[int], list[int]]], n: int) -> dict:
    """Summary of a capacity run (``--capacity``: every request submitted at once, more than the KV budget may hold
    whole): output tokens per second over the run, the most requests decoding in one step (a request decodes from
    its first output token to its last), the median step at that batch and its cost per request, mean TTFT / TPOT."""
    t, first, last, decoding, at = 0.0, {}, {}, [], []
    for dt, before, after in rows:
        t += dt
        k = sum(1 for b in before if 1 <= b < n)
        decoding.append(k)
        at.append((k, dt))
        for i, (b, a_) in enumerate(zip(before, after)):
            if b == 0 and a_ >= 1:
                first[i] = t
            if a_ >= n and b < n:
                last[i] = t
    total = sum(rows[-1][2]) if rows else 0
    most = max(decoding, default=0)
    steps_at_most = [dt for k, dt in at if k == most and most]
    ttft = [first[i] for i in first]
    tpot = [(last[i] - first[i]) / max(1, n - 1) for i in last if i in first]
    out = {"total_s": t, "steps": len(rows), "output_tokens": total, "output_tok_per_s": total / t if t else None,
           "max_decoding": most, "mean_decoding": statistics.fmean(decoding) if decoding else 0.0,
           "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
           "mean_tpot_ms": statistics.fmean(tpot) * 1e3 if tpot else None}
    if steps_at_most:
        step = statistics.median(steps_at_most)
        out.update(step_ms_at_max=step * 1e3, per_request_step_ms=step * 1e3 / most)
    return out


def stepped(step, lengths, done) -> list[tuple[float, list[int], list[int]]]:
    """Drive an engine step by step: ``step()`` runs one, ``lengths()`` gives each request's output tokens so far,
    ``done()`` says every request finished. Returns :func:`decode_window`'s rows."""
    rows = []
    before, prev = lengths(), time.perf_counter()
    while not done():
        step()
        now = time.perf_counter()
        after = lengths()
        rows.append((now - prev, before, after))
        before, prev = after, now
    return rows


def run_length(a: argparse.Namespace, ctx: int) -> int:
    """Output tokens each request is asked for: ``output_len`` decode steps of the whole batch, plus what the first
    requests decode while the last ones still prefill (chunked prefill: ``batch * ctx / batched_tokens`` steps, two
    tokens a step with accepted drafts). Without the margin, at 32K x 16 the first requests finish before the last
    one's first token, and no step has the whole batch decoding."""
    return a.output_len + 2 * -(-a.batch * ctx // a.batched_tokens) + 2


def timed_points(a: argparse.Namespace, vocab: int, warm, run) -> list[dict]:
    """Per context: a short warm-up (``warm(prompts, n)``: compiles kernels at small shapes), then one stepped run
    (``run(prompts, n) -> (rows, tokens, extra fields)``) of :func:`run_length` tokens, its decode window timed step
    by step."""
    points = []
    for ctx in a.context:
        warm(prompts_for(max(64, min(ctx, 2048) // 2), a, vocab), 8)  # other prompts: no prefix-cache hit
        n = a.output_len if a.capacity else run_length(a, ctx)
        rows, tokens, extra = run(prompts_for(ctx, a, vocab), n)
        summary = capacity_summary(rows, n) if a.capacity else decode_window(rows, n)
        points.append({"context": ctx, "batch": a.batch, "output_tokens": n, **summary, **extra, "tokens": tokens})
        print(json.dumps({k: v for k, v in points[-1].items() if k != "tokens"}), flush=True)
    return points


def embedded_mode(a: argparse.Namespace) -> dict:
    """Our own engine (``embedded-dense`` / ``embedded-oasiskv``) on the same prompts: its dense vs oasiskv token
    agreement is the bar the plug-in's agreement with plain vLLM is held to (its random weights are not vLLM's dummy
    weights, so only agreements WITHIN one engine compare)."""
    from oasiskv_runtime.llm import LLM
    from oasiskv_runtime.sampling_params import SamplingParams

    mode = a.mode.split("-", 1)[1]
    extra = {} if mode == "dense" else {"top_k_blocks": a.top_k}
    t0 = time.perf_counter()
    llm = LLM(model=a.preset, device=a.device, dtype=a.dtype, mode=mode, max_num_seqs=a.batch,
              kv_cache_gb=a.kv_gb, **extra)
    out = {"mode": a.mode, "engine_start_s": time.perf_counter() - t0}
    vocab = json.load(open(Path(a.model_dir) / "config.json"))["vocab_size"]

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run(prompts, n):
        seqs = [llm.engine.add_request(p, params(n), request_id=f"t{i}") for i, p in enumerate(prompts)]
        rows = stepped(llm.engine.step, lambda: [len(s.output_token_ids) for s in seqs],
                       lambda: not llm.engine.has_unfinished())
        return rows, [list(s.output_token_ids) for s in seqs], {}

    out["points"] = timed_points(a, vocab, lambda p, n: llm.generate(p, params(n)), run)
    return out


def profile_mode(llm, a: argparse.Namespace, vocab: int, prompts: list[list[int]]) -> dict:
    """In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): where a decode step's time goes. One generate under
    ``torch.cuda.set_sync_debug_mode('warn')`` (every host sync with the frames of ours that caused it), then one
    under torch.profiler (top ops by self CUDA and self CPU time, counts of synchronising CUDA calls)."""
    import vllm

    params = lambda n: vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    llm.generate(prompts, params(a.profile_tokens), use_tqdm=False)  # warm
    from profile_prefill import sync_sites  # bench/ is this script's directory

    syncs = {where: n for n, where in sync_sites(lambda: llm.generate(prompts, params(a.profile_tokens),
                                                                       use_tqdm=False))}
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    llm.generate(prompts, params(1), use_tqdm=False)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params(a.profile_tokens), use_tqdm=False)
    tn = time.perf_counter() - t
    ev = prof.key_averages()
    fmt = lambda e, attr: {"name": e.key[:90], "calls": e.count, "self_ms": round(getattr(e, attr) / 1e3, 3)}  # noqa
    cuda_attr = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    by_cuda = sorted(ev, key=lambda e: -getattr(e, cuda_attr))[:30]
    by_cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:30]
    sync_calls = {e.key: e.count for e in ev if any(s in e.key for s in ("Synchronize", "cudaMemcpy ", "cudaMemcpy\0"))
                  or e.key in ("cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")}
    return {"context": a.context[0], "tokens": a.profile_tokens,
            "step_ms_profiled": (tn - t1) * 1e3 / max(1, a.profile_tokens - 1),
            "host_syncs_one_generate": dict(sorted(syncs.items(), key=lambda kv: -kv[1])),
            "top_self_cuda": [fmt(e, cuda_attr) for e in by_cuda], "top_self_cpu": [fmt(e, "self_cpu_time_total")
                                                                                    for e in by_cpu],
            "sync_calls": sync_calls}


ISSUE34_SETTING = dict(selection_score="max_logit_b2", attended_share=0.25, fill_window=32, early_fetch_ratio=1.0,
                      demand_fetch=True, demand_fetch_cap=2)
"""``+b2``: the setting that meets issue #34's accuracy bars on SmolLM2 (docs/accuracy.md): 2-bit key codes, the
step's own top-K misses fetched before it attends (2 a head), attended share, fill window, early cap."""


def one_mode(a: argparse.Namespace) -> dict:
    """Run in the child: one engine, every context length (a warm-up and one stepped run per context)."""
    if a.mode.startswith("embedded-"):
        return embedded_mode(a)
    import vllm

    from oasiskv_runtime.vllm import acceptance, engine_args, spec_decode_counts

    mode, _, variant = a.mode.partition("+")
    graphs = {"": "auto", "piecewise": "off", "full": "full", "b2": "auto"}
    platform = "cuda" if a.device == "cuda" else "cpu"
    if mode == "plain":  # plain vLLM; plain+ngram: with the n-gram speculative decoding (one token) oasiskv runs
        if variant not in ("", "ngram"):
            raise ValueError(f"plain vLLM's variant {variant!r}: +ngram (oasiskv's n-gram drafts) or none")
        extra = engine_args(mode="dense", draft="ngram", platform=platform) if variant else {}
    elif variant not in graphs:
        raise ValueError(f"mode variant {variant!r}: +piecewise (cuda_graphs='off'), +full (cuda_graphs='full') or "
                         f"+b2 (issue #34's setting)")
    else:
        setting = {**(ISSUE34_SETTING if variant == "b2" else {}), **a.plugin_set}
        extra = engine_args(mode=mode, top_k_blocks=a.top_k, draft=a.draft, platform=platform,
                            cuda_graphs=graphs[variant], host_pool_gb=a.host_pool_gb, **setting)
    max_len = max(a.context) + 16
    t0 = time.perf_counter()
    kwargs = dict(model=a.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=a.dtype, seed=0,
                  max_model_len=max_len, max_num_seqs=a.batch, kv_cache_memory_bytes=int(a.kv_gb * (1 << 30)),
                  max_num_batched_tokens=a.batched_tokens, **extra)
    if a.capacity:
        kwargs["disable_log_stats"] = False  # the preemption counter
    llm = vllm.LLM(**kwargs)
    out = {"mode": a.mode, "engine_start_s": time.perf_counter() - t0, "points": []}
    vocab = json.load(open(Path(a.model_dir) / "config.json"))["vocab_size"]
    if a.profile:
        out["profile"] = profile_mode(llm, a, vocab, [{"prompt_token_ids": p}
                                                      for p in prompts_for(a.context[0], a, vocab)])
        return out
    drafting = "speculative_config" in extra
    before = spec_decode_counts(llm) if drafting else None

    def params(n):
        return vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    timers = a.host_timers and mode != "plain"  # the timed runs' host time per phase, without compilation

    def warm(prompts, n):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params(n), use_tqdm=False)
        if timers:
            from oasiskv_runtime.vllm.backend import reset_host_timers

            llm.apply_model(reset_host_timers)

    runs = itertools.count()

    def run(prompts, n):
        eng, tag = llm.llm_engine, next(runs)
        index: dict[str, int] = {}
        for i, p in enumerate(prompts):
            rid = f"r{tag}-{i}"
            internal = eng.add_request(rid, {"prompt_token_ids": p}, params(n))
            index[rid] = index[internal] = i  # outputs may carry either id
        tokens: list[list[int]] = [[] for _ in prompts]
        left = set(range(len(prompts)))

        def step():
            for o in eng.step():
                i = index[o.request_id]
                tokens[i] = list(o.outputs[0].token_ids)
                if o.finished:
                    left.discard(i)

        rows = stepped(step, lambda: [len(t) for t in tokens], lambda: not left)
        extra = {}
        if timers:  # reset after the warm-up
            from oasiskv_runtime.vllm.backend import collect_stats

            extra["host_ms"] = llm.apply_model(collect_stats)[0].get("host_ms")
        return rows, tokens, extra

    preempted = _preemptions(llm)
    out["points"] = timed_points(a, vocab, warm, run)
    after = _preemptions(llm)
    out["preemptions"] = None if after is None or preempted is None else after - preempted
    if before is not None:
        out["acceptance"] = acceptance(before, spec_decode_counts(llm))
    if mode != "plain":  # the plug-in's own counters (traffic, fills, rows served sparse), summed over layers
        try:
            from oasiskv_runtime.vllm.backend import collect_stats

            out["plugin_stats"] = json.loads(json.dumps(llm.apply_model(collect_stats)[0], default=str))
        except Exception as e:  # noqa: BLE001 - a report without them is still a report
            out["plugin_stats"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _preemptions(llm) -> int | None:
    """vLLM's preemption counter (None when its stats are off)."""
    try:
        return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    except Exception:  # noqa: BLE001 - stats disabled
        return None


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
    ap.add_argument("--draft", default="auto", help="engine_args' draft for the plug-in modes (auto: ngram for "
                    "oasiskv, none otherwise)")
    ap.add_argument("--profile", action="store_true", help="instead of timing: per mode, one in-process engine, "
                    "host syncs and a torch.profiler summary of a generate at the first context")
    ap.add_argument("--profile-tokens", type=int, default=16)
    ap.add_argument("--capacity", action="store_true", help="instead of the decode window: --batch requests of "
                    "--output-len tokens submitted at once in a KV budget (--kv-gb) that may not hold them all; "
                    "output throughput, the most requests decoding at once, TTFT / TPOT, preemptions")
    ap.add_argument("--host-timers", action="store_true", help="the plug-in accounts its host time per phase "
                    "(OASISKV_HOST_TIMERS=1; plugin_stats.host_ms; a few microseconds per layer)")
    ap.add_argument("--host-pool-gb", default="auto", type=lambda v: v if v == "auto" else float(v),
                    help="engine_args' host_pool_gb for the host-pool modes (auto: 80%% of available host memory)")
    ap.add_argument("--plugin-set", type=json.loads, default={},
                    help="JSON object of engine_args options for every plug-in mode, after +b2's setting (e.g. "
                         "'{\"demand_fetch\": true, \"demand_fetch_cap\": 2}')")
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
    results = {"model": a.model, "random_weights": True, "batch": a.batch, "kv_gb": a.kv_gb, "capacity": a.capacity,
               "top_k_blocks": a.top_k, "output_len": a.output_len, "plugin_set": a.plugin_set, "modes": {}}
    for mode in a.modes.split(","):
        name, _, kv = mode.partition("@")  # plain@55: this mode's own KV budget (GiB)
        child = dict(mode=name, model_dir=mdir, batch=a.batch, context=[int(x) for x in a.context.split(",")],
                     output_len=a.output_len, top_k=a.top_k, kv_gb=float(kv) if kv else a.kv_gb,
                     batched_tokens=a.batched_tokens,
                     device=a.device, dtype=a.dtype, draft=a.draft, profile=a.profile,
                     profile_tokens=a.profile_tokens, preset=a.model, host_timers=a.host_timers,
                     capacity=a.capacity, host_pool_gb=a.host_pool_gb, plugin_set=a.plugin_set)
        try:
            env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model sends a function
            if a.host_timers:
                env["OASISKV_HOST_TIMERS"] = "1"
            if a.profile:  # the engine core in this process: the profiler and the sync check see its steps
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            p = subprocess.run([sys.executable, __file__, "--one", json.dumps(child)], capture_output=True, text=True,
                               timeout=a.timeout, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            results["modes"][mode] = (json.loads(lines[-1][7:]) if lines else
                                      {"error": f"exit {p.returncode}: {p.stderr[-3000:]}"})
        except subprocess.TimeoutExpired as e:
            results["modes"][mode] = {"error": f"timed out after {a.timeout:.0f} s: {str(e.stderr)[-2000:]}"}
        print(mode, json.dumps({k: v for k, v in results["modes"][mode].items() if k != "points"})[:3000], flush=True)
        Path(a.out).write_text(json.dumps(results, indent=1))
    plain = next((m for m in results["modes"] if m.partition("@")[0] == "plain"), "plain")
    anchors = {"": results["modes"].get(plain, {}), "embedded-": results["modes"].get("embedded-dense", {})}
    for mode, r in results["modes"].items():
        if mode in (plain, "embedded-dense"):
            continue
        anchor = anchors["embedded-" if mode.startswith("embedded-") else ""]
        for i, pt in enumerate(r.get("points", [])):
            ref = anchor.get("points", [])[i] if i < len(anchor.get("points", [])) else None
            if ref is not None:
                pt["agreement_with_dense"] = agreement(ref["tokens"], pt["tokens"])
                for key, name in (("decode_step_ms", "step_vs_dense"), ("ms_per_token", "token_ms_vs_dense"),
                                  ("output_tok_per_s", "throughput_vs_dense"),
                                  ("per_request_step_ms", "per_request_step_vs_dense")):
                    if pt.get(key) and ref.get(key):
                        pt[name] = pt[key] / ref[key]
            summary = {k: v for k, v in pt.items() if k != "tokens"}
            print(mode, json.dumps(summary), flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
