"""``oasisbench train-draft`` on a tiny random target: loss goes down, the checkpoint is a usable EAGLE-3 head
(public layout, loads in the engine without changing greedy output), and resume continues the step count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oasisbench.runners.train_draft import (TrainDraftConfig, TrainDraftResult, choose_draft_vocab, crops_loss,
                                            train_draft)
from oasiskv_runtime import LLM, SamplingParams
from oasiskv_runtime.drafts.eagle3 import Eagle3Head
from tests.tiny_models import write_tiny_with_tokenizer

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
    return write_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny-target"))


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
        assert cfg["sliding_window"] == 48  # the training crop (batch_tokens 48 < seq_len 64): no further back
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


def test_self_distillation_samples_are_generated_cached_and_scored(tiny, trained, tmp_path):
    cfg = _cfg(tiny, tmp_path / "gen", steps=3, checkpoint_every=0, gen_samples=4, gen_eval_samples=2,
               gen_prompt_tokens=40, gen_tokens=24, gen_batch=3, compare_head=trained[0])
    res = train_draft(cfg, show_progress=False)
    summary = json.loads((cfg.output / "train_summary.json").read_text())
    assert summary["gen_train_samples"] == 4 and summary["gen_eval_samples"] == 2
    # plain continuations ignore EOS, so each holds its excerpt plus all 24 new tokens
    assert summary["gen_tokens"] >= 2 * (40 + 24)
    assert summary["train_windows"] > 1024 // 64  # the essays' windows plus the generated ones
    g = res.heldout_gen
    assert 0 < g["positions"] <= 2 * 24  # generated tokens only, never the prompts
    assert {"head_vs_target", "ngram_vs_text", "layerskip_vs_target"} <= set(g)
    assert "layerskip_vs_text" in res.heldout
    compare = summary["compare"]  # the other head, scored on the very same positions
    assert compare["heldout"]["positions"] == res.heldout["positions"]
    assert compare["heldout_gen"]["positions"] == g["positions"]
    assert compare["heldout"]["ngram_vs_text"] == res.heldout["ngram_vs_text"]
    rounds = sorted(p.name for p in (cfg.output / "cache").glob("gen-*.json"))
    assert len(rounds) == 2  # 2 held-out + 4 training requests in rounds of 3
    again = train_draft(cfg, show_progress=False)  # every round comes from the cache: identical text
    assert again.heldout_gen == res.heldout_gen
    resummary = json.loads((cfg.output / "train_summary.json").read_text())
    assert resummary["gen_tokens"] == summary["gen_tokens"]
    # every training and held-out window: captured the first time, read from the cache the second
    n = summary["train_windows"] + 2  # + the held-out essay windows (128 tokens in windows of 64)
    assert summary["capture_times"]["captured"] == n and summary["capture_times"]["loaded"] == 0
    assert resummary["capture_times"]["loaded"] == n and resummary["capture_times"]["captured"] == 0


def test_gen_requests_mix_plain_and_chat_greedy_and_sampled(tiny):
    from oasisbench.runners.train_draft import gen_requests

    tok = LLM(tiny).tokenizer
    cfg = _cfg(tiny, Path("unused"), gen_prompt_tokens=16, gen_tokens=8)
    reqs = gen_requests(tok, list(range(3, 300)), 8, cfg, seed=0)
    kinds = [(len(ids) == 16, p["temperature"] > 0) for ids, p in reqs]
    assert kinds[:4] == [(True, False), (False, False), (True, True), (False, True)]
    assert all(not p["ignore_eos"] for ids, p in reqs if len(ids) != 16)  # chat answers stop at EOS
    assert "Question:" in tok.decode(reqs[1][0])  # no chat template: the plain fallback format
    greedy = gen_requests(tok, list(range(3, 300)), 8, cfg, seed=0, greedy_only=True)
    assert all(p["temperature"] == 0.0 for _, p in greedy)


def test_gen_time_limit_cuts_a_round_and_keeps_partial_samples(tiny, tmp_path, monkeypatch):
    import itertools

    import oasisbench.runners.train_draft as td

    clock = itertools.count()  # a fake clock: every reading is one second later
    monkeypatch.setattr(td.time, "monotonic", lambda: float(next(clock)))
    cfg = _cfg(tiny, tmp_path / "cut", gen_prompt_tokens=20, gen_tokens=50, gen_batch=4, gen_time_limit_s=6.0)
    reqs = td.gen_requests(LLM(tiny).tokenizer, list(range(3, 200)), 8, cfg, seed=0)
    got = td.generate_samples(cfg, reqs, "cut", t0=0.0)
    assert len(got) == 4  # the first round ran (cut short); the second never started
    new = [len(ids) - plen for ids, plen in got]
    assert all(n < 50 for n in new) and max(n for n in new) > 0
    assert [ids[:plen] for ids, plen in got] == [ids for ids, _ in reqs[:4]]


def test_packed_capture_equals_one_window_at_a_time(tiny, tmp_path, monkeypatch):
    from oasisbench.runners import train_draft as td
    from oasiskv_runtime.drafts.eagle3 import default_aux_layer_ids
    from oasiskv_runtime.models.loader import load_model

    target, _, mc = load_model(tiny, "cpu", "float32", seed=0)
    aux = default_aux_layer_ids(mc.num_layers)
    g = torch.Generator().manual_seed(4)
    windows = [torch.randint(3, mc.vocab_size, (n,), generator=g).tolist() for n in (37, 64, 5)]
    packed = td.capture_windows(target, mc, windows, aux, "cpu")
    for ids, got in zip(windows, packed):
        one = td.capture_window(target, mc, ids, aux, "cpu")
        assert got["ids"].tolist() == ids and got["aux"].shape == one["aux"].shape
        torch.testing.assert_close(got["aux"].float(), one["aux"].float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got["top_p"].float(), one["top_p"].float(), atol=2e-3, rtol=2e-3)
        assert (got["top_i"][:, 0] == one["top_i"][:, 0]).float().mean() > 0.97
    # grouped capture through the cache gives the same shards, in order, whatever the group size
    cfg = _cfg(tiny, tmp_path / "a", seq_len=32)
    tokens = [t for w in windows for t in w][:96]
    ones = td.load_or_capture(target, mc, td.stream_windows(tokens, 32), cfg, aux, "t")
    monkeypatch.setattr(td, "capture_group", lambda device, seq_len: 2)
    grouped = td.load_or_capture(target, mc, td.stream_windows(tokens, 32), _cfg(tiny, tmp_path / "b", seq_len=32),
                                 aux, "t")
    assert [s["ids"].tolist() for s in grouped] == [s["ids"].tolist() for s in ones] == \
        [tokens[i:i + 32] for i in range(0, 96, 32)]
    for a, b in zip(grouped, ones):
        torch.testing.assert_close(a["aux"].float(), b["aux"].float(), atol=2e-3, rtol=2e-3)
    times = td.new_capture_times()
    again = td.load_or_capture(target, mc, td.stream_windows(tokens, 32), _cfg(tiny, tmp_path / "b", seq_len=32),
                               aux, "t", times=times)  # cached
    assert all(torch.equal(a["aux"], b["aux"]) for a, b in zip(again, grouped))
    assert times["loaded"] == 3 and times["captured"] == 0 and times["save_bytes"] == 0
    td.load_or_capture(target, mc, td.stream_windows(tokens, 32), _cfg(tiny, tmp_path / "c", seq_len=32), aux, "t",
                       times=times)  # a fresh cache: captured and written
    assert times["captured"] == 3 and times["loaded"] == 3
    assert times["save_bytes"] == sum(f.stat().st_size for f in (tmp_path / "c").rglob("*.pt")) > 0
    assert "3 windows captured" in td.capture_times_text(times)


def test_pack_samples_keeps_samples_whole_and_windows_full():
    from oasisbench.runners.train_draft import pack_samples

    rng = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 65, (300,), generator=rng).tolist() + [150]  # one longer than a window
    samples = [[i] * n for i, n in enumerate(lengths)]
    windows = pack_samples(samples, 64)
    assert all(sum(map(len, w)) <= 64 for w in windows)
    segs = [seg for w in windows for seg in w]
    # every sample is one segment (the long one: cut into window-long pieces), none lost or repeated
    assert sorted(map(tuple, segs)) == sorted([tuple(s) for s in samples[:-1]] + [(300,) * 64, (300,) * 64,
                                                                                  (300,) * 22])
    assert sum(map(len, segs)) == sum(lengths)
    # first fit: all but the last few windows are nearly full
    fill = sorted(sum(map(len, w)) for w in windows)
    assert fill[len(fill) // 10] >= 56


def test_packed_windows_attend_within_each_sample(tiny, tmp_path):
    from oasisbench.runners import train_draft as td
    from oasiskv_runtime.drafts.eagle3 import default_aux_layer_ids
    from oasiskv_runtime.models.loader import load_model

    target, _, mc = load_model(tiny, "cpu", "float32", seed=0)
    aux = default_aux_layer_ids(mc.num_layers)
    g = torch.Generator().manual_seed(6)
    samples = [torch.randint(3, mc.vocab_size, (n,), generator=g).tolist() for n in (19, 30, 11, 27, 9)]
    windows = td.pack_samples(samples, 48)
    got = td.load_or_capture(target, mc, windows, _cfg(tiny, tmp_path, seq_len=48), aux, "p")
    assert [s["ids"].tolist() for s in got] == [[t for seg in w for t in seg] for w in windows]
    # a window's states are its samples' states, each computed alone from its own first token
    for w, shard in zip(windows, got):
        alone = [td.capture_window(target, mc, seg, aux, "cpu") for seg in w]
        torch.testing.assert_close(shard["aux"].float(), torch.cat([a["aux"] for a in alone]).float(),
                                   atol=2e-3, rtol=2e-3)


def test_gen_prompt_lengths_drawn_from_the_range(tiny):
    from oasisbench.runners.train_draft import gen_requests

    tok = LLM(tiny).tokenizer
    cfg = TrainDraftConfig(model=tiny, gen_prompt_tokens=40, gen_prompt_min_tokens=8, gen_tokens=4)
    plain = [ids for i, (ids, _) in enumerate(gen_requests(tok, list(range(3, 300)), 64, cfg, seed=1)) if i % 2 == 0]
    lengths = {len(ids) for ids in plain}
    assert min(lengths) >= 8 and max(lengths) <= 40 and len(lengths) > 8
    with pytest.raises(ValueError, match="gen-prompt-min-tokens"):
        gen_requests(tok, list(range(3, 300)), 4, TrainDraftConfig(model=tiny, gen_prompt_tokens=40,
                                                                   gen_prompt_min_tokens=41), seed=1)


def test_cli_rejects_a_prompt_range_upside_down(tmp_path):
    from typer.testing import CliRunner

    from oasisbench.cli.main import app

    res = CliRunner().invoke(app, ["train-draft", "--model", "smollm2-135m-random", "--output", str(tmp_path / "o"),
                                   "--gen-prompt-tokens", "40", "--gen-prompt-min-tokens", "41", "--device", "cpu"])
    assert res.exit_code != 0 and "--gen-prompt-min-tokens must be in [1, --gen-prompt-tokens 40]" in res.output
    assert not (tmp_path / "o").exists()  # nothing started


def test_crop_rows_sets_the_crop_and_the_window(tiny, tmp_path):
    out = tmp_path / "c"
    res = train_draft(_cfg(tiny, out, steps=2, checkpoint_every=0, crop_rows=29), show_progress=False)
    assert res.step == 2
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 29
    assert "training crops: 1 x 29 head rows" in (out / "train.log").read_text()
    with pytest.raises(ValueError, match="no training window is longer than --crop-rows 64"):
        train_draft(_cfg(tiny, tmp_path / "d", steps=2, checkpoint_every=0, crop_rows=64), show_progress=False)


def test_cli_rejects_a_crop_longer_than_a_window(tmp_path):
    from typer.testing import CliRunner

    from oasisbench.cli.main import app

    res = CliRunner().invoke(app, ["train-draft", "--model", "smollm2-135m-random", "--output", str(tmp_path / "o"),
                                   "--seq-len", "64", "--crop-rows", "64", "--device", "cpu"])
    assert res.exit_code != 0 and "--crop-rows must be in [1, --seq-len 64), got 64" in res.output


def _crop_loss_reference(head, shard, start, rows, t2draft):
    """One crop, one plain head call: what a training step did per crop before crops were batched."""
    p = torch.arange(start, start + rows, device=shard["ids"].device)
    logits = head(shard["ids"][p + 1].long(), shard["aux"][p].float(), p).logits
    tgt = t2draft[shard["top_i"][p + 1].long()]
    q = shard["top_p"][p + 1].float() * (tgt >= 0)
    keep = q.sum(-1) > 0
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-9)
    loss = -(q * logits.log_softmax(-1).gather(-1, tgt.clamp_min(0))).sum(-1)[keep].sum()
    return loss, ((logits.argmax(-1) == tgt[:, 0]) & keep).sum(), keep.sum()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("window", [None, 5])
def test_batched_crops_equal_one_call_per_crop(window, device):
    """crops_loss runs every crop of a step in one vmapped head call: loss, agreement, rows and gradients equal
    the per-crop calls, on random shards of odd lengths, random starts and a draft vocab missing some targets."""
    from oasiskv_runtime.drafts.eagle3 import Eagle3Config

    g = torch.Generator().manual_seed(7)
    vocab, hidden, k = 211, 48, 4
    cfg = Eagle3Config(hidden_size=hidden, intermediate_size=72, num_attention_heads=6, num_key_value_heads=3,
                       vocab_size=vocab, draft_vocab_size=37, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                       num_target_layers=7)
    head = Eagle3Head(cfg, target_embed=torch.nn.Embedding(vocab, hidden).to(device)).to(device)
    draft_ids = torch.randperm(vocab, generator=g)[:37].sort().values
    head.set_vocab_mapping(draft_ids)
    head.set_sliding_window(window)
    t2draft = torch.full((vocab,), -1, dtype=torch.long)
    t2draft[draft_ids] = torch.arange(37)
    shards = []
    for n in (29, 41, 33):
        top_p = torch.rand(n, k, generator=g).softmax(-1).half()
        shards.append({"ids": torch.randint(vocab, (n,), generator=g).int(),
                       "aux": torch.randn(n, 3, hidden, generator=g).half(),
                       "top_i": torch.randint(vocab, (n, k), generator=g).int(), "top_p": top_p})
    shards[1]["top_i"][:6] = int((t2draft < 0).nonzero()[0])  # rows whose targets are all outside the draft vocab
    rows = 13
    crops = [(shards[i], int(torch.randint(shards[i]["ids"].numel() - rows, (), generator=g))) for i in (0, 1, 2, 1)]
    t2draft = t2draft.to(device)  # the shards sit where training keeps them: on the device
    shards[:] = [{key: v.to(device) for key, v in sh.items()} for sh in shards]
    crops = [(shards[[0, 1, 2, 1][j]], st) for j, (_, st) in enumerate(crops)]

    loss, hit, count = crops_loss(head, crops, rows, t2draft)
    (loss / count).backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)
    ref = [_crop_loss_reference(head, sh, st, rows, t2draft) for sh, st in crops]
    ref_loss, ref_hit, ref_count = (sum(r[i] for r in ref) for i in range(3))
    (ref_loss / ref_count).backward()

    assert int(count) == int(ref_count) < len(crops) * rows  # the out-of-vocab rows are not counted
    assert int(hit) == int(ref_hit)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-4)
    assert grads and set(grads) == {n for n, p in head.named_parameters() if p.grad is not None}
    for name, p in head.named_parameters():
        if p.grad is not None:
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_gen_only_generates_and_caches_then_a_later_run_trains_on_that_text(tiny, tmp_path, monkeypatch):
    """--gen-only stops after the text (no states, no head); the next run reads every round from the cache."""
    import oasisbench.runners.train_draft as td

    cfg = _cfg(tiny, tmp_path / "g", steps=2, checkpoint_every=0, gen_samples=3, gen_eval_samples=1,
               gen_prompt_tokens=30, gen_tokens=12, gen_batch=2, cache_dir=tmp_path / "cache", gen_only=True)
    res = train_draft(cfg, show_progress=False)
    assert res.step == 0 and not (cfg.output / "model.safetensors").exists()
    assert len(list((tmp_path / "cache").glob("gen-*.json"))) == 2 and not list((tmp_path / "cache").glob("*.pt"))
    assert "generation only" in (cfg.output / "train.log").read_text()

    def no_generation(*a, **k):
        raise AssertionError("the cached rounds should have been read, not generated again")

    monkeypatch.setattr(td, "generation_llm", no_generation)
    cfg.gen_only = False
    res = train_draft(cfg, show_progress=False)
    summary = json.loads((cfg.output / "train_summary.json").read_text())
    assert res.step == 2 and (cfg.output / "model.safetensors").is_file() and summary["gen_train_samples"] == 3


def test_gen_only_without_text_is_an_error(tiny, tmp_path):
    with pytest.raises(ValueError, match="--gen-only needs"):
        train_draft(_cfg(tiny, tmp_path / "x", gen_only=True), show_progress=False)
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_cli_gen_only(tiny, tmp_path):
    from typer.testing import CliRunner

    from oasisbench.cli.main import app

    args = ["train-draft", "--model", tiny, "--output", str(tmp_path / "o"), "--device", "cpu", "--seq-len", "64",
            "--batch-tokens", "48", "--num-train-tokens", "1024", "--holdout-tokens", "256", "--eval-tokens", "128",
            "--draft-vocab", "128", "--intermediate-size", "64", "--gen-only"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0 and "--gen-only needs --gen-samples" in res.output
    res = CliRunner().invoke(app, args + ["--gen-samples", "2", "--gen-prompt-tokens", "30", "--gen-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "run again without --gen-only to train" in " ".join(res.output.split())  # rich wraps lines
    assert list((tmp_path / "o" / "cache").glob("gen-*.json")) and not (tmp_path / "o" / "model.safetensors").exists()
