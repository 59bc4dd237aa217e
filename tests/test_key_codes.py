"""The device format of keys coded in a few bits (``ops/key_codes.py``): packing, and a score that reads only the
codes and the min/max summaries equals the study setting the NIAH runs measured (``coded_max_logit_scores``, which
codes the full keys)."""

from __future__ import annotations

import pytest
import torch

from oasiskv_runtime.ops.key_codes import coded_scores, pack_codes, unpack_codes
from oasiskv_runtime.ops.split_quest import coded_max_logit_scores
from tests.selection_checks import scorer_inputs


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_keeps_the_nearest_level_in_bits_per_dimension(bits):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    n, bs, hkv, d = 5, 7, 3, 16
    keys = torch.randn(n, bs, hkv, d, generator=gen) * torch.rand(n, 1, hkv, d, generator=gen) * 4
    keys[0, :, 0, 0] = 1.5                                    # a dimension with no spread: every code is level 0
    lo, hi = keys.amin(1), keys.amax(1)
    packed = pack_codes(keys, lo, hi, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (n, bs, hkv, d * bits // 8)
    assert packed.numel() * 8 == keys.numel() * bits           # bits / 16 of a bf16 key cache
    codes = unpack_codes(packed, bits).long()
    levels = 2 ** bits - 1
    assert codes.shape == keys.shape and int(codes.max()) <= levels and not bool(codes[0, :, 0, 0].any())
    step = ((hi - lo) / levels).unsqueeze(1)
    grid = lo.unsqueeze(1).unsqueeze(-1) + torch.arange(levels + 1) * step.unsqueeze(-1)      # [n, 1, hkv, d, L]
    dist = (keys.unsqueeze(-1) - grid).abs()
    chosen = dist.gather(-1, codes.unsqueeze(-1)).squeeze(-1)
    assert bool((chosen <= dist.amin(-1) + 1e-5).all())      # no level is nearer than the one kept
    assert torch.equal(unpack_codes(pack_codes(keys, lo, hi, bits), bits), unpack_codes(packed, bits))


def test_unpack_inverts_pack_on_every_level():
    for bits in (1, 2, 4, 8):
        levels = torch.arange(2 ** bits, dtype=torch.float32).repeat(32)[:32]
        keys = levels.view(1, 1, 1, 32)                     # lo 0, hi 2**bits - 1: each key sits on its level
        packed = pack_codes(keys, torch.zeros(1, 1, 32), torch.full((1, 1, 32), 2.0 ** bits - 1), bits)
        assert torch.equal(unpack_codes(packed, bits).float(), keys)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bs,bits,bound", [(16, 2, None), (16, 1, 13), (8, 4, None), (12, 2, 17)])
def test_scores_from_codes_and_summaries_equal_the_measured_study_setting(device, bs, bits, bound):
    """Summaries in the engine's layout (summary block ``j // bs``, row ``j % bs`` of each request's summary table)
    and codes in the KV cache's, both built from the same keys: the score equals ``coded_max_logit_scores`` on the
    keys themselves, the ranking the NIAH study measured."""
    hkv, d = 2, 24
    q, k_cache, table, num_candidates = scorer_inputs(bs, torch.seed() % (2**31), hkv=hkv, d=d)
    nb = k_cache.shape[0]
    mins, maxs = torch.zeros(3 * 2, bs, hkv, d), torch.zeros(3 * 2, bs, hkv, d)
    summary_table = torch.arange(3 * 2).view(3, 2)
    for b in range(3):
        for j in range(14):
            blk = k_cache[int(table[b, j])]
            mins[int(summary_table[b, j // bs]), j % bs] = blk.amin(0)
            maxs[int(summary_table[b, j // bs]), j % bs] = blk.amax(0)
    codes = pack_codes(k_cache, k_cache.amin(1), k_cache.amax(1), bits)
    assert codes.shape[0] == nb
    to = lambda t: t.to(device)  # noqa: E731
    got = coded_scores(to(q), to(codes), to(mins), to(maxs), to(table), to(summary_table), to(num_candidates), hkv,
                       bits, bound).cpu()
    want = coded_max_logit_scores(q, k_cache, table, num_candidates, hkv, bits, bound or 11)
    assert got.shape == want.shape == (3, hkv, bound or 11)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_formats_that_are_not_whole_bytes_are_refused():
    keys = torch.randn(2, 4, 1, 20)
    with pytest.raises(ValueError, match="bits=3 must be one of 1, 2, 4, 8"):
        pack_codes(keys, keys.amin(1), keys.amax(1), 3)
    with pytest.raises(ValueError, match="head_dim=20 x bits=1 is not a whole number of bytes"):
        pack_codes(keys, keys.amin(1), keys.amax(1), 1)
