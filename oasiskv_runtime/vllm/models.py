"""Our model names as vLLM loads them: a directory holding a Hugging Face ``config.json`` (and, for real weights, the
weights).

A random-weight preset (``qwen3-8b``...) becomes a generated config directory that vLLM fills with its own random
weights (``load_format="dummy"``): the real shapes, RANDOM WEIGHTS, as in the embedded engine. A packaged model
(``smollm2-135m``) or a ``.gguf`` file is the Hugging Face directory the loader converts it into once (cached); a
Hugging Face directory is itself. This module imports no vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oasiskv_runtime.config import ModelConfig

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
"""Our architecture name -> the Hugging Face class name vLLM resolves its model from."""


def hf_config(c: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a model config (the fields vLLM reads for Llama and Qwen3)."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[c.architecture]], "model_type": c.architecture, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": dtype, "hidden_act": "silu", "attention_bias": False, "eos_token_id": list(c.eos_token_ids)}
    if c.rope_scaling:
        cfg["rope_scaling"] = c.rope_scaling
    return cfg


VLLM_ONLY_PRESETS: dict[str, tuple[ModelConfig, dict[str, Any]]] = {
    "qwen3-30b-a3b": (
        ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                    num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                    max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
                    name="qwen3-30b-a3b", random_weights=True),
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
         "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "norm_topk_prob": True}),
}
"""Random-weight presets of models vLLM runs and the embedded engine does not (MoE): the config is Qwen3's
attention (what OasisKV touches; GQA, 4 KV heads of 128) and the dict the MoE fields of the Hugging Face config."""


@dataclass(frozen=True)
class VllmModel:
    """Where vLLM finds a model, and how to load it."""

    path: Path
    """Directory with ``config.json`` (and the weights unless random)."""
    config: ModelConfig
    """Our config of the same model (vocabulary size, shapes)."""
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments ``vllm.LLM`` needs for it (``load_format="dummy"`` for random weights)."""

    @property
    def random_weights(self) -> bool:
        return self.config.random_weights


def vllm_model(model: str, root: Path) -> VllmModel:
    """The vLLM-loadable form of ``model`` (any name the embedded engine takes, or a :data:`VLLM_ONLY_PRESETS`
    name); a preset's config directory is written under ``root``.

    Raises:
        FileNotFoundError, ValueError: the model cannot be found or read (as the embedded engine's loader).
    """
    from oasiskv_runtime.models.loader import model_config_for

    if model in VLLM_ONLY_PRESETS:
        config, extra = VLLM_ONLY_PRESETS[model]
    else:
        config, _, directory = model_config_for(model)
        if directory is not None:
            return VllmModel(Path(directory), config)
        extra = {}
    out = Path(root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**hf_config(config), **extra}, indent=1))
    return VllmModel(out, config, {"load_format": "dummy"})
