"""Markers: ``gpu`` tests auto-skip without CUDA. Shared fixtures for tiny checkpoints."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """A tiny Qwen3 checkpoint (``tests/tiny_models.py``) with 4,096 positions, written once per test module."""
    from tests.tiny_models import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3", max_position_embeddings=4096))
