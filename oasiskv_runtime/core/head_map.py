"""The per-head KV map over paged attention (SPEC item 5), and the request rows of every per-request tensor.

Page tables stay as they are. In between sits, per request and layer, one row per KV head: which logical block of
the full-KV pool each of the working set's ``K`` device slots holds (``slot_map``), and the last step each slot's
block was selected (``last_sel``, the recency Algorithm 2 evicts by). Updating a selection rewrites only these rows
and the slots' contents. Under tensor parallelism each rank holds the rows of its own heads: no map sync.

Requests get a state row when their sparse state starts (prefill completes, or a peer hands them over) and give it
back when they leave; the row indexes ``slot_map``/``last_sel`` and the copy counters.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.ops.attended import attended_topk, heaviest_blocks


NEVER = -(1 << 40)
"""``HeadMap.start`` of a row with no filled working set: every step is far past it."""


class HeadMap:
    """``slot_map`` / ``last_sel``: ``[max_rows, num_layers, Hkv, K]`` int64 on ``device`` (None in modes whose
    working set is the whole device-resident context: ``with_map=False``)."""

    def __init__(self, max_rows: int, num_layers: int, num_kv_heads: int, k_slots: int, device: torch.device,
                 with_map: bool = True, attended_blocks: int = 0) -> None:
        self.k_slots = k_slots
        shape = (max_rows, num_layers, num_kv_heads, k_slots)
        self.slot_map = torch.full(shape, -1, dtype=torch.long, device=device) if with_map else None
        """Logical block held by each working-set slot, -1 empty."""
        self.last_sel = torch.full(shape, -1, dtype=torch.long, device=device) if with_map else None
        """Step at which each slot's block was last selected or admitted, -1 never."""
        self.attended = torch.full(shape[:3] + (attended_blocks,), -1, dtype=torch.long, device=device) \
            if attended_blocks else None
        """``attended_blocks``: per request, layer and KV head, the logical blocks that held the most of its last
        step's attention (a decode step's, or the end of its prefill's), most first (-1: none); every sparse mode."""
        self.start = torch.full((max_rows,), NEVER, dtype=torch.long, device=device)
        """Per row, the step its working set was filled (its prefill completed, or a peer handed it over): how
        ``early_fetch_ratio`` finds a request's first decode steps on the device."""
        self.rows: dict[int, int] = {}
        self.free_rows = list(range(max_rows))
        self.ready: set[int] = set()
        """Requests whose working set is filled: their decode steps run sparse."""

    def row(self, seq_id: int) -> int:
        """The request's state row (taken on first use)."""
        r = self.rows.get(seq_id)
        if r is None:
            if not self.free_rows:
                raise RuntimeError("OasisKV head map: more running requests than state rows")
            r = self.rows[seq_id] = self.free_rows.pop()
        return r

    def free(self, seq_id: int) -> int | None:
        """Give a request's row back (its map rows emptied); returns the row, None if it had none."""
        row = self.rows.pop(seq_id, None)
        self.ready.discard(seq_id)
        if row is None:
            return None
        if self.slot_map is not None:
            self.slot_map[row] = -1
            self.last_sel[row] = -1
        if self.attended is not None:
            self.attended[row] = -1
        self.start[row] = NEVER
        self.free_rows.append(row)
        return row

    def stamp_start(self, rows: torch.Tensor, step: int) -> None:
        """Rows ``rows`` start their decode steps after step ``step`` (their working sets are filled in it; a fill
        step runs eagerly, so its stamp is a host int on both front ends)."""
        self.start.index_fill_(0, rows, step)

    def since_start(self, rows: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
        """``[n]``: steps since rows ``rows`` were filled (1 at the first decode step; huge for a row never
        stamped), on the device (no host read: CUDA graphs capture it)."""
        return step - self.start[rows]

    def prefetch_caps(self, batch, step_cap: int, early_cap: int,
                      early_steps: int) -> tuple[int, torch.Tensor | None]:
        """A prefetch's cap for ``batch`` (a ``DecodeBatch``), and with ``early_fetch_ratio`` (``early_cap`` over
        ``step_cap``) each request's: ``early_cap`` in its first ``early_steps`` decode steps, ``step_cap`` after;
        made on the device once per step (a front end's caps, whichever builds the batch)."""
        if early_cap <= step_cap:
            return step_cap, None
        return early_cap, batch.derived("early_caps", lambda: torch.where(
            self.since_start(batch.state_rows, batch.step) <= early_steps, early_cap, step_cap))

    def clear(self, layer: int, rows: torch.Tensor) -> None:
        """Empty one layer's map rows of ``rows`` ([n] on the map's device) before they are filled again."""
        # index_fill_, not `[rows, layer] = -1`: that assignment copies the -1 up as a pageable 0-dim tensor, a host
        # sync in the middle of the layer loop.
        self.slot_map[:, layer].index_fill_(0, rows, -1)
        self.last_sel[:, layer].index_fill_(0, rows, -1)

    def record_attended(self, layer: int, rows: torch.Tensor, logical: torch.Tensor, mass: torch.Tensor) -> None:
        """Keep, for ``rows`` ([B]), the ``attended_blocks`` logical blocks of ``logical`` ([B, Hkv, K], -1 empty)
        with the most attention ``mass`` ([B, Hkv, K], -inf empty) this step, most first."""
        self.attended[:, layer].index_copy_(0, rows, heaviest_blocks(mass, logical, self.attended.shape[-1]))

    def lse_buffer(self, block_ids: torch.Tensor, num_q_heads: int) -> torch.Tensor | None:
        """The ``slot_lse`` output a decode step's sparse attention over ``block_ids`` (``[B, Hkv, N]``) writes for
        :meth:`record_lse` (``[B, Hkv, g, N]`` fp32); None unless ``attended_blocks``."""
        if self.attended is None:
            return None
        B, hkv, n = block_ids.shape
        return torch.empty((B, hkv, num_q_heads // hkv, n), dtype=torch.float32, device=block_ids.device)

    def record_lse(self, layer: int, rows: torch.Tensor, slot_lse: torch.Tensor, n: int, backend: str,
                   logical: torch.Tensor | None = None) -> None:
        """Keep, for ``rows`` ([B]), the blocks of the first ``n`` slots that held the most of a decode step's
        attention, from the per-slot log-sum-exps its sparse attention wrote (:meth:`lse_buffer`) in one launch
        (:func:`~oasiskv_runtime.ops.attended.attended_topk`). ``logical`` (``[B, Hkv, >= n]``): the block in each
        slot; default the rows' working sets at ``layer`` (the prefetching modes)."""
        if logical is None:
            logical = self.slot_map[rows, layer]
        ids = attended_topk(slot_lse, logical, self.attended.shape[-1], n, backend=backend)
        self.attended[:, layer].index_copy_(0, rows, ids)

    def attended_ids(self, layer: int, rows: torch.Tensor) -> torch.Tensor | None:
        """``[B, Hkv, attended_blocks]``: the blocks every prediction for ``rows`` keeps (None: the option is off)."""
        return None if self.attended is None else self.attended[rows, layer]

    def block_ids(self, layer: int, batch) -> torch.Tensor:
        """The device block behind each working-set slot of each KV head, ``[B, Hkv, K]`` (``-1``: empty slot): what
        the sparse attention reads for ``batch`` (a ``DecodeBatch``) at this layer."""
        smap = self.slot_map[batch.state_rows, layer]                            # [B, Hkv, K]
        slots = batch.derived("slots_i32", lambda: batch.slot_blocks.int()[:, None, :])
        return torch.where(smap >= 0, slots.expand(smap.shape), -1)

    def export(self, seq_id: int, step: int) -> dict:
        """A request's map (``[L, Hkv, K]`` on the CPU) with selection stamps relative to ``step``, for a peer that
        continues it (prefill-decode)."""
        row = self.rows[seq_id]
        last = self.last_sel[row]
        out = {"slot_map": self.slot_map[row].to("cpu", copy=True),  # a copy: the row is reset on release
               "last_sel": torch.where(last >= 0, last - (step - 1), torch.full_like(last, -1)).cpu(),
               "top_k_blocks": self.k_slots}
        if self.attended is not None:  # the attended record its prefill seeded (logical blocks: the same on a peer)
            out["attended"] = self.attended[row].to("cpu", copy=True)
        return out

    def import_(self, seq_id: int, state: dict, step: int) -> int:
        """Install a map :meth:`export` made on a peer, stamps rebased on ``step``; returns the request's row."""
        if state["top_k_blocks"] != self.k_slots:
            raise ValueError(f"prefill peer selects {state['top_k_blocks']} blocks per head, this engine "
                             f"{self.k_slots}: both sides need the same top_k_blocks")
        if (self.attended is not None) != ("attended" in state):
            raise ValueError("attended_blocks differs between the peers: both sides need the same attended_blocks / "
                             "attended_share")
        if self.attended is not None and state["attended"].shape != self.attended.shape[1:]:
            raise ValueError(f"prefill peer keeps {tuple(state['attended'].shape)} attended blocks, this engine "
                             f"{tuple(self.attended.shape[1:])}: both sides need the same attended_blocks")
        row = self.row(seq_id)
        dev = self.slot_map.device
        if self.attended is not None:
            self.attended[row] = state["attended"].to(dev)
        last = state["last_sel"].to(dev)
        self.slot_map[row] = state["slot_map"].to(dev)
        self.last_sel[row] = torch.where(last >= 0, last + (step - 1), torch.full_like(last, -1))
        self.start[row] = step - 1  # its first decode step here is its first after the prefill
        return row
