"""Counters of the sparse modes: transfers, deferrals, recall. Plain Python (no tensors)."""

from __future__ import annotations

from collections import defaultdict


class SparseStats:
    def __init__(self, num_layers: int, bytes_per_head_block: int) -> None:
        self.num_layers = num_layers
        self.bytes_per_head_block = bytes_per_head_block
        """Bytes one (block, KV head) copy moves: K and V of block_size tokens."""
        self.decode_steps = 0
        self.decode_request_steps = 0
        self.fetched_by_layer = [0] * num_layers
        self.deferred_by_layer = [0] * num_layers
        self.initial_fill_blocks = 0
        self.recall_hits = [0] * num_layers
        self.recall_total = [0] * num_layers
        self.per_request: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._step_fetched = 0
        self.max_step_fetched = 0

    def begin_step(self, num_decode: int) -> None:
        if num_decode:
            self.decode_steps += 1
            self.decode_request_steps += num_decode
        self._step_fetched = 0

    def end_step(self) -> None:
        self.max_step_fetched = max(self.max_step_fetched, self._step_fetched)

    def add_transfer(self, layer: int, seq_ids: list[int], fetched: list[int], deferred: list[int],
                     initial: bool) -> None:
        for sid, f, d in zip(seq_ids, fetched, deferred):
            r = self.per_request[sid]
            if initial:
                r["initial_fill_blocks"] += f
                self.initial_fill_blocks += f
                continue
            r["fetched_blocks"] += f
            r["deferred_blocks"] += d
            self.fetched_by_layer[layer] += f
            self.deferred_by_layer[layer] += d
            self._step_fetched += f

    def add_recall(self, layer: int, hits: int, total: int, seq_id: int | None = None) -> None:
        self.recall_hits[layer] += hits
        self.recall_total[layer] += total
        if seq_id is not None:  # per request too: recall's spread over texts (oasisbench recall)
            r = self.per_request[seq_id]
            r["recall_hits"] += hits
            r["recall_total"] += total

    def recall_per_layer(self) -> list[float | None]:
        return [h / t if t else None for h, t in zip(self.recall_hits, self.recall_total)]

    def run_stats(self) -> dict:
        steps = max(1, self.decode_steps)
        fetched = sum(self.fetched_by_layer)
        per_layer = self.recall_per_layer()
        measured = [r for r in per_layer if r is not None]
        return {
            "fetched_blocks_per_step": fetched / steps,
            "fetched_bytes_per_step": fetched * self.bytes_per_head_block / steps,
            "max_fetched_bytes_per_step": self.max_step_fetched * self.bytes_per_head_block,
            "fetched_bytes_per_request_step": fetched * self.bytes_per_head_block / max(1, self.decode_request_steps),
            "deferred_blocks_per_step": sum(self.deferred_by_layer) / steps,
            "initial_fill_bytes": self.initial_fill_blocks * self.bytes_per_head_block,
            "fetched_blocks_by_layer": list(self.fetched_by_layer),
            "prediction_recall": (sum(self.recall_hits) / sum(self.recall_total)) if sum(self.recall_total) else None,
            "recall_per_layer": per_layer if measured else None,
        }

    def request_metrics(self, seq_id: int) -> dict:
        r = self.per_request.get(seq_id, {})
        m = {
            "fetched_blocks": r.get("fetched_blocks", 0),
            "fetched_bytes": r.get("fetched_blocks", 0) * self.bytes_per_head_block,
            "deferred_blocks": r.get("deferred_blocks", 0),
            "initial_fill_bytes": r.get("initial_fill_blocks", 0) * self.bytes_per_head_block,
        }
        if r.get("recall_total"):  # measured (measure_recall) and not trivial for this request
            m.update(recall_hits=r["recall_hits"], recall_total=r["recall_total"])
        return m
