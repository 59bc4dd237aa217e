"""Turns a scheduler decision into tensors (once per step), runs the model, samples.

This is the only place where lists become tensors: it builds one ``StepMetadata`` per step and hands it to
the attention backend before the forward.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.engine.attention.metadata import SeqSlice, StepMetadata
from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager, token_slot
from oasiskv_runtime.engine.sampler import sample
from oasiskv_runtime.engine.scheduler import SchedulerOutput
from oasiskv_runtime.engine.sequence import Sequence
from oasiskv_runtime.models.decoder import DecoderForCausalLM
from oasiskv_runtime.ops.common import host_list_to


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, config: EngineConfig, kv: KVCacheManager, backend) -> None:
        self.model = model
        self.config = config
        self.kv = kv
        self.backend = backend
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step_index = 0
        self.capture_layers: tuple[int, ...] = ()
        self.last_captured: dict[int, torch.Tensor] = {}
        """Captured residual streams of the last forward, per layer: [T, hidden] (for EAGLE-style drafts)."""
        self.last_meta: StepMetadata | None = None
        self.sparse_inputs = None
        """The sparse modes' per-step inputs of the OasisKV core, built here with the step's metadata."""
        if config.mode.is_sparse:
            from oasiskv_runtime.engine.attention.sparse_step import SparseStepBuilder

            self.sparse_inputs = SparseStepBuilder(config.mode, kv, backend.head_map, self.device,
                                                   device_step=backend.background,
                                                   fill_from_draft=config.sparse.fill_query == "draft")
        self.last_bonus: dict[int, int] = {}
        """With ``accept_drafts``: the second token of each request whose draft the last step accepted (the draft
        itself is that request's sampled token)."""
        self.graphs = None
        """Decode-only steps on the static layout, replayed from CUDA graphs on CUDA (engine/cuda_graphs.py)."""
        setting = config.kernels.cuda_graphs
        capture = self.device.type == "cuda" and setting == "auto"
        if capture or setting == "static":
            from oasiskv_runtime.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, capture=capture)

    def forget(self, seq_id: int) -> None:
        """A request left the engine (finished, preempted, aborted): drop its static-layout rows."""
        if self.graphs is not None:
            self.graphs.forget(seq_id)
        if self.sparse_inputs is not None:
            self.sparse_inputs.forget(seq_id)

    def primary_table(self, seq: Sequence) -> list[int]:
        """Where a request's full KV lives: device blocks, or host blocks in host-pool modes."""
        rb = self.kv.blocks(seq)
        return rb.host_blocks if self.config.mode.uses_host_pool else rb.device_blocks

    def build_metadata(self, sched: SchedulerOutput, drafts: dict[int, int]) -> StepMetadata:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seqs: list[SeqSlice] = []
        logits_rows: list[int] = []
        for s in sched.scheduled:
            seq = s.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_tokens
            table = self.primary_table(seq)
            row0 = len(ids)
            ids += seq.token_slice(start, end)
            pos += range(start, end)
            slots += [token_slot(table, p, bs) for p in range(start, end)]
            draft_row = None
            if s.completes and seq.seq_id in drafts:
                draft_row = len(ids)
                ids.append(drafts[seq.seq_id])
                pos.append(end)
                slots.append(-1)
            seqs.append(SeqSlice(seq.seq_id, row0, s.num_tokens, end, table, draft_row, s.completes))
            if s.completes:
                logits_rows.append(row0 + s.num_tokens - 1)
        dev = self.device
        meta = StepMetadata(
            input_ids=host_list_to(ids, torch.long, dev),
            positions=host_list_to(pos, torch.long, dev),
            slot_mapping=host_list_to(slots, torch.long, dev),
            seqs=seqs,
            logits_indices=host_list_to(logits_rows, torch.long, dev),
            step=self.step_index,
        )
        if self.sparse_inputs is not None:
            meta.sparse = self.sparse_inputs.build(meta)
        return meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, drafts: dict[int, int] | None = None) -> dict[int, int]:
        """Run one step; returns the sampled token of each request that completed its pending tokens.

        With CUDA graphs (``graphs``) the step's decode requests run on the static layout (replayed when
        captured) and any prefill chunks of the same step run eagerly after them."""
        drafts = drafts or {}
        self.last_bonus = {}
        new_step = getattr(self.backend, "new_step", None)
        if new_step is not None:  # e.g. the sparse modes' per-step fetch cap, baked into the graph key below
            new_step(sched)
        # (requests, their logits) of each part of the step, sampled at its end: sampling reads the tokens back
        # to the host, which waits for the GPU. Sampling a split step's decode part before launching its prefill
        # part left the host idle through the replay and then the GPU idle while the host set up the prefill
        # (measured on the H200: ~30 ms per split prefill step waiting on the replay).
        parts: list[tuple[list[Sequence], torch.Tensor]] = []
        kernels = self.config.kernels
        # graphs capture this setting too
        self.model.use_fused_kernels(kernels.fused_norm_rope and kernels.backend != "ref")
        accept = self.config.sparse.accept_drafts
        pending: list[tuple[list, torch.Tensor]] = []  # accepted-draft candidates and their draft rows' logits
        part = self.graphs.plan(sched) if self.graphs is not None else None
        if part is not None:
            decode, key = part
            meta, hidden, captured = self.graphs.run(decode, drafts, key)
            self.last_captured, self.last_meta = captured, meta
            # the logits now: a new tensor, so the next replay may overwrite the static output
            parts.append(([s.seq for s in decode], self.model.compute_logits(hidden)))
            if accept:
                pending += self._draft_logits(SchedulerOutput(scheduled=decode), meta, self.graphs.last_hidden, drafts)
            taken = {id(s) for s in decode}
            rest = [s for s in sched.scheduled if id(s) not in taken]
            if not rest:
                self.step_index += 1
                return self._sample_and_accept(parts, pending, drafts)
            sched = SchedulerOutput(scheduled=rest)
            self.graphs.num_split_steps += 1
        meta = self.build_metadata(sched, drafts)
        self.backend.begin_step(meta)
        hidden, captured = self.model(meta.input_ids, meta.positions, self.backend, self.capture_layers)
        self.backend.end_step()
        self.last_captured, self.last_meta = captured, meta
        self.step_index += 1
        completing = [s.seq for s in sched.scheduled if s.completes]
        if completing:
            parts.append((completing, self.model.compute_logits(hidden.index_select(0, meta.logits_indices))))
        if accept:
            pending += self._draft_logits(sched, meta, hidden, drafts)
        return self._sample_and_accept(parts, pending, drafts)

    def _draft_logits(self, sched: SchedulerOutput, meta: StepMetadata, hidden: torch.Tensor,
                      drafts: dict[int, int]) -> list[tuple[list, torch.Tensor]]:
        """``[(candidates, their draft rows' logits)]`` of a step part (:meth:`_draft_candidates`), or ``[]``."""
        candidates = self._draft_candidates(sched, meta, drafts)
        if not candidates:
            return []
        rows = host_list_to([c[2].draft_row for c in candidates], torch.long, self.device)
        return [(candidates, self.model.compute_logits(hidden.index_select(0, rows)))]

    def _sample_and_accept(self, parts: list, pending: list, drafts: dict[int, int]) -> dict[int, int]:
        out = self._sample(parts)
        for candidates, draft_logits in pending:
            self._accept(candidates, draft_logits, out, drafts)
        return out

    def _draft_candidates(self, sched: SchedulerOutput, meta: StepMetadata,
                          drafts: dict[int, int]) -> list[tuple[int, Sequence, object]]:
        """(index in the decode batch, request, its slice) of each request whose draft could be accepted this step:
        it decodes over its working set with a draft row, has no forced outputs left, and its blocks can hold the
        draft's KV. A draft that completes a block may be accepted: the block stays in its local slot (two, used in
        turn) and the next step attends it there (``DecodeBatch.gap_block``), since this step's prediction could
        not rank it."""
        b = meta.sparse.decode if meta.sparse is not None else None
        if b is None:
            return []
        seqs = {s.seq.seq_id: s for s in sched.scheduled}
        slices = {s.seq_id: s for s in meta.seqs}
        out = []
        for i, seq_id in enumerate(b.seq_ids):
            sl, sc = slices[seq_id], seqs[seq_id]
            seq = sc.seq
            if sl.draft_row is None or seq_id not in drafts:
                continue
            if seq.forced_output_ids is not None and len(seq.output_token_ids) < len(seq.forced_output_ids):
                continue
            if not self.kv.allocate(seq, sc.num_tokens + 1):  # room for the draft's KV at position context_len
                continue
            out.append((i, seq, sl))
        return out

    def _accept(self, candidates: list, draft_logits: torch.Tensor, sampled: dict[int, int],
                drafts: dict[int, int]) -> None:
        """Where the sampled token equals the draft (an exact test: the draft is one fixed token, so accepting it
        exactly when the model samples it keeps the output distribution), sample the draft row's token as the
        second token of the step (``last_bonus``) and keep the draft's KV in the backend."""
        take = [j for j, (_, seq, _) in enumerate(candidates) if sampled.get(seq.seq_id) == drafts[seq.seq_id]]
        if not take:
            return
        bs, dev = self.block_size, self.device
        chosen = [candidates[j] for j in take]
        seqs = [seq for _, seq, _ in chosen]
        logits = draft_logits.index_select(0, host_list_to(take, torch.long, dev))
        bonus = sample(logits, [q.params for q in seqs], [len(q.output_token_ids) + 1 for q in seqs], self.generator)
        self.last_bonus.update((q.seq_id, t) for q, t in zip(seqs, bonus))
        # Each draft written as a decode step writes its token (one row at the draft's position e), laid out by the
        # step builder: its local-block row and its summary row.
        pos = [sl.context_len for _, _, sl in chosen]
        drafted = [SeqSlice(seq.seq_id, 0, 1, e + 1, self.primary_table(seq)) for (_, seq, _), e in zip(chosen, pos)]
        slots = [token_slot(s.block_table, e, bs) for s, e in zip(drafted, pos)]
        local = self.sparse_inputs.decode_vectors([s.seq_id for s in drafted], [e + 1 for e in pos]).get("local_rows")
        self.backend.commit_drafts(host_list_to([i for i, _, _ in chosen], torch.long, dev),
                                   host_list_to(slots, torch.long, dev),
                                   host_list_to(local, torch.long, dev) if local is not None else None,
                                   self.sparse_inputs.summary_writes(drafted, runs=False))

    def _sample(self, parts: list[tuple[list[Sequence], torch.Tensor]]) -> dict[int, int]:
        """Tokens for the requests of each (requests, logits rows in the same order) part."""
        out: dict[int, int] = {}
        for seqs, logits in parts:
            tokens = sample(logits, [q.params for q in seqs], [len(q.output_token_ids) for q in seqs],
                            self.generator)
            out.update((q.seq_id, t) for q, t in zip(seqs, tokens))
        return out
