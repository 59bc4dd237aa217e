"""Parity with Hugging Face transformers on tiny random Llama and Qwen3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from tests.tiny_models import write_tiny

PROMPTS = [[5, 17, 33, 2 + 7, 101, 250], [300, 12], list(range(40, 40 + 37)), [7] * 19 + [8, 9, 10]]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp(request.param), request.param)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_greedy_matches_transformers_batched_and_alone(tiny):
    path, hf = tiny
    expected = [hf_greedy(hf, p, 48) for p in PROMPTS]
    llm = LLM(str(path), max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert batched == expected
    for p, e in zip(PROMPTS, expected):
        assert llm.generate([p], params)[0].token_ids == e


def test_prefill_logits_match(tiny):
    path, hf = tiny
    llm = LLM(str(path))
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    from oasiskv_runtime.engine.sequence import Sequence

    eng = llm.engine
    seq = eng.add_request(prompt, SamplingParams(max_tokens=1))
    sched = eng.scheduler.schedule()
    meta = eng.runner.build_metadata(sched, {})
    eng.backend.begin_step(meta)
    with torch.inference_mode():
        hidden, _ = eng.model(meta.input_ids, meta.positions, eng.backend)
        ours = eng.model.compute_logits(hidden)
    eng.backend.end_step()
    assert isinstance(seq, Sequence)
    assert (ours - ref).abs().max().item() < 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    from safetensors.torch import load_file, save_file
    import json

    path = write_tiny(tmp_path / "one", "llama", seed=3)
    state = load_file(str(path / "model.safetensors"))
    keys = sorted(state)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((path / "config.json").read_text())
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(shard_dir / name))
        weight_map.update({k: name for k in part})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = LLM(str(path)).generate([PROMPTS[0]], params)[0].token_ids
    b = LLM(str(shard_dir)).generate([PROMPTS[0]], params)[0].token_ids
    assert a == b
