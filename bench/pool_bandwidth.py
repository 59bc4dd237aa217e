"""UVA read bandwidth from the host KV pool by pool size and page size (4 KiB vs transparent huge pages).

In the end-to-end runs the prefill path's reads from a 100 GiB pool (a chunk's prefix, the first working-set fill)
moved ~22 GB/s on the main stream, while the gather kernel alone reaches 49-51 GB/s from a 256 MiB pool. One
candidate: with 4 KiB pages every read in a huge pool needs a translation of its own. This script pins a region
like the engine's (``PinnedRegion``: exact size, cudaHostRegister), with and without ``MADV_HUGEPAGE``, views it as
one layer's pool ``[blocks, 16, 8, 128]`` bf16 (Qwen3-8B KV heads), and times on the GPU:

- ``prefix``: a prefill chunk's context read (``uva_gather_blocks``: every head of 1,536 consecutive blocks, 24K
  tokens, 96 MiB) at random places in the pool;
- ``random``: decode prefetch copies (32,768 random (block, head) pairs, 128 MiB);

each with the engine's grid (32 CTAs) and a full grid (one CTA per copy). Median of 5 timed runs after a warm-up.

    python bench/pool_bandwidth.py --sizes-gb 2,64 --out pool-bandwidth.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from oasiskv_runtime.ops.uva_gather import uva_gather, uva_gather_blocks
from oasiskv_runtime.transfer.host_memory import PinnedRegion, huge_page_bytes

BS, H, D = 16, 8, 128
DTYPE = torch.bfloat16


def timed(fn, runs: int = 5) -> float:
    """Median milliseconds of ``fn`` on the current stream (CUDA events), after one warm-up call."""
    fn()
    out = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def measure(size_gb: float, huge: bool, gen: torch.Generator) -> list[dict]:
    before = huge_page_bytes() or 0
    region = PinnedRegion(int(size_gb * 2**30), huge_pages=huge)
    huge_gb = ((huge_page_bytes() or 0) - before) / 2**30
    nb = region.nbytes // (BS * H * D * DTYPE.itemsize * 2)
    k, v = (region.take((nb, BS, H, D), DTYPE) for _ in range(2))
    rows = []
    span = 1536
    starts = torch.randint(0, nb - span, (4,), generator=gen).tolist()
    tables = [torch.arange(s, s + span, device="cuda") for s in starts]
    n = 32768
    src = torch.randint(0, nb, (n,), generator=gen).cuda()
    heads = torch.randint(0, H, (n,), generator=gen).cuda()
    dst = torch.arange(n, device="cuda") // H
    dk = torch.empty((n // H + 1, BS, H, D), dtype=DTYPE, device="cuda")
    dv = torch.empty_like(dk)
    for grid in (32, 0):
        it = iter(range(10**9))

        def prefix() -> None:  # a different place of the pool each call
            t = tables[next(it) % len(tables)]
            hk = uva_gather_blocks(k, v, t, span * BS)  # default grid: the engine's prefill path
            del hk

        def prefix_grid() -> None:
            t = tables[next(it) % len(tables)]
            nblk = t.numel()
            s = t[:, None].expand(nblk, H).reshape(-1)
            d = torch.arange(nblk, device="cuda")[:, None].expand(nblk, H).reshape(-1)
            hd = torch.arange(H, device="cuda")[None, :].expand(nblk, H).reshape(-1)
            uva_gather(k, v, out_k, out_v, s, d, hd, programs=grid)

        out_k = torch.empty((span, BS, H, D), dtype=DTYPE, device="cuda")
        out_v = torch.empty_like(out_k)
        ms = timed(prefix_grid)
        rows.append({"size_gb": size_gb, "huge_pages": huge, "huge_gb": round(huge_gb, 1), "pattern": "prefix",
                     "grid": grid, "ms": ms, "GBps": 2 * span * BS * H * D * 2 / ms / 1e6})
        ms = timed(lambda: uva_gather(k, v, dk, dv, src, dst, heads, programs=grid))
        rows.append({"size_gb": size_gb, "huge_pages": huge, "huge_gb": round(huge_gb, 1), "pattern": "random",
                     "grid": grid, "ms": ms, "GBps": 2 * n * BS * D * 2 / ms / 1e6})
    ms = timed(prefix)
    rows.append({"size_gb": size_gb, "huge_pages": huge, "huge_gb": round(huge_gb, 1), "pattern": "prefix",
                 "grid": "uva_gather_blocks", "ms": ms, "GBps": 2 * span * BS * H * D * 2 / ms / 1e6})
    del k, v, region
    gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-gb", default="2,64")
    ap.add_argument("--out", default="pool-bandwidth.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for size in (float(x) for x in args.sizes_gb.split(",")):
        for huge in (False, True):
            rows += measure(size, huge, gen)
            for r in rows[-5:]:
                print(json.dumps(r), flush=True)
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
