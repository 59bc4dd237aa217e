"""The per-step batch the OasisKV backend builds from vLLM's attention metadata (no vLLM import: plain tensors in).

vLLM hands a metadata builder, once per step, the flattened batch: ``query_start_loc`` ``[R+1]``, ``seq_lens`` ``[R]``
(tokens with KV once this step's rows are written, drafts included), ``block_table`` ``[R, NB]`` (physical block of
each logical block of ``block_size`` tokens). With the batch reordered decode-first, the leading ``num_decodes``
requests have one or two query rows:

* one row: a plain decode (or a one-token prefill chunk);
* two rows, ``[last token, draft]``: a speculative-decoding verify step with one draft token (or a two-token
  chunk, which the same layout serves exactly: row 1 sees everything row 0 sees, plus its own KV).

From those the builder makes the core's :class:`~oasiskv_runtime.core.batch.DecodeBatch` (what the embedded engine's
model runner builds too: one batch type, one set of core calls) and :class:`SummaryRuns`, the blocks whose key
summaries this step rewrites. ``state_rows`` are the batch positions here (sparse-resident keeps no per-request
state); the host-pool modes map them to stable rows (:func:`host_pool_batch`, ``vllm/host_pool.py``). Decode values
are computed on the device from ``seq_lens`` (exact even when the host only has an upper bound, as under
asynchronous scheduling with speculation); only the prefill runs are planned on the host.

In sparse-resident, key summaries are indexed by the physical block of vLLM's paged cache (one ``[Hkv, D]`` row per
block), not by request: a block's summary describes its content, so it needs no per-request slot, stays right when
prefix caching shares a block between requests, and is rebuilt when vLLM reuses the block (its first write resets
it). With a summary tensor of shape ``[num_blocks, 1, Hkv, D]`` the ops' paged-summary convention ("logical block
``j`` is row ``j % S`` of summary block ``table[b, j // S]``", ``S`` = the tensor's dim 1) reads it with ``S = 1``
and vLLM's block table as the summary table. The host-pool modes key them, and the pool, by (state row, logical
block) instead (vLLM frees a decoding request's blocks: ``vllm/kv_spec.py``), and pass that table
(``host_table``) where sparse-resident passes vLLM's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from oasiskv_runtime.core.batch import DecodeBatch
from oasiskv_runtime.ops.common import host_list_to


@dataclass
class SummaryRuns:
    """Blocks whose summaries this step rebuilds from the paged cache, in the run layout of
    :func:`oasiskv_runtime.ops.summary_update.update_summaries_runs` (every run resets its row).

    Each run is one physical block and its first ``n`` valid rows as of this step (``n`` counts every token written
    so far, this step's included). Rebuilding a touched block from the cache rather than folding the step's new keys
    in keeps summaries exact under speculative decoding: a rejected draft's KV stays in the cache until the next
    step overwrites it, and that step rebuilds the block without it.
    """

    blocks: torch.Tensor
    """[R] int64: physical block of each run (read from the paged cache; sparse-resident: also its summary row)."""
    reqs: torch.Tensor
    """[R] int64: the run's request (its index in the step's batch)."""
    logical: torch.Tensor
    """[R] int64: the run's logical block in its request (the host-pool modes key summaries by request row and
    logical block: ``HostPoolRuntime.summary_dest``)."""
    pad_idx: torch.Tensor
    """[R * block_size] int64: per run, indices into the gathered ``[R * block_size]`` cache rows: its valid rows,
    then copies of its first (min / max are idempotent)."""
    reset: torch.Tensor
    """[R] bool, all True."""


class StepPlan:
    """Everything the OasisKV layers of one step read: the decode batch and the summary runs.

    The builder plans the step on the host; the device tensors of its decode part are made by the first layer that
    reads :attr:`batch` or :attr:`runs`, inside the forward. Under a full CUDA graph that first layer runs inside
    the capture, so the graph holds the ops that derive the batch from vLLM's persistent input buffers and a replay
    recomputes them from the replayed step's values (a batch made in the builder, outside the capture, would be
    replayed stale)."""

    def __init__(self, num_decodes: int = 0, num_decode_tokens: int = 0, make: Callable[[], tuple] | None = None,
                 num_real: int | None = None) -> None:
        """``make() -> (batch, runs, real_rows)``: the device part (None: nothing to decode or rebuild)."""
        self._batch: DecodeBatch | None = None
        self._runs: SummaryRuns | None = None
        self._real: torch.Tensor | None = None
        self._make = make
        self.num_decodes = num_decodes
        """Leading requests served by sparse decode (padded requests included on the static layout)."""
        self.num_decode_tokens = num_decode_tokens
        self.num_real = num_decodes if num_real is None else num_real
        """The decode requests that are requests (not CUDA-graph padding), known on the host."""

    def _resolve(self) -> None:
        if self._make is not None:
            make, self._make = self._make, None
            self._batch, self._runs, self._real = make()

    @property
    def batch(self) -> DecodeBatch | None:
        """The leading decode requests, or None when there are none."""
        self._resolve()
        return self._batch

    @property
    def runs(self) -> SummaryRuns | None:
        """Summary rebuilds of every request's touched blocks, or None when nothing is written."""
        self._resolve()
        return self._runs

    @property
    def real_rows(self) -> torch.Tensor | None:
        """[B] bool: the decode rows that are requests (False: CUDA-graph padding), None without decodes."""
        self._resolve()
        return self._real


def _runs(blocks: torch.Tensor, valid: torch.Tensor, reqs: torch.Tensor, logical: torch.Tensor,
          block_size: int) -> SummaryRuns:
    r = blocks.numel()
    dev = blocks.device
    col = torch.arange(block_size, device=dev).view(1, block_size)
    base = (torch.arange(r, device=dev) * block_size).view(r, 1)
    pad_idx = (base + torch.where(col < valid.view(r, 1), col, torch.zeros_like(col))).flatten()
    return SummaryRuns(blocks=blocks.long(), reqs=reqs.long(), logical=logical.long(), pad_idx=pad_idx,
                       reset=torch.ones(r, dtype=torch.bool, device=dev))


def decode_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 num_decodes: int, max_seq_len: int, block_size: int
                 ) -> tuple[DecodeBatch, tuple[torch.Tensor, ...], torch.Tensor]:
    """The leading ``num_decodes`` requests as a :class:`DecodeBatch`, plus their summary runs' (blocks, valid rows,
    requests, logical blocks) (two runs per request: the token's block and the last written row's block, identical
    when they coincide), and ``real`` [B] bool (False for padded requests).

    Padded requests (vLLM pads a CUDA-graph batch with requests of no query rows, ``seq_lens`` 0 and null-block
    table rows) come out harmless: their rows point at the first token row after the real ones (padding too), they
    have no candidates, and their runs rebuild the null block's summary from its row 0.

    Device tensors in, device tensors out: no host sync. ``max_seq_len`` is a host-side upper bound of ``seq_lens``.
    """
    nd, bs = num_decodes, block_size
    qsl = query_start_loc[:nd + 1].long()
    qlen = qsl[1:] - qsl[:-1]
    real = qlen > 0
    seq = seq_lens[:nd].long()
    table = block_table[:nd]
    ctx = seq - (qlen - 1)          # tokens with KV up to and including the request's token (its draft excluded)
    pos = ctx - 1                   # the token's position
    j_tok = pos // bs
    j_last = torch.clamp((seq - 1) // bs, min=0)  # block of the last row written this step (the draft's, if any)
    blocks_at = lambda j: table.gather(1, j.view(-1, 1)).view(-1).long()  # noqa: E731
    q_rows = qsl[:-1]
    batch = DecodeBatch(
        seq_ids=list(range(nd)),
        state_rows=torch.arange(nd, device=seq.device),
        q_rows=q_rows,
        draft_rows=torch.where(real, q_rows + qlen - 1, q_rows),
        has_draft=qlen > 1,
        local_block=blocks_at(j_tok),
        local_len=pos % bs + 1,
        num_candidates=j_tok.int(),
        next_candidates=(ctx // bs).int(),
        summary_table=table.int(),
        primary_table=table.long(),
        max_candidates=max(0, (max_seq_len - 1) // bs),
        max_next_candidates=max(0, max_seq_len // bs),
    )
    run_blocks = torch.cat([blocks_at(j_tok), blocks_at(j_last)])
    run_valid = torch.cat([torch.clamp(seq - j_tok * bs, max=bs), seq - j_last * bs])
    reqs = torch.arange(nd, device=seq.device)
    return batch, (run_blocks, run_valid, torch.cat([reqs, reqs]), torch.cat([j_tok, j_last])), real


def prefill_runs(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, block_table: torch.Tensor,
                 first: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """Blocks touched by requests ``first..R-1`` (prefill chunks), their valid rows after this step, their requests
    and logical blocks, planned on the host (prefill rows' host lengths are exact) and looked up in ``block_table``
    on its device."""
    bs = block_size
    reqs: list[int] = []
    logical: list[int] = []
    valid: list[int] = []
    starts = query_start_loc_cpu.tolist()
    lens = seq_lens_cpu.tolist()
    for r in range(first, len(starts) - 1):
        num_query, seq = starts[r + 1] - starts[r], int(lens[r])
        if num_query <= 0:
            continue
        for j in range((seq - num_query) // bs, (seq - 1) // bs + 1):
            reqs.append(r)
            logical.append(j)
            valid.append(min(bs, seq - j * bs))
    dev = block_table.device
    if not reqs:
        empty = torch.empty(0, dtype=torch.long, device=dev)
        return empty, empty, empty, empty
    # pinned, non-blocking uploads: a pageable copy would make the host wait for the GPU's queued work (the last
    # step's forward) in every prefill step (three host syncs per step in the H200 profile)
    r_t, j_t, v_t = (host_list_to(x, torch.long, dev) for x in (reqs, logical, valid))
    return block_table[r_t, j_t].long(), v_t, r_t, j_t


def plan_step(query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor, seq_lens: torch.Tensor,
              seq_lens_cpu: torch.Tensor | None, block_table: torch.Tensor, num_decodes: int, max_seq_len: int,
              block_size: int, static: bool = False) -> StepPlan:
    """The step's :class:`StepPlan`: its host part now, its decode part's device tensors when a layer first reads
    them (no host sync either way).

    ``num_decodes``: the leading requests served by sparse decode (query length 1 or 2). ``seq_lens_cpu``: exact
    host lengths of the other requests (None when there are none). Trailing requests with no query rows (padding)
    are dropped, unless ``static``: a decode-only step that vLLM may replay from a full CUDA graph keeps its padded
    batch (the graph was captured for that size; :func:`decode_batch` makes the padding harmless).
    """
    starts = query_start_loc_cpu
    num_real = num_decodes
    while num_real and int(starts[num_real] - starts[num_real - 1]) == 0:
        num_real -= 1  # padded requests sort after the real decodes
    if not static:
        num_decodes = num_real
    num_decode_tokens = int(starts[num_decodes]) if num_decodes else 0
    prefill = None
    if int(starts[-1]) > num_decode_tokens:  # query rows after the decodes (not only padding): prefill chunks
        if seq_lens_cpu is None:
            raise ValueError("plan_step: prefill requests need their host seq_lens")
        prefill = prefill_runs(starts, seq_lens_cpu, block_table, num_decodes, block_size)
        if not prefill[0].numel():
            prefill = None
    if not num_decodes and prefill is None:
        return StepPlan(num_decode_tokens=num_decode_tokens)

    def make() -> tuple:
        batch = real = None
        parts = []
        if num_decodes:
            batch, runs, real = decode_batch(query_start_loc, seq_lens, block_table, num_decodes, max_seq_len,
                                             block_size)
            parts.append(runs)
        if prefill is not None:
            parts.append(prefill)
        return batch, _runs(*(torch.cat(xs) for xs in zip(*parts)), block_size), real

    return StepPlan(num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, make=make, num_real=num_real)


# ---------------------------------------------------------------------------------------------------------------
# Host-pool modes (proxy-prefetch, oasiskv): the same batch over the per-request working sets
# ---------------------------------------------------------------------------------------------------------------
LOCAL_SLOTS = 2
"""Device blocks per request row before its ``K`` selection slots: the active block's, alternating by the parity of
its logical block (see :func:`host_pool_batch`)."""


def working_set_base(rows: torch.Tensor, k_slots: int) -> torch.Tensor:
    """First device block of each state row's working set (``LOCAL_SLOTS + K`` blocks per row)."""
    return rows.long() * (k_slots + LOCAL_SLOTS)


def selection_blocks(rows: torch.Tensor, k_slots: int) -> torch.Tensor:
    """``[B, K]`` device block of each selection slot of each row (the core's ``DecodeBatch.slot_blocks``)."""
    slots = torch.arange(k_slots, device=rows.device) + LOCAL_SLOTS
    return working_set_base(rows, k_slots)[:, None] + slots[None, :]


@dataclass
class HostPoolBatch:
    """One step's decode requests over their working sets (what the OasisKV layers of a host-pool mode read).

    The working set of state row ``r`` is ``LOCAL_SLOTS + K`` device blocks from ``r * (K + 2)``: two local slots,
    then the ``K`` selection slots of the per-head map (``core.head_map.HeadMap``). The active block (logical block
    ``j`` of the token) lives in local slot ``j % 2``. Two, not one, because vLLM accepts drafts: when the draft at
    ``p + 1`` completes block ``j`` and is accepted, the next token is ``p + 2`` in block ``j + 1``, and block ``j`` is
    a full candidate that the last prediction could not rank (a prediction ranks only blocks whose every row is
    final, and the draft's was not). Its rows are all in local slot ``j % 2`` (the token and draft rows are written
    there as they are computed), so that step attends it there (``gap_block``) while the new active block fills
    the other slot; the next prediction ranks it like any other block.
    """

    batch: DecodeBatch
    """The core's batch: state rows, ``local_block`` = the active block's local slot, ``slot_blocks``, candidate
    counts (0 for rows without a working set: nothing is predicted or copied for them)."""
    ready: torch.Tensor
    """[B] bool: the request has a working set (its prefill completed); other rows are prefill chunks of one or two
    tokens, which attend vLLM's own cache (:attr:`resident`)."""
    gap_block: torch.Tensor
    """[B] int64: the local slot holding the block before the active one where the last prediction could not rank it
    (an accepted draft completed it), else -1."""
    local_dst: torch.Tensor
    """[2B] flat working-set rows the step's token rows then draft rows are written to (a request without a draft
    writes its token row twice)."""
    local_src: torch.Tensor
    """[2B] rows of the step's K/V written there (``q_rows`` then ``draft_rows``)."""
    next_bound: torch.Tensor
    """[B] int32: the candidate count this step's prediction ranks, per row (the next step's gap test reads it)."""
    resident: DecodeBatch
    """The batch over vLLM's own paged cache (:func:`plan_step`'s), for rows without a working set."""


def host_pool_batch(b: DecodeBatch, rows: torch.Tensor, ready: torch.Tensor, bound: torch.Tensor, k_slots: int,
                    block_size: int, step: int, host_table: torch.Tensor) -> HostPoolBatch:
    """The :class:`HostPoolBatch` of :func:`plan_step`'s decode batch ``b``, on the device (no host sync).

    ``rows`` [B]: each request's state row; ``ready`` [B]: whether it has a working set; ``bound`` [B]: the candidate
    count its last prediction ranked (:attr:`HostPoolBatch.next_bound` of its previous step, or of its fill);
    ``host_table`` [B, NB]: each request's pool block (= summary row) of each logical block.
    """
    bs = block_size
    rows = rows.long()
    base = working_set_base(rows, k_slots)
    nc = b.num_candidates.long()
    pos = nc * bs + b.local_len.long() - 1                      # the token's position
    local = base + nc % LOCAL_SLOTS
    draft_pos = pos + 1
    tok_dst = local * bs + pos % bs
    draft_dst = (base + (draft_pos // bs) % LOCAL_SLOTS) * bs + draft_pos % bs
    draft_dst = torch.where(b.has_draft, draft_dst, tok_dst)
    gap = ready & (nc > bound.long())
    gap_block = torch.where(gap, base + (nc - 1) % LOCAL_SLOTS, torch.full_like(base, -1))
    zero = torch.zeros_like(b.num_candidates)
    num_candidates = torch.where(ready, b.num_candidates, zero)
    next_candidates = torch.where(ready, b.next_candidates, zero)
    table = host_table.int()  # the summaries' and the key codes' rows
    core = dataclasses.replace(
        b, seq_ids=list(b.seq_ids), state_rows=rows, local_block=local, num_candidates=num_candidates,
        next_candidates=next_candidates, slot_blocks=selection_blocks(rows, k_slots), step=step, _memo={},
        summary_table=table, code_table=table, primary_table=host_table, gap_block=gap_block)
    return HostPoolBatch(batch=core, ready=ready, gap_block=gap_block, local_dst=torch.cat([tok_dst, draft_dst]),
                         local_src=torch.cat([b.q_rows, b.draft_rows]), next_bound=next_candidates, resident=b)


@dataclass
class FillBatch:
    """Requests whose prefill completes this step: the core's batch for ``LookaheadPipeline.fill`` and where each
    request's prompt tail goes."""

    batch: DecodeBatch
    """q_rows = the last prompt row; candidates = the full prompt blocks (the first decode step's)."""
    tail_src: torch.Tensor
    """[F] vLLM block holding the prompt's last, partial block (any block when the prompt ends on a boundary: the
    first decode step writes its row 0 and masks the rest)."""
    tail_dst: torch.Tensor
    """[F] the local slot the first decode step's active block lives in."""
    table: torch.Tensor
    """[F, NB] each request's row of vLLM's block table (where its prompt's keys are)."""


def fill_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               first_blocks: torch.Tensor, rows: torch.Tensor, k_slots: int, block_size: int, max_seq_len: int,
               step: int, seq_ids: list, host_table: torch.Tensor) -> FillBatch:
    """The :class:`FillBatch` of the requests whose first physical blocks are ``first_blocks`` [F] (state rows
    ``rows`` [F], pool blocks ``host_table`` [F, NB] as in :func:`host_pool_batch`), found in this step's block table
    on the device (no host sync)."""
    bs = block_size
    table = block_table.long()
    match = table[:, 0][None, :] == first_blocks.long()[:, None]          # [F, R]
    bi = match.int().argmax(dim=1)
    qsl = query_start_loc.long()
    n = seq_lens.long()[bi]                                              # the prompt's tokens
    q_rows = qsl[bi + 1] - 1
    nc = (n // bs).int()
    req_table = table[bi]
    rows = rows.long()
    base = working_set_base(rows, k_slots)
    col = torch.clamp(n // bs, max=table.shape[1] - 1)
    batch = DecodeBatch(
        seq_ids=list(seq_ids), state_rows=rows, q_rows=q_rows, draft_rows=q_rows,
        has_draft=torch.zeros_like(rows, dtype=torch.bool), local_block=base + (n // bs) % LOCAL_SLOTS,
        local_len=n % bs, num_candidates=nc, next_candidates=nc, summary_table=host_table.int(),
        code_table=host_table.int(), primary_table=host_table.long(), slot_blocks=selection_blocks(rows, k_slots),
        max_candidates=max(0, max_seq_len // bs), max_next_candidates=max(0, max_seq_len // bs), step=step)
    return FillBatch(batch=batch, tail_src=req_table.gather(1, col[:, None]).view(-1), tail_dst=batch.local_block,
                     table=req_table)
