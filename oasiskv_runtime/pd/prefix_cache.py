"""Prefix cache on the prefill side: prompts that start with blocks already staged skip computing them.

Requests sharing a long prefix (a multi-turn agent trace, a shared system prompt) hit full blocks that an
earlier request left staged in the host pool. A block is keyed by the chained hash of its tokens and every
token before it (vLLM's scheme), and carries its key summaries, so a hit needs no recompute at all: the new
request's block table starts with the shared host blocks (read-only), its summary rows are written from the
cache, and only the rest of the prompt is prefilled.

Ownership: a block inserted here belongs to the cache; staged requests hold references; a block is
returned to the host pool only when evicted (least recently used first) with no staged request using it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    block: int
    summary_min: torch.Tensor  # [L, Hkv, D]
    summary_max: torch.Tensor


class PrefixCache:
    def __init__(self, block_size: int, host_pool) -> None:
        self.bs = block_size
        self.pool = host_pool
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # chained hash -> entry, least recent first
        self.owned: set[int] = set()
        self.refs: dict[int, int] = {}
        self.hits = self.lookups = 0

    def hashes(self, tokens: list[int], max_blocks: int | None = None) -> list[int]:
        n = len(tokens) // self.bs if max_blocks is None else min(max_blocks, len(tokens) // self.bs)
        out, h = [], 0
        for j in range(n):
            h = hash((h, tuple(tokens[j * self.bs:(j + 1) * self.bs])))
            out.append(h)
        return out

    def lookup(self, tokens: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """The longest run of cached blocks from the start, leaving at least one token to compute."""
        self.lookups += 1
        entries = []
        for h in self.hashes(tokens, (len(tokens) - 1) // self.bs):
            e = self.entries.get(h)
            if e is None:
                break
            self.entries.move_to_end(h)
            entries.append(e)
        if not entries:
            return None
        self.hits += 1
        return ([e.block for e in entries], torch.stack([e.summary_min for e in entries], 1),
                torch.stack([e.summary_max for e in entries], 1))

    def acquire(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if b in self.refs:
                self.refs[b] -= 1
                if not self.refs[b]:
                    del self.refs[b]

    def insert(self, tokens: list[int], host_blocks: list[int], summary_min: torch.Tensor,
               summary_max: torch.Tensor) -> list[int]:
        """Add a staged prompt's full blocks (those not cached yet). Returns every full block of the prompt
        the cache owns now (the staged request references them until it is released)."""
        held = []
        for j, h in enumerate(self.hashes(tokens)):
            e = self.entries.get(h)
            if e is None:
                e = Entry(host_blocks[j], summary_min[:, j].clone(), summary_max[:, j].clone())
                self.entries[h] = e
                self.owned.add(e.block)
            if e.block == host_blocks[j]:
                held.append(e.block)
        self.acquire(held)
        return held

    def evict(self, need_free: int) -> int:
        """Return unreferenced blocks to the host pool (LRU first) until ``need_free`` blocks are free."""
        freed = []
        for h in list(self.entries):
            if self.pool.num_free + len(freed) >= need_free:
                break
            e = self.entries[h]
            if e.block in self.refs:
                continue
            del self.entries[h]
            self.owned.discard(e.block)
            freed.append(e.block)
        if freed:
            self.pool.free(freed)
        return len(freed)
