"""Qwen3 dense: the shared decoder with RMSNorm on each head's query and key before RoPE."""

from __future__ import annotations

from oasiskv_runtime.config import ModelConfig
from oasiskv_runtime.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if config.architecture != "qwen3" or not config.qk_norm:
            raise ValueError(f"Qwen3ForCausalLM got architecture {config.architecture!r}")
        super().__init__(config)
