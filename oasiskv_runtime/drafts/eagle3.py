"""EAGLE-3 draft head in plain PyTorch, loadable from the public Hugging Face layout.

What an EAGLE-3 head is
-----------------------
A single Llama-style decoder layer that drafts the next token from

* three hidden states of the *target* model (low / mid / high layers) at a position,
  fused by ``fc: Linear(3*T -> H)`` (``T`` = target hidden size, usually ``H``), and
* the embedding of the token that FOLLOWS that position (EAGLE's one-token shift).

The layer's attention takes ``2*H`` inputs: ``cat(input_layernorm(embed), hidden_norm(fused))``.
The residual stream is the fused hidden state itself (or its normed copy when the
config sets ``norm_before_residual``, a vLLM "speculators" option). After the layer a
final ``norm`` and ``lm_head`` give logits over a reduced *draft* vocabulary; draft id
``d`` maps to target id ``d + d2t[d]``, and ``t2d`` is the boolean mask of target ids
that have a draft id.

Checkpoint layout (e.g. ``Tengyunw/qwen3_8b_eagle3``; ``model.`` prefixes are accepted)::

    config.json
    *.safetensors:
      fc.weight                                  [H, 3*T]
      midlayer.input_layernorm.weight            [H]
      midlayer.hidden_norm.weight                [H]
      midlayer.self_attn.q_proj.weight           [heads*D, 2*H]
      midlayer.self_attn.{k,v}_proj.weight       [kv_heads*D, 2*H]
      midlayer.self_attn.o_proj.weight           [H, heads*D]
      midlayer.post_attention_layernorm.weight   [H]
      midlayer.mlp.{gate,up}_proj.weight         [I, H]
      midlayer.mlp.down_proj.weight              [H, I]
      norm.weight                                [H]
      lm_head.weight                             [draft_vocab, H]
      d2t                                        [draft_vocab]  int64
      t2d                                        [vocab]        bool
      embed_tokens.weight (optional)             [vocab, H]

Which target hidden states feed the head
----------------------------------------
Everything in this module indexes target hidden states the way Hugging Face's
``output_hidden_states=True`` tuple does: index ``i`` is the residual stream ENTERING
decoder layer ``i`` (index 0 = embeddings, index ``i`` = output of layer ``i-1``). The
EAGLE-3 reference captures exactly that (it records ``hidden_states`` before running
layer ``idx`` for ``idx in {2, n//2, n-3}``); see :func:`default_aux_layer_ids` and
:meth:`Eagle3Config.aux_hidden_state_indices` for how explicit config ids are mapped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "Eagle3CheckpointError",
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Head",
    "Eagle3Output",
    "DraftStep",
    "default_aux_layer_ids",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

AuxIdConvention = Literal["layer_output", "layer_input"]


class Eagle3CheckpointError(ValueError):
    """A checkpoint directory exists but its contents do not describe a usable head."""


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's default low/mid/high taps for a target with ``num_target_layers`` layers.

    Returns ``[2, n // 2, n - 3]`` as Hugging Face ``output_hidden_states`` indices, i.e.
    the hidden state entering decoder layer ``i`` (== output of layer ``i - 1``). This is
    what the EAGLE-3 reference, sglang and vLLM all capture when no ids are configured,
    and what public heads without explicit ids were trained on.
    """
    n = int(num_target_layers)
    if n < 4:
        # n - 3 must name a real decoder output (index >= 1), not the embeddings.
        raise ValueError(f"EAGLE-3 needs a target with >= 4 layers, got {n}")
    return [2, n // 2, n - 3]


def _rope_config(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Extract (rope_theta, scaling dict or None) from either config dialect.

    Accepts the legacy ``rope_theta`` + ``rope_scaling`` keys and the transformers>=5
    ``rope_parameters`` dict (which carries ``rope_theta`` and ``rope_type`` together).
    """
    rope_params = d.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise Eagle3CheckpointError(f"rope_parameters must be a dict, got {rope_params!r}")
    theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling: dict[str, Any] | None = None
    for candidate in (d.get("rope_scaling"), rope_params):
        if not candidate:
            continue
        rope_type = candidate.get("rope_type", candidate.get("type", "default"))
        if rope_type != "default":
            scaling = {k: v for k, v in candidate.items() if k not in ("type", "rope_theta")}
            scaling["rope_type"] = rope_type
            break
    if scaling is not None and scaling["rope_type"] not in ("linear", "llama3"):
        raise NotImplementedError(
            f"EAGLE-3 head: rope_type {scaling['rope_type']!r} is not supported "
            "(supported: default, linear, llama3)"
        )
    return float(theta), scaling


@dataclass
class Eagle3Config:
    """Shape/hyper-parameters of an EAGLE-3 head, read from its ``config.json``.

    Attributes:
        hidden_size: draft hidden size ``H`` (= embedding width).
        intermediate_size: SwiGLU width ``I``.
        num_attention_heads / num_key_value_heads: GQA geometry.
        vocab_size: TARGET vocabulary size (rows of ``t2d`` and of the embedding).
        draft_vocab_size: rows of ``lm_head`` / entries of ``d2t``.
        head_dim: per-head width ``D``; defaults to ``hidden_size // num_attention_heads``.
        rms_norm_eps: epsilon of every RMSNorm in the head.
        rope_theta / rope_scaling: RoPE base and optional ``linear``/``llama3`` scaling.
        target_hidden_size: ``T``, width of each target hidden state (defaults to ``H``).
        attention_bias: q/k/v/o projections carry biases.
        norm_before_residual: residual is ``hidden_norm(fused)`` instead of ``fused``.
        eagle_aux_hidden_state_layer_ids: raw ids from the config, or ``None``.
        aux_layer_ids_convention: how those raw ids are meant (see
            :meth:`aux_hidden_state_indices`).
        num_target_layers: target depth, only needed to compute the default taps.
        sliding_window: each row attends to at most this many cached positions, itself included
            (``None``: all). ``train-draft`` writes its training crop length here: a head scores worse
            at distances it never attended over in training (docs/benchmarks.md, "Draft and recall"). Read from
            config.json only with ``use_sliding_window: true`` (HF's Qwen2 convention): configs derived
            from other models may carry a ``sliding_window`` that EAGLE-3 implementations ignore.
        extra: unknown config keys, kept so ``save_pretrained`` round-trips them.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    target_hidden_size: int | None = None
    attention_bias: bool = False
    norm_before_residual: bool = False
    hidden_act: str = "silu"
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    aux_layer_ids_convention: AuxIdConvention = "layer_output"
    num_target_layers: int | None = None
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise Eagle3CheckpointError(f"sliding_window must be a positive int or null, got {self.sliding_window}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise Eagle3CheckpointError(
                    f"hidden_size {self.hidden_size} not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_attention_heads % self.num_key_value_heads:
            raise Eagle3CheckpointError(
                f"num_attention_heads {self.num_attention_heads} not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise Eagle3CheckpointError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"EAGLE-3 head: hidden_act {self.hidden_act!r} unsupported")
        if self.draft_vocab_size > self.vocab_size:
            raise Eagle3CheckpointError(
                f"draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}"
            )

    # Keys consumed by from_dict; everything else goes to `extra`.
    _KNOWN_KEYS = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "draft_vocab_size", "head_dim", "rms_norm_eps", "rope_theta",
        "rope_scaling", "rope_parameters", "target_hidden_size", "attention_bias",
        "norm_before_residual", "hidden_act", "eagle_aux_hidden_state_layer_ids",
        "num_target_layers", "sliding_window", "use_sliding_window",
    )  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any], num_target_layers: int | None = None) -> Eagle3Config:
        """Build from a parsed ``config.json`` dict.

        ``num_target_layers`` (or a ``num_target_layers`` key) is only used to compute the
        default taps when the config names none.
        """
        required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in d]
        if missing:
            raise Eagle3CheckpointError(f"EAGLE-3 config is missing required keys {missing}")
        theta, scaling = _rope_config(d)

        # Two dialects name the taps. SpecForge/sglang nest them under `eagle_config` and
        # mean decoder-layer OUTPUTS (sglang captures at layer id+1). vLLM "speculators"
        # configs put them top-level and vLLM captures the input of layer id as-is.
        nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = d.get("eagle_aux_hidden_state_layer_ids")
        ids: list[int] | None
        convention: AuxIdConvention
        if nested:
            ids, convention = [int(i) for i in nested], "layer_output"
        elif top:
            ids, convention = [int(i) for i in top], "layer_input"
        else:
            ids, convention = None, "layer_output"
        if ids is not None and len(ids) != 3:
            raise Eagle3CheckpointError(f"EAGLE-3 expects 3 aux layer ids, config has {ids}")

        extra = {k: v for k, v in d.items() if k not in cls._KNOWN_KEYS}
        head_dim = d.get("head_dim")
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            vocab_size=int(d["vocab_size"]),
            # A head without a reduced vocab drafts over the full target vocab.
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            head_dim=int(head_dim) if head_dim is not None else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            target_hidden_size=d.get("target_hidden_size"),
            attention_bias=bool(d.get("attention_bias", False)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            eagle_aux_hidden_state_layer_ids=ids,
            aux_layer_ids_convention=convention,
            num_target_layers=num_target_layers or d.get("num_target_layers"),
            sliding_window=int(d["sliding_window"])
            if d.get("use_sliding_window") and d.get("sliding_window") is not None else None,
            extra=extra,
        )

    @classmethod
    def from_file(cls, path: str | Path, num_target_layers: int | None = None) -> Eagle3Config:
        """Read ``path`` (a ``config.json`` file or a directory containing one)."""
        p = Path(path)
        if p.is_dir():
            p = p / CONFIG_NAME
        if not p.is_file():
            raise FileNotFoundError(f"EAGLE-3 head config not found: {p} (expected {CONFIG_NAME})")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise Eagle3CheckpointError(f"{p} is not valid JSON: {e}") from e
        return cls.from_dict(d, num_target_layers=num_target_layers)

    def to_dict(self) -> dict[str, Any]:
        """Config dict in the public layout (readable by EAGLE/SpecForge/sglang/vLLM)."""
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            num_hidden_layers=1,  # the head always has exactly one decoder layer
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            tie_word_embeddings=False,
        )
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.sliding_window is not None:
            d.update(use_sliding_window=True, sliding_window=self.sliding_window)
        if self.eagle_aux_hidden_state_layer_ids is not None:
            ids = list(self.eagle_aux_hidden_state_layer_ids)
            if self.aux_layer_ids_convention == "layer_output":
                eagle_cfg = dict(d.get("eagle_config") or {})
                eagle_cfg.update(eagle_aux_hidden_state_layer_ids=ids, use_aux_hidden_state=True)
                d["eagle_config"] = eagle_cfg
            else:
                d["eagle_aux_hidden_state_layer_ids"] = ids
        return d

    def aux_hidden_state_indices(self, num_target_layers: int | None = None) -> list[int]:
        """Indices into the target's HF ``output_hidden_states`` tuple, low/mid/high.

        ``aux_hidden[:, j]`` passed to the head must be ``hidden_states[idx[j]]``.

        * config ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge/sglang):
          ids name decoder-layer outputs, so index = id + 1;
        * top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM speculators): ids name the
          layer whose input is captured, so index = id;
        * neither: :func:`default_aux_layer_ids` of ``num_target_layers`` (argument, else
          ``self.num_target_layers``).
        """
        if self.eagle_aux_hidden_state_layer_ids is not None:
            shift = 1 if self.aux_layer_ids_convention == "layer_output" else 0
            return [i + shift for i in self.eagle_aux_hidden_state_layer_ids]
        n = num_target_layers if num_target_layers is not None else self.num_target_layers
        if n is None:
            raise ValueError(
                "EAGLE-3 config names no aux layers; pass num_target_layers to use the "
                "default [2, n//2, n-3]"
            )
        return default_aux_layer_ids(n)


# --------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama RMSNorm: ``weight * x / rms(x)``, statistics in fp32. Shapes: ``[..., H]``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics: bf16 mean-of-squares loses too much precision for large H.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` (fp32) incl. linear / llama3 scaling."""
    # Explicit CPU device: the head may be built under a `torch.device("meta")` context.
    exps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv = 1.0 / (theta**exps)
    if scaling is None:
        return inv.float()
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv / factor).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    ramp = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - ramp) * inv / factor + ramp * inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, scaled)
    scaled = torch.where(wavelen < old_ctx / high, inv, scaled)
    return scaled.float()


def _rotate_half(x: Tensor) -> Tensor:
    # HF/Llama "half split" convention (not interleaved pairs): public heads use it.
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate ``x: [heads, n, D]`` by absolute ``positions: [n]``; returns ``x``'s dtype."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Eagle3Attention(nn.Module):
    """GQA self-attention whose q/k/v read ``2*H`` inputs (embedding ++ fused hidden)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.window = cfg.sliding_window
        self.head_dim = cfg.head_dim
        in_dim = 2 * cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        inv_freq: Tensor,
        past_k: Tensor | None = None,
        past_v: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Attend ``n`` new positions to ``L`` cached ones plus themselves (causally).

        Args:
            x: ``[n, 2H]`` normed ``cat(embed, hidden)``.
            positions: ``[n]`` absolute positions of the new rows (RoPE only; ordering of
                the cache is by insertion, which callers keep increasing).
            inv_freq: ``[D/2]`` RoPE frequencies.
            past_k / past_v: ``[kv_heads, L, D]`` post-RoPE cache or ``None``.

        Returns:
            ``(out [n, H], k_new [kv_heads, n, D], v_new [kv_heads, n, D])``; the new
            k/v are post-RoPE and ready to append to the cache.
        """
        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(n, h, d).transpose(0, 1)  # [h, n, D]
        k = self.k_proj(x).view(n, kvh, d).transpose(0, 1)  # [kvh, n, D]
        v = self.v_proj(x).view(n, kvh, d).transpose(0, 1)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)

        if past_k is not None and self.window is not None and past_k.shape[1] >= self.window:
            # No row reaches further back than window - 1 cached slots: drop the rest before the matmuls.
            past_k, past_v = past_k[:, past_k.shape[1] - self.window + 1:], past_v[:, past_v.shape[1] - self.window + 1:]
        if past_k is not None and past_k.shape[1] > 0:
            assert past_v is not None
            k_all, v_all = torch.cat((past_k, k), dim=1), torch.cat((past_v, v), dim=1)
        else:
            k_all, v_all = k, v
        total = k_all.shape[1]
        past_len = total - n

        # Query head j*g + r uses kv head j (HF repeat_kv order); grouping by a view
        # avoids materialising repeated K/V.
        g = h // kvh
        qf = q.float().view(kvh, g, n, d)
        scores = torch.matmul(qf, k_all.float().transpose(-1, -2)[:, None]) / math.sqrt(d)
        # New row i sits at cache slot past_len + i and may see slots <= past_len + i.
        slot = torch.arange(total, device=x.device)
        row = (past_len + torch.arange(n, device=x.device))[:, None]
        allowed = slot[None, :] <= row
        if self.window is not None:
            allowed &= slot[None, :] > row - self.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(dim=-1)  # fp32 softmax, as in HF eager attention
        out = torch.matmul(probs, v_all.float()[:, None])  # [kvh, g, n, D]
        out = out.to(x.dtype).reshape(h, n, d).transpose(0, 1).reshape(n, h * d)
        return self.o_proj(out), k, v


class Eagle3MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``[n, H] -> [n, H]``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The head's single layer (``midlayer.*`` in checkpoints)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)  # applied to the token embedding
        self.hidden_norm = RMSNorm(h, eps)  # applied to the fused target hidden
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = Eagle3MLP(h, cfg.intermediate_size)

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        inv_freq: Tensor,
        past_k: Tensor | None = None,
        past_v: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``embeds, hidden: [n, H]`` -> ``(out [n, H] pre-final-norm, k_new, v_new)``."""
        hn = self.hidden_norm(hidden)
        residual = hn if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), hn), dim=-1)  # embed first, then hidden
        attn, k, v = self.self_attn(x, positions, inv_freq, past_k, past_v)
        h = residual + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v


@dataclass
class Eagle3Output:
    """Result of :meth:`Eagle3Head.forward` for ``n`` new positions.

    Attributes:
        logits: ``[n, draft_vocab]`` draft-vocab logits (fp32).
        hidden: ``[n, H]`` layer output BEFORE the final norm; EAGLE-3 feeds this back as
            the hidden input when drafting further tokens autoregressively.
        k, v: ``[kv_heads, n, D]`` post-RoPE keys/values of the new positions.
    """

    logits: Tensor
    hidden: Tensor
    k: Tensor
    v: Tensor


# --------------------------------------------------------------------------------------
# Head
# --------------------------------------------------------------------------------------


def _normalize_key(key: str) -> str:
    """Map accepted checkpoint spellings onto this module's state-dict names."""
    if key.startswith("model."):
        key = key[len("model.") :]
    # Some exporters (vLLM-style) name the single layer `layers.0` instead of `midlayer`.
    if key.startswith("layers.0."):
        key = "midlayer." + key[len("layers.0.") :]
    return key


def _ignorable(key: str) -> bool:
    # Old HF exports store the (recomputable) RoPE table; it carries no weights.
    return key.endswith("rotary_emb.inv_freq")


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head (one decoder layer + fc fusion + reduced-vocab lm_head).

    Args:
        config: head geometry.
        target_embed: the target model's input embedding ``[vocab, H]``; used when the
            head has no ``embed_tokens`` of its own. It is referenced, NOT registered as a
            submodule, so ``head.to(dtype)`` never converts the target's weights in place
            and ``state_dict``/``save_pretrained`` never copy them.
        own_embedding: give the head its own ``embed_tokens`` (saved with it). Defaults to
            ``target_embed is None``.

    Buffers: ``d2t: int64 [draft_vocab]`` and ``t2d: bool [vocab]``. A fresh head maps
    draft ids onto the first ``draft_vocab`` target ids; use :meth:`set_vocab_mapping`.
    """

    embed_tokens: nn.Embedding | None
    d2t: Tensor
    t2d: Tensor

    def __init__(
        self,
        config: Eagle3Config,
        target_embed: nn.Embedding | None = None,
        own_embedding: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        cfg = config
        assert cfg.head_dim is not None and cfg.target_hidden_size is not None
        if own_embedding is None:
            own_embedding = target_embed is None
        if not own_embedding and target_embed is None:
            raise ValueError("Eagle3Head without its own embed_tokens needs target_embed")
        if target_embed is not None:
            want = (cfg.vocab_size, cfg.hidden_size)
            if tuple(target_embed.weight.shape) != want:
                raise ValueError(
                    f"target_embed has shape {tuple(target_embed.weight.shape)}, head expects "
                    f"[vocab_size, hidden_size] = {list(want)}"
                )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        # Stored outside nn.Module registration on purpose (see class docstring).
        self._target_embed: nn.Embedding | None = None
        object.__setattr__(self, "_target_embed", target_embed)

        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Plain attribute, not a buffer: it is derived from config, must stay fp32 even
        # after head.to(bfloat16), and must survive meta-device construction.
        self._inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    # ---- small accessors -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def owns_embedding(self) -> bool:
        return self.embed_tokens is not None

    def set_sliding_window(self, window: int | None) -> None:
        """Attend to at most ``window`` cached positions per row (``None``: all); saved with the config."""
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be positive or None, got {window}")
        self.config.sliding_window = window
        self.midlayer.self_attn.window = window

    # ---- vocab mapping ---------------------------------------------------------------

    def set_vocab_mapping(self, draft_to_target: Tensor) -> None:
        """Set ``d2t``/``t2d`` from ``draft_to_target: int [draft_vocab]`` (distinct ids)."""
        cfg = self.config
        ids = draft_to_target.to(device=self.d2t.device, dtype=torch.long).flatten()
        if ids.numel() != cfg.draft_vocab_size:
            raise ValueError(f"need {cfg.draft_vocab_size} target ids, got {ids.numel()}")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError("draft_to_target must hold distinct ids in [0, vocab_size)")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def check_vocab_mapping(self) -> None:
        """Raise :class:`Eagle3CheckpointError` unless ``d2t`` and ``t2d`` agree."""
        cfg = self.config
        tgt = self.draft_to_target(torch.arange(cfg.draft_vocab_size, device=self.d2t.device))
        if tgt.min() < 0 or tgt.max() >= cfg.vocab_size:
            raise Eagle3CheckpointError("d2t maps draft ids outside the target vocab")
        if tgt.unique().numel() != tgt.numel():
            raise Eagle3CheckpointError("d2t maps two draft ids onto the same target id")
        if not bool(self.t2d[tgt].all()) or int(self.t2d.sum()) != cfg.draft_vocab_size:
            raise Eagle3CheckpointError("t2d is not the set of target ids reachable via d2t")

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids (any shape, int) -> target-vocab ids: ``d + d2t[d]``."""
        return draft_ids + self.d2t[draft_ids]

    # ---- forward pieces --------------------------------------------------------------

    def embed(self, token_ids: Tensor) -> Tensor:
        """``token_ids: int [n]`` (TARGET vocab) -> ``[n, H]`` in the head's dtype/device."""
        if self.embed_tokens is not None:
            return self.embed_tokens(token_ids.to(self.device))
        emb = self._target_embed
        assert emb is not None
        w = emb.weight
        return F.embedding(token_ids.to(w.device), w).to(device=self.device, dtype=self.dtype)

    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """``aux_hidden: [n, 3, T]`` (low, mid, high) or ``[n, 3T]`` -> ``fc(..): [n, H]``."""
        x = aux_hidden.to(device=self.device, dtype=self.dtype)
        return self.fc(x.reshape(x.shape[0], -1))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Pre-norm layer output ``[n, H]`` -> draft-vocab logits ``[n, draft_vocab]`` (fp32)."""
        return self.lm_head(self.norm(hidden)).float()

    def forward_hidden(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        past_k: Tensor | None = None,
        past_v: Tensor | None = None,
    ) -> Eagle3Output:
        """Run the layer on already-fused ``hidden: [n, H]`` and ``embeds: [n, H]``.

        This is the entry point for autoregressive drafting steps, where ``hidden`` is a
        previous :attr:`Eagle3Output.hidden` instead of ``fc(aux)``.
        """
        positions = positions.to(device=self.device, dtype=torch.long)
        out, k, v = self.midlayer(embeds, hidden, positions, self._inv_freq, past_k, past_v)
        return Eagle3Output(logits=self.compute_logits(out), hidden=out, k=k, v=v)

    def forward(
        self,
        token_ids: Tensor,
        aux_hidden: Tensor,
        positions: Tensor,
        past_k: Tensor | None = None,
        past_v: Tensor | None = None,
    ) -> Eagle3Output:
        """One sequence, ``n`` new positions, optional cache of ``L`` earlier ones.

        Args:
            token_ids: ``int [n]``, target-vocab token that FOLLOWS each position.
            aux_hidden: ``[n, 3, T]`` target hidden states (low, mid, high) AT each position.
            positions: ``int [n]`` absolute positions.
            past_k / past_v: ``[kv_heads, L, D]`` cache from earlier calls.
        """
        if token_ids.dim() != 1 or positions.dim() != 1:
            raise ValueError("token_ids and positions must be 1-D [n]")
        n = token_ids.shape[0]
        if aux_hidden.shape[0] != n or positions.shape[0] != n:
            raise ValueError(
                f"length mismatch: token_ids {n}, aux_hidden {aux_hidden.shape[0]}, "
                f"positions {positions.shape[0]}"
            )
        t = self.config.target_hidden_size
        assert t is not None
        if aux_hidden.shape[1:] not in ((3, t), (3 * t,)):
            raise ValueError(f"aux_hidden must be [n, 3, {t}], got {list(aux_hidden.shape)}")
        return self.forward_hidden(
            self.embed(token_ids), self.fuse(aux_hidden), positions, past_k, past_v
        )

    # ---- (de)serialisation -----------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target_embed: nn.Embedding | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        num_target_layers: int | None = None,
        strict: bool = True,
    ) -> Eagle3Head:
        """Load ``config.json`` + ``*.safetensors`` from directory ``path``.

        Keys may carry a ``model.`` prefix. If the checkpoint has ``embed_tokens.weight`` the
        head uses it; otherwise ``target_embed`` is required. ``d2t``/``t2d`` may only be
        absent when ``draft_vocab_size == vocab_size`` (identity mapping). With
        ``strict`` (default), keys this head does not use are an error rather than being
        silently dropped (e.g. a Qwen3-style ``q_norm`` it would otherwise ignore).

        Raises:
            FileNotFoundError: no directory, no ``config.json`` or no ``*.safetensors``.
            Eagle3CheckpointError: missing/unexpected keys, wrong shapes, bad vocab map.
        """
        from safetensors.torch import load_file

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"EAGLE-3 head directory not found: {root}")
        cfg = Eagle3Config.from_file(root, num_target_layers=num_target_layers)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in EAGLE-3 head directory {root}")

        tensors: dict[str, Tensor] = {}
        source: dict[str, str] = {}
        for f in files:
            for raw_key, t in load_file(str(f), device="cpu").items():
                if _ignorable(raw_key):
                    continue
                key = _normalize_key(raw_key)
                if key in tensors:
                    raise Eagle3CheckpointError(
                        f"duplicate tensor {key!r} ({source[key]} and {f.name}:{raw_key})"
                    )
                tensors[key], source[key] = t, f"{f.name}:{raw_key}"

        own_embedding = "embed_tokens.weight" in tensors
        if not own_embedding and target_embed is None:
            raise Eagle3CheckpointError(
                f"{root} has no embed_tokens.weight; pass target_embed= (the target "
                "model's input embedding)"
            )
        if "d2t" not in tensors and "t2d" not in tensors:
            if cfg.draft_vocab_size != cfg.vocab_size:
                raise Eagle3CheckpointError(
                    f"{root} is missing d2t/t2d but draft_vocab_size {cfg.draft_vocab_size} "
                    f"!= vocab_size {cfg.vocab_size}"
                )
            tensors["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
            tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        # Exporters disagree on integer widths; the module wants int64 / bool.
        if "d2t" in tensors:
            tensors["d2t"] = tensors["d2t"].to(torch.long)
        if "t2d" in tensors:
            tensors["t2d"] = tensors["t2d"].to(torch.bool)

        # Build on the meta device so no memory/time goes into random init that the
        # checkpoint overwrites (heads for 8B+ targets are ~1B parameters).
        with torch.device("meta"):
            head = cls(cfg, target_embed=target_embed, own_embedding=own_embedding)
        # ...but the target embedding must stay a real tensor (it was built elsewhere).
        object.__setattr__(head, "_target_embed", target_embed)

        expected = head.state_dict()
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise Eagle3CheckpointError(f"{root}: checkpoint is missing keys {missing}")
        unexpected = sorted(set(tensors) - set(expected))
        if unexpected and strict:
            raise Eagle3CheckpointError(
                f"{root}: checkpoint has keys this EAGLE-3 head does not use {unexpected} "
                "(pass strict=False to ignore them)"
            )
        bad = [
            f"{k}: checkpoint {list(tensors[k].shape)} vs expected {list(v.shape)}"
            for k, v in expected.items()
            if tuple(tensors[k].shape) != tuple(v.shape)
        ]
        if bad:
            raise Eagle3CheckpointError(f"{root}: shape mismatch (config vs weights): {bad}")

        head.load_state_dict({k: tensors[k] for k in expected}, strict=True, assign=True)
        head.to(device=device)
        # .to(dtype) only touches floating tensors, so d2t/t2d keep int64/bool.
        head.to(dtype=dtype)
        head.check_vocab_mapping()
        head.eval()
        return head

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the public layout; returns dir.

        A borrowed ``target_embed`` is not saved (the checkpoint then has no
        ``embed_tokens.weight``, like the public heads).
        """
        from safetensors.torch import save_file

        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        (root / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        # safetensors refuses views/shared storage: materialise contiguous CPU copies.
        state = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.state_dict().items()}
        save_file(state, str(root / WEIGHTS_NAME), metadata={"format": "pt"})
        return root


# --------------------------------------------------------------------------------------
# Per-request drafter
# --------------------------------------------------------------------------------------


@dataclass
class DraftStep:
    """One greedy draft.

    Attributes:
        token_id: TARGET-vocab id of the drafted token.
        draft_id: the same token in the draft vocab.
        logits: ``[draft_vocab]`` fp32 logits it was taken from.
        hidden: ``[H]`` pre-norm layer output at the last input position (what a further
            autoregressive drafting step consumes as its hidden input).
    """

    token_id: int
    draft_id: int
    logits: Tensor
    hidden: Tensor


@dataclass
class _RequestState:
    k: Tensor  # [kv_heads, L, D] post-RoPE
    v: Tensor  # [kv_heads, L, D]
    positions: Tensor  # int64 [L], strictly increasing
    last: DraftStep | None = None


class Eagle3Drafter:
    """Stateful per-request greedy proposer over an :class:`Eagle3Head`.

    Alignment (EAGLE's one-token shift). Let ``x_0, x_1, ...`` be the request's tokens and
    ``h_p`` the target's aux hidden states (``[3, T]``, low/mid/high) computed while
    processing ``x_p`` at position ``p``. Head row ``p`` consumes ``(h_p, embed(x_{p+1}))``,
    is rotated with RoPE position ``p``, and predicts ``x_{p+2}``. Hence in
    ``propose(req, token_ids, aux_hidden, positions)``::

        aux_hidden[i] = h_{positions[i]}
        token_ids[i]  = x_{positions[i] + 1}      # the token that FOLLOWS the position
        returns       greedy guess for x_{positions[-1] + 2}   (target-vocab id)

    Typical flow: after prefill of ``x_0..x_{T-1}`` the target samples ``x_T``; call
    ``propose(token_ids=x_1..x_T, aux_hidden=h_0..h_{T-1}, positions=0..T-1)`` to get a
    guess for ``x_{T+1}``. After the target verifies and accepts tokens up to ``x_{m}``
    (it has hidden states through position ``m-1``), feed the not-yet-fed positions
    ``T..m-1`` with tokens ``x_{T+1}..x_m``. Every position must be fed exactly once, in
    increasing order; the head's KV cache for the request grows by ``n`` per call.
    Positions need not be contiguous (RoPE uses them as given), but must increase.
    """

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self._reqs: dict[Any, _RequestState] = {}

    # ---- request lifecycle -----------------------------------------------------------

    def _empty_state(self) -> _RequestState:
        cfg, head = self.head.config, self.head
        assert cfg.head_dim is not None
        kv = torch.empty(cfg.num_key_value_heads, 0, cfg.head_dim, device=head.device, dtype=head.dtype)
        pos = torch.empty(0, dtype=torch.long, device=head.device)
        return _RequestState(k=kv, v=kv.clone(), positions=pos)

    def reset(self, req_id: Any) -> None:
        """Start (or restart) ``req_id`` with an empty cache."""
        self._reqs[req_id] = self._empty_state()

    def free(self, req_id: Any) -> None:
        """Drop ``req_id``'s cache. Idempotent, so it is safe in cleanup paths."""
        self._reqs.pop(req_id, None)

    def __contains__(self, req_id: Any) -> bool:
        return req_id in self._reqs

    def num_cached(self, req_id: Any) -> int:
        """Number of positions in ``req_id``'s head KV cache (0 if unknown)."""
        st = self._reqs.get(req_id)
        return 0 if st is None else int(st.positions.numel())

    def cached_positions(self, req_id: Any) -> Tensor:
        """``int64 [L]`` positions currently cached for ``req_id``."""
        return self._reqs[req_id].positions.clone()

    def truncate(self, req_id: Any, length: int) -> None:
        """Keep only the first ``length`` cached positions (e.g. to roll back rows that
        were fed for tokens the target later rejected)."""
        st = self._reqs[req_id]
        if not 0 <= length <= st.positions.numel():
            raise ValueError(f"truncate length {length} outside [0, {st.positions.numel()}]")
        st.k, st.v = st.k[:, :length], st.v[:, :length]
        st.positions = st.positions[:length]
        st.last = None

    # ---- drafting --------------------------------------------------------------------

    def _validate(self, st: _RequestState, token_ids: Tensor, aux: Tensor, pos: Tensor) -> None:
        n = token_ids.numel()
        if n == 0:
            raise ValueError("propose needs at least one new position")
        if token_ids.dim() != 1 or pos.dim() != 1 or pos.numel() != n or aux.shape[0] != n:
            raise ValueError(
                f"expected token_ids [n], aux_hidden [n, 3, T], positions [n]; got "
                f"{list(token_ids.shape)}, {list(aux.shape)}, {list(pos.shape)}"
            )
        if n > 1 and not bool((pos[1:] > pos[:-1]).all()):
            raise ValueError(f"positions must be strictly increasing, got {pos.tolist()}")
        if int(pos[0]) < 0:
            raise ValueError("positions must be >= 0")
        if st.positions.numel() and int(pos[0]) <= int(st.positions[-1]):
            raise ValueError(
                f"position {int(pos[0])} already fed (cache ends at {int(st.positions[-1])}); "
                "call truncate() to roll back first"
            )
        vocab = self.head.config.vocab_size
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
            raise ValueError(f"token ids must be target-vocab ids in [0, {vocab})")

    def _greedy(self, logits: Tensor, hidden: Tensor) -> DraftStep:
        draft_id = int(logits.argmax())  # argmax picks the lowest index on ties: deterministic
        token_id = int(self.head.draft_to_target(torch.tensor(draft_id, device=self.head.d2t.device)))
        return DraftStep(token_id=token_id, draft_id=draft_id, logits=logits, hidden=hidden)

    @torch.inference_mode()
    def step(self, req_id: Any, token_ids: Tensor, aux_hidden: Tensor, positions: Tensor) -> DraftStep:
        """Like :meth:`propose` but returns the full :class:`DraftStep`."""
        st = self._reqs.get(req_id)
        if st is None:  # first call for a request implies reset()
            st = self._reqs[req_id] = self._empty_state()
        pos = positions.to(device=self.head.device, dtype=torch.long)
        self._validate(st, token_ids, aux_hidden, pos)
        out = self.head(token_ids, aux_hidden, pos, st.k, st.v)
        st.k = torch.cat((st.k, out.k), dim=1)
        st.v = torch.cat((st.v, out.v), dim=1)
        st.positions = torch.cat((st.positions, pos))
        st.last = self._greedy(out.logits[-1], out.hidden[-1])
        return st.last

    def propose(self, req_id: Any, token_ids: Tensor, aux_hidden: Tensor, positions: Tensor) -> int:
        """Append ``n`` positions to ``req_id``'s head cache; return the next greedy draft.

        Args:
            token_ids: ``int [n]`` target-vocab ids; ``token_ids[i]`` is the token at
                position ``positions[i] + 1`` (see class docstring).
            aux_hidden: ``[n, 3, T]`` target hidden states (low, mid, high) at ``positions``.
            positions: ``int [n]`` strictly increasing, after everything already fed.

        Returns:
            TARGET-vocab id guessed for position ``positions[-1] + 2``.
        """
        return self.step(req_id, token_ids, aux_hidden, positions).token_id

    @torch.inference_mode()
    def propose_chain(
        self, req_id: Any, token_ids: Tensor, aux_hidden: Tensor, positions: Tensor, num_tokens: int
    ) -> list[int]:
        """Feed like :meth:`propose`, then draft ``num_tokens`` greedy tokens in a chain.

        Step ``j >= 1`` feeds the head its own previous pre-norm output as the hidden input
        (EAGLE-3 skips ``fc`` there) with the embedding of the token just drafted, at
        position ``positions[-1] + j``. Those speculative rows are removed from the cache
        before returning, so the request's cache only ever holds target-backed rows.

        Returns:
            ``num_tokens`` TARGET-vocab ids for positions ``positions[-1] + 2, + 3, ...``.
        """
        if num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")
        first = self.step(req_id, token_ids, aux_hidden, positions)
        st = self._reqs[req_id]
        k, v = st.k, st.v
        drafts, cur = [first.token_id], first
        next_pos = int(st.positions[-1]) + 1
        for _ in range(num_tokens - 1):
            tok = torch.tensor([cur.token_id], device=self.head.device)
            pos = torch.tensor([next_pos], device=self.head.device)
            out = self.head.forward_hidden(self.head.embed(tok), cur.hidden[None], pos, k, v)
            # Local k/v only: the committed cache (st.k/st.v) is left untouched.
            k, v = torch.cat((k, out.k), dim=1), torch.cat((v, out.v), dim=1)
            cur = self._greedy(out.logits[-1], out.hidden[-1])
            drafts.append(cur.token_id)
            next_pos += 1
        return drafts
