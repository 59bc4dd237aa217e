"""Tests for the EAGLE-3 draft head (oasiskv_runtime.drafts.eagle3) on a tiny random head."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from oasiskv_runtime.drafts.eagle3 import (
    Eagle3CheckpointError,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    default_aux_layer_ids,
    rope_inv_freq,
)

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 48, 3, 1, 16, 64
VOCAB, DRAFT_VOCAB = 101, 37


def tiny_config_dict(**overrides: object) -> dict:
    """A config.json as public EAGLE-3 heads write it (legacy rope keys)."""
    d = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    d.update(overrides)
    return d


def draft_to_target_ids(seed: int = 0) -> torch.Tensor:
    """Sorted distinct target ids for each draft id (how EAGLE-3 builds d2t)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values


def make_head(seed: int = 0, own_embedding: bool = True, target_embed=None) -> Eagle3Head:
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_dict(tiny_config_dict())
    head = Eagle3Head(cfg, target_embed=target_embed, own_embedding=own_embedding)
    with torch.no_grad():
        # Non-trivial norm weights so a swapped/missing norm would change the outputs.
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("_proj.weight") or name in ("fc.weight", "lm_head.weight"):
                p.mul_(3.0)  # spread the logits so greedy argmax is not a near-tie
    head.set_vocab_mapping(draft_to_target_ids(seed))
    return head.eval()


def make_inputs(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, VOCAB, (n,), generator=g)
    aux = torch.randn(n, 3, H, generator=g)
    positions = torch.arange(n)
    return token_ids, aux, positions


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def test_config_defaults_and_dialects() -> None:
    d = tiny_config_dict()
    del d["head_dim"]
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}
    cfg = Eagle3Config.from_dict(d)
    assert cfg.head_dim == H // HEADS
    assert cfg.rope_theta == 123456.0 and cfg.rope_scaling is None
    assert cfg.target_hidden_size == H

    assert default_aux_layer_ids(36) == [2, 18, 33]
    assert cfg.aux_hidden_state_indices(num_target_layers=36) == [2, 18, 33]
    with pytest.raises(ValueError, match="num_target_layers"):
        cfg.aux_hidden_state_indices()

    # SpecForge/sglang nesting names layer outputs -> HF hidden_states index id + 1.
    nested_ids = {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}
    nested = Eagle3Config.from_dict(tiny_config_dict(eagle_config=nested_ids))
    assert nested.eagle_aux_hidden_state_layer_ids == [1, 29, 57]
    assert nested.aux_hidden_state_indices() == [2, 30, 58] == default_aux_layer_ids(61)
    # vLLM speculators' top-level key names captured layer inputs -> used as-is.
    top = Eagle3Config.from_dict(tiny_config_dict(eagle_aux_hidden_state_layer_ids=[2, 30, 58]))
    assert top.aux_hidden_state_indices() == [2, 30, 58]
    # Both dialects survive a to_dict/from_dict round trip.
    for c in (nested, top):
        again = Eagle3Config.from_dict(c.to_dict())
        assert again.aux_hidden_state_indices() == c.aux_hidden_state_indices()


def test_llama3_rope_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,  # puts some frequencies in the ramp
    }
    hf_cfg = LlamaConfig(
        hidden_size=H, num_attention_heads=HEADS, head_dim=HEAD_DIM,
        rope_parameters={**scaling, "rope_theta": 500000.0},
    )  # fmt: skip
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(HEAD_DIM, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    # The legacy `rope_scaling` spelling parses to the same thing.
    cfg = Eagle3Config.from_dict(tiny_config_dict(rope_theta=500000.0, rope_scaling={**scaling}))
    assert cfg.rope_scaling == scaling


# --------------------------------------------------------------------------------------
# Architecture against an independent reference built from transformers' Llama pieces
# --------------------------------------------------------------------------------------


def reference_logits(head: Eagle3Head, token_ids, aux, positions) -> torch.Tensor:
    """Full-sequence causal EAGLE-3 forward using HF's RoPE/GQA helpers; [n, draft_vocab]."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
        repeat_kv,
    )

    sd = {k: v.double() if v.is_floating_point() else v for k, v in head.state_dict().items()}
    eps = head.config.rms_norm_eps

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    n = token_ids.shape[0]
    emb = sd["embed_tokens.weight"][token_ids]
    fused = aux.double().reshape(n, 3 * H) @ sd["fc.weight"].T
    x = torch.cat(
        [rms(emb, sd["midlayer.input_layernorm.weight"]), rms(fused, sd["midlayer.hidden_norm.weight"])], -1
    )
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(1, n, HEADS, HEAD_DIM).transpose(1, 2)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(1, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(1, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
    hf_cfg = LlamaConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rope_theta=head.config.rope_theta,
    )
    rope = LlamaRotaryEmbedding(hf_cfg)
    cos, sin = rope(q.float(), positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = attn.transpose(1, 2).reshape(n, HEADS * HEAD_DIM) @ sd["midlayer.self_attn.o_proj.weight"].T
    h = fused + attn
    y = rms(h, sd["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ sd["midlayer.mlp.gate_proj.weight"].T, y @ sd["midlayer.mlp.up_proj.weight"].T
    mlp = (F.silu(gate) * up) @ sd["midlayer.mlp.down_proj.weight"].T
    h = h + mlp
    return (rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T).float()


def test_forward_matches_reference() -> None:
    head = make_head()
    token_ids, aux, positions = make_inputs(9)
    with torch.no_grad():
        out = head(token_ids, aux, positions)
    ref = reference_logits(head, token_ids, aux, positions)
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------
# save/load
# --------------------------------------------------------------------------------------


def test_save_load_roundtrip(tmp_path: Path) -> None:
    head = make_head()
    head.save_pretrained(tmp_path / "head")
    assert (tmp_path / "head" / "config.json").is_file()
    assert (tmp_path / "head" / "model.safetensors").is_file()

    loaded = Eagle3Head.from_pretrained(tmp_path / "head")
    assert loaded.config.to_dict() == head.config.to_dict()
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool

    token_ids, aux, positions = make_inputs(5)
    assert Eagle3Drafter(head).propose("r", token_ids, aux, positions) == Eagle3Drafter(loaded).propose(
        "r", token_ids, aux, positions
    )


def test_borrowed_embedding_not_saved_nor_converted(tmp_path: Path) -> None:
    target_embed = torch.nn.Embedding(VOCAB, H)
    head = make_head(own_embedding=False, target_embed=target_embed)
    assert "embed_tokens.weight" not in head.state_dict()
    head.to(torch.bfloat16)
    assert target_embed.weight.dtype == torch.float32  # the target's weights are untouched
    head.to(torch.float32).save_pretrained(tmp_path)
    with pytest.raises(Eagle3CheckpointError, match="target_embed"):
        Eagle3Head.from_pretrained(tmp_path)
    loaded = Eagle3Head.from_pretrained(tmp_path, target_embed=target_embed)
    assert not loaded.owns_embedding
    token_ids = torch.tensor([3, 99, 0])
    torch.testing.assert_close(loaded.embed(token_ids), target_embed.weight[token_ids].detach())


# --------------------------------------------------------------------------------------
# Drafter
# --------------------------------------------------------------------------------------


def test_propose_deterministic_and_in_t2d_support() -> None:
    head = make_head()
    drafter = Eagle3Drafter(head)
    for seed in range(6):
        token_ids, aux, positions = make_inputs(4 + seed, seed=seed)
        drafter.reset("a")
        drafter.reset("b")
        ta = drafter.propose("a", token_ids, aux, positions)
        tb = drafter.propose("b", token_ids, aux, positions)
        assert isinstance(ta, int) and ta == tb
        assert 0 <= ta < VOCAB and bool(head.t2d[ta])
    step = drafter.step("c", *make_inputs(3))
    assert step.token_id == step.draft_id + int(head.d2t[step.draft_id])
    assert step.logits.shape == (DRAFT_VOCAB,) and step.hidden.shape == (H,)


def test_incremental_equals_full() -> None:
    head = make_head()
    n = 8
    token_ids, aux, positions = make_inputs(n, seed=3)
    with torch.no_grad():
        full = head(token_ids, aux, positions)  # logits for every position, no cache
    full_tokens = head.draft_to_target(full.logits.argmax(-1))

    one_by_one = Eagle3Drafter(head)
    for i in range(n):
        step = one_by_one.step("r", token_ids[i : i + 1], aux[i : i + 1], positions[i : i + 1])
        torch.testing.assert_close(step.logits, full.logits[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step.hidden, full.hidden[i], rtol=1e-5, atol=1e-5)
        assert step.token_id == int(full_tokens[i])
    assert one_by_one.num_cached("r") == n

    # Uneven chunks, and one call with everything, agree too.
    chunked = Eagle3Drafter(head)
    for lo, hi in ((0, 3), (3, 4), (4, 8)):
        t_chunk = chunked.propose("r", token_ids[lo:hi], aux[lo:hi], positions[lo:hi])
        assert t_chunk == int(full_tokens[hi - 1])
    whole = Eagle3Drafter(head).propose("r", token_ids, aux, positions)
    assert whole == int(full_tokens[-1])


def test_sliding_window_sees_only_the_last_rows(tmp_path: Path) -> None:
    """With ``sliding_window`` W, row r's output is the plain head's output for rows r-W+1..r alone (one layer:
    a row depends on other rows only through its attention); full, incremental and chunked calls agree, and the
    window survives save/load."""
    head, w, n = make_head(seed=4), 5, 13
    token_ids, aux, positions = make_inputs(n, seed=6)
    positions = positions + 1000  # RoPE is relative: far positions must not matter
    with torch.no_grad():
        plain_rows = [head(token_ids[max(0, r - w + 1):r + 1], aux[max(0, r - w + 1):r + 1],
                           positions[max(0, r - w + 1):r + 1]).logits[-1] for r in range(n)]
        head.set_sliding_window(w)
        full = head(token_ids, aux, positions).logits
    torch.testing.assert_close(full, torch.stack(plain_rows), rtol=1e-5, atol=1e-5)
    drafter = Eagle3Drafter(head)
    rows = []
    for lo, hi in ((0, 1), (1, 7), (7, 8), (8, 9), (9, 13)):  # the cache slicing path, past > window
        rows.append(drafter.step("r", token_ids[lo:hi], aux[lo:hi], positions[lo:hi]).logits.reshape(-1, DRAFT_VOCAB))
    torch.testing.assert_close(torch.cat(rows)[-1], full[-1], rtol=1e-5, atol=1e-5)
    one = Eagle3Drafter(head)
    for i in range(n):
        step = one.step("q", token_ids[i:i + 1], aux[i:i + 1], positions[i:i + 1])
        torch.testing.assert_close(step.logits.reshape(-1), full[i], rtol=1e-5, atol=1e-5)
    head.save_pretrained(tmp_path / "h")
    saved = json.loads((tmp_path / "h" / "config.json").read_text())
    assert saved["sliding_window"] == w and saved["use_sliding_window"] is True
    assert Eagle3Config.from_file(tmp_path / "h").sliding_window == w
    assert Eagle3Config.from_dict(tiny_config_dict()).sliding_window is None
    # a window another model's config left behind is not ours to apply (EAGLE-3 implementations ignore it)
    assert Eagle3Config.from_dict(tiny_config_dict(sliding_window=4096)).sliding_window is None
    assert Eagle3Config.from_dict(tiny_config_dict(sliding_window=4096, use_sliding_window=False)).sliding_window is None
    with pytest.raises(Eagle3CheckpointError, match="sliding_window"):
        Eagle3Config.from_dict(tiny_config_dict(sliding_window=0, use_sliding_window=True))


def test_gapped_positions_use_given_rope_positions() -> None:
    # Positions need not be contiguous; the cache must still equal a full call with them.
    head = make_head()
    token_ids, aux, _ = make_inputs(5, seed=4)
    positions = torch.tensor([0, 1, 5, 6, 20])
    with torch.no_grad():
        full = head(token_ids, aux, positions)
    drafter = Eagle3Drafter(head)
    drafter.propose("r", token_ids[:2], aux[:2], positions[:2])
    step = drafter.step("r", token_ids[2:], aux[2:], positions[2:])
    torch.testing.assert_close(step.logits, full.logits[-1], rtol=1e-5, atol=1e-5)


def test_request_isolation_truncate_and_free() -> None:
    head = make_head()
    token_ids, aux, positions = make_inputs(6, seed=5)
    drafter = Eagle3Drafter(head)
    drafter.propose("a", token_ids[:4], aux[:4], positions[:4])
    other = make_inputs(3, seed=9)
    drafter.propose("b", *other)
    expected = Eagle3Drafter(head).propose("x", token_ids, aux, positions)
    assert drafter.propose("a", token_ids[4:], aux[4:], positions[4:]) == expected

    with pytest.raises(ValueError, match="already fed"):
        drafter.propose("a", token_ids[5:], aux[5:], positions[5:])
    drafter.truncate("a", 5)
    assert drafter.num_cached("a") == 5
    assert drafter.propose("a", token_ids[5:], aux[5:], positions[5:]) == expected

    with pytest.raises(ValueError, match="strictly increasing"):
        drafter.propose("c", token_ids[:2], aux[:2], torch.tensor([3, 3]))
    drafter.free("a")
    drafter.free("a")  # idempotent
    assert "a" not in drafter and drafter.num_cached("a") == 0
    assert "b" in drafter and drafter.num_cached("b") == 3


def test_propose_chain_reuses_own_hidden_and_rolls_back() -> None:
    head = make_head()
    token_ids, aux, positions = make_inputs(6, seed=6)
    drafter = Eagle3Drafter(head)
    chain = drafter.propose_chain("r", token_ids, aux, positions, num_tokens=4)
    assert len(chain) == 4 and all(bool(head.t2d[t]) for t in chain)
    assert chain[0] == Eagle3Drafter(head).propose("r", token_ids, aux, positions)
    assert drafter.num_cached("r") == 6  # speculative rows were not committed

    # Step 2 by hand: hidden = previous pre-norm output, embedding of drafted token, pos 6.
    first = Eagle3Drafter(head).step("r", token_ids, aux, positions)
    with torch.no_grad():
        full_k = head(token_ids, aux, positions)
        out = head.forward_hidden(
            head.embed(torch.tensor([first.token_id])),
            first.hidden[None],
            torch.tensor([6]),
            full_k.k,
            full_k.v,
        )
    assert chain[1] == int(head.draft_to_target(out.logits[-1].argmax()))


def test_bfloat16_load(tmp_path: Path) -> None:
    make_head().save_pretrained(tmp_path)
    head = Eagle3Head.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16 and head.d2t.dtype == torch.long
    tok = Eagle3Drafter(head).propose("r", *make_inputs(5))
    assert bool(head.t2d[tok])


# --------------------------------------------------------------------------------------
# Public layout, written without save_pretrained
# --------------------------------------------------------------------------------------


def public_state_dict(prefix: str = "", with_embed: bool = False, seed: int = 11) -> dict[str, torch.Tensor]:
    """Tensors named as in e.g. Tengyunw/qwen3_8b_eagle3/model.safetensors."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    target_ids = draft_to_target_ids(seed)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    sd = {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "lm_head.weight": w(DRAFT_VOCAB, H),
        "d2t": target_ids - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    if with_embed:
        sd["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=g)
    return {prefix + k: v for k, v in sd.items()}


def write_public(root: Path, sd: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or tiny_config_dict()))
    save_file(sd, str(root / "model.safetensors"))
    return root


def test_public_layout_loads(tmp_path: Path) -> None:
    sd = public_state_dict()
    root = write_public(tmp_path / "plain", sd)
    target_embed = torch.nn.Embedding(VOCAB, H)
    head = Eagle3Head.from_pretrained(root, target_embed=target_embed)
    assert not head.owns_embedding
    for k, v in sd.items():
        assert torch.equal(head.state_dict()[k], v), k

    # `model.`-prefixed keys with the head's own embedding load too (and win over target).
    sd_emb = public_state_dict(with_embed=True)
    prefixed = write_public(tmp_path / "prefixed", {"model." + k: v for k, v in sd_emb.items()})
    head2 = Eagle3Head.from_pretrained(prefixed, target_embed=target_embed)
    assert head2.owns_embedding
    assert torch.equal(head2.embed_tokens.weight, sd_emb["embed_tokens.weight"])

    token_ids, aux, positions = make_inputs(7)
    for h in (head, head2):
        tok = Eagle3Drafter(h).propose("r", token_ids, aux, positions)
        assert bool(h.t2d[tok])
    # The public head matches the independent reference too (own-embedding variant).
    with torch.no_grad():
        out = head2(token_ids, aux, positions)
    ref = reference_logits(head2, token_ids, aux, positions)
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)

    # transformers>=5 `rope_parameters` spelling of the config is accepted as well.
    cfg = tiny_config_dict()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    head3 = Eagle3Head.from_pretrained(write_public(tmp_path / "v5cfg", sd, cfg), target_embed=target_embed)
    assert head3.config.rope_theta == 10000.0


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


def test_missing_key_is_a_clear_error(tmp_path: Path) -> None:
    sd = public_state_dict(with_embed=True)
    del sd["midlayer.self_attn.q_proj.weight"]
    root = write_public(tmp_path, sd)
    match = r"missing keys \['midlayer\.self_attn\.q_proj\.weight'\]"
    with pytest.raises(Eagle3CheckpointError, match=match):
        Eagle3Head.from_pretrained(root)


def test_missing_config_and_weights_are_clear_errors(tmp_path: Path) -> None:
    root = write_public(tmp_path / "h", public_state_dict(with_embed=True))
    (root / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        Eagle3Head.from_pretrained(root)
    with pytest.raises(FileNotFoundError, match="directory not found"):
        Eagle3Head.from_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(tiny_config_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Eagle3Head.from_pretrained(empty)
    bad_cfg = tiny_config_dict()
    del bad_cfg["hidden_size"]
    (empty / "config.json").write_text(json.dumps(bad_cfg))
    with pytest.raises(Eagle3CheckpointError, match="hidden_size"):
        Eagle3Config.from_file(empty)


def test_unexpected_shape_and_vocab_map_errors(tmp_path: Path) -> None:
    sd = public_state_dict(with_embed=True)
    sd["midlayer.self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)  # Qwen3-style extra
    root = write_public(tmp_path / "extra", sd)
    with pytest.raises(Eagle3CheckpointError, match="q_norm"):
        Eagle3Head.from_pretrained(root)
    Eagle3Head.from_pretrained(root, strict=False)  # explicit opt-out works

    sd = public_state_dict(with_embed=True)
    sd["fc.weight"] = torch.zeros(H, 2 * H)  # an EAGLE-1/2 style fc
    with pytest.raises(Eagle3CheckpointError, match="shape mismatch.*fc.weight"):
        Eagle3Head.from_pretrained(write_public(tmp_path / "shape", sd))

    sd = public_state_dict(with_embed=True)
    sd["t2d"] = ~sd["t2d"]
    with pytest.raises(Eagle3CheckpointError, match="t2d"):
        Eagle3Head.from_pretrained(write_public(tmp_path / "vocab", sd))
