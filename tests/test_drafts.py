"""Draft sources: n-gram lookup, a small model, layer-skip, an EAGLE-3 head and the oracle, in the engine."""

from __future__ import annotations

import random

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.drafts.eagle3 import Eagle3Config
from oasiskv_runtime.drafts.sources import NgramDraft
from tests.tiny_models import write_tiny, write_tiny_eagle3_head

PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 6, list(range(40, 40 + 53))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def brute_ngram(tokens: list[int], max_n: int = 3) -> int | None:
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n]
    return None


def test_ngram_incremental_index_equals_brute_force():
    rng = random.Random(0)
    d = NgramDraft()
    for _ in range(200):
        toks = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        state = None
        for n in range(1, len(toks) + 1):
            assert d.propose_one(toks[:n], state) == brute_ngram(toks[:n])
            state = d._last_state


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("drafts"), "llama"))


@pytest.fixture(scope="module")
def dense(tiny):
    return [o.token_ids for o in LLM(tiny).generate(PROMPTS, GREEDY)]


@pytest.mark.slow
def test_model_draft_of_itself_is_always_right(tiny, dense):
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, draft=f"model:{tiny}")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == dense
    assert llm.engine.run_stats()["draft_accuracy"] == 1.0


@pytest.mark.slow
def test_eagle3_head_drafts_in_the_engine(tiny, dense, tmp_path):
    write_tiny_eagle3_head(tmp_path / "head")
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, draft=f"eagle3:{tmp_path / 'head'}")
    assert llm.engine.runner.capture_layers == (1, 1, 1)  # HF hidden_states[2] = output of layer 1, for [2, 5//2, 5-3]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == dense  # a draft only steers selection while acceptance is off
    st = llm.engine.run_stats()
    assert st["draft_accuracy"] is not None  # the head proposed every decode step


def test_unknown_draft_and_oracle_without_truth(tiny):
    with pytest.raises(ValueError, match="unknown draft source"):
        LLM(tiny, mode="oasiskv", draft="telepathy")
    with pytest.raises(ValueError, match="oracle draft needs the true continuation"):
        LLM(tiny, mode="oasiskv", draft="oracle").generate(PROMPTS[:1], GREEDY)
    with pytest.raises(ValueError, match="layerskip"):
        LLM(tiny, mode="oasiskv", draft="layerskip:9")


def test_oracle_proposes_a_reference_run_while_the_outputs_follow_it(tiny, dense):
    """reference_output_ids (accuracy's `--draft oracle`: dense's outputs): the oracle proposes the reference's next
    token at every step while the request's outputs equal the reference's; from the first output that differs it
    proposes nothing. Outputs are sampled, never forced: at a covering budget they stay dense's either way."""
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, draft="oracle")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, reference_output_ids=dense)] == dense
    st = llm.engine.stats
    assert st.num_draft_checked == 2 * GREEDY.max_tokens and st.num_draft_correct == st.num_draft_checked
    wrong = [list(dense[0]), list(dense[1])]
    wrong[0][5] = (wrong[0][5] + 1) % 100  # prompt 0's reference leaves its outputs at output 5
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=64, block_size=4, draft="oracle")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, reference_output_ids=wrong)] == dense
    st = llm.engine.stats
    assert (st.num_draft_checked, st.num_draft_correct) == (6 + GREEDY.max_tokens, 5 + GREEDY.max_tokens)
    with pytest.raises(ValueError, match="reference_output_ids: one list per prompt"):
        llm.generate(PROMPTS, GREEDY, reference_output_ids=dense[:1])


def test_hybrid_takes_ngram_on_a_full_match_and_the_other_draft_elsewhere():
    from oasiskv_runtime.drafts.sources import HybridDraft
    from oasiskv_runtime.engine.sequence import Sequence

    class Fixed:
        name, capture_layers = "fixed", ()

        def propose(self, seqs):
            return {s.seq_id: 99 for s in seqs}

        def observe(self, meta, captured):
            pass

        def free(self, seq_id):
            pass

    hybrid = HybridDraft(NgramDraft(3), Fixed())
    repeat = Sequence([5, 6, 7, 8, 5, 6, 7], SamplingParams())   # "5 6 7" seen before -> 8
    short = Sequence([5, 6, 1, 2, 3, 6], SamplingParams())       # only a 1-token match -> the other draft
    fresh = Sequence([1, 2, 3, 4], SamplingParams())             # no match at all
    out = hybrid.propose([repeat, short, fresh])
    assert out == {repeat.seq_id: 8, short.seq_id: 99, fresh.seq_id: 99}
    assert hybrid.name == "ngram:3+fixed"


def _ngram_brute(tokens, max_n):
    """The token after the most recent earlier occurrence of the longest suffix (n <= max_n), by a full scan."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - 1, n - 1, -1):
            if tokens[i - n:i] == suffix:
                return tokens[i], n
    return None, 0


def test_ngram_propose_on_sequences_matches_a_full_scan():
    """NgramDraft.propose reads only each request's new tokens (token_at / token_slice, no copy of the context):
    its guesses equal a full scan of the whole token list as prompts are read and outputs appended one or a
    few at a time, for several requests at once and for prompts shorter than max_n."""
    import random

    from oasiskv_runtime.drafts.sources import NgramDraft
    from oasiskv_runtime.engine.sequence import Sequence
    from oasiskv_runtime.sampling_params import SamplingParams

    rng = random.Random(3)
    draft = NgramDraft(max_n=3)
    seqs = [Sequence([rng.randrange(6) for _ in range(n)], SamplingParams()) for n in (1, 2, 5, 40)]
    checked = 0
    for _ in range(60):
        for s in seqs:
            s.output_token_ids += [rng.randrange(6) for _ in range(rng.choice((1, 1, 1, 3)))]
        got = draft.propose(seqs)
        for s in seqs:
            want, n = _ngram_brute(s.all_token_ids, 3)
            assert got.get(s.seq_id) == want, (s.all_token_ids, got.get(s.seq_id), want)
            checked += want is not None
    assert checked > 100


def test_auto_draft_is_the_shipped_head_behind_ngram_where_one_ships(tiny, tmp_path):
    from oasiskv_runtime.config import EngineConfig
    from oasiskv_runtime.drafts import HEADS_DIR, resolve_draft, shipped_head

    head = shipped_head("smollm2-135m")
    assert head == HEADS_DIR / "smollm2-135m"
    assert Eagle3Config.from_file(head / "config.json").draft_vocab_size == 4096  # a public-layout config
    assert resolve_draft("auto", "smollm2-135m") == f"ngram+eagle3:{head}"
    assert resolve_draft("auto", "/models/somewhere/smollm2-135m") == f"ngram+eagle3:{head}"
    assert resolve_draft("auto", tiny) == "ngram" and resolve_draft("oracle", "smollm2-135m") == "oracle"
    assert shipped_head(str(tmp_path)) is None
    # resolved once, where the config is built, so reports and checks see the concrete draft
    assert EngineConfig.from_overrides("smollm2-135m", mode="oasiskv").sparse.draft == f"ngram+eagle3:{head}"
    assert EngineConfig.from_overrides("smollm2-135m", mode="oasiskv", draft="ngram:2").sparse.draft == "ngram:2"
    assert EngineConfig("smollm2-135m").sparse.draft == f"ngram+eagle3:{head}"  # built directly too
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=4, block_size=4)
    assert llm.engine.config.sparse.draft == "ngram"


def test_ngram_minimum_match_proposes_only_on_a_long_enough_suffix(tiny):
    """``ngram:N:M``: no guess where the longest earlier suffix match is shorter than M tokens, the plain n-gram's
    guess elsewhere; built from its name by the engine; M outside [1, N] is refused."""
    from oasiskv_runtime.engine.sequence import Sequence
    from oasiskv_runtime.sampling_params import SamplingParams

    rng = random.Random(5)
    seqs = [Sequence([rng.randrange(7) for _ in range(n)], SamplingParams()) for n in (3, 30, 60)]
    plain, strict = NgramDraft(3), NgramDraft(3, 2)
    dropped = kept = 0
    for _ in range(40):
        for s in seqs:
            s.output_token_ids.append(rng.randrange(7))
        a, b = plain.propose(seqs), strict.propose(seqs)
        for s in seqs:
            want, n = _ngram_brute(s.all_token_ids, 3)
            assert a.get(s.seq_id) == want
            assert b.get(s.seq_id) == (want if n >= 2 else None), (n, want, b.get(s.seq_id))
            dropped += want is not None and n < 2
            kept += n >= 2
    assert dropped > 0 and kept > 0  # both cases occur in this data
    assert strict.name == "ngram:3:2" and plain.name == "ngram:3"
    with pytest.raises(ValueError, match="minimum match must be in"):
        NgramDraft(3, 4)
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=2, block_size=4, draft="ngram:3:2")
    llm.generate(PROMPTS, GREEDY)
    assert llm.engine.drafter.name == "ngram:3:2"
