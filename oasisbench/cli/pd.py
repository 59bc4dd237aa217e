"""``oasisbench pd``: prefill-decode disaggregation with Remote Partial Fetching (RPF) vs full-KV transfer.

Default: both roles started here as separate processes, NIXL (UCX) moving KV host to host, one point per
(decode mode, transfer, context length). ``--role prefill|decode`` instead runs one worker in the
foreground, for two hosts: start the decode worker, then the prefill worker with ``--peer`` pointing at it.
Exit codes as ``oasisbench throughput``: 0 all completed, 1 some request failed, 2 bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from oasisbench.cli.options import (DEFAULT_MODEL_NAME, BlockSizeOpt, DeviceOpt, DtypeOpt, FetchRatioOpt, KvGbOpt,
                                    ModelOpt, SeedOpt, default_device, default_dtype, engine_default, engine_option)
from oasisbench.cli.report import fail
from oasisbench.cli.throughput import OutputDirOpt, ResumeOpt, _ints, _modes, _split, open_store, positive_gb


def pd_cmd(
    model: ModelOpt = DEFAULT_MODEL_NAME,
    modes: Annotated[str, typer.Option("--modes", help="Decode modes: oasiskv, proxy-prefetch, fetch-on-demand "
                                       "(host-pool), dense (full transfer only).")] = "oasiskv,dense",
    transfer: Annotated[str, typer.Option("--transfer", help="rpf (remote partial fetching) and/or full "
                                          "(whole KV at admission).")] = "rpf,full",
    context_len: Annotated[str, typer.Option("--context-len", help="Prompt + output tokens, comma list.")] = "2048",
    output_len: Annotated[int, typer.Option("--output-len", help="Tokens generated per request.")] = 32,
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests per point, all sent at t0.")] = 4,
    top_k_blocks: Annotated[int, engine_option("top_k_blocks", note="Here 16 by default: the CPU runs 2-8K "
                                               "contexts.")] = 16,
    fetch_ratio: FetchRatioOpt = engine_default("fetch_ratio"),
    draft: Annotated[str, engine_option("draft", note="Here ngram by default: prefill-decode hands over drafts "
                                        "whose state is tokens only (ngram, oracle).")] = "ngram",
    block_size: BlockSizeOpt = engine_default("block_size"),
    kv_cache_gb: KvGbOpt = None,
    device: DeviceOpt = "",
    dtype: DtypeOpt = "",
    seed: SeedOpt = 0,
    transport: Annotated[str, typer.Option("--transport", help="nixl (UCX), or tcp: the explicit fallback "
                                           "where NIXL is not installed.")] = "nixl",
    role: Annotated[str, typer.Option("--role", help="local (both roles here), or prefill / decode: run one "
                                      "worker in the foreground.")] = "local",
    peer: Annotated[str, typer.Option("--peer", help="prefill role: the decode worker's HOST:PORT.")] = "",
    host: Annotated[str, typer.Option("--host", help="worker roles: address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="worker roles: control port (0: any).")] = 0,
    prompts: Annotated[str, typer.Option("--prompts", help="random (seeded token ids) or essays (real text: "
                                         "Paul Graham essays, needs the model's tokenizer).")] = "random",
    shared_prefix: Annotated[int, typer.Option("--shared-prefix", help="Tokens every prompt shares (a multi-turn "
                                               "trace): runs each point with the prefill-side prefix cache off "
                                               "and on; TTFT is over the requests after the first.")] = 0,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache", help="prefill role: reuse staged prompt blocks "
                                               "across requests (local runs use --shared-prefix).")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before an unfinished point's requests "
                                           "count as failed.")] = 1800.0,
    output_dir: OutputDirOpt = Path("results"),
    resume: ResumeOpt = None,
) -> None:
    """Prefill and decode as separate processes: RPF vs full-KV transfer, bytes at admission, during
    decode, decode-host memory, network bandwidth, throughput."""
    from oasiskv_runtime.config import PD_TRANSFERS as TRANSFERS

    dev = default_device(device)
    dt = default_dtype(dtype, dev)
    mode_list = _modes(modes)
    positive_gb(kv_cache_gb, "--kv-cache-gb")
    transfers = _split(transfer, "--transfer")
    bad = [t for t in transfers if t not in TRANSFERS]
    if bad:
        raise fail(f"unknown transfer(s) {', '.join(bad)}; choose from: {', '.join(TRANSFERS)}")
    if prompts not in ("random", "essays"):
        raise fail(f"--prompts must be random or essays, got {prompts!r}")
    if transport not in ("nixl", "tcp"):
        raise fail(f"--transport must be nixl or tcp, got {transport!r}")
    if transport == "nixl":
        try:
            import nixl  # noqa: F401
        except ImportError:
            raise fail("NIXL is not installed: pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1 "
                       "(or choose the TCP fallback explicitly with --transport tcp)") from None
    if role in ("prefill", "decode"):
        _run_worker(role, model, mode_list, transfers, dev, dt, seed, top_k_blocks, fetch_ratio, draft, block_size,
                    kv_cache_gb, transport, peer, host, port, prefix_cache)
        return
    if role != "local":
        raise fail(f"--role must be local, prefill or decode, got {role!r}")
    from oasisbench.runners.pd import plan, run_pd

    ctxs = _ints(context_len, "--context-len")
    if any(c <= output_len for c in ctxs):
        raise fail(f"--context-len must exceed --output-len ({output_len})")
    try:
        points, notes = plan(mode_list, transfers, context_lens=ctxs, output_len=output_len,
                             num_requests=num_requests, model=model, device=dev, dtype=dt, top_k_blocks=top_k_blocks,
                             fetch_ratio=fetch_ratio, draft=draft, block_size=block_size, seed=seed,
                             kv_cache_gb=kv_cache_gb, transport=transport, shared_prefix=shared_prefix, prompts=prompts)
        from oasiskv_runtime.config import EngineConfig
        from oasiskv_runtime.models.loader import resolve
        from oasiskv_runtime.pd.workers import check_pd_config

        resolve(model)
        for p in points:
            check_pd_config(EngineConfig.from_overrides(model, device=dev, dtype=dt, mode=p.mode, draft=draft,
                                                        top_k_blocks=top_k_blocks, fetch_ratio=fetch_ratio,
                                                        transfer=p.transfer))
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise fail(str(e)) from None
    console = Console()
    for n in notes:
        console.print(f"[yellow]{n}[/yellow]")
    if not points:
        raise fail("no valid (mode, transfer) point: rpf needs a host-pool mode, dense needs full")
    store = open_store(output_dir, "pd", resume)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        run_pd(points, store, progress, timeout, resume=resume is not None)
    records = store.records
    console.print(summary_table(records))
    from oasisbench.results.plots import plots_available

    if plots_available():
        from oasisbench.results.plots import write_pd_plots

        write_pd_plots(store.path, records)
    typer.echo(str(store.path))  # the last line, unwrapped: scripts read it
    if any(r["metrics"].get("failed") for r in records):
        raise typer.Exit(1)


def _run_worker(role, model, modes, transfers, dev, dt, seed, top_k, ratio, draft, block_size, kv_gb, transport,
                peer, host, port, prefix_cache=False) -> None:
    from oasiskv_runtime.config import EngineConfig
    from oasiskv_runtime.pd.workers import DecodeWorker, PrefillWorker, prefill_config

    if len(modes) != 1 or len(transfers) != 1:
        raise fail("a worker role takes one --modes value and one --transfer value")
    try:
        cfg = EngineConfig.from_overrides(model, device=dev, dtype=dt, mode=modes[0], seed=seed, top_k_blocks=top_k,
                                          fetch_ratio=ratio, draft=draft, block_size=block_size, kv_cache_gb=kv_gb,
                                          transfer=transfers[0], transport=transport, prefix_cache=prefix_cache)
        if role == "decode":
            w = DecodeWorker(cfg, host, port)
        else:
            if not peer:
                raise fail("--role prefill needs --peer HOST:PORT of the decode worker")
            w = PrefillWorker(prefill_config(cfg), peer, host, port, send_state=cfg.mode.is_sparse)
    except (ValueError, ConnectionError, FileNotFoundError) as e:
        raise fail(str(e)) from None
    typer.echo(f"{role} worker listening on {w.address}", err=True)
    w.serve()


def summary_table(records: list[dict]) -> Table:
    t = Table(title="prefill-decode")
    cols = ["mode", "transfer", "ctx", "prefix$", "done", "out tok/s", "TTFT ms", "TPOT ms", "admit KiB/req", "decode KiB/req",
            "full/admit", "dup reads", "bw med/peak GB/s"]
    for c in cols:
        t.add_column(c, justify="right")

    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    for r in records:
        p, m = r["point"], r["metrics"]
        kib = lambda v: None if v is None else v / 1024  # noqa: E731
        t.add_row(p["mode"], p["transfer"], str(p["context_len"]), "on" if p.get("prefix_cache") else "off", f"{m.get('completed', 0)}/{p['num_requests']}",
                  f(m.get("output_throughput")), f(m.get("median_ttft_ms")), f(m.get("median_tpot_ms")),
                  f(kib(m.get("admission_bytes_per_request"))), f(kib(m.get("decode_fetch_bytes_per_request"))),
                  f(m.get("admission_reduction"), "{:.2f}x"), str(m.get("duplicate_block_reads", "-")),
                  f"{f(m.get('net_bw_median_gbps'), '{:.2f}')}/{f(m.get('net_bw_peak_gbps'), '{:.2f}')}")
    return t
