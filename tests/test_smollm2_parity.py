"""Parity on the real model: SmolLM2-135M-Instruct from the packaged GGUF against transformers' own GGUF load."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.models.assets import SMOLLM2

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Three reasons to learn a second language are"]


@pytest.mark.skipif(SMOLLM2.path() is None, reason=f"needs {SMOLLM2.install}")
def test_smollm2_gguf_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = SMOLLM2.path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly 32 tokens, EOS included, like ignore_eos
    expected = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones_like(ids), pad_token_id=tok.eos_token_id, eos_token_id=None)
        expected.append(out[0, ids.shape[1]:].tolist())
    del hf
    llm = LLM("smollm2-135m")
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in tok.decode(expected[0])


@pytest.mark.skipif(SMOLLM2.path() is None, reason=f"needs {SMOLLM2.install}")
def test_smollm2_sparse_modes_with_covering_budget_equal_dense():
    prompts = [list(range(1000, 1090)), [504, 2988, 314] * 20]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    dense = [o.token_ids for o in LLM("smollm2-135m").generate(prompts, params)]
    for mode in ("sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"):
        llm = LLM("smollm2-135m", mode=mode, top_k_blocks=16)  # 16 blocks of 16 cover the 106-token contexts
        assert [o.token_ids for o in llm.generate(prompts, params)] == dense, mode
    # oasiskv ran with the default draft: the shipped EAGLE-3 head behind the n-gram draft, which only steers
    assert llm.engine.config.sparse.draft.startswith("ngram+eagle3:") and llm.stats.num_draft_checked > 0


def test_gguf_conversion_cache_is_keyed_by_content_not_path(tmp_path, monkeypatch):
    """Each fresh venv installs the GGUF at a new path: the conversion must be found again, not redone (and kept
    again, ~0.5 GB each); a file with other bytes gets its own entry."""
    from oasiskv_runtime.models import loader

    monkeypatch.setattr(loader, "_cache_root", lambda: tmp_path / "cache")
    data = bytes(range(256)) * 64
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for p, body in ((a, data), (b, data), (c, data[:-1] + b"\x00")):
        p.parent.mkdir()
        p.write_bytes(body)
    assert loader._gguf_cache_dir(a, sample=1024) == loader._gguf_cache_dir(b, sample=1024)
    assert loader._gguf_cache_dir(a, sample=1024) != loader._gguf_cache_dir(c, sample=1024)
