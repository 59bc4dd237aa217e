"""Llama family (Llama 2/3.x, SmolLM2, Mistral without sliding window): the shared decoder as is."""

from __future__ import annotations

from oasiskv_runtime.config import ModelConfig
from oasiskv_runtime.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if config.architecture != "llama":
            raise ValueError(f"LlamaForCausalLM got architecture {config.architecture!r}")
        super().__init__(config)
