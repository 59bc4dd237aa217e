"""The dense decoder-only causal LM shared by every supported architecture."""

from __future__ import annotations

import torch
from torch import nn

from oasiskv_runtime.config import ModelConfig
from oasiskv_runtime.models.layers import AttentionBackend, DecoderLayer, RMSNorm, RotaryEmbedding


class DecoderForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Architectures differ only in config flags
    (Qwen3's q/k norm) and in how checkpoint names map onto the fused projections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    def use_fused_kernels(self, enabled: bool) -> None:
        """RMSNorm, and the q/k norm with rotary, as one Triton kernel each where the tensors are on CUDA
        (``oasiskv_runtime.ops.norm_rope``); off: their plain-PyTorch composition (the reference). Cheap when
        unchanged: engines that share one model (benchmarks) set it before each step."""
        if getattr(self, "_fused", None) == enabled:
            return
        self._fused = enabled
        for m in self.modules():
            if hasattr(m, "fused"):
                m.fused = enabled

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids, positions: [T] -> final hidden [T, hidden] and the residual stream after each layer in
        ``capture_layers`` (for EAGLE-style drafts)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, backend)
            if i in capture_layers:
                captured[i] = x
        return self.norm(x), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ weight.t()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face names (``model.layers.N.self_attn.q_proj.weight`` ...) into fused parameters."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
            if name not in own:
                raise KeyError(f"checkpoint tensor maps to unknown parameter {name}")
            p = own[name]
            target = p.data if rows is None else p.data[rows]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                 f"model {tuple(target.shape)}")
            target.copy_(tensor.to(target.dtype))
            loaded.add(name if rows is None else f"{name}[{rows.start}:{rows.stop}]")

        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        inter = c.intermediate_size
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
            "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
            "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
            "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
        }
        for name, tensor in state.items():
            key = name[len("model."):] if name.startswith("model.") else name
            if key.startswith("rotary_emb") or key.endswith("rotary_emb.inv_freq"):
                continue
            if key == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy
            parts = key.split(".")
            if parts[0] == "layers":
                prefix, sub, leaf = ".".join(parts[:2]), ".".join(parts[2:4]), parts[-1]
                if sub in fused:
                    target, rows = fused[sub]
                    put(f"{prefix}.{target}.{leaf}", tensor, rows)
                    continue
            put(key, tensor)
        expected = set()
        for pname, p in own.items():
            if ".qkv_proj." in pname:
                expected.update({f"{pname}[0:{q}]", f"{pname}[{q}:{q + kv}]", f"{pname}[{q + kv}:{q + 2 * kv}]"})
            elif ".gate_up_proj." in pname:
                expected.update({f"{pname}[0:{inter}]", f"{pname}[{inter}:{2 * inter}]"})
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
