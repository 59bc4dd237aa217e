"""Counters of the sparse modes for reports: decode steps, prediction recall, per-request traffic. Plain Python.

Copies are counted on the device where they are planned (``transfer.engine.TransferCounters``); this object turns
those totals into the report's numbers and keeps what is counted on the host.
"""

from __future__ import annotations

from collections import defaultdict


class SparseStats:
    def __init__(self, num_layers: int, bytes_per_head_block: int) -> None:
        self.num_layers = num_layers
        self.bytes_per_head_block = bytes_per_head_block
        """Bytes one (block, KV head) copy moves: K and V of block_size tokens."""
        self.decode_steps = 0
        self.decode_request_steps = 0
        self.recall_hits = [0] * num_layers
        self.recall_total = [0] * num_layers
        self.per_request: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def reset(self) -> None:
        """Zero every count (benchmarks measure a window of steps)."""
        self.__init__(self.num_layers, self.bytes_per_head_block)

    def begin_step(self, num_decode: int) -> None:
        if num_decode:
            self.decode_steps += 1
            self.decode_request_steps += num_decode

    def add_request_fetched(self, seq_id: int, blocks: int) -> None:
        self.per_request[seq_id]["fetched_blocks"] += blocks

    def add_recall(self, layer: int, hits: int, total: int, seq_id: int | None = None) -> None:
        self.recall_hits[layer] += hits
        self.recall_total[layer] += total
        if seq_id is not None:  # per request too: recall's spread over texts (oasisbench recall)
            r = self.per_request[seq_id]
            r["recall_hits"] += hits
            r["recall_total"] += total

    def recall_per_layer(self) -> list[float | None]:
        return [h / t if t else None for h, t in zip(self.recall_hits, self.recall_total)]

    def run_stats(self, copies: dict | None = None) -> dict:
        """The report's traffic and recall figures; ``copies``: :meth:`TransferCounters.totals` (None: no copies,
        e.g. sparse-resident)."""
        copies = copies or {"fetched_by_layer": [0] * self.num_layers, "deferred_by_layer": [0] * self.num_layers,
                            "initial_fill_blocks": 0, "max_step_fetched": 0, "demand_by_layer": [0] * self.num_layers}
        steps = max(1, self.decode_steps)
        fetched = sum(copies["fetched_by_layer"])
        per_layer = self.recall_per_layer()
        measured = [r for r in per_layer if r is not None]
        unit = self.bytes_per_head_block
        return {
            "fetched_blocks_per_step": fetched / steps,
            "fetched_bytes_per_step": fetched * unit / steps,
            "max_fetched_bytes_per_step": copies["max_step_fetched"] * unit,
            "fetched_bytes_per_request_step": fetched * unit / max(1, self.decode_request_steps),
            "deferred_blocks_per_step": sum(copies["deferred_by_layer"]) / steps,
            "initial_fill_bytes": copies["initial_fill_blocks"] * unit,
            "fetched_blocks_by_layer": list(copies["fetched_by_layer"]),
            # demand_fetch: the prefetch's misses, fetched before the step attends (on its critical path)
            "demand_fetched_blocks_per_step": sum(copies["demand_by_layer"]) / steps,
            "prediction_recall": (sum(self.recall_hits) / sum(self.recall_total)) if sum(self.recall_total) else None,
            "recall_per_layer": per_layer if measured else None,
        }

    def request_metrics(self, seq_id: int) -> dict:
        r = self.per_request.get(seq_id, {})
        m = {"fetched_blocks": r.get("fetched_blocks", 0),
             "fetched_bytes": r.get("fetched_blocks", 0) * self.bytes_per_head_block}
        if r.get("recall_total"):  # measured (measure_recall) and not trivial for this request
            m.update(recall_hits=r["recall_hits"], recall_total=r["recall_total"])
        return m
