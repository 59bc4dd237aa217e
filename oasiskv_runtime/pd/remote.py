"""Remote Partial Fetching, decode side (SPEC item 6): which host blocks still live only on a prefill peer.

A request prefilled elsewhere arrives with only the blocks its first decode step attends over (per layer, the
union over KV heads of the working set the prefill side filled, plus the partial last block). Every other
block of its prompt stays staged in the prefill peer's host memory. ``RemoteKV`` keeps, per layer and local
host block, whether the bytes are here; the sparse backend calls :meth:`ensure` with the host blocks it is
about to copy to the device, and the missing ones are read from the peer in one batched transfer per layer
and peer, for the whole batch (a cache miss, never an approximation). A block is read at most once per
layer; a block never selected never crosses.

Region layout on both sides (the transport's registered regions): ``[k_0, v_0, k_1, v_1, ...]``, one region
per layer and K/V, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous.

A transfer error or a dead peer never stalls the batch: the requests that needed the bytes are recorded in
``failed`` (the worker aborts them after the step with the message), the others go on.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch


def region(layer: int, value: bool) -> int:
    return 2 * layer + int(value)


def block_ops(pairs: Sequence[tuple[int, int]], layer: int, block_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """Read ops (local_region, local_offset, remote_region, remote_offset, nbytes) copying remote block -> local
    block for K and V of one layer; runs consecutive on both sides become one op."""
    ops = []
    run: list[int] | None = None  # [local_start, remote_start, count]
    for local, remote in sorted(pairs, key=lambda p: p[1]):
        if run is not None and local == run[0] + run[2] and remote == run[1] + run[2]:
            run[2] += 1
            continue
        if run is not None:
            ops.append(tuple(run))
        run = [local, remote, 1]
    if run is not None:
        ops.append(tuple(run))
    return [(region(layer, v), lo * block_bytes, region(layer, v), ro * block_bytes, n * block_bytes)
            for lo, ro, n in ops for v in (False, True)]


@dataclass
class RemoteRequest:
    seq_id: int
    request_id: str
    peer: str
    local_blocks: list[int]
    remote_of: dict[int, int]          # local host block -> the peer's host block
    admission_bytes: int = 0
    decode_bytes: int = 0
    blocks_read: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))  # layer -> remote blocks


class RemoteKV:
    def __init__(self, transport, num_layers: int, num_host_blocks: int, block_bytes: int,
                 timeout_s: float = 10.0) -> None:
        self.transport = transport
        self.num_layers = num_layers
        self.block_bytes = block_bytes
        """Bytes of one block of one layer for K (the same again for V)."""
        self.timeout_s = timeout_s
        self.present = torch.ones(num_layers, num_host_blocks, dtype=torch.bool)
        self.requests: dict[int, RemoteRequest] = {}
        self.owner: dict[int, int] = {}            # local host block -> seq id
        self.failed: dict[int, str] = {}           # seq id -> why (the worker aborts these after the step)
        self.dead_peers: dict[str, str] = {}
        self.log: list[tuple[str, int, int]] = []  # (request id, layer, remote block): every block read
        self.retired: dict[int, RemoteRequest] = {}  # forgotten requests, until the worker reports them
        self.lock = threading.Lock()

    # ---- admission -----------------------------------------------------------------------------------
    def adopt(self, seq_id: int, request_id: str, peer: str, local_blocks: list[int], remote_blocks: list[int],
              admit: Sequence[Sequence[int]] | None) -> int:
        """Register a request's blocks as living on ``peer`` and read its admission set: per layer, the
        logical blocks in ``admit[layer]`` (None: every block, the full-transfer baseline). Raises the
        transport's error when the admission read fails (nothing is admitted then). Returns bytes read."""
        if len(remote_blocks) > len(local_blocks):
            raise ValueError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones")
        if peer in self.dead_peers:
            raise RuntimeError(f"prefill peer {peer} is gone ({self.dead_peers[peer]})")
        n = len(remote_blocks)
        req = RemoteRequest(seq_id, request_id, peer, list(local_blocks[:n]),
                            {local_blocks[j]: remote_blocks[j] for j in range(n)})
        ops, log = [], []
        per_layer = [list(range(n)) if admit is None else sorted(set(admit[layer])) for layer in range(self.num_layers)]
        for layer, logical in enumerate(per_layer):
            pairs = [(local_blocks[j], remote_blocks[j]) for j in logical]
            ops += block_ops(pairs, layer, self.block_bytes)
            log += [(request_id, layer, r) for _, r in pairs]
        nbytes = self.transport.read(peer, ops, self.timeout_s) if ops else 0
        with self.lock:
            local = torch.tensor(req.local_blocks, dtype=torch.long)
            self.present[:, local] = False
            for layer, logical in enumerate(per_layer):
                if logical:
                    self.present[layer, local[logical]] = True
                    req.blocks_read[layer].update(remote_blocks[j] for j in logical)
            req.admission_bytes = nbytes
            self.requests[seq_id] = req
            for b in req.local_blocks:
                self.owner[b] = seq_id
            self.log += log
        return nbytes

    def forget(self, seq_id: int) -> RemoteRequest | None:
        """The request left the decode engine: its local blocks go back to the pool as ordinary blocks."""
        with self.lock:
            req = self.requests.pop(seq_id, None)
            if req is None:
                return None
            local = torch.tensor(req.local_blocks, dtype=torch.long)
            self.present[:, local] = True
            for b in req.local_blocks:
                self.owner.pop(b, None)
            self.failed.pop(seq_id, None)
            self.retired[seq_id] = req
            return req

    def peer_lost(self, peer: str, why: str) -> None:
        self.dead_peers.setdefault(peer, why)

    # ---- decode: cache misses ------------------------------------------------------------------------
    def ensure(self, layer: int, host_blocks: torch.Tensor) -> None:
        """Read the blocks of ``host_blocks`` (any order, duplicates allowed) that are not here yet."""
        if not self.requests or host_blocks.numel() == 0:
            return
        blocks = host_blocks.detach().to("cpu", torch.long).unique()
        blocks = blocks[blocks >= 0]
        missing = blocks[~self.present[layer, blocks]].tolist()
        if not missing:
            return
        by_peer: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for b in missing:
            seq_id = self.owner[b]
            if seq_id in self.failed:
                continue
            req = self.requests[seq_id]
            by_peer[req.peer].append((seq_id, b, req.remote_of[b]))
        for peer, items in by_peer.items():
            seqs = {s for s, _, _ in items}
            if peer in self.dead_peers:
                self._fail(seqs, f"prefill peer {peer} is gone ({self.dead_peers[peer]}) and the request "
                                 f"needs KV blocks staged there")
                continue
            ops = block_ops([(b, r) for _, b, r in items], layer, self.block_bytes)
            try:
                nbytes = self.transport.read(peer, ops, self.timeout_s)
            except Exception as e:  # noqa: BLE001 - any transport failure ends these requests, never the batch
                # The peer is not declared dead for one failed read: its control connection closing does that.
                self._fail(seqs, f"reading KV blocks from prefill peer {peer} failed: {type(e).__name__}: {e}")
                continue
            with self.lock:
                self.present[layer, torch.tensor([b for _, b, _ in items])] = True
                per_block = nbytes // max(1, len(items))
                for seq_id, _, r in items:
                    req = self.requests[seq_id]
                    req.decode_bytes += per_block
                    req.blocks_read[layer].add(r)
                    self.log.append((req.request_id, layer, r))

    def _fail(self, seqs: set[int], message: str) -> None:
        with self.lock:
            for s in seqs:
                self.failed.setdefault(s, message)

    def missing_blocks(self, seq_id: int) -> int:
        """Block-layers of the request still only on its peer."""
        req = self.requests.get(seq_id)
        if req is None:
            return 0
        local = torch.tensor(req.local_blocks, dtype=torch.long)
        return int((~self.present[:, local]).sum())
