"""What the end of a prefill tells the first sparse steps (issue #34), for both front ends.

When a request's prefill completes, every key of its prompt is on the device (the embedded engine's prefill
attention has them; vLLM's paged cache holds them) and its last rows' queries are this step's. Two settings read
the exact attention of those rows there, once per request and layer:

* ``attended_blocks``: the last row's attention mass on each full block seeds the record of the blocks the next
  prediction keeps (:meth:`HeadMap.record_attended`), as a decode step's own attention does after it;
* ``fill_window``: the mass of the last ``W`` rows ranks the blocks the working set is filled with
  (:meth:`LookaheadPipeline.fill`'s ``scores``), instead of a prediction from one query's summaries.

Both are :func:`~oasiskv_runtime.ops.attention_mass.prompt_block_mass`: each row's causal softmax over every key of
the prompt (its partial last block included), summed per full block over the rows and each KV head's GQA group.
"""

from __future__ import annotations

import torch

from oasiskv_runtime.core.head_map import HeadMap
from oasiskv_runtime.ops.attention_mass import prompt_block_mass


def end_of_prefill(head_map: HeadMap, layer: int, row: torch.Tensor, query: torch.Tensor, end: int, num_query: int,
                   keys: torch.Tensor, scale: float, block_size: int, fill_window: int,
                   seed: bool = True) -> torch.Tensor | None:
    """One request whose prefill completes at ``layer``: seed its ``attended_blocks`` record (when the map keeps
    one and ``seed``: a layer that attends sparsely) and return its fill scores ``[Hkv, n // block_size]`` (None without ``fill_window``).

    ``row``: ``[1]`` its state row on the map's device; ``query``: the step's queries ``[T, Hq, D]``, the request's
    last chunk being rows ``end - num_query .. end - 1``; ``keys``: ``[n, Hkv, D]`` its prompt's keys, all of them.
    A last chunk shorter than the window gives its own rows (the embedded engine's one-token last chunk: one row)."""
    if seed and head_map.attended is not None and keys.shape[0] >= block_size:
        mass = prompt_block_mass(query[end - 1:end], keys, scale, block_size)                # [Hkv, j]
        logical = torch.arange(mass.shape[1], device=mass.device).expand_as(mass)
        dev = head_map.attended.device
        head_map.record_attended(layer, row, logical[None].to(dev), mass[None].to(dev))
    if not fill_window:
        return None
    w = min(fill_window, num_query)
    return prompt_block_mass(query[end - w:end], keys, scale, block_size)


def fill_scores(masses: list[torch.Tensor], width: int) -> torch.Tensor:
    """A fill batch's scores ``[F, Hkv, width]`` from each request's :func:`end_of_prefill` scores (in the batch's
    order), ``-inf`` past its candidates (the full blocks before its first decode step's active one)."""
    scores = masses[0].new_full((len(masses), masses[0].shape[0], width), float("-inf"))
    for b, m in enumerate(masses):
        scores[b, :, :m.shape[1]] = m
    return scores
