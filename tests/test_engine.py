"""Engine behaviour on a tiny random checkpoint: continuous batching, preemption, sampling, bad input."""

from __future__ import annotations

import pytest

from oasiskv_runtime import LLM, SamplingParams
from tests.tiny_models import write_tiny

PROMPTS = [[5, 17, 33, 9, 101, 250, 7], [300, 12], list(range(40, 40 + 37)), [7] * 19 + [8, 9, 10], [11] * 50]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tiny"), "llama", max_position_embeddings=256))


@pytest.fixture(scope="module")
def alone(tiny_path):
    llm = LLM(tiny_path)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.slow
def test_requests_arriving_mid_run_get_the_tokens_they_get_alone(tiny_path, alone):
    llm = LLM(tiny_path, max_num_batched_tokens=16)  # also forces chunked prefill
    eng = llm.engine
    seqs = {}
    seqs[0] = eng.add_request(PROMPTS[0], GREEDY)
    seqs[1] = eng.add_request(PROMPTS[1], GREEDY)
    pending = list(range(2, len(PROMPTS)))
    steps = 0
    while eng.has_unfinished() or pending:
        eng.step()
        steps += 1
        if pending and steps % 5 == 0:  # arrivals while others decode
            i = pending.pop(0)
            seqs[i] = eng.add_request(PROMPTS[i], GREEDY)
    assert [seqs[i].output_token_ids for i in range(len(PROMPTS))] == alone
    assert llm.stats.max_running_batch >= 3


def test_preemption_by_recompute_keeps_tokens(tiny_path, alone):
    # 5 requests of up to ~74 tokens at block size 4 need ~19 blocks each; 30 blocks hold one or two at a time.
    per_block = 4 * 2 * 5 * 3 * 48 * 4  # block_size * (k,v) * layers * kv heads * head_dim * fp32
    llm = LLM(tiny_path, block_size=4, kv_cache_bytes=30 * per_block)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert llm.stats.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) == llm.stats.num_preemptions
    assert llm.engine.kv.device_pool.num_used == 0  # nothing leaked


def test_sampling_seeded_is_reproducible_and_respects_top_k(tiny_path):
    llm = LLM(tiny_path)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_k=3, top_p=0.9, seed=7, ignore_eos=True)
    a = llm.generate([PROMPTS[0], PROMPTS[2]], p)
    b = llm.generate([PROMPTS[2]], p)
    assert a[1].token_ids == b[0].token_ids  # independent of batching
    assert len(a[0].token_ids) == 12
    # top_k=1 sampling is greedy whatever the temperature
    k1 = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=5.0, top_k=1, ignore_eos=True))
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert k1[0].token_ids == greedy[0].token_ids


def test_stop_on_eos_and_max_tokens(tiny_path, alone):
    llm = LLM(tiny_path)
    eos = alone[0][3]
    llm.engine.eos_ids = {eos}
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == alone[0][: alone[0].index(eos) + 1]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_metrics_present(tiny_path):
    out = LLM(tiny_path).generate([PROMPTS[0]], GREEDY)[0]
    m = out.metrics
    assert m["ttft_ms"] > 0 and m["tpot_ms"] > 0 and len(m["itl_ms"]) == len(out.token_ids) - 1


def test_bad_input_errors(tiny_path, tmp_path):
    llm = LLM(tiny_path)
    with pytest.raises(ValueError, match="longer than the model's context"):
        llm.generate([[5] * 300], GREEDY)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[100000]], GREEDY)
    with pytest.raises(ValueError, match="too small for one request"):
        LLM(tiny_path, kv_cache_bytes=4096).generate([PROMPTS[2]], GREEDY)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(tiny_path, not_an_option=1)
    with pytest.raises(ValueError, match="unknown mode"):
        LLM(tiny_path, mode="turbo")
    with pytest.raises(ValueError, match="unknown model"):
        LLM("qwen3-9b")
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "nope" / "model"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(bad))
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(tiny_path).generate(["text"], GREEDY)  # the tiny checkpoint ships no tokenizer


@pytest.mark.slow
def test_stop_string_cuts_at_its_first_occurrence(tmp_path):
    from tests.tiny_models import write_tiny_tokenizer

    path = write_tiny(tmp_path / "m", "llama")
    write_tiny_tokenizer(path)
    llm = LLM(str(path))
    free = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 12, text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                                               stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
