"""The OasisKV core: the mechanism, engine-agnostic (it imports torch, ``ops`` and ``transfer`` only).

- ``summaries``: compressed key summaries (min/max per block and KV head): where they live, update, read.
- ``predictor``: score the summaries with a query, top-K blocks per KV head, sinks.
- ``selector``: Algorithm 2 (incremental selection, fetch cap, least-recently-selected eviction): the plain-Python
  oracle; ``ops.select_rows`` is its batched reference and ``ops.select_plan`` the fused kernel.
- ``head_map``: the per-head map of each request's working set (slot map, last selection, request rows, PD export).
- ``pipeline``: the look-ahead pipeline, per layer predict -> select -> transfer on a ``transfer.TransferEngine``.
- ``batch``: what a front end builds once per step; ``link_cap``, ``stats``: the link-sized cap, the counters.

Front ends (the embedded engine in ``engine/``, the vLLM plug-in) turn their step metadata into a ``DecodeBatch`` and
call these per layer. See docs/architecture.md.
"""
