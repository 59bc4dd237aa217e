"""OasisKV inside vLLM (front end 2): an attention backend registered through vLLM's plug-in entry point.

Turn it on from Python::

    import vllm
    from oasiskv_runtime.vllm import engine_args
    llm = vllm.LLM(model=..., **engine_args(mode="sparse-resident", top_k_blocks=128, draft="ngram"))

or for ``vllm serve`` with the flags of :func:`serve_flags` (docs/vllm.md). Importing this package imports no vLLM;
the backend modules (``backend``, ``plugin``) are loaded by vLLM itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from oasiskv_runtime.config import Mode
from oasiskv_runtime.vllm.options import CONFIG_KEY, VllmOptions
from oasiskv_runtime.vllm.version import UnsupportedVllmVersion, check_vllm_version

logger = logging.getLogger(__name__)

__all__ = ["engine_args", "serve_flags", "speculative_config", "VllmOptions", "UnsupportedVllmVersion",
           "spec_decode_counts", "acceptance"]


def speculative_config(draft: str | None) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for a draft spec, always ONE speculative token (the look-ahead row).

    ``ngram[:N]``: the embedded engine's n-gram draft (the most recent earlier occurrence of the longest suffix of
    1..N tokens, default 3) as vLLM's ``custom_class`` proposer (``vllm/ngram.py``: the same look-ahead tokens, so
    the same prefetch, on both front ends); ``vllm-ngram[:N]``: vLLM's own n-gram proposer (its earliest
    occurrence); ``eagle3:<dir>``: an EAGLE-3 head in ``<dir>``; ``none`` / None: no speculation.
    """
    if draft is None or draft == "none":
        return None
    kind, _, arg = draft.partition(":")
    if kind in ("ngram", "vllm-ngram"):
        if ":" in arg:
            raise ValueError(f"draft {draft!r}: the n-gram draft's minimum match (ngram:N:M) is an embedded-engine "
                             "study setting with no vLLM proposer yet; use ngram[:N]")
        max_n = int(arg) if arg else 3
        if max_n < 1:
            raise ValueError(f"draft {draft!r}: N must be >= 1")
        if kind == "vllm-ngram":
            return {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
                    "prompt_lookup_max": max_n}
        from oasiskv_runtime.vllm.ngram import proposer_path

        return {"method": "custom_class", "model": proposer_path(max_n), "num_speculative_tokens": 1}
    if kind == "eagle3":
        if not arg:
            raise ValueError("draft 'eagle3:<dir>' needs the head's directory")
        return {"method": "eagle3", "model": arg, "num_speculative_tokens": 1}
    raise ValueError(f"draft {draft!r} has no vLLM counterpart; choose ngram[:N], vllm-ngram[:N], eagle3:<dir> or "
                     f"none")


def _on_cuda(platform: str | None) -> bool:
    if platform is not None:
        if platform not in ("cpu", "cuda"):
            raise ValueError(f"platform must be 'cpu' or 'cuda', got {platform!r}")
        return platform == "cuda"
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


HOST_POOL_FRACTION = 0.8
"""Share of the host's available memory ``engine_args(host_pool_gb='auto')`` gives the host pool (the rest: vLLM's
processes, the tokenizer, the OS)."""


def auto_host_pool_gb() -> float:
    """``HOST_POOL_FRACTION`` of the host's available memory in GiB (0.0 where it is unknown: ``max_num_seqs`` rows)."""
    from oasiskv_runtime.transfer.host_memory import available_host_bytes

    avail = available_host_bytes()
    return 0.0 if avail is None else round(HOST_POOL_FRACTION * avail / (1 << 30), 1)


def engine_args(mode: str = "oasiskv", top_k_blocks: int = 128, fetch_ratio: float = 0.05, draft: str | None = "auto",
                block_size: int = 16, sink_blocks: int = 0, backend: str = "auto", measure_recall: bool = False,
                platform: str | None = None, recent_blocks: int = 0, selection_score: str = "quest",
                cuda_graphs: str = "auto", admission: str = "auto", host_pool_gb: float | str = "auto",
                device_tier_gb: float = 0.0, attended_blocks: int = 0, attended_share: float = 0.0,
                fill_window: int = 0, early_fetch_ratio: float = 0.0, early_steps: int = 16,
                demand_fetch: bool = False, demand_fetch_cap: int = 0) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(model=..., **engine_args(...))`` (or ``AsyncEngineArgs``).

    ``mode``: ``dense`` (plain vLLM: nothing of ours is added), ``sparse-resident`` (Quest on vLLM's paged cache),
    ``proxy-prefetch`` / ``oasiskv`` (full KV in a pinned host pool, per-request working sets on the device, the next
    step's blocks prefetched per layer from the token's / the draft's query; these add our KV connector and turn
    prefix caching off). ``draft``: ``auto`` (``ngram`` for oasiskv, none otherwise), ``ngram[:N]``,
    ``eagle3:<dir>`` or ``none``; any draft is vLLM's own speculative decoding with one token, and turns vLLM's
    stats on so the acceptance rate can be read (:func:`acceptance`). ``measure_recall``: host-pool modes report
    each layer's prediction recall (host round trips). ``cuda_graphs``: ``auto`` (decode-only steps replay full CUDA
    graphs; the host-pool modes stay piecewise if the environment asks for vLLM's V2 model runner), ``full`` (the
    same, refusing V2) or ``off`` (vLLM's piecewise graphs only; see
    ``VllmOptions.cuda_graphs``; full graphs in a host-pool mode on CUDA set ``VLLM_USE_V2_MODEL_RUNNER=0``:
    :func:`use_v1_model_runner`). ``admission`` (host-pool modes): ``working-set`` (vLLM's cache frees a request's
    blocks once its prefill completes, keeping three: more requests fit), ``full`` (vLLM keeps them all), ``auto``
    (working-set, but full with an EAGLE-3 draft, whose draft layers attend their whole context in vLLM's cache).
    ``host_pool_gb`` (host-pool modes): GiB of host memory for the full-KV pool, a row of ``max_model_len`` tokens
    per running request; when its rows are all held, new requests wait. ``auto``: 80% of the host's available
    memory now (:data:`HOST_POOL_FRACTION`; where that is unknown, ``max_num_seqs`` rows); 0: ``max_num_seqs`` rows.
    ``device_tier_gb`` (host-pool modes): GiB of device memory beside vLLM's cache for more rows than the host pool
    holds (``VllmOptions.device_tier_gb``); 0: none. ``attended_blocks`` (host-pool modes): the blocks each step's
    attention weighed most that the next prediction keeps (``VllmOptions.attended_blocks``; ``attended_share``: the
    same as a share of ``top_k_blocks``); 0: none. ``fill_window``
    (host-pool modes): the prompt's last rows whose exact attention fills a working set (``VllmOptions.fill_window``);
    0: a prediction from the last prompt token's query. ``early_fetch_ratio`` (host-pool modes): the cap of a
    request's first ``early_steps`` decode steps, as a share of ``top_k_blocks`` (``VllmOptions.early_fetch_ratio``);
    0: ``fetch_ratio``'s cap at every step. ``demand_fetch`` (host-pool modes): the step's own top-K misses fetched
    before it attends, at most ``demand_fetch_cap`` per request, layer and KV head (0: all; ``VllmOptions``).
    ``selection_score``: ``quest``, ``minmax_mass``, and in the host-pool modes the key codes' ``max_logit_b2`` (or
    ``_b1`` / ``_b4``).
    ``platform``: ``cpu`` / ``cuda`` (default: vLLM's current platform).

    Raises :class:`UnsupportedVllmVersion` outside the supported vLLM range.
    """
    check_vllm_version()
    if draft == "auto":
        draft = "ngram" if Mode.parse(mode) is Mode.OASISKV else None
    if admission == "auto":
        admission = "full" if draft and draft.startswith("eagle3") else "working-set"
    if host_pool_gb == "auto":
        host_pool_gb = auto_host_pool_gb() if Mode.parse(mode).uses_host_pool else 0.0
    opts = VllmOptions(mode=mode, top_k_blocks=top_k_blocks, fetch_ratio=fetch_ratio, block_size=block_size,
                       sink_blocks=sink_blocks, backend=backend, measure_recall=measure_recall,
                       recent_blocks=recent_blocks, selection_score=selection_score, cuda_graphs=cuda_graphs,
                       admission=admission, host_pool_gb=host_pool_gb, device_tier_gb=device_tier_gb,
                       attended_blocks=attended_blocks, attended_share=attended_share, fill_window=fill_window,
                       early_fetch_ratio=early_fetch_ratio, early_steps=early_steps, demand_fetch=demand_fetch,
                       demand_fetch_cap=demand_fetch_cap)
    parsed = opts.parsed_mode
    out: dict[str, Any] = {}
    spec = speculative_config(draft)
    if spec is not None:
        out["speculative_config"] = spec
        out["disable_log_stats"] = False
    if not opts.enabled:
        return out
    _forget_cached_backend()
    out["additional_config"] = {CONFIG_KEY: opts.to_dict()}
    out["block_size"] = opts.block_size
    if parsed.uses_host_pool:
        from oasiskv_runtime.vllm.requests import CONNECTOR_MODULE, CONNECTOR_NAME

        out["kv_transfer_config"] = {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
                                     "kv_role": "kv_both"}
        out["enable_prefix_caching"] = False
    if _on_cuda(platform):
        out["attention_backend"] = "CUSTOM"
        if parsed.uses_host_pool and opts.full_graphs:
            if cuda_graphs == "auto" and _asks_for_v2():
                logger.warning("OasisKV: VLLM_USE_V2_MODEL_RUNNER asks for vLLM's V2 model runner: the host-pool "
                               "modes run piecewise CUDA graphs (full graphs need V1)")
                out["additional_config"] = {CONFIG_KEY: dataclasses.replace(opts, cuda_graphs="off").to_dict()}
            else:
                use_v1_model_runner()
    return out


def _asks_for_v2() -> bool:
    import os

    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("0", "false", "False")


def use_v1_model_runner() -> None:
    """The host-pool modes' full CUDA graphs need vLLM's V1 model runner: it replays a full graph inside the step's
    forward context, where the KV connector prepares the replay (``connector.prepare_replay``: the step's events,
    its stamp, or eager execution for a step that fills a working set). vLLM 0.26's V2 runner, its default for
    some models without speculative decoding, replays before any forward context exists, so nothing could run the
    replay's host part. vLLM reads ``VLLM_USE_V2_MODEL_RUNNER`` in every process it starts; this sets it for the
    engines this process starts (``vllm serve``: set it in the environment)."""
    import os

    if _asks_for_v2():
        raise ValueError("cuda_graphs='full' in the host-pool modes needs vLLM's V1 model runner, and "
                         "VLLM_USE_V2_MODEL_RUNNER asks for V2: unset it, or use cuda_graphs='auto' (piecewise then)")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def _forget_cached_backend() -> None:
    """vLLM caches its attention-backend choice per process; an engine created in this process before (in-process
    mode, VLLM_ENABLE_V1_MULTIPROCESSING=0) would make the next one reuse it and skip ours. Forget it (a private
    cache: nothing happens where it does not exist)."""
    try:
        from vllm.v1.attention import selector
    except ImportError:
        return
    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def serve_flags(**kwargs: Any) -> list[str]:
    """The same options as ``vllm serve`` flags: ``vllm serve MODEL $(...)`` (takes :func:`engine_args`' arguments)."""
    flags: list[str] = []
    for key, value in engine_args(**kwargs).items():
        if key == "disable_log_stats":  # the server logs its stats (acceptance included) by default
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):  # vLLM's boolean flags: --x / --no-x
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            flags += [flag, str(value)]
    return flags


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def spec_decode_counts(llm: Any) -> dict[str, int]:
    """vLLM's speculative-decoding counters (``drafts``, ``draft_tokens``, ``accepted_tokens``) summed over engines,
    read in-process from ``llm.get_metrics()`` (needs ``disable_log_stats=False``, which ``engine_args`` sets with a
    draft). Prometheus counters live as long as the process: take the difference of two readings."""
    out = dict.fromkeys(("drafts", "draft_tokens", "accepted_tokens"), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            key = metric.name[len("vllm:spec_decode_num_"):]
            out[key] += int(metric.value)
    return out


def acceptance(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Acceptance rate (accepted / proposed draft tokens) and mean tokens per verify step (1 + accepted / drafts,
    the bonus token included) between two :func:`spec_decode_counts` readings."""
    drafts = after["drafts"] - before["drafts"]
    proposed = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "tokens_per_step": 1.0 + accepted / drafts if drafts else 1.0}
