"""``oasisbench train-draft`` on a tiny random target: loss goes down, the checkpoint is a usable EAGLE-3 head
(public layout, loads in the engine without changing greedy output), and resume continues the step count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oasisbench.runners.train_draft import TrainDraftConfig, TrainDraftResult, choose_draft_vocab, train_draft
from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.drafts.eagle3 import Eagle3Head
from tests.tiny_models import write_tiny, write_tiny_tokenizer

PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 6, list(range(40, 40 + 53))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
STEPS = 12


def _cfg(tiny: str, out: Path, **kw) -> TrainDraftConfig:
    # Small everything: the point is the plumbing, in a few seconds on CPU.
    base = dict(model=tiny, output=out, steps=STEPS, batch_tokens=48, lr=3e-3, draft_vocab=128, seq_len=64,
                num_train_tokens=1024, holdout_tokens=256, eval_tokens=128, intermediate_size=64,
                checkpoint_every=6, log_every=1, seed=0, device="cpu")
    base.update(kw)
    return TrainDraftConfig(**base)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-target")
    write_tiny(path, "llama")
    write_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory) -> tuple[Path, TrainDraftResult]:
    out = tmp_path_factory.mktemp("head")
    return out, train_draft(_cfg(tiny, out), show_progress=False)


def test_training_lowers_the_loss(trained):
    _, res = trained
    assert res.step == STEPS and len(res.losses) == STEPS
    first = sum(loss for _, loss, _ in res.losses[:3]) / 3
    last = sum(loss for _, loss, _ in res.losses[-3:]) / 3
    assert last < first
    h = res.heldout
    assert h["positions"] > 0 and 0.0 <= h["head_vs_target"] <= 1.0 and 0.0 <= h["ngram_vs_text"] <= 1.0


def test_checkpoint_is_a_public_layout_fp16_head(trained, tiny):
    out, _ = trained
    embed = LLM(tiny).engine.model.embed_tokens
    for d in (out, out / "checkpoint-6", out / f"checkpoint-{STEPS}"):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 128
        head = Eagle3Head.from_pretrained(d, target_embed=embed, dtype=torch.float16, num_target_layers=5)
        head.check_vocab_mapping()
        assert not head.owns_embedding  # the target's embedding is borrowed, not saved
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.float16 and "embed_tokens.weight" not in state
    assert state["lm_head.weight"].shape == (128, 144) and state["t2d"].sum() == 128


def test_trained_head_only_steers_selection_in_the_engine(trained, tiny):
    out, _ = trained
    dense = [o.token_ids for o in LLM(tiny).generate(PROMPTS, GREEDY)]
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, draft=f"eagle3:{out}")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == dense
    assert llm.engine.run_stats()["draft_accuracy"] is not None


def test_resume_continues_the_step_count(trained, tiny):
    out, res = trained
    more = train_draft(_cfg(tiny, out, steps=STEPS + 4, resume=str(out / f"checkpoint-{STEPS}")),
                       show_progress=False)
    assert more.step == STEPS + 4
    assert [s for s, _, _ in more.losses] == list(range(1, STEPS + 5))
    assert more.losses[:STEPS] == res.losses  # the history came from the checkpoint, not from re-training
    latest = train_draft(_cfg(tiny, out, steps=STEPS + 4, resume="latest"), show_progress=False)
    assert latest.step == STEPS + 4  # the final step was checkpointed: nothing left to do


def test_draft_vocab_is_most_frequent_and_padded():
    ids = choose_draft_vocab([7, 7, 7, 3, 3, 9], size=2, vocab=20)
    assert ids.tolist() == [3, 7]
    assert choose_draft_vocab([5, 5], size=3, vocab=10).tolist() == [0, 1, 5]
