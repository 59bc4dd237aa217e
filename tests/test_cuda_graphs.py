"""Decode-only steps on the static layout that CUDA graphs replay (engine/cuda_graphs.py).

On the CPU the layout runs eagerly (``cuda_graphs="static"``) and must give the same tokens as the eager
engine in every mode, with small budgets (selection, transfers, deferrals all active), requests finishing at
different steps (the batch shrinks), preemption, and staggered arrivals. On CUDA (``gpu`` marker) the same
comparison runs with graphs captured and replayed.
"""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.engine.cuda_graphs import RowTable
from tests.tiny_models import write_tiny

MODES = ["dense", "sparse-resident", "fetch-on-demand", "proxy-prefetch", "oasiskv"]
PROMPTS = [[5, 17, 33, 9, 101, 250, 7] * 9, [300, 12] * 20, list(range(40, 40 + 77))]


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("graphs"), "qwen3", head_dim=64, max_position_embeddings=4096))


def run(tiny, mode, graphs, device="cpu", dtype="float32", one_at_a_time=False, **kw):
    if device == "cuda":
        kw.setdefault("host_kv_bytes", 1 << 28)  # the CUDA default (64 GiB) takes ~40 s to pin
    llm = LLM(tiny, device=device, dtype=dtype, mode=mode, top_k_blocks=3, fetch_ratio=0.34, block_size=4,
              cuda_graphs=graphs, **kw)
    # Different lengths: requests finish at different steps, so the batch size changes during the run.
    lens = [24, 9, 17]
    if one_at_a_time:
        outs = [llm.generate([p], params(n))[0] for p, n in zip(PROMPTS, lens)]
    else:
        eng = llm.engine
        seqs = [eng.add_request(p, params(n)) for p, n in zip(PROMPTS, lens)]
        while eng.has_unfinished():
            eng.step()
        outs = seqs
    toks = [list(o.token_ids if hasattr(o, "token_ids") else o.output_token_ids) for o in outs]
    return toks, llm.engine.run_stats()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_static_layout_equals_eager_cpu(tiny, mode):
    # One request at a time: float32 BLAS can differ in the last bit when the rows of a step are arranged
    # differently (the static layout puts draft rows after all token rows), which could flip a near-tie.
    eager, st_e = run(tiny, mode, "off", one_at_a_time=True)
    static, st_s = run(tiny, mode, "static", one_at_a_time=True)
    assert static == eager
    assert st_s["static_eager_steps"] > 0 and "static_eager_steps" not in st_e
    # Host time of decode steps outside the runner, and of laying a step out on the static buffers.
    assert st_s["decode_host_ms_per_step"] > 0 and st_e["decode_host_ms_per_step"] > 0
    assert st_s["prefill_host_ms_per_step"] > 0 and st_e["prefill_host_ms_per_step"] > 0
    assert st_s["graph_prepare_ms_per_step"] > 0 and "graph_prepare_ms_per_step" not in st_e
    if mode in ("fetch-on-demand", "proxy-prefetch", "oasiskv"):
        assert st_s["fetched_blocks_per_step"] == st_e["fetched_blocks_per_step"] > 0
        assert st_s["deferred_blocks_per_step"] == st_e["deferred_blocks_per_step"]
        assert st_s["max_fetched_bytes_per_step"] == st_e["max_fetched_bytes_per_step"] >= st_e["fetched_bytes_per_step"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_static_layout_batched_equals_eager_cpu(tiny, mode):
    # A whole batch, shrinking as requests finish.
    # Three requests run as a padded batch of four: the padding row (the scratch request) must change no token
    # and no counter.
    eager, st_e = run(tiny, mode, "off")
    static, st_s = run(tiny, mode, "static")
    assert static == eager
    assert st_s["static_eager_steps"] >= 8 and st_s["graph_padding_rows"] > 0
    assert st_s["fetched_blocks_per_step"] == st_e["fetched_blocks_per_step"]
    assert st_s["deferred_blocks_per_step"] == st_e["deferred_blocks_per_step"]


def staggered(tiny, mode, graphs, device="cpu", **kw):
    """Requests arrive while others decode, prompts prefill in 16-token chunks: most steps mix decode
    requests with a prefill chunk, which the static layout splits (decode part first, prefill after)."""
    if device == "cuda":
        kw.setdefault("host_kv_bytes", 1 << 28)
    llm = LLM(tiny, device=device, mode=mode, top_k_blocks=3, fetch_ratio=0.34, block_size=4,
              max_num_batched_tokens=16, cuda_graphs=graphs, **kw)
    eng, seqs = llm.engine, []
    pending = list(zip(PROMPTS, [30, 12, 20]))
    while pending or eng.has_unfinished():
        if pending and (not seqs or eng.stats.num_steps % 5 == 0):
            p, n = pending.pop(0)
            seqs.append(eng.add_request(p, params(n)))
        eng.step()
    return [list(s.output_token_ids) for s in seqs], eng.run_stats()


@pytest.mark.parametrize("mode", ["dense", "oasiskv", "fetch-on-demand"])
@pytest.mark.slow
def test_static_layout_split_steps_equal_eager_cpu(tiny, mode):
    eager, _ = staggered(tiny, mode, "off")
    static, st = staggered(tiny, mode, "static")
    if mode == "dense":  # dense decode rows ride along in the prefill forward: never split
        assert st["split_steps"] == 0 and st["static_eager_steps"] > 0
    else:
        assert st["split_steps"] > 5
    assert static == eager


@pytest.mark.slow
def test_split_steps_sample_after_launching_their_prefill_part(tiny, monkeypatch):
    """Sampling reads tokens back (on CUDA the host waits for the GPU), so a split step samples its decode
    part only once its prefill part is launched: no sample between the two parts."""
    import oasiskv_runtime.engine.model_runner as mr
    from oasiskv_runtime.engine.attention.oasiskv import OasisKVAttention

    events: list[str] = []
    real_sample, real_begin = mr.sample, OasisKVAttention.begin_step
    monkeypatch.setattr(mr, "sample", lambda *a, **k: events.append("sample") or real_sample(*a, **k))
    monkeypatch.setattr(OasisKVAttention, "begin_step",
                        lambda self, meta: events.append("static" if meta.extra.get("static") is not None
                                                         else "eager") or real_begin(self, meta))
    _, st = staggered(tiny, "oasiskv", "static")
    assert st["split_steps"] > 5
    steps = "".join({"sample": "s", "static": "|d", "eager": "e"}[e] for e in events).split("|")
    split = [x for x in steps if x.startswith("de")]
    assert len(split) == st["split_steps"] and all(x.startswith("dess") or x == "des" for x in split), split[:5]


@pytest.mark.slow
def test_static_layout_survives_preemption(tiny):
    # Room for 40 blocks of 4 tokens (the three requests need 59): requests are preempted, recomputed, and
    # their static rows freed and reused.
    budget = 40 * 4 * 5 * 3 * 64 * 2 * 4 / (1 << 30)
    eager, st_e = run(tiny, "dense", "off", kv_cache_gb=budget)
    static, st_s = run(tiny, "dense", "static", kv_cache_gb=budget)
    assert st_e["num_preemptions"] > 0
    assert static == eager and st_s["num_preemptions"] == st_e["num_preemptions"]


def test_row_table_uploads_only_changes():
    t = RowTable(3, 6, -1, torch.long, torch.device("cpu"))
    t.set(0, 7, [4, 5])
    t.set(1, 8, [9])
    t.flush()
    assert t.buf.tolist() == [[4, 5, -1, -1, -1, -1], [9, -1, -1, -1, -1, -1], [-1] * 6]
    t.set(0, 7, [4, 5, 6])            # the same request grew: only the new entry is sent
    assert t._idx == [2] and t._val == [6]
    t.set(1, 3, [1, 2, 3, 4], length=2)  # a new owner with a length: the row is rewritten, the rest filled
    t.flush()
    assert t.buf.tolist()[:2] == [[4, 5, 6, -1, -1, -1], [1, 2, -1, -1, -1, -1]]
    t.forget(0)
    t.set(0, 7, [1])                  # a forgotten row is rewritten even for the same owner id
    t.flush()
    assert t.buf.tolist()[0] == [1, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="exceeds the table width"):
        t.set(2, 1, list(range(7)))


def test_bad_cuda_graphs_setting(tiny):
    with pytest.raises(ValueError, match="cuda_graphs must be auto, off or static"):
        LLM(tiny, cuda_graphs="sometimes")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_graph_replay_equals_eager_cuda(tiny, mode):
    eager, st_e = run(tiny, mode, "off", device="cuda", one_at_a_time=True)
    static, st_s = run(tiny, mode, "static", device="cuda", one_at_a_time=True)
    graphed, st = run(tiny, mode, "auto", device="cuda", one_at_a_time=True)
    assert static == eager
    assert graphed == eager
    assert st["graph_replays"] > 0 and st["graphs_disabled"] is None
    assert st["fetched_blocks_per_step"] == st_s["fetched_blocks_per_step"] == st_e["fetched_blocks_per_step"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "oasiskv"])
def test_graph_split_steps_cuda(tiny, mode):
    eager, _ = staggered(tiny, mode, "off", device="cuda")
    graphed, st = staggered(tiny, mode, "auto", device="cuda")
    assert st["graph_replays"] > 0 and st["graphs_disabled"] is None
    assert (st["split_steps"] == 0) if mode == "dense" else (st["split_steps"] > 0)
    agree = sum(a == b for x, y in zip(graphed, eager) for a, b in zip(x, y))
    assert agree >= 0.9 * sum(len(x) for x in eager)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "proxy-prefetch", "oasiskv"])
def test_graph_replay_batched_cuda(tiny, mode):
    eager, st_e = run(tiny, mode, "off", device="cuda", dtype="float32")
    graphed, st = run(tiny, mode, "auto", device="cuda", dtype="float32")
    assert st["graph_replays"] > 0 and st["graphs_disabled"] is None
    # Draft modes arrange rows differently (last-bit GEMM differences): compare token agreement, not identity.
    agree = sum(a == b for x, y in zip(graphed, eager) for a, b in zip(x, y))
    total = sum(len(x) for x in eager)
    assert agree == total if mode != "oasiskv" else agree >= 0.9 * total
    if mode != "dense":
        assert st["fetched_blocks_per_step"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.slow
def test_link_cap_is_part_of_the_graph_key(tiny, device):
    """With ``link_gbps`` each decode step's fetch cap may change (here from the fixed 2 to the working set's 3
    once a decode step was timed: any measured time gives this link's budget more than that). A captured graph
    bakes its cap in, so the cap must be part of the key: graphs (or the static layout on the CPU) give eager's
    tokens and traffic, which differ from the fixed cap's."""
    graphs = "auto" if device == "cuda" else "static"
    eager, st_e = run(tiny, "proxy-prefetch", "off", device=device, one_at_a_time=True, link_gbps=1e6)
    graphed, st_g = run(tiny, "proxy-prefetch", graphs, device=device, one_at_a_time=True, link_gbps=1e6)
    _, st_fixed = run(tiny, "proxy-prefetch", "off", device=device, one_at_a_time=True)
    assert graphed == eager
    for key in ("fetched_blocks_per_step", "deferred_blocks_per_step", "mean_fetch_cap"):
        assert st_g[key] == st_e[key], key
    assert st_fixed["mean_fetch_cap"] == 2 < st_e["mean_fetch_cap"]
    assert st_fixed["deferred_blocks_per_step"] > st_e["deferred_blocks_per_step"]
    if device == "cuda":
        assert st_g["graph_replays"] > 0 and st_g["graphs_disabled"] is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode,option", [("sparse-resident", {"selection_score": "attention"}),
                                         ("oasiskv", {"recent_blocks": 1})], ids=["exact", "recent"])
@pytest.mark.slow
def test_selection_options_take_the_graph_path(tiny, device, mode, option):
    """The exact top-K (``selection_score="attention"``) and the recent window read device tensors only, in shapes
    known on the host, so their decode steps stay on the static layout and in CUDA graphs: a shrinking padded batch
    gives eager's tokens, which differ from those without the option at this budget."""
    graphs = "auto" if device == "cuda" else "static"
    eager, _ = run(tiny, mode, "off", device=device, **option)
    graphed, st = run(tiny, mode, graphs, device=device, **option)
    without, _ = run(tiny, mode, "off", device=device)
    assert graphed == eager != without
    assert st["graph_padding_rows"] > 0
    if device == "cuda":
        assert st["graph_replays"] > 0 and st["graphs_disabled"] is None


def test_capture_remakes_the_per_step_rows(tiny):
    """A capture re-runs the step that just ran eagerly, with the same metadata. The index tensors every layer
    of a decode step reads (made once per step by the first layer) must then be made again inside the capture:
    reused, the graph would read the eager run's copies, never rewritten, on every replay."""
    llm = LLM(tiny, mode="oasiskv", top_k_blocks=3, fetch_ratio=0.34, block_size=4, cuda_graphs="static")
    eng = llm.engine
    eng.add_request(PROMPTS[0], params(4))
    be = eng.runner.backend
    seen = []
    end_step = be.end_step

    def memos():  # the tensors made once per step: on the decode batch, and the adapter's own
        batch = be.step.decode
        return set(batch._memo if batch is not None else ()) | set(be.context.memo)

    def spy():  # at the end of each step, before the backend lets go of its metadata: a capture would run now
        seen.append(memos())
        be.before_capture()
        seen.append(memos())
        end_step()

    be.end_step = spy
    for _ in range(3):  # the prefill step, then decode steps on the static layout
        eng.step()
    assert {"qd_rows", "pred_rows", "slots_i32", "local_len_i32", "pool_rows"} <= seen[-2] and seen[-1] == set()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.slow
def test_eagle3_draft_takes_the_graph_path(tiny, tmp_path, device):
    """A draft that reads the target's hidden states (EAGLE-3, behind n-gram: SmolLM2's default) gets them from
    the static layout (a captured graph's outputs on CUDA): same tokens, proposals and traffic as eager. Steps
    that mix decode and prefill are not split for it (the draft observes a step as one part)."""
    from tests.tiny_models import write_tiny_eagle3_head

    draft = f"ngram+eagle3:{write_tiny_eagle3_head(tmp_path / 'head')}"
    graphs = "auto" if device == "cuda" else "static"
    eager, st_e = run(tiny, "oasiskv", "off", device=device, one_at_a_time=True, draft=draft)
    graphed, st_g = run(tiny, "oasiskv", graphs, device=device, one_at_a_time=True, draft=draft)
    assert graphed == eager
    assert st_g["draft_accuracy"] is not None
    if device == "cpu":  # the same arithmetic, rows laid out differently: equal on the CPU
        for key in ("draft_accuracy", "fetched_blocks_per_step", "deferred_blocks_per_step"):
            assert st_g[key] == st_e[key], key
        assert st_g["static_eager_steps"] > 0
    else:
        assert st_g["graph_replays"] > 0 and st_g["graphs_disabled"] is None
        assert abs(st_g["draft_accuracy"] - st_e["draft_accuracy"]) <= 0.1
    _, st_mixed = staggered(tiny, "oasiskv", graphs, device=device, draft=draft)
    assert st_mixed["split_steps"] == 0 and st_mixed["draft_accuracy"] is not None


@pytest.mark.gpu
def test_accepted_drafts_replay_as_eager_cuda(tiny):
    """``accept_drafts`` on captured graphs: the draft rows' K/V and logits are graph outputs, the gap block a graph
    input; the tokens agree with eager steps (float32: rows arranged differently round differently)."""
    kw = dict(draft="ngram", accept_drafts=True)
    eager, st_e = run(tiny, "oasiskv", "off", device="cuda", **kw)
    graphed, st = run(tiny, "oasiskv", "auto", device="cuda", **kw)
    assert st["graph_replays"] > 0 and st["graphs_disabled"] is None
    agree = sum(a == b for x, y in zip(graphed, eager) for a, b in zip(x, y))
    assert agree >= 0.9 * sum(len(x) for x in eager)
    assert st["spec_decode_acceptance_rate"] > 0 and st_e["spec_decode_acceptance_rate"] > 0
