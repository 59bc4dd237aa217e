"""Per-request KV block bookkeeping across the device pool and the host pool. No tensors.

What a request holds depends on the mode (one manager, mode flags, no forks):

- full KV on device (dense, sparse-resident): ``device_blocks[j]`` backs logical block j.
- host-pool modes (fetch-on-demand, proxy-prefetch, oasiskv): ``host_blocks[j]`` backs logical block j in
  host memory; the device holds a fixed working set ``ws_blocks``: its first ``local_slots`` blocks are local
  ones (the active block; with ``accept_drafts``, two used in turn by logical block parity, so a block an accepted
  draft completed stays readable while the next fills), the rest the ``top_k_blocks`` selection slots: the working
  set does not grow with context length.
- every sparse mode: ``summary_blocks``: device blocks holding the per-block key min/max rows, one row per
  logical block, ``block_size`` rows per summary block (1/16 of the KV at block size 16); with ``summary_parts``
  P, P rows per logical block (one per run of ``block_size / P`` tokens: sub-block ``p // (block_size / P)``).
- with key codes (``selection_score = "max_logit_b2"``, ``core/summaries.KeyCodes``): ``code_blocks``, device blocks
  holding one code row per logical block, ``code_rows_per_block`` rows each; ``code_rows[j]`` is logical block j's.
- host-pool modes with a device tier (``CacheConfig.device_tier``): once the host pool is full, a request's
  full-KV blocks come from the device pool instead, listed in ``host_blocks`` as ``tier_first + device id``
  (``tier_first`` = the host pool's size), so every path that reads the pool by block id reads either part
  (``ops.uva_gather.PoolTier``). The working sets need a small part of the device KV budget; the tier puts the
  rest to use, at the same budget as dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oasiskv_runtime.config import Mode
from oasiskv_runtime.engine.block_pool import BlockPool
from oasiskv_runtime.engine.sequence import Sequence


ADMIT_WATERMARK = 0.01
"""Fraction of each block pool a new request may not take at admission (kept for running requests to grow)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_slot(table: list[int], pos: int, block_size: int) -> int:
    """The flat slot (block * block_size + offset) of the token at ``pos`` of a request whose logical blocks are
    ``table`` (its primary KV: pool blocks in host-pool modes, device blocks otherwise)."""
    return table[pos // block_size] * block_size + pos % block_size


@dataclass
class RequestBlocks:
    device_blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    ws_blocks: list[int] = field(default_factory=list)
    summary_blocks: list[int] = field(default_factory=list)
    code_blocks: list[int] = field(default_factory=list)
    code_rows: list[int] = field(default_factory=list)
    """The flat code row of each logical block (``code_rows_per_block`` per code block, in order)."""
    num_shared_host: int = 0
    """The first host blocks belong to a prefix cache (prefill-decode, prefill side): never freed here."""
    num_tier: int = 0
    """How many of ``host_blocks`` are device-tier blocks (counted as they are taken: read every step)."""
    capacity: int = 0
    """Tokens the blocks held cover with nothing more to allocate (set by ``KVCacheManager.allocate``; 0: not
    known): a decode step's allocation is then a comparison, not a recount (it runs per request per step)."""

    num_local: int = 1
    """Local blocks at the head of ``ws_blocks`` (host-pool modes)."""

    @property
    def held_device_blocks(self) -> list[int]:
        """Every device block the request holds (full KV, working set, summaries, key codes): what freeing it returns
        to the device pool."""
        return self.device_blocks + self.ws_blocks + self.summary_blocks + self.code_blocks

    @property
    def num_device_blocks(self) -> int:
        return len(self.held_device_blocks)

    @property
    def slot_blocks(self) -> list[int]:
        """The working set's selection slots (host-pool modes)."""
        return self.ws_blocks[self.num_local:]

    def local_block(self, pos: int, block_size: int) -> int:
        """The local device block that holds token ``pos``'s KV while its logical block is active."""
        return self.ws_blocks[(pos // block_size) % self.num_local]


class KVCacheManager:
    def __init__(self, mode: Mode, block_size: int, num_device_blocks: int, num_host_blocks: int,
                 top_k_blocks: int, max_model_len: int, device_tier: bool = False, local_slots: int = 1,
                 summary_parts: int = 1, code_rows_per_block: int = 0) -> None:
        """``local_slots``: local blocks per working set (2 with ``accept_drafts``, see the module docstring);
        ``summary_parts``: summary rows per logical block (``SparseConfig.summary_parts``); ``code_rows_per_block``:
        key-code rows a device block holds (``KeyCodes.rows_per_block``; 0: no key codes)."""
        self.code_rows_per_block = code_rows_per_block
        self.local_slots = local_slots
        self.summary_parts = summary_parts
        self.mode = mode
        self.block_size = block_size
        self.top_k_blocks = top_k_blocks
        self.max_model_len = max_model_len
        self.device_pool = BlockPool(num_device_blocks, "device")
        self.host_pool = BlockPool(num_host_blocks if mode.uses_host_pool else 0, "host")
        self.requests: dict[int, RequestBlocks] = {}
        self.scratch_blocks = (0, 0)
        """(device, host) blocks held by :meth:`add_scratch_request` for good (no request can use them)."""
        self.tier_first: int | None = self.host_pool.num_blocks if (device_tier and mode.uses_host_pool) else None
        """First block id of the device tier in ``host_blocks`` lists (None: no device tier)."""
        self.tier_blocks_used = 0

    # ---- the full-KV store of host-pool modes: the host pool, then (device tier) the device pool ----------
    def _spill(self, need_host: int, free_host: int) -> int | None:
        """Device blocks that ``need_host`` full-KV blocks take beyond ``free_host`` host blocks (None: they do
        not fit, no device tier)."""
        over = max(0, need_host - max(free_host, 0)) + max(0, -free_host)
        if over and self.tier_first is None:
            return None
        return over

    def _take_primary(self, rb: RequestBlocks, n: int) -> None:
        """``n`` more full-KV blocks for ``rb``: from the host pool, the rest (device tier) from the device pool."""
        on_host = n if self.tier_first is None else min(n, self.host_pool.num_free)
        rb.host_blocks += self.host_pool.allocate(on_host)
        if n > on_host:
            rb.host_blocks += [self.tier_first + b for b in self.device_pool.allocate(n - on_host)]
            rb.num_tier += n - on_host
            self.tier_blocks_used += n - on_host

    def _free_primary(self, ids: list[int]) -> None:
        if self.tier_first is None:
            self.host_pool.free(ids)
            return
        tier = [b - self.tier_first for b in ids if b >= self.tier_first]
        self.host_pool.free([b for b in ids if b < self.tier_first])
        self.device_pool.free(tier)
        self.tier_blocks_used -= len(tier)

    def num_ws_slots(self, max_len: int) -> int:
        """Selection slots per request: always ``top_k_blocks`` (uniform shapes let one batched selection and
        one attention launch cover every request; the paper's working set is likewise fixed at K + 1)."""
        return self.top_k_blocks

    def max_len(self, seq: Sequence) -> int:
        return min(len(seq.prompt_token_ids) + seq.params.max_tokens, self.max_model_len)

    def _needs(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """(device blocks, host blocks) a request holds once ``num_tokens`` tokens have KV."""
        nb = cdiv(num_tokens, self.block_size)
        device = self.summary_blocks_for(nb) + self.code_blocks_for(nb) if self.mode.is_sparse else 0
        host = 0
        if self.mode.uses_host_pool:
            host = nb
            device += self.num_ws_slots(self.max_len(seq)) + self.local_slots
        else:
            device += nb
        return device, host

    def summary_blocks_for(self, num_blocks: int) -> int:
        """Summary blocks holding the summaries of ``num_blocks`` logical blocks (``summary_parts`` rows each,
        ``block_size`` rows per summary block)."""
        return cdiv(num_blocks * self.summary_parts, self.block_size)

    def code_blocks_for(self, num_blocks: int) -> int:
        """Device blocks holding the key codes of ``num_blocks`` logical blocks (0 without key codes)."""
        return cdiv(num_blocks, self.code_rows_per_block) if self.code_rows_per_block else 0

    def _take_code_blocks(self, rb: RequestBlocks, n: int) -> None:
        """``n`` more code blocks for ``rb`` and their rows: block ``p``'s K half, then its V half (the layout of
        ``KeyCodes``: the K/V pair ``[2, num_blocks, ...]`` viewed as rows)."""
        half, total = self.code_rows_per_block // 2, self.device_pool.num_blocks
        for p in self.device_pool.allocate(n):
            rb.code_blocks.append(p)
            rb.code_rows += [p * half + i for i in range(half)] + [(total + p) * half + i for i in range(half)]

    def check_fits_alone(self, seq: Sequence) -> None:
        """Raise when the request could not run even with the whole budget to itself."""
        device, host = self._needs(seq, self.max_len(seq))
        usable_device = self.device_pool.num_blocks - self.scratch_blocks[0]
        usable_host = self.host_pool.num_blocks - self.scratch_blocks[1]
        if device > usable_device:
            raise ValueError(
                f"KV cache budget too small for one request: {len(seq.prompt_token_ids)} prompt tokens + "
                f"{seq.params.max_tokens} output tokens need {device} device blocks in mode {self.mode.value}, "
                f"the budget holds {usable_device}; raise kv_cache_bytes (--kv-cache-gb)")
        spill = self._spill(host, usable_host)
        if spill is not None and device + spill > usable_device:
            raise ValueError(
                f"KV cache budget too small for one request: {len(seq.prompt_token_ids)} prompt tokens + "
                f"{seq.params.max_tokens} output tokens need {host} full-KV blocks, the host pool holds "
                f"{usable_host} and the device tier the {usable_device - device} device blocks left after the "
                f"working set; raise host_kv_bytes (--host-kv-gb) or kv_cache_bytes (--kv-cache-gb)")
        if spill is None:
            raise ValueError(
                f"host KV pool too small for one request: needs {host} host blocks, the pool holds "
                f"{usable_host}; raise host_kv_bytes (--host-kv-gb)")

    def add_scratch_request(self, seq: Sequence) -> bool:
        """Give ``seq`` (a one-token request that never runs) blocks of its own for good: the padding rows of a
        CUDA-graph batch (engine/cuda_graphs.py) compute as this request at position 0, so everything they write
        (their token's KV, its key summary and code, in host-pool modes the host row and the local block) lands in blocks
        no real request reads. Its working-set slots all alias its local block: a request at position 0 has no
        candidate blocks, so nothing is ever fetched into them. False (nothing held) when the pools are short."""
        codes = int(self.code_rows_per_block > 0)  # one code block (its rows), taken last
        need_device = 1 + int(self.mode.is_sparse) + codes
        need_host = int(self.mode.uses_host_pool)
        if need_device > self.device_pool.num_free or need_host > self.host_pool.num_free:
            return False
        dev = self.device_pool.allocate(need_device - codes)
        rb = RequestBlocks()
        if self.mode.uses_host_pool:
            rb.host_blocks = self.host_pool.allocate(need_host)
            rb.ws_blocks = [dev[0]] * (self.num_ws_slots(1) + 1)
        else:
            rb.device_blocks = [dev[0]]
        rb.summary_blocks = dev[1:2]
        self._take_code_blocks(rb, codes)
        self.requests[seq.seq_id] = rb
        self.scratch_blocks = (self.scratch_blocks[0] + need_device, self.scratch_blocks[1] + need_host)
        return True

    def pending_needs(self, seq: Sequence) -> tuple[int, int]:
        """(device, host) blocks ``seq`` still has to get to hold KV for all its current tokens."""
        rb = self.requests.get(seq.seq_id)
        device, host = self._needs(seq, seq.num_tokens)
        return (max(0, device - (rb.num_device_blocks if rb else 0)),
                max(0, host - (len(rb.host_blocks) if rb else 0)))

    def can_admit(self, seq: Sequence, reserved: tuple[int, int] = (0, 0)) -> bool:
        """Whether a waiting request's whole pending context (not just its first prefill chunk) fits in the free
        blocks left after ``reserved`` (what running requests still need for their own pending prompts) and
        ``ADMIT_WATERMARK`` of each pool (room for running requests to grow, as vLLM's watermark). Admitting on
        the first chunk alone let long prompts in whose later chunks could not get blocks: they were preempted
        and re-admitted over and over (dense, 16K prompts in 8K chunks on the H200: 31 preemptions for 32
        requests)."""
        need_device, need_host = self.pending_needs(seq)
        keep_device = int(ADMIT_WATERMARK * self.device_pool.num_blocks) + reserved[0]
        keep_host = int(ADMIT_WATERMARK * self.host_pool.num_blocks) + reserved[1]
        spill = self._spill(need_host, self.host_pool.num_free - keep_host)
        return spill is not None and need_device + spill <= self.device_pool.num_free - keep_device

    def _capacity(self, rb: RequestBlocks) -> int:
        """Most tokens ``rb``'s blocks hold with nothing to allocate (each kind of block checked on its own, as
        :meth:`allocate` takes them: never more than :meth:`_needs` allows)."""
        bs = self.block_size
        if self.mode.uses_host_pool:
            cap = len(rb.host_blocks) * bs if rb.ws_blocks else 0
        else:
            cap = len(rb.device_blocks) * bs
        if self.mode.is_sparse:
            cap = min(cap, len(rb.summary_blocks) * bs * (bs // self.summary_parts))
        if self.code_rows_per_block:
            cap = min(cap, len(rb.code_rows) * bs)
        return cap

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``. All or nothing; False when out of blocks."""
        rb = self.requests.get(seq.seq_id)
        if rb is not None and seq.num_computed_tokens + num_new_tokens <= rb.capacity:
            return True  # most decode steps: the token fits the blocks held
        rb = self.requests.setdefault(seq.seq_id, RequestBlocks())
        device, host = self._needs(seq, seq.num_computed_tokens + num_new_tokens)
        need_device = max(0, device - rb.num_device_blocks)
        need_host = max(0, host - len(rb.host_blocks))
        spill = self._spill(need_host, self.host_pool.num_free)
        if spill is None or need_device + spill > self.device_pool.num_free:
            if not rb.num_device_blocks and not rb.host_blocks:
                del self.requests[seq.seq_id]
            return False
        if self.mode.uses_host_pool:
            self._take_primary(rb, need_host)
            if not rb.ws_blocks:
                n_ws = self.num_ws_slots(self.max_len(seq)) + self.local_slots
                rb.ws_blocks, rb.num_local = self.device_pool.allocate(n_ws), self.local_slots
                need_device -= n_ws
        if self.mode.is_sparse:
            nb = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
            n_sum = self.summary_blocks_for(nb)
            n_sum = max(0, n_sum - len(rb.summary_blocks))
            rb.summary_blocks += self.device_pool.allocate(n_sum)
            need_device -= n_sum
            n_code = max(0, self.code_blocks_for(nb) - len(rb.code_blocks))
            self._take_code_blocks(rb, n_code)
            need_device -= n_code
        if not self.mode.uses_host_pool:
            rb.device_blocks += self.device_pool.allocate(need_device)
        rb.capacity = self._capacity(rb)
        return True

    def free(self, seq: Sequence) -> None:
        rb = self.requests.pop(seq.seq_id, None)
        if rb is None:
            return
        self.device_pool.free(rb.held_device_blocks)
        self._free_primary(rb.host_blocks[rb.num_shared_host:])

    def attach_prefix(self, seq: Sequence, host_blocks: list[int]) -> None:
        """Start a waiting request with KV already in these host blocks (a prefix-cache hit): its first
        ``len(host_blocks)`` blocks are shared, read-only, and not freed with the request."""
        if not self.mode.uses_host_pool:
            raise ValueError("prefix blocks live in the host pool: a host-pool mode is needed")
        if seq.seq_id in self.requests:
            raise ValueError("attach_prefix before the request's first allocation")
        self.requests[seq.seq_id] = RequestBlocks(host_blocks=list(host_blocks), num_shared_host=len(host_blocks))

    def detach_host_blocks(self, seq: Sequence) -> list[int]:
        """Take a request's host blocks out of its bookkeeping without freeing them (prefill-decode: the
        prefill side keeps the prompt's KV staged after the request leaves the engine). The caller frees
        them with :meth:`free_host_blocks`."""
        rb = self.requests.get(seq.seq_id)
        if rb is None:
            return []
        blocks, rb.host_blocks, rb.num_tier, rb.capacity = rb.host_blocks, [], 0, 0
        return blocks

    def free_host_blocks(self, blocks: list[int]) -> None:
        self._free_primary(blocks)

    def blocks(self, seq: Sequence) -> RequestBlocks:
        return self.requests[seq.seq_id]

    def device_blocks_held(self, seq: Sequence) -> int:
        """Device blocks the request holds: working set, summaries, full KV on the device (dense modes and the
        device tier)."""
        rb = self.requests.get(seq.seq_id)
        return rb.num_device_blocks + rb.num_tier if rb else 0
