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
state); the host-pool modes will take stable rows from the KV connector's metadata. Decode values are computed on the device from ``seq_lens`` (exact even
when the host only has an upper bound, as under asynchronous scheduling with speculation); only the prefill runs are
planned on the host.

Key summaries are indexed by the physical block of vLLM's paged cache (one ``[Hkv, D]`` row per block), not by
request: a block's summary describes its content, so it needs no per-request slot, stays right when prefix caching
shares a block between requests, and is rebuilt when vLLM reuses the block (its first write resets it). With a
summary tensor of shape ``[num_blocks, 1, Hkv, D]`` the ops' paged-summary convention ("logical block ``j`` is row
``j % S`` of summary block ``table[b, j // S]``", ``S`` = the tensor's dim 1) reads it with ``S = 1`` and vLLM's
block table as the summary table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv_runtime.core.batch import DecodeBatch


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
    """[R] int64: physical block of each run (= its summary row)."""
    pad_idx: torch.Tensor
    """[R * block_size] int64: per run, indices into the gathered ``[R * block_size]`` cache rows: its valid rows,
    then copies of its first (min / max are idempotent)."""
    reset: torch.Tensor
    """[R] bool, all True."""


@dataclass
class StepPlan:
    batch: DecodeBatch | None
    """The leading decode requests, or None when there are none."""
    runs: SummaryRuns | None
    """Summary rebuilds of every request's touched blocks, or None when nothing is written."""
    num_decodes: int
    num_decode_tokens: int


def _runs(blocks: torch.Tensor, valid: torch.Tensor, block_size: int) -> SummaryRuns:
    r = blocks.numel()
    dev = blocks.device
    col = torch.arange(block_size, device=dev).view(1, block_size)
    base = (torch.arange(r, device=dev) * block_size).view(r, 1)
    pad_idx = (base + torch.where(col < valid.view(r, 1), col, torch.zeros_like(col))).flatten()
    return SummaryRuns(blocks=blocks.long(), pad_idx=pad_idx, reset=torch.ones(r, dtype=torch.bool, device=dev))


def decode_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 num_decodes: int, max_seq_len: int, block_size: int) -> tuple[DecodeBatch, torch.Tensor, torch.Tensor]:
    """The leading ``num_decodes`` requests as a :class:`DecodeBatch`, plus their summary runs' blocks and valid
    rows (two runs per request: the token's block and the last written row's block, identical when they coincide).

    Device tensors in, device tensors out: no host sync. ``max_seq_len`` is a host-side upper bound of ``seq_lens``.
    """
    nd, bs = num_decodes, block_size
    qsl = query_start_loc[:nd + 1].long()
    qlen = qsl[1:] - qsl[:-1]
    seq = seq_lens[:nd].long()
    table = block_table[:nd]
    ctx = seq - (qlen - 1)          # tokens with KV up to and including the request's token (its draft excluded)
    pos = ctx - 1                   # the token's position
    j_tok = pos // bs
    j_last = (seq - 1) // bs        # block of the last row written this step (the draft's, when it has one)
    blocks_at = lambda j: table.gather(1, j.view(-1, 1)).view(-1).long()  # noqa: E731
    batch = DecodeBatch(
        seq_ids=list(range(nd)),
        state_rows=torch.arange(nd, device=seq.device),
        q_rows=qsl[:-1],
        draft_rows=qsl[:-1] + qlen - 1,
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
    return batch, run_blocks, run_valid


def prefill_runs(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, block_table: torch.Tensor,
                 first: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks touched by requests ``first..R-1`` (prefill chunks) and their valid rows after this step, planned on the
    host (prefill rows' host lengths are exact) and looked up in ``block_table`` on its device."""
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
        return empty, empty
    r_t = torch.tensor(reqs, dtype=torch.long).to(dev)
    j_t = torch.tensor(logical, dtype=torch.long).to(dev)
    return block_table[r_t, j_t].long(), torch.tensor(valid, dtype=torch.long).to(dev)


def plan_step(query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor, seq_lens: torch.Tensor,
              seq_lens_cpu: torch.Tensor | None, block_table: torch.Tensor, num_decodes: int, max_seq_len: int,
              block_size: int) -> StepPlan:
    """Everything the OasisKV layers of one step read: the decode batch and the summary runs.

    ``num_decodes``: the leading requests served by sparse decode (query length 1 or 2). ``seq_lens_cpu``: exact
    host lengths of the other requests (None when there are none). Trailing requests with no query rows (padding)
    are skipped.
    """
    starts = query_start_loc_cpu
    while num_decodes and int(starts[num_decodes] - starts[num_decodes - 1]) == 0:
        num_decodes -= 1  # padded requests sort after the real decodes
    num_decode_tokens = int(starts[num_decodes]) if num_decodes else 0
    batch = None
    blocks, valid = [], []
    if num_decodes:
        batch, b, v = decode_batch(query_start_loc, seq_lens, block_table, num_decodes, max_seq_len, block_size)
        blocks.append(b)
        valid.append(v)
    if starts.numel() - 1 > num_decodes:
        if seq_lens_cpu is None:
            raise ValueError("plan_step: prefill requests need their host seq_lens")
        b, v = prefill_runs(starts, seq_lens_cpu, block_table, num_decodes, block_size)
        blocks.append(b)
        valid.append(v)
    runs = None
    if blocks and sum(b.numel() for b in blocks):
        runs = _runs(torch.cat(blocks), torch.cat(valid), block_size)
    return StepPlan(batch=batch, runs=runs, num_decodes=num_decodes, num_decode_tokens=num_decode_tokens)
