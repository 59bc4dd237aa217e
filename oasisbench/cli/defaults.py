"""Defaults that depend on the run's shape: K against the context length, the CPU's stand-in KV budget.

Shared by ``oasisbench throughput`` and ``oasisbench accuracy``, so both treat a K that covers the whole context the
same way: a default K is lowered below the context, an explicit one that covers it gets a note, never silence
(every sparse mode would attend to the whole context, and the run would compare dense with dense).
"""

from __future__ import annotations

import math

from oasiskv_runtime.config import EngineConfig

PAPER_TOP_K_BLOCKS = EngineConfig.options()["top_k_blocks"].default
"""The engine's K, the paper's (SPEC item 7): 128 blocks of 16 tokens per KV head, plus the local block."""


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def default_top_k_blocks(context_lens: list[int] | tuple[int, ...], block_size: int = 16) -> int:
    """The paper's K, or, where K + 1 blocks would hold the shortest context whole, a quarter of that context's
    blocks (1K tokens: 16). No known context length (lm-eval tasks): the paper's K."""
    if not context_lens:
        return PAPER_TOP_K_BLOCKS
    shortest = _blocks(min(context_lens), block_size)
    return PAPER_TOP_K_BLOCKS if PAPER_TOP_K_BLOCKS + 1 < shortest else max(1, shortest // 4)


def top_k_note(top_k: int, context_lens: list[int] | tuple[int, ...], block_size: int = 16) -> str | None:
    """A warning when ``top_k`` + 1 blocks hold some context whole (the sparse modes then attend to all of it);
    None when every context is longer."""
    covered = sorted(c for c in set(context_lens) if top_k + 1 >= _blocks(c, block_size))
    if not covered:
        return None
    return (f"note: --top-k-blocks {top_k} keeps {(top_k + 1) * block_size:,} tokens per KV head, the whole context "
            f"at --context-len {', '.join(f'{c:,}' for c in covered)}: there every sparse mode attends to everything, "
            f"like dense; use --top-k-blocks below {_blocks(covered[0], block_size) - 1} to compare sparse decoding")


def demo_kv_budget(model: str, dtype: str, context_lens: list[int], concurrencies: list[int],
                   block_size: int = 16) -> tuple[float, int]:
    """(GiB, requests): a device KV budget holding the dense KV of half the largest concurrency's requests at the
    longest context, plus a few blocks of slack for the engine's admission watermark. The default on the CPU,
    which has no memory wall of its own: at the largest concurrency dense then runs half its requests at a time
    while oasiskv, keeping only a working set per request on the device, can run them all.

    Raises:
        FileNotFoundError, ValueError, ImportError: the model cannot be found or read.
    """
    from oasiskv_runtime.engine.kv_cache_manager import ADMIT_WATERMARK
    from oasiskv_runtime.models.loader import model_config_for

    num_requests = max(1, max(concurrencies) // 2)
    blocks = num_requests * _blocks(max(context_lens), block_size)
    # The watermark admission keeps free, and one block more: admits exactly num_requests, not one more.
    blocks += math.ceil(1.1 * ADMIT_WATERMARK * blocks) + 1
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    block_bytes = block_size * model_config_for(model)[0].kv_bytes_per_token(elem)
    # Half a block over: the engine floors GiB * 2**30 to whole blocks, and float rounding must not lose one.
    return (blocks + 0.5) * block_bytes / 2**30, num_requests
