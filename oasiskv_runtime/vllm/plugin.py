"""vLLM ``general_plugins`` entry point (``oasiskv = "oasiskv_runtime.vllm.plugin:register"`` in pyproject.toml).

vLLM calls :func:`register` once in every process (front end, engine core, workers). It registers the KV-cache
spec of working-set admission (``vllm/kv_spec.py``) and points two attention backend names at this module:

* ``CUSTOM``: the OasisKV backend over FLASH_ATTN (CUDA). vLLM uses it only when asked
  (``--attention-backend CUSTOM``, which ``engine_args`` sets).
* ``CPU_ATTN``, on the CPU platform only (it honours no other name): resolved, inside the engine's config context,
  to the OasisKV backend over CPU_ATTN when ``additional_config["oasiskv"]`` enables a sparse mode, and to vLLM's
  own ``CPUAttentionBackend`` class otherwise. So a plain vLLM run with the plug-in installed gets vLLM's own class:
  the plug-in is a no-op unless asked for.

The names resolve through the module ``__getattr__`` below (vLLM imports a backend by its dotted path).
"""

from __future__ import annotations

import logging
from typing import Any

from oasiskv_runtime.vllm.options import VllmOptions
from oasiskv_runtime.vllm.version import check_vllm_version

logger = logging.getLogger(__name__)

_BASES = {
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
}


def register() -> None:
    """Register the OasisKV attention backend names with vLLM (idempotent; never fails a plain vLLM run)."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.CUSTOM")
        if current_platform.is_cpu():
            register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.CPU_ATTN")
    except Exception as exc:  # an incompatible vLLM: plain vLLM must still run
        logger.warning("OasisKV plug-in not registered (%s: %s)", type(exc).__name__, exc)
        return
    try:
        from oasiskv_runtime.vllm import kv_spec

        kv_spec.register()
    except Exception as exc:  # noqa: BLE001 - the modes still run, vLLM then keeps every block (admission='full')
        logger.warning("OasisKV working-set admission not registered (%s: %s): vLLM keeps whole contexts",
                       type(exc).__name__, exc)


def _base(name: str) -> type:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    return resolve_obj_by_qualname(_BASES[name])


def _current_config() -> Any:
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def _enabled_backend(base_name: str, opts: VllmOptions) -> type:
    check_vllm_version()
    from oasiskv_runtime.vllm.backend import oasiskv_backend

    return oasiskv_backend(_base(base_name))


def __getattr__(name: str) -> Any:
    base = name[len("OasisKV_"):] if name.startswith("OasisKV_") else None
    if name not in ("CPU_ATTN", "CUSTOM") and base not in _BASES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from oasiskv_runtime.vllm.backend import oasiskv_backend

    if base is not None:  # a generated backend looked up again by its own path (vLLM's CUDA platform does this)
        return oasiskv_backend(_base(base))
    cfg = _current_config()
    opts = None if cfg is None else VllmOptions.from_vllm_config(cfg)
    if name == "CPU_ATTN":
        if opts is None or not opts.enabled:
            return _base("CPU_ATTN")
        return _enabled_backend("CPU_ATTN", opts)
    if cfg is None:  # CUSTOM looked up outside an engine's config: the class itself (its parts read the options)
        return oasiskv_backend(_base("FLASH_ATTN"))
    if opts is None or not opts.enabled:
        raise ValueError(
            "the CUSTOM attention backend is OasisKV's: enable it with "
            "additional_config={'oasiskv': {'mode': 'sparse-resident', ...}} (see oasiskv_runtime.vllm.engine_args)")
    return _enabled_backend("FLASH_ATTN", opts)
