"""OasisKV runtime: an engine-agnostic OasisKV core (``core/``, ``transfer/``, ``ops/``) with an embedded inference
engine (``engine/``) as its first front end.

Importing the package is light: the public names load on first use, so the torch-free bookkeeping (block pool,
scheduler, selector oracle) imports without pulling in the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "Mode"]
__version__ = "0.1.0"

_EXPORTS = {"LLM": "oasiskv_runtime.llm", "SamplingParams": "oasiskv_runtime.sampling_params",
            "RequestOutput": "oasiskv_runtime.outputs", "EngineConfig": "oasiskv_runtime.config",
            "Mode": "oasiskv_runtime.config"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'oasiskv_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
