"""The engine loop: schedule, (draft), execute, update requests, finish."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.core.summaries import KeyCodes
from oasiskv_runtime.engine.attention.dense import DenseAttention
from oasiskv_runtime.engine.attention.oasiskv import OasisKVAttention
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager
from oasiskv_runtime.engine.model_runner import ModelRunner
from oasiskv_runtime.engine.scheduler import Scheduler
from oasiskv_runtime.engine.sequence import Sequence, SequenceStatus
from oasiskv_runtime.models.loader import DTYPES, eos_token_ids, load_model
from oasiskv_runtime.sampling_params import SamplingParams
from oasiskv_runtime.transfer.host_pool import HostKVPool
from oasiskv_runtime.transfer.paged_kv import PagedKVCache

GiB = 1 << 30


@dataclass
class StagedKV:
    """A finished request's prompt KV kept in the host pool (prefill-decode hand-off), with the sparse state
    the decode side continues from (``OasisKVAttention.export_request``)."""

    seq: Sequence
    host_blocks: list[int]
    state: dict | None


@dataclass
class EngineStats:
    num_steps: int = 0
    running_batch: list[int] = field(default_factory=list)
    """Requests running in each step (the admitted batch)."""
    decode_batch: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    peak_device_blocks: int = 0
    peak_tier_blocks: int = 0
    """Most full-KV blocks in the device tier at once (CacheConfig.device_tier)."""
    request_device_blocks: list[int] = field(default_factory=list)
    """Most device blocks each finished request held (working set + summaries in sparse modes)."""
    num_draft_checked: int = 0
    num_draft_correct: int = 0
    num_draft_accepted: int = 0
    """Drafts emitted as a second token of their step (``accept_drafts``)."""
    prefill_step_seconds: float = 0.0
    """Wall time of steps that compute a prefill chunk (alone or with decode tokens)."""
    decode_step_seconds: float = 0.0
    """Wall time of decode-only steps. Each step's GPU work is waited for by the step's sampling or by the
    next step's first host sync, so the split is exact up to one step at each change of kind."""
    num_prefill_steps: int = 0
    decode_host_seconds: float = 0.0
    """Of decode-only steps: host time outside the model runner (scheduling, draft proposals, bookkeeping of the
    sampled tokens). The runner's sampling waits for the GPU, so with CUDA graphs the GPU idles through it."""
    prefill_host_seconds: float = 0.0
    """The same for prefill-carrying steps (admission into the pools is scheduling; a new request's n-gram index
    is a draft proposal)."""

    @property
    def max_running_batch(self) -> int:
        return max(self.running_batch, default=0)

    @property
    def mean_running_batch(self) -> float:
        return sum(self.running_batch) / len(self.running_batch) if self.running_batch else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, preloaded: tuple | None = None) -> None:
        """preloaded: (model, tokenizer, model_config) from another engine with the same model, device and
        dtype: benchmarks compare modes on one copy of the weights."""
        self.config = config
        torch.manual_seed(config.seed)
        if preloaded is not None:
            self.model, self.tokenizer, self.model_config = preloaded
        else:
            self.model, self.tokenizer, self.model_config = load_model(config.model, config.device, config.dtype,
                                                                       config.seed)
        mc = self.model_config
        self.dtype = DTYPES[config.dtype]
        elem = torch.tensor([], dtype=self.dtype).element_size()
        bs = config.cache.block_size
        self.block_bytes = bs * mc.kv_bytes_per_token(elem)
        kv_bytes = config.cache.kv_cache_bytes or self._default_kv_bytes()
        num_device_blocks = kv_bytes // self.block_bytes
        host_bytes = config.cache.host_kv_bytes or self._default_host_bytes()
        num_host_blocks = host_bytes // self.block_bytes if config.mode.uses_host_pool else 0
        self.max_model_len = mc.max_position_embeddings
        bits = config.sparse.code_bits if config.mode.is_sparse else 0
        self.kv = KVCacheManager(config.mode, bs, num_device_blocks, num_host_blocks,
                                 config.sparse.top_k_blocks, self.max_model_len, config.cache.device_tier,
                                 local_slots=2 if config.sparse.accept_drafts else 1,
                                 summary_parts=config.sparse.summary_parts,
                                 code_rows_per_block=KeyCodes.rows_per_block(elem, bits) if bits else 0)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.backend = self._make_backend(num_device_blocks, num_host_blocks)
        self.runner = ModelRunner(self.model, config, self.kv, self.backend)
        self.drafter = None
        if config.mode.uses_draft:
            from oasiskv_runtime.drafts.sources import make_draft_source

            self.drafter = make_draft_source(config.sparse.draft, self)
            self.runner.capture_layers = self.drafter.capture_layers
        self.stats = EngineStats()
        self.staged: dict[str, StagedKV] = {}
        """Prefill-decode, prefill side: request id -> the prompt KV kept in the host pool for a decode peer."""
        self._held_blocks: dict[int, int] = {}
        self.eos_ids = eos_token_ids(mc, self.tokenizer)

    def _default_host_bytes(self) -> int:
        """The host pool when none is given: on CUDA 64 GiB, or half the available RAM where that is less (it
        is pinned up front); on the CPU 8 GiB (pageable, touched only where written)."""
        if not self.config.device.startswith("cuda"):
            return 8 * GiB
        from oasiskv_runtime.transfer.host_memory import available_host_bytes

        avail = available_host_bytes()
        return 64 * GiB if avail is None else min(64 * GiB, avail // 2)

    def _default_kv_bytes(self) -> int:
        if self.config.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(self.config.device))
            return int(free * 0.9)
        return 2 * GiB

    def _make_backend(self, num_device_blocks: int, num_host_blocks: int) -> Any:
        mc, bs, cfg = self.model_config, self.config.cache.block_size, self.config
        scale = 1.0 / math.sqrt(mc.head_dim)
        device = torch.device(cfg.device)
        cache = PagedKVCache(mc.num_layers, num_device_blocks, bs, mc.num_kv_heads, mc.head_dim, self.dtype, device)
        if not cfg.mode.is_sparse:
            return DenseAttention(cache, scale, cfg.kernels.backend)
        if cfg.sparse.dense_layers > mc.num_layers:
            raise ValueError(f"dense_layers: {cfg.sparse.dense_layers} layers asked, the model has {mc.num_layers}")
        pool = None
        if cfg.mode.uses_host_pool:
            host = PagedKVCache(mc.num_layers, num_host_blocks, bs, mc.num_kv_heads, mc.head_dim, self.dtype, "cpu",
                                pin_memory=device.type == "cuda", zero=False)
            tier = self.kv.tier_first is not None
            pool = HostKVPool(host, cache if tier else None, self.kv.tier_first, cfg.kernels.backend)
        return OasisKVAttention(cfg, mc.num_layers, mc.num_kv_heads, mc.head_dim, cache, pool, scale,
                                cfg.scheduler.max_num_seqs + 1)  # + the padding rows of CUDA graphs

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    arrival: float | None = None, stage_kv: bool = False,
                    prefix: tuple[list[int], torch.Tensor, torch.Tensor] | None = None) -> Sequence:
        """Queue a request. ``stage_kv`` (prefill-decode, prefill side): when it finishes, keep its prompt KV
        in the host pool (``self.staged``) until :meth:`release_staged`. ``prefix``: a prefix-cache hit,
        (host blocks holding the prompt's first blocks, their key summaries min / max ``[L, n, Hkv, D]``):
        only the rest of the prompt is computed."""
        if stage_kv and not self.config.mode.uses_host_pool:
            raise ValueError(f"staging KV for a decode peer needs a host-pool mode, not {self.config.mode.value}")
        if (stage_kv or prefix is not None) and self.kv.tier_first is not None:
            raise ValueError("staged KV and prefix-cache hits live in the host pool: not supported with a device "
                             "tier (device_tier)")
        if (stage_kv or prefix is not None) and self.config.sparse.summary_parts > 1:
            raise ValueError(f"summary_parts={self.config.sparse.summary_parts} does not run with prefill-decode "
                             "hand-off or prefix-cache hits yet (they carry one summary per block)")
        if prefix is not None and self.kv.code_rows_per_block:
            raise ValueError(f"selection_score={self.config.sparse.selection_score!r} does not run with prefix-cache "
                             "hits yet (they carry no key codes)")
        seq = self._new_sequence(prompt_token_ids, params, request_id, arrival)
        seq.stage_kv = stage_kv
        self.scheduler.add(seq)
        if prefix is not None:
            blocks, summary_min, summary_max = prefix
            n = len(blocks) * self.config.cache.block_size
            if not blocks or n >= len(prompt_token_ids):
                raise ValueError("a prefix hit must cover whole blocks and leave at least one prompt token")
            self.kv.attach_prefix(seq, blocks)
            seq.num_computed_tokens = n
            self.runner.sparse_inputs.pending_prefix[seq.seq_id] = (summary_min, summary_max)
        return seq

    def _new_sequence(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None,
                      arrival: float | None) -> Sequence:
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, longer than the model's context of "
                             f"{self.max_model_len} tokens (one more is needed for the first output token)")
        return Sequence(prompt_token_ids, params, request_id, arrival)

    # ---- prefill-decode hand-off ---------------------------------------------------------------------
    def release_staged(self, request_id: str, keep: set[int] | frozenset[int] = frozenset()) -> StagedKV | None:
        """Free a staged request's host blocks (its decode peer finished with it), except those in ``keep``
        (a prefix cache owns them). None if unknown."""
        st = self.staged.get(request_id)
        if st is None:
            return None
        self.kv.free_host_blocks([b for b in st.host_blocks if b not in keep])
        del self.staged[request_id]  # last: an observer that sees it gone sees the blocks free
        return st

    def import_request(self, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                       request_id: str, state: dict | None, load_kv, arrival: float | None = None,
                       forced_output_ids: list[int] | None = None) -> Sequence | None:
        """Admit a request whose prompt was prefilled elsewhere (prefill-decode, decode side).

        Allocates its blocks, calls ``load_kv(seq, blocks)`` to bring the prompt KV the decode side starts
        with into the primary store (the caller's transport), installs the sparse state the prefill side
        exported, and puts the request straight into the running batch with ``first_token`` as its first
        output. Returns None when the KV budget has no room now (retry after a step), the sequence otherwise.
        """
        seq = self._new_sequence(prompt_token_ids, params, request_id, arrival)
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token {first_token} out of the vocabulary")
        seq.forced_output_ids = forced_output_ids
        self.kv.check_fits_alone(seq)
        if len(self.scheduler.running) >= self.config.scheduler.max_num_seqs:
            return None
        if not self.kv.allocate(seq, len(prompt_token_ids)):
            return None
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.output_token_ids.append(first_token)
        try:
            load_kv(seq, self.kv.blocks(seq))
            if self.config.mode.is_sparse:
                if state is None:
                    raise ValueError("a sparse decode peer needs the prefill side's sparse state")
                self.backend.import_request(seq.seq_id, self.kv.blocks(seq), len(prompt_token_ids), state,
                                            self.runner.step_index)
        except BaseException:
            self._release(seq.seq_id)
            self.kv.free(seq)
            raise
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        now = time.perf_counter()
        seq.times.first_scheduled = seq.times.first_token = now
        seq.times.token_times.append(now)
        reason = self._stop_reason(seq, first_token)
        if reason is not None:
            self._finish(seq, reason, now)
        return seq

    def abort(self, seq: Sequence, message: str) -> None:
        """End a running request with an error (its output so far is kept; finish reason "error")."""
        if seq.is_finished:
            return
        seq.error = message
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        self._finish(seq, "error", time.perf_counter())

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq.stage_kv:
            state = self.backend.export_request(seq.seq_id, self.kv.blocks(seq), len(seq.prompt_token_ids),
                                                self.runner.step_index)
            self.staged[seq.request_id] = StagedKV(seq, self.kv.detach_host_blocks(seq), state)
        self.scheduler.finish(seq, reason)
        self._release(seq.seq_id)
        seq.times.finished = now
        self.stats.request_device_blocks.append(self._held_blocks.pop(seq.seq_id, 0))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step; returns the requests that finished in it."""
        t_start = time.perf_counter()
        sched = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        for seq_id in sched.preempted_ids:
            self._release(seq_id)
        if sched.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request can be scheduled: KV budget exhausted with nothing running")
            return []
        now = time.perf_counter()
        for s in sched.scheduled:
            if s.seq.times.first_scheduled is None:
                s.seq.times.first_scheduled = now
        drafts = self.drafter.propose([s.seq for s in sched.scheduled if s.completes]) if self.drafter else {}
        t_exec = time.perf_counter()
        sampled = self.runner.execute(sched, drafts)
        t_sampled = time.perf_counter()
        if self.drafter is not None:
            self.drafter.observe(self.runner.last_meta, self.runner.last_captured)
        now = time.perf_counter()
        self.stats.num_steps += 1
        decode_only = not any(s.num_tokens > 1 for s in sched.scheduled)
        if not decode_only:
            self.stats.num_prefill_steps += 1
            self.stats.prefill_step_seconds += now - t_start
        else:
            self.stats.decode_step_seconds += now - t_start
        self.stats.running_batch.append(len(self.scheduler.running))
        self.stats.decode_batch.append(sum(1 for s in sched.scheduled if s.num_tokens == 1))
        self.stats.peak_device_blocks = max(self.stats.peak_device_blocks, self.kv.device_pool.num_used)
        self.stats.peak_tier_blocks = max(self.stats.peak_tier_blocks, self.kv.tier_blocks_used)
        finished = []
        held = self._held_blocks
        bonus = self.runner.last_bonus
        for s in sched.scheduled:
            seq = s.seq
            held[seq.seq_id] = max(held.get(seq.seq_id, 0), self.kv.device_blocks_held(seq))
            seq.num_computed_tokens += s.num_tokens
            if seq.seq_id not in sampled:
                continue
            token = sampled[seq.seq_id]
            if seq.forced_output_ids is not None and len(seq.output_token_ids) < len(seq.forced_output_ids):
                token = seq.forced_output_ids[len(seq.output_token_ids)]
            if seq.seq_id in drafts:
                seq.num_draft_checked += 1
                seq.num_draft_correct += int(drafts[seq.seq_id] == token)
                self.stats.num_draft_checked += 1
                self.stats.num_draft_correct += int(drafts[seq.seq_id] == token)
            reason = self._emit(seq, token, now)
            second = bonus.get(seq.seq_id)
            if reason is None and second is not None:  # the draft was the token: its KV is kept, the next follows
                seq.num_computed_tokens += 1
                self.stats.num_draft_accepted += 1
                reason = self._emit(seq, second, now)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(seq)
        host = (t_exec - t_start) + (time.perf_counter() - t_sampled)
        if decode_only:
            self.stats.decode_host_seconds += host
        else:
            self.stats.prefill_host_seconds += host
        return finished

    def _emit(self, seq: Sequence, token: int, now: float) -> str | None:
        """Append an output token; returns why the request stops there (None: it goes on)."""
        seq.output_token_ids.append(token)
        if seq.times.first_token is None:
            seq.times.first_token = now
        seq.times.token_times.append(now)
        return self._stop_reason(seq, token)

    def _release(self, seq_id: int) -> None:
        """Drop per-request state outside the KV manager (sparse maps, draft caches)."""
        free = getattr(self.backend, "free_request", None)
        if free is not None:
            free(seq_id)
        self.runner.forget(seq_id)
        if self.drafter is not None:
            self.drafter.free(seq_id)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            # Only the newest tokens can complete a stop string (an earlier one would have stopped an earlier
            # step): decode a tail long enough to hold the longest one (every token is at least one character
            # or a byte of one), and the whole output only to cut it. Decoding everything every step was
            # quadratic in the output length.
            window = 4 * max(len(s) for s in p.stop) + 8
            tail = self.tokenizer.decode(seq.output_token_ids[-window:], skip_special_tokens=True)
            if any(s in tail for s in p.stop):
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
                for s in p.stop:
                    if s in text:
                        seq.text = text[: text.index(s)]
                        return "stop"
        if len(seq.output_token_ids) >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def reset_stats(self) -> None:
        """Zero every run counter (engine, scheduler, sparse traffic, graphs) between measured windows, e.g.
        after a warm-up request. Only between runs: with requests in flight, their counts would be split."""
        if self.has_unfinished():
            raise RuntimeError("reset_stats with requests in flight")
        self.stats = EngineStats()
        self.scheduler.num_preemptions = 0
        self._held_blocks = {}
        reset = getattr(self.backend, "reset_counters", None)
        if reset is not None:
            reset()
        if self.runner.graphs is not None:
            self.runner.graphs.reset_counters()

    def run_stats(self) -> dict[str, Any]:
        """Run-level counters for reports (stable names; see oasisbench.results.schema)."""
        st = self.stats
        per_req = st.request_device_blocks
        accepted = (st.num_draft_accepted / st.num_draft_checked
                    if st.num_draft_checked and self.config.sparse.accept_drafts else None)
        out: dict[str, Any] = {
            "num_steps": st.num_steps,
            "max_running_batch": st.max_running_batch,
            "mean_running_batch": st.mean_running_batch,
            "num_preemptions": st.num_preemptions,
            "peak_device_memory_bytes": st.peak_device_blocks * self.block_bytes,
            "peak_device_tier_bytes": st.peak_tier_blocks * self.block_bytes,
            "resident_gpu_bytes_per_request": (sum(per_req) / len(per_req) * self.block_bytes) if per_req else None,
            "draft_accuracy": (st.num_draft_correct / st.num_draft_checked) if st.num_draft_checked else None,
            "spec_decode_acceptance_rate": accepted,
            "tokens_per_step": 1 + accepted if accepted is not None else None,
            "fetched_blocks_per_step": 0.0,
            "fetched_bytes_per_step": 0.0,
            "deferred_blocks_per_step": 0.0,
            "prediction_recall": None,
            "recall_per_layer": None,
            "random_weights": self.model_config.random_weights,
            "kv_bytes_per_token": self.block_bytes // self.config.cache.block_size,
            "num_prefill_steps": st.num_prefill_steps,
            "prefill_step_seconds": st.prefill_step_seconds,
            "decode_step_seconds": st.decode_step_seconds,
            "prefill_time_share": (st.prefill_step_seconds / (st.prefill_step_seconds + st.decode_step_seconds)
                                   if st.num_steps else None),
            "decode_host_ms_per_step": (st.decode_host_seconds * 1e3 / (st.num_steps - st.num_prefill_steps)
                                        if st.num_steps > st.num_prefill_steps else None),
            "prefill_host_ms_per_step": (st.prefill_host_seconds * 1e3 / st.num_prefill_steps
                                         if st.num_prefill_steps else None),
        }
        if self.config.device.startswith("cuda"):
            out["peak_torch_allocated_bytes"] = torch.cuda.max_memory_allocated(torch.device(self.config.device))
        if self.runner.graphs is not None:
            out.update(self.runner.graphs.stats())
        backend_stats = getattr(self.backend, "run_stats", None)
        if backend_stats is not None:
            out.update(backend_stats())
        return out

    def request_metrics(self, seq: Sequence) -> dict:
        t = seq.times
        times = t.token_times
        itl = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        m = {
            "ttft_ms": ((t.first_token - t.arrival) * 1e3) if t.first_token else None,
            "tpot_ms": ((times[-1] - times[0]) * 1e3 / (len(times) - 1)) if len(times) > 1 else None,
            "itl_ms": itl,
            "e2e_ms": ((t.finished - t.arrival) * 1e3) if t.finished else None,
            "num_preemptions": seq.num_preemptions,
            "num_output_tokens": len(seq.output_token_ids),
        }
        if seq.num_draft_checked:
            m["draft_accuracy"] = seq.num_draft_correct / seq.num_draft_checked
        extra = getattr(self.backend, "request_metrics", None)
        if extra is not None:
            m.update(extra(seq.seq_id))
        return m
