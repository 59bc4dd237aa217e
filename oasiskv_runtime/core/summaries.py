"""Compressed key summaries (SPEC item 2, Quest): per logical block and KV head, the element-wise min and max of
the block's keys, two rows per block (1/16 of the full KV at block size 16).

Where they live: rows of per-layer ``[num_blocks, block_size, Hkv, D]`` tensors, ``block_size`` summary rows per
block. The embedded engine keeps them in blocks of its device KV cache (mins in the K tensor, maxes in the V
tensor), so they count against the same device budget as the working sets; a request's summary blocks are listed
in ``DecodeBatch.summary_table``. They stay on the device: prediction reads them there, and only a hand-off to a
peer (prefill-decode) copies them out.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.core.batch import SummaryWrites
from oasiskv_runtime.ops.key_codes import check_code_bits, pack_codes_into
from oasiskv_runtime.ops.summary_update import update_summaries, update_summaries_runs


class KeySummaries:
    """``mins[l]`` / ``maxs[l]``: layer ``l``'s summary storage, ``[num_blocks, block_size, Hkv, D]``."""

    def __init__(self, mins: list[torch.Tensor], maxs: list[torch.Tensor], backend: str = "auto") -> None:
        self.mins, self.maxs, self.backend = mins, maxs, backend
        self.num_layers = len(mins)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(mins, maxs)`` storage (the scoring kernels index it by summary table)."""
        return self.mins[layer], self.maxs[layer]

    def update(self, layer: int, k_new: torch.Tensor, writes: SummaryWrites) -> None:
        """Fold this step's written keys ``k_new: [n, Hkv, D]`` into their blocks' summaries (in place)."""
        if writes.runs is not None:
            update_summaries_runs(k_new, *writes.runs, self.mins[layer], self.maxs[layer], backend=self.backend)
        elif writes.rows is not None and writes.rows.numel():  # decode rows only: one token per summary row
            update_summaries(k_new, writes.rows, writes.reset, self.mins[layer], self.maxs[layer],
                             assume_distinct=True, backend=self.backend)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])

    def write(self, rows: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> None:
        """Summaries made elsewhere, ``[L, n, Hkv, D]``, into flat rows ``rows: [n]`` of every layer (a request
        handed over by a prefill peer, or the shared prefix of a prefix-cache hit)."""
        for layer in range(self.num_layers):
            for store, src in ((self.mins[layer], mins), (self.maxs[layer], maxs)):
                self._flat(store)[rows] = src[layer].to(store.device, store.dtype)

    def export(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows: [n]`` of every layer as ``([L, n, Hkv, D], [L, n, Hkv, D])`` CPU tensors (mins, maxs)."""
        pick = lambda stores: torch.stack([self._flat(s)[rows] for s in stores]).cpu()  # noqa: E731
        return pick(self.mins), pick(self.maxs)


class KeyCodes:
    """Keys coded in ``bits`` bits per dimension within their block's min/max (``ops/key_codes.py``; what
    ``selection_score = "max_logit_b2"`` ranks by): one code row ``[block_size, Hkv, D * bits / 8]`` uint8 per logical
    block. On the embedded engine they live in blocks of the device KV cache, as the summaries do, so they count
    against the same budget: a cache block's K and V bytes hold :meth:`rows_per_block` code rows (16 for bf16 at 2
    bits: 1/16 of the KV per logical block); the vLLM front end keeps them in storage of their own beside its
    summaries (:meth:`allocate`). ``codes[l]`` views layer ``l``'s K/V pair ``[2, num_blocks, block_size, Hkv, D]`` as
    code rows:
    block ``p``'s K bytes are rows ``p * h .. p * h + h - 1`` and its V bytes rows ``(num_blocks + p) * h ..``, with
    ``h`` = half of :meth:`rows_per_block` (``engine/kv_cache_manager.py`` lists a request's rows).

    A block's codes are final once it is full (its min/max no longer move): the engine writes a block's row from its
    keys when a prefill chunk fills it, and at every decode step the active block's (partial until the step that
    fills it, whose write is the last; a selection ranks only full blocks)."""

    def __init__(self, storage: list[torch.Tensor], block_size: int, num_kv_heads: int, head_dim: int, bits: int,
                 backend: str = "auto") -> None:
        """``storage``: one contiguous tensor per layer whose bytes hold the code rows (:meth:`in_cache`,
        :meth:`allocate`)."""
        check_code_bits(bits, head_dim)
        self.bits, self.backend = bits, backend
        # stored head-major (a code row's KV heads one after another, each head's keys contiguous) and read in the
        # cache's order [rows, block_size, Hkv, bytes]: a candidate's codes for one head are one run of
        # block_size * D * bits / 8 bytes (the tensor-core and tile kernels read them 1.2x / 1.4x faster so on the H100,
        # docs/accuracy.md)
        row = (num_kv_heads, block_size, head_dim * bits // 8)
        self.codes = [t.view(torch.uint8).view(-1, *row).permute(0, 2, 1, 3) for t in storage]

    @classmethod
    def in_cache(cls, kv_pairs: list[torch.Tensor], bits: int, backend: str = "auto") -> "KeyCodes":
        """Code rows in blocks of a KV cache: layer ``l``'s K/V pair ``[2, num_blocks, block_size, Hkv, D]`` (the
        embedded engine's)."""
        _, _, bs, hkv, d = kv_pairs[0].shape
        return cls(kv_pairs, bs, hkv, d, bits, backend)

    @classmethod
    def allocate(cls, num_layers: int, rows: int, block_size: int, num_kv_heads: int, head_dim: int, bits: int,
                 device: torch.device, backend: str = "auto") -> "KeyCodes":
        """``rows`` zeroed code rows per layer in storage of their own (the vLLM front end's, addressed as its
        summaries: one row per pool block)."""
        check_code_bits(bits, head_dim)
        shape = (rows, num_kv_heads, block_size, head_dim * bits // 8)
        return cls([torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(num_layers)], block_size,
                   num_kv_heads, head_dim, bits, backend)

    def nbytes(self) -> int:
        """Bytes of every layer's code rows."""
        return sum(c.numel() for c in self.codes)

    @staticmethod
    def rows_per_block(element_size: int, bits: int) -> int:
        """Code rows one cache block (its K and V) holds: ``2 * D * element_size`` bytes a token and KV head,
        against ``D * bits / 8`` a code."""
        return 16 * element_size // bits

    @staticmethod
    def bytes_for(kv_bytes: int, element_size: int, bits: int) -> int:
        """Bytes of the codes of the keys whose K and V take ``kv_bytes`` (1 / :meth:`rows_per_block` of them; 0
        without codes): what a memory check counts before the codes exist."""
        return kv_bytes * bits // (16 * element_size)

    def read(self, layer: int) -> torch.Tensor:
        return self.codes[layer]

    def write(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Code full (or active) blocks ``keys: [n, block_size, Hkv, D]`` within their own min/max into code rows
        ``rows: [n]`` of layer ``layer``. The min/max are the keys' own, equal to their blocks' summary rows (the same
        values in the cache's dtype) once a block is full. One Triton launch on CUDA (``pack_codes_into``)."""
        pack_codes_into(self.codes[layer], rows, keys, self.bits, backend=self.backend)

    def export(self, rows: torch.Tensor) -> torch.Tensor:
        """Code rows ``rows: [n]`` of every layer, ``[L, n, block_size, Hkv, D * bits / 8]`` uint8 on the CPU (a
        request handed to a decode peer: its full blocks' codes, which the peer cannot make without every key)."""
        return torch.stack([c[rows] for c in self.codes]).cpu()

    def install(self, rows: torch.Tensor, codes: torch.Tensor) -> None:
        """:meth:`export`'s codes into code rows ``rows: [n]`` of every layer."""
        want = (len(self.codes), rows.numel(), *self.codes[0].shape[1:])
        if tuple(codes.shape) != want or codes.dtype != torch.uint8:
            raise ValueError(f"key codes of shape {tuple(codes.shape)} ({codes.dtype}) handed over, this engine keeps "
                             f"{want} uint8 (the peers must keep the same codes)")
        for layer, c in enumerate(self.codes):
            c[rows] = codes[layer].to(c.device)
