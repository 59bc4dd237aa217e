"""Random-weight presets at real shapes (for throughput only: every report labels them random-weights).

Shapes are copied from the models' published config.json files.
"""

from __future__ import annotations

from oasiskv_runtime.config import ModelConfig

_PRESETS: dict[str, dict] = {
    "qwen3-8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1_000_000.0, max_position_embeddings=40960, eos_token_ids=(151645,)),
    "qwen3-32b": dict(architecture="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, max_position_embeddings=40960, eos_token_ids=(151645,)),
    "llama-3.1-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope_theta=500_000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         eos_token_ids=(128001, 128008, 128009), bos_token_id=128000),
    # Same shape as SmolLM2-135M, random weights: lets CPU tests and benches run without the real model.
    "smollm2-135m-random": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100_000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                                eos_token_ids=(2,)),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def preset_config(name: str) -> ModelConfig:
    if name not in _PRESETS:
        raise KeyError(name)
    return ModelConfig(name=name, random_weights=True, **_PRESETS[name])
