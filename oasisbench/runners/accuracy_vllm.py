"""The accuracy suite's vLLM engine (``oasisbench accuracy --engine vllm``): each (mode, setting)'s generations come
from one vLLM engine in a process of its own (:mod:`oasisbench.runners.vllm_child`), plain vLLM for ``dense``, vLLM
with the OasisKV plug-in (``engine_args``) for the sparse modes.

The parent keeps everything but the generation: it builds the prompts with the model's tokenizer (the same one, and
the same token ids, as the embedded engine), sends token ids and sampling parameters to the child, and decodes and
scores what comes back with the embedded path's code, so both engines' runs have one schema. vLLM runs without a
tokenizer (``skip_tokenizer_init``): the ids it sees are ours, and it stops on the EOS ids the embedded engine stops
on. The child's figures: the generation's wall time (the engine start excluded), vLLM's preemptions, the acceptance of
drafts and the plug-in's counters (:class:`~oasisbench.runners.vllm_child.EngineCounters`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from oasisbench.runners import vllm_child
from oasiskv_runtime.outputs import RequestOutput
from oasiskv_runtime.sampling_params import SamplingParams


#: vLLM's KV block size where the plug-in does not set one (plain vLLM).
KV_BLOCK_TOKENS = 16


class VllmRunError(RuntimeError):
    """A vLLM child failed (start, generation, timeout): the message names the cause and the log."""


def plan_setting(model: str, device: str, dtype: str, seed: int, mode: str, opts: dict[str, Any],
                 max_model_len: int) -> Any:
    """The :class:`~oasisbench.runners.vllm_point.VllmPlan` of one accuracy setting (``opts``: its engine options),
    checked without vLLM: an option the vLLM front end does not have (``dense_layers``, ``link_gbps``,
    ``selection_score=attention`` or ``gauss``, ...) raises ``ValueError`` naming it."""
    from oasisbench.runners.vllm_point import plan_vllm_point

    engine_opts = {k: v for k, v in opts.items() if k not in ("max_num_seqs", "kv_cache_gb")}
    point = {**engine_opts, "mode": mode, "model": model, "device": device, "dtype": dtype, "seed": seed,
             "context_len": max_model_len, "concurrency": opts["max_num_seqs"], "kv_cache_gb": opts["kv_cache_gb"],
             "max_num_batched_tokens": opts.get("max_num_batched_tokens") or 2048}
    return plan_vllm_point(point)


class VllmEngine:
    """The part of :class:`oasiskv_runtime.LLM` the accuracy runner's NIAH path uses (``tokenizer``, ``generate``),
    served by one vLLM child per :meth:`generate` call."""

    def __init__(self, model: str, device: str, plan: Any, log_path: Path | None, timeout_s: float) -> None:
        from oasiskv_runtime.models.loader import eos_token_ids, load_tokenizer, model_config_for

        self.model, self.device, self.plan, self.log_path, self.timeout_s = model, device, plan, log_path, timeout_s
        config = self.config = model_config_for(model)[0]
        self.random_weights = bool(config.random_weights)
        self.tokenizer = load_tokenizer(model)
        self.stop_token_ids = sorted(eos_token_ids(config, self.tokenizer))
        self.stats: dict[str, Any] = {}
        self.generate_seconds = 0.0

    @property
    def max_model_len(self) -> int:
        return int(self.plan.llm_kwargs["max_model_len"])

    @property
    def eos_ids(self) -> set[int]:
        return set(self.stop_token_ids)

    def model_info(self) -> dict[str, Any]:
        """As the embedded ``LLM.model_info``: what ran (plain vLLM has no sparse settings)."""
        plugin = self.plan.plugin or {}
        return {"model": self.model, "engine": "vllm", "device": self.device, "mode": plugin.get("mode", "dense"),
                "top_k_blocks": plugin.get("top_k_blocks"), "fetch_ratio": plugin.get("fetch_ratio"),
                "draft": plugin.get("draft"), "random_weights": self.random_weights}

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Greedy or seeded-sampled generations of token-id prompts; text decoded as the embedded engine does.

        Stop strings: vLLM runs without a tokenizer here (the ids are ours), so it cannot see them; each output is
        cut after generation where the embedded engine would have stopped (:func:`cut_at_stop`): the same tokens
        and text, only the tokens past the stop cost time."""
        payload = {"model": self.model, "device": self.device, "llm": self._llm_kwargs(prompts, params),
                   "plugin": self.plan.plugin, "prompts": [list(map(int, p)) for p in prompts],
                   "params": [_vllm_params(p, self.stop_token_ids) for p in params]}
        result = vllm_child.run_child(lambda out_dir: vllm_child.child_command(__name__, payload, out_dir),
                                      self.device, self.log_path, self.timeout_s)
        if result.get("error"):
            raise VllmRunError(result["error"])
        self.stats = dict(result["stats"], vllm_version=result.get("vllm_version"))
        self.generate_seconds += float(result["duration"])
        outs = []
        for i, (p, q, o) in enumerate(zip(prompts, params, result["outputs"])):
            ids, text, reason = o["token_ids"], None, o["finish_reason"]
            if q.stop and self.tokenizer is not None:
                ids, text, reason = cut_at_stop(self._decode, ids, q.stop, reason)
            outs.append(RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=list(p), token_ids=ids,
                                      text=self._decode(ids) if text is None else text, finish_reason=reason))
        return outs

    def _llm_kwargs(self, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
        """vLLM's arguments; without ``--kv-cache-gb`` a KV cache that holds the whole batch (vLLM's own default on
        the CPU reserves most of the machine's memory and refuses to start where others use some)."""
        kwargs = dict(self.plan.llm_kwargs)
        # no more sequences than prompts: the host-pool modes size their pool by max_num_seqs x max_model_len
        kwargs["max_num_seqs"] = max(1, min(int(kwargs["max_num_seqs"]), len(prompts)))
        if "kv_cache_memory_bytes" not in kwargs:
            import torch

            from oasiskv_runtime.models.loader import DTYPES

            block = int((self.plan.plugin or {}).get("block_size") or KV_BLOCK_TOKENS)
            # A slot per request for a draft token, and one window more: vLLM wants room for a request of the whole
            # window, keeps a null block, and its CPU backend may page in larger blocks than ours.
            tokens = block * sum(-(-(len(p) + q.max_tokens + 1) // block) for p, q in zip(prompts, params))
            tokens += int(kwargs["max_model_len"])
            per_token = self.config.kv_bytes_per_token(torch.tensor([], dtype=DTYPES[kwargs["dtype"]]).element_size())
            kwargs["kv_cache_memory_bytes"] = tokens * per_token
        return kwargs

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def run_stats(self) -> dict[str, Any]:
        return dict(self.stats)


def cut_at_stop(decode: Any, ids: list[int], stops: list[str], reason: str) -> tuple[list[int], str | None, str]:
    """``ids`` up to the token whose text completes one of ``stops`` (the embedded engine's stop), the text before
    that stop (the first of ``stops`` found, as the embedded engine cuts) and finish reason ``stop``; unchanged (text
    None) when no stop occurs. A decoded prefix that holds a stop holds it in every longer prefix, so the shortest
    one is found by bisection (a few decodes, not one per token)."""
    if not any(s in decode(ids) for s in stops):
        return ids, None, reason
    lo, hi = 1, len(ids)  # the shortest prefix holding a stop is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = decode(ids[:lo])
    stop = next(s for s in stops if s in text)
    return ids[:lo], text[: text.index(stop)], "stop"


def _vllm_params(p: SamplingParams, stop_token_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` arguments for ours (top-k 0 is "off" in both)."""
    return {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
            "seed": p.seed, "ignore_eos": p.ignore_eos, "stop_token_ids": stop_token_ids}


# ---- the child: one vLLM engine, one batch -----------------------------------------------------------------------


def generate_all(payload: dict[str, Any], status: vllm_child.ChildStatus) -> dict[str, Any]:
    """Start vLLM as ``payload`` says, generate every prompt as one batch; token ids, the time, the counters."""
    from oasiskv_runtime.vllm.version import check_vllm_version

    with vllm_child.start_vllm(payload["model"], payload["device"], payload["llm"], payload["plugin"],
                               status) as (llm, vllm, _):
        counters = vllm_child.EngineCounters(llm, payload["plugin"], fresh=True)
        status.update(phase="generating", force=True)
        prompts = [{"prompt_token_ids": p} for p in payload["prompts"]]
        params = [vllm.SamplingParams(**p) for p in payload["params"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - t0
        stats = counters.since()
    return {"outputs": [{"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
                        for o in outs],
            "duration": duration, "stats": stats, "vllm_version": check_vllm_version()}


def main(argv: list[str]) -> None:
    """The child: ``PAYLOAD_JSON DIR``; writes ``DIR/result.json`` (generations, or ``error``)."""
    vllm_child.child_main(argv, generate_all)


if __name__ == "__main__":
    main(sys.argv[1:])
