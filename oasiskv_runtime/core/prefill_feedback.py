"""What the end of a prefill tells the first sparse steps (issue #34), for both front ends.

When a request's prefill completes, every key of its prompt is on the device (the embedded engine's prefill
attention has them; vLLM's paged cache holds them) and its last rows' queries are this step's. Two settings read
the exact attention of those rows there, once per request and layer:

* ``attended_blocks``: the last row's attention mass on each full block seeds the record of the blocks the next
  prediction keeps (:meth:`HeadMap.record_attended`), as a decode step's own attention does after it;
* ``fill_window``: the mass of the last ``W`` rows ranks the blocks the working set is filled with
  (:meth:`LookaheadPipeline.fill`'s ``scores``), instead of a prediction from one query's summaries. A prompt
  prefilled in chunks keeps its last rows from one chunk to the next (:class:`PromptWindows`), so the window does
  not depend on where the scheduler cut it (the two front ends cut differently).

Both are :func:`~oasiskv_runtime.ops.attention_mass.prompt_block_mass`: each row's causal softmax over every key of
the prompt (its partial last block included), summed per full block over the rows and each KV head's GQA group.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.ops.attention_mass import prompt_block_mass


class PromptWindows:
    """``fill_window`` across prefill chunks: per request still in prefill and per layer, the last ``window`` query
    rows of its prompt so far, so the fill reads the prompt's last rows however the scheduler cut it (a last chunk
    shorter than the window takes the rest from the chunk before). Held only between a request's chunks."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.held: dict = {}
        """seq_id -> {layer: [<= window, Hq, D]} (copies: a step's query tensor is not kept alive)."""

    def rows(self, layer: int, seq_id, chunk: torch.Tensor, start: int, completes: bool) -> torch.Tensor:
        """The prompt's last ``<= window`` query rows up to the end of ``chunk`` (``[c, Hq, D]``: this chunk's rows,
        prompt positions ``start .. start + c - 1``; a chunk at position 0 starts the request afresh). Kept for the
        request's next chunk unless ``completes``."""
        mine = self.held.get(seq_id)
        prev = mine.pop(layer, None) if mine is not None else None
        if start == 0:  # a fresh prefill (a preempted request's rows from before are stale)
            prev = None
        w = self.window
        out = chunk[-w:] if prev is None or chunk.shape[0] >= w else torch.cat([prev[-(w - chunk.shape[0]):], chunk])
        if completes:
            if mine is not None and not mine:
                del self.held[seq_id]
        else:
            self.held.setdefault(seq_id, {})[layer] = out.clone()
        return out

    def forget(self, seq_id) -> None:
        """A request left (finished, aborted or preempted mid-prefill)."""
        self.held.pop(seq_id, None)


def end_of_prefill(head_map: HeadMap, layer: int, row: torch.Tensor, last_rows: torch.Tensor, keys: torch.Tensor,
                   scale: float, block_size: int, fill_window: int, seed: bool = True) -> torch.Tensor | None:
    """One request whose prefill completes at ``layer``: seed its ``attended_blocks`` record (when the map keeps
    one and ``seed``: a layer that attends sparsely) and return its fill scores ``[Hkv, n // block_size]`` (None
    without ``fill_window``).

    ``row``: ``[1]`` its state row on the map's device; ``last_rows``: ``[w, Hq, D]`` the queries of its prompt's
    last ``w`` tokens (``w >= 1``; :class:`PromptWindows` across chunks); ``keys``: ``[n, Hkv, D]`` its prompt's keys,
    all of them. The fill reads the last ``min(fill_window, w)`` rows."""
    if seed and head_map.attended is not None and keys.shape[0] >= block_size:
        mass = prompt_block_mass(last_rows[-1:], keys, scale, block_size)                   # [Hkv, j]
        logical = torch.arange(mass.shape[1], device=mass.device).expand_as(mass)
        dev = head_map.attended.device
        head_map.record_attended(layer, row, logical[None].to(dev), mass[None].to(dev))
    if not fill_window:
        return None
    return prompt_block_mass(last_rows[-fill_window:], keys, scale, block_size)


def fill_scores(masses: list[torch.Tensor], width: int) -> torch.Tensor:
    """A fill batch's scores ``[F, Hkv, width]`` from each request's :func:`end_of_prefill` scores (in the batch's
    order), ``-inf`` past its candidates (the full blocks before its first decode step's active one)."""
    scores = masses[0].new_full((len(masses), masses[0].shape[0], width), float("-inf"))
    for b, m in enumerate(masses):
        scores[b, :, :m.shape[1]] = m
    return scores
