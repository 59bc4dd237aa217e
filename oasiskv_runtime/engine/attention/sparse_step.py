"""The embedded engine's per-step inputs of the OasisKV core: its bookkeeping (block lists of the KV manager, the
scheduled slices) turned into the core's tensors, once per step, by the model runner (``ModelRunner`` for eager
steps, ``DecodeGraphs`` for the static layout of CUDA graphs). The core never reads the KV manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oasiskv_runtime.config import Mode
from oasiskv_runtime.core.batch import DecodeBatch, SummaryWrites, summary_row, summary_rows
from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.engine.attention.metadata import SeqSlice, StepMetadata, written_rows
from oasiskv_runtime.engine.kv_cache_manager import KVCacheManager, cdiv
from oasiskv_runtime.ops.common import host_list_to


@dataclass
class SparseStep:
    """One step as the sparse backend sees it."""

    written: torch.Tensor
    """[n] rows of the step's k/v whose KV is written (every computed row; draft rows are not)."""
    writes: SummaryWrites
    decode: DecodeBatch | None = None
    """Requests decoding over their working sets this step."""
    prefill: list[SeqSlice] = field(default_factory=list)
    """Sequences attending densely this step (prefill chunks, requests whose working set is not filled yet)."""
    fill: DecodeBatch | None = None
    """Requests whose prefill completes this step (host-pool modes): their working sets are filled at the end of
    each layer, from the last computed row's (or the draft's) query."""
    fill_tails: list[tuple[SeqSlice, int]] = field(default_factory=list)
    """Of ``fill``'s requests: (slice, local device block): the prompt's tail goes into the local block."""
    decode_slices: list[SeqSlice] = field(default_factory=list)
    summary_imports: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(flat summary rows [n], mins [L, n, Hkv, D], maxs): summaries computed elsewhere, written as the step starts
    (a prefix-cache hit's shared blocks)."""
    static: bool = False
    """Built on the static layout of CUDA graphs (decode only)."""
    prefill_codes: list[tuple[int, torch.Tensor] | None] = field(default_factory=list)
    """Key codes: per ``prefill`` slice, the blocks its chunk fills ``(first logical block, their code rows [n])``,
    coded from the context keys its attention reads (None: the chunk fills none)."""


class SparseStepBuilder:
    def __init__(self, mode: Mode, kv: KVCacheManager, head_map: HeadMap, device: torch.device,
                 device_step: bool, fill_from_draft: bool = True) -> None:
        """``device_step``: the static layout stamps selections with the step from a device buffer (the background
        pipeline reads it inside captured graphs) rather than a host int; ``fill_from_draft``: a completed prefill's
        working set is predicted from its draft row where the mode drafts (``SparseConfig.fill_query``)."""
        self.mode, self.kv, self.map, self.device = mode, kv, head_map, device
        self.fill_from_draft = fill_from_draft and mode.uses_draft
        self.bs = kv.block_size
        self.parts = kv.summary_parts
        self.codes = kv.code_rows_per_block > 0
        """Key codes are kept (``KVCacheManager.code_rows_per_block``)."""
        self.sb = self.bs // self.parts
        """Tokens per summary row (``summary_parts`` rows per block): token ``p``'s row is sub-block ``p // sb``'s."""
        self.device_step = device_step
        self.bound: dict[int, int] = {}
        """Per request, the candidate count its last prediction ranked (the next step's ``gap_block`` test)."""
        self.gap_rows = 0
        """Decode rows that attended a gap block (tests read it)."""
        self.pending_prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Prefix-cache hits: key summaries ``[L, n, Hkv, D]`` of a request's shared first blocks, written at its first
        step (its summary blocks exist from then on)."""

    def forget(self, seq_id: int) -> None:
        self.pending_prefix.pop(seq_id, None)
        self.bound.pop(seq_id, None)

    def _summary_imports(self, seqs: list[SeqSlice]) -> list:
        out = []
        for s in seqs:
            hit = self.pending_prefix.pop(s.seq_id, None)
            if hit is not None:
                table = self.kv.requests[s.seq_id].summary_blocks
                out.append((summary_rows(table, hit[0].shape[1], self.bs, self.device), *hit))
        return out

    # ---- eager steps --------------------------------------------------------------------------------------------
    def build(self, meta: StepMetadata) -> SparseStep:
        dev = meta.slot_mapping.device
        distinct = all(s.num_query == 1 for s in meta.seqs)  # decode: one token per summary row
        decode = [s for s in meta.seqs if s.num_query == 1 and s.seq_id in self.map.ready]
        ids = {s.seq_id for s in decode}
        prefill = [s for s in meta.seqs if s.seq_id not in ids]
        done = [s for s in prefill if s.completes] if self.mode.uses_host_pool else []
        return SparseStep(written=host_list_to(written_rows(meta.seqs), torch.long, dev),
                          writes=self.summary_writes(meta.seqs, runs=not distinct),
                          decode=self.decode_batch(decode, meta.step) if decode else None,
                          prefill=prefill, fill=self.fill_batch(done, meta.step) if done else None,
                          fill_tails=[(s, self.kv.requests[s.seq_id].local_block(s.context_len - 1, self.bs))
                                      for s in done],
                          decode_slices=decode, summary_imports=self._summary_imports(meta.seqs),
                          prefill_codes=[self._filled_blocks(s) for s in prefill] if self.codes else [])

    def _filled_blocks(self, s: SeqSlice) -> tuple[int, torch.Tensor] | None:
        """The blocks ``s``'s rows fill and their code rows (key codes), or None."""
        first, end = (s.context_len - s.num_query) // self.bs, s.context_len // self.bs
        if end <= first:
            return None
        rows = self.kv.requests[s.seq_id].code_rows[first:end]
        return first, host_list_to(rows, torch.long, self.device)

    def summary_writes(self, seqs: list[SeqSlice], runs: bool) -> SummaryWrites:
        """The summary row of every written token (one row per sub-block of ``sb`` tokens, ``summary_parts`` per
        logical block; each row at most once: decode), or with ``runs`` (a prefill chunk in the step) the run layout
        of ``update_summaries_runs``, built a sub-block at a time (an 8K-token chunk is 512 runs at one part, laid
        out on the host before the step's first launch), each run padded to ``block_size`` entries."""
        bs, sb, dev = self.bs, self.sb, self.device
        if not runs:
            rows, reset = [], []
            for s in seqs:
                table = self.kv.requests[s.seq_id].summary_blocks
                for p in range(s.context_len - s.num_query, s.context_len):
                    rows.append(summary_row(table, p // sb, bs))
                    reset.append(p % sb == 0)
            return SummaryWrites(rows=host_list_to(rows, torch.long, dev), reset=host_list_to(reset, torch.bool, dev))
        pad_idx: list[int] = []
        run_rows: list[int] = []
        run_reset: list[bool] = []
        i = 0  # the run's first token among the written rows (``written_rows`` order: by sequence, by position)
        for s in seqs:
            table = self.kv.requests[s.seq_id].summary_blocks
            p, end = s.context_len - s.num_query, s.context_len
            while p < end:
                j, off = divmod(p, sb)
                n = min(sb - off, end - p)
                pad_idx += range(i, i + n)
                pad_idx += [i] * (bs - n)
                run_rows.append(summary_row(table, j, bs))
                run_reset.append(off == 0)
                i, p = i + n, p + n
        return SummaryWrites(runs=(host_list_to(pad_idx, torch.long, dev), host_list_to(run_rows, torch.long, dev),
                                   host_list_to(run_reset, torch.bool, dev)))

    def decode_vectors(self, seq_ids: list[int], ctxs: list[int]) -> dict[str, list[int]]:
        """Per-request decode-step values (eager batches and the static layout alike): state row, active block and
        its valid tokens, full blocks before it now and at the next step, and in host-pool modes the flat row this
        step's token takes in the local block."""
        bs, host = self.bs, self.mode.uses_host_pool
        out: dict[str, list[int]] = {k: [] for k in ("state_rows", "local_block", "local_len", "num_candidates",
                                                     "next_candidates")}
        if host:
            out["local_rows"] = []
        for seq_id, ctx in zip(seq_ids, ctxs):
            rb = self.kv.requests[seq_id]
            p = ctx - 1
            out["state_rows"].append(self.map.row(seq_id))
            out["local_len"].append(p % bs + 1)
            out["num_candidates"].append(p // bs)
            out["next_candidates"].append(ctx // bs)
            if host:
                local = rb.local_block(p, bs)
                out["local_block"].append(local)
                out["local_rows"].append(local * bs + p % bs)
            else:
                out["local_block"].append(rb.device_blocks[p // bs])
        return out

    def _padded(self, rows: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        width = max(1, max((len(r) for r in rows), default=1))
        return host_list_to([r + [0] * (width - len(r)) for r in rows], dtype, self.device)

    def gap_blocks(self, seq_ids: list[int], vec: dict[str, list[int]]) -> list[int] | None:
        """Per request, the local block of the block before the active one where this step has more candidates
        than its last prediction ranked (only after an accepted draft completed a block: two local slots), else
        -1; None when no request has one. Records this step's bounds."""
        gaps = []
        for seq_id, nc, nxt in zip(seq_ids, vec["num_candidates"], vec["next_candidates"]):
            rb = self.kv.requests[seq_id]
            bound = self.bound.get(seq_id, nc)
            gaps.append(rb.local_block((nc - 1) * self.bs, self.bs) if nc > bound and rb.num_local > 1 else -1)
            self.bound[seq_id] = nxt
        n = sum(g >= 0 for g in gaps)
        self.gap_rows += n
        return gaps if n else None

    def decode_batch(self, decode: list[SeqSlice], step: int) -> DecodeBatch:
        host = self.mode.uses_host_pool
        vec = self.decode_vectors([s.seq_id for s in decode], [s.context_len for s in decode])
        t = lambda xs, dt=torch.long: host_list_to(xs, dt, self.device)  # noqa: E731
        gaps = self.gap_blocks([s.seq_id for s in decode], vec) if host and self.kv.local_slots > 1 else None
        return DecodeBatch(
            seq_ids=[s.seq_id for s in decode],
            state_rows=t(vec["state_rows"]),
            q_rows=t([s.query_start for s in decode]),
            draft_rows=t([s.draft_row if s.draft_row is not None else s.query_start for s in decode]),
            has_draft=t([s.draft_row is not None for s in decode], torch.bool),
            local_block=t(vec["local_block"]),
            local_len=t(vec["local_len"]),
            num_candidates=t(vec["num_candidates"], torch.int32),  # the score and ranking kernels' dtype
            next_candidates=t(vec["next_candidates"], torch.int32),
            summary_table=self._padded([self.kv.requests[s.seq_id].summary_blocks for s in decode], torch.int32),
            primary_table=self._padded([s.block_table for s in decode], torch.long),
            slot_blocks=t([self.kv.requests[s.seq_id].slot_blocks for s in decode]) if host else None,
            local_rows=t(vec["local_rows"]) if host else None,
            max_candidates=max(vec["num_candidates"]),
            max_next_candidates=max(vec["next_candidates"]),
            step=step,
            gap_block=t(gaps) if gaps is not None else None,
            code_table=self._code_table(decode),
        )

    def _code_table(self, seqs: list[SeqSlice]) -> torch.Tensor | None:
        """Key codes: ``[B, NB]`` the code row of each logical block (as wide as ``primary_table``)."""
        if not self.codes:
            return None
        return self._padded([self.kv.requests[s.seq_id].code_rows[:len(s.block_table)] for s in seqs], torch.long)

    def fill_batch(self, done: list[SeqSlice], step: int) -> DecodeBatch:
        """The batch that fills the working sets of requests whose prefill completes this step (their first
        decode step's blocks are predicted from the last computed row, or the draft row in draft modes)."""
        long = lambda xs: host_list_to(xs, torch.long, self.device)  # noqa: E731
        rows = long([self.map.row(s.seq_id) for s in done])
        self.bound.update((s.seq_id, s.context_len // self.bs) for s in done)
        qi = long([s.draft_row if (s.draft_row is not None and self.fill_from_draft)
                   else s.query_start + s.num_query - 1 for s in done])
        blocks = [self.kv.requests[s.seq_id] for s in done]
        n_cand = long([s.context_len // self.bs for s in done])
        return DecodeBatch(
            seq_ids=[s.seq_id for s in done], state_rows=rows, q_rows=qi, draft_rows=qi,
            has_draft=torch.zeros_like(rows, dtype=torch.bool),
            local_block=long([rb.local_block(s.context_len - 1, self.bs) for rb, s in zip(blocks, done)]),
            local_len=rows, num_candidates=n_cand, next_candidates=n_cand,
            summary_table=self._padded([self.kv.requests[s.seq_id].summary_blocks for s in done], torch.long),
            primary_table=self._padded([s.block_table for s in done], torch.long),
            slot_blocks=long([rb.slot_blocks for rb in blocks]), code_table=self._code_table(done),
            max_next_candidates=max(s.context_len // self.bs for s in done), step=step)

    # ---- the static layout of decode-only steps (engine/cuda_graphs.py) -----------------------------------------
    def graph_fields(self, seqs, ctxs, tables, rows, has_draft, fields, static, max_blocks) -> dict:
        """Add the per-request vectors to ``fields`` and update the per-request tables of the static layout;
        returns the dtypes of fields uploaded in another dtype than int64."""
        bs, host = self.bs, self.mode.uses_host_pool
        primary = static.table("primary", max_blocks, 0)
        summary = static.table("summary", cdiv(max_blocks * self.parts, bs), 0, torch.int32)  # the scorer's dtype
        slot_table = static.table("slots", self.map.k_slots, 0) if host else None
        code_table = static.table("codes", max_blocks, 0) if self.codes else None
        sum_rows, reset = [], []
        for seq, ctx, table, row in zip(seqs, ctxs, tables, rows):
            rb = self.kv.requests[seq.seq_id]
            p = ctx - 1
            sum_rows.append(summary_row(rb.summary_blocks, p // self.sb, bs))
            reset.append(int(p % self.sb == 0))
            primary.set(row, seq.seq_id, table)
            summary.set(row, seq.seq_id, rb.summary_blocks)
            if host:
                slot_table.set(row, seq.seq_id, rb.slot_blocks)
            if code_table is not None:
                code_table.set(row, seq.seq_id, rb.code_rows, length=len(table))
        vec = self.decode_vectors([seq.seq_id for seq in seqs], ctxs)
        fields.update(vec)
        if host and self.kv.local_slots > 1:  # a gap column in every step, so the shapes a graph bakes in stay put
            gaps = self.gap_blocks([seq.seq_id for seq in seqs], vec)
            fields["gap_block"] = gaps if gaps is not None else [-1] * len(seqs)
        fields.update(sum_rows=sum_rows, reset=reset, has_draft=[int(d) for d in has_draft])
        # int32 candidate counts: the score and ranking kernels' dtype (converted once per step, not per layer)
        return {"reset": torch.bool, "has_draft": torch.bool, "num_candidates": torch.int32,
                "next_candidates": torch.int32}

    def static_step(self, meta: StepMetadata, st) -> SparseStep:
        """The step's inputs as views of the static buffers (every tensor the forward reads is persistent)."""
        v, t = st.vec, st.tables
        batch = DecodeBatch(
            seq_ids=[s.seq_id for s in meta.seqs], state_rows=v["state_rows"], q_rows=st.q_rows,
            draft_rows=st.draft_rows, has_draft=v["has_draft"], local_block=v["local_block"],
            local_len=v["local_len"], num_candidates=v["num_candidates"], next_candidates=v["next_candidates"],
            summary_table=t["summary"], primary_table=t["primary"], slot_blocks=t.get("slots"),
            local_rows=v.get("local_rows"), max_candidates=st.block_bucket, max_next_candidates=st.block_bucket,
            step=v["step"][0] if self.device_step else meta.step, separate_draft_rows=self.mode.uses_draft,
            gap_block=v.get("gap_block"), code_table=t.get("codes"))
        return SparseStep(written=st.q_rows, writes=SummaryWrites(rows=v["sum_rows"], reset=v["reset"]),
                          decode=batch, decode_slices=list(meta.seqs), static=True,
                          summary_imports=self._summary_imports(meta.seqs))
