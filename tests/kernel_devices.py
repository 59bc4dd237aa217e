"""Where a kernel-against-reference test runs: on CUDA (``gpu`` marker), and on the CPU in Triton's interpreter
(parameter id ``interpreted``) when ``TRITON_INTERPRET=1`` and Triton is importable. The default test run has no
Triton, so only ``.ci/run``'s interpreter step (``-k interpreted``) and the GPU machine exercise the kernels."""

from __future__ import annotations

import os

import pytest


def interpreter_available() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


KERNEL_DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("cpu", id="interpreted", marks=pytest.mark.skipif(
        not interpreter_available(), reason="set TRITON_INTERPRET=1 with Triton installed")),
]
