"""Keys coded in a few bits within their block's min/max: the storage format and the score over it (issue #34).

``selection_score = "max_logit_b2"`` ranks blocks like the exact attention mass at 1/8 of the context
(docs/accuracy.md, "Keys coded in a few bits"; measured first as a study op that codes the full keys at every step,
:func:`~oasiskv_runtime.ops.split_quest.coded_max_logit_scores`, which needs every key on the device). This module is
the format the engine keeps on the device instead (``core/summaries.KeyCodes``), and the score that reads only those
codes and the min/max summaries:

* :func:`pack_codes`: a block's keys ``[n, block_size, Hkv, D]`` and its min/max ``[n, Hkv, D]`` -> ``uint8`` codes
  ``[n, block_size, Hkv, D * bits / 8]``, the KV cache's layout with a narrow last dimension (``bits / 16`` of a bf16
  key cache: 2 bits, 1/8). Each key dimension keeps the nearest of ``2**bits`` levels from min to max; ``8 / bits``
  codes a byte, the lowest bits first.
* :func:`coded_scores`: per candidate block, the largest ``q_i . k^_t`` over the GQA group's query heads ``i`` and the
  block's coded keys ``k^_t = lo + code_t * (hi - lo) / (2**bits - 1)``, with ``lo`` / ``hi`` read from the summary
  rows (addressed as Quest's scores address them) and the codes from a block table (addressed as the KV cache).

Codes are final only once a block is full (its min/max no longer move), which is when every candidate block is
(a selection ranks the full blocks before the active one). Plain PyTorch on every device, nothing read back to the
host when ``max_candidates`` is given (a CUDA graph captures it).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from oasiskv_runtime.ops.attention_mass import candidate_blocks
from oasiskv_runtime.ops.common import build_csrc, lazy_kernels, next_pow2, on_device, use_triton
from oasiskv_runtime.ops.score_topk import _gather_summaries, _num_cols

log = logging.getLogger(__name__)

__all__ = ["CODE_BITS", "check_code_bits", "code_levels", "coded_scores", "coded_scores_ref", "cuda_available",
           "cuda_misfit", "head_major", "level_step", "pack_codes", "pack_codes_into", "unpack_codes"]

CODE_BITS = (1, 2, 4, 8)
"""Bits per key dimension the format packs (a divisor of 8)."""


def check_code_bits(bits: int, head_dim: int) -> None:
    """Raise unless ``head_dim`` keys of ``bits`` bits a dimension pack into whole bytes."""
    if bits not in CODE_BITS:
        raise ValueError(f"bits={bits} must be one of {', '.join(map(str, CODE_BITS))} (whole codes a byte)")
    if head_dim * bits % 8:
        raise ValueError(f"head_dim={head_dim} x bits={bits} is not a whole number of bytes")


def level_step(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """The spacing of the ``2**bits`` levels from ``lo`` to ``hi``: a coded key is ``lo + level * step``. A product
    with the reciprocal (in the tensors' dtype, fp32 for the kernels), which a kernel computes as the reference does
    in one instruction (an IEEE division is a dozen on a GPU)."""
    return (hi - lo) * (1.0 / (2 ** bits - 1))


def code_levels(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels, step)``: each key dimension's nearest level ``0 .. 2**bits - 1`` between ``lo`` and ``hi`` (fp32,
    broadcast against ``keys``) and :func:`level_step`, so ``lo + levels * step`` is the coded key."""
    step = level_step(lo, hi, bits)
    pos = torch.where(step > 0, (keys - lo) / step.clamp_min(torch.finfo(step.dtype).tiny), 0.0)
    return pos.round_().clamp_(0, 2 ** bits - 1), step


def pack_codes(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """``keys`` ``[n, block_size, Hkv, D]`` of ``n`` full blocks, ``lo`` / ``hi`` ``[n, Hkv, D]`` their min/max ->
    ``uint8`` ``[n, block_size, Hkv, D * bits / 8]``."""
    D = keys.shape[-1]
    check_code_bits(bits, D)
    levels, _ = code_levels(keys.float(), lo.float().unsqueeze(1), hi.float().unsqueeze(1), bits)
    codes = levels.to(torch.uint8)                                                          # [n, bs, Hkv, D]
    per = 8 // bits
    codes = codes.view(*codes.shape[:-1], D // per, per).to(torch.int32)
    shifts = torch.arange(per, device=keys.device, dtype=torch.int32) * bits
    return (codes << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes`'s bytes ``[..., D * bits / 8]`` -> the levels ``[..., D]`` (``uint8``)."""
    check_code_bits(bits, packed.shape[-1] * 8 // bits)
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2 ** bits - 1)
    return codes.view(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def head_major(codes: torch.Tensor) -> torch.Tensor:
    """:func:`pack_codes`'s rows ``[n, block_size, Hkv, bytes]`` copied head-major (``[n, Hkv, block_size, bytes]`` in
    memory, a block's codes for one KV head one run) and viewed in the cache's order again: how
    ``core/summaries.KeyCodes`` stores them, for a kernel test or benchmark that starts from packed rows."""
    return codes.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def coded_scores_ref(q: torch.Tensor, codes: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor,
                     block_table: torch.Tensor, summary_block_table: torch.Tensor, num_candidates: torch.Tensor,
                     num_kv_heads: int, bits: int, max_candidates: Optional[int] = None,
                     key_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`coded_scores`: each candidate block's largest logit over its coded keys,
    ``[B, Hkv, J]`` fp32, ``-inf`` beyond ``num_candidates``. ``key_dtype``: each coded key (fp32) rounded to it
    before the product, as the tensor-core kernel rounds them to the query's dtype (``variant="dot"``).

    ``q``: ``[B, Hq, D]``; ``codes``: ``[num_blocks, block_size, Hkv, D * bits / 8]`` one layer's codes, block
    ``block_table[b, j]`` holding logical block ``j``'s; ``sum_min`` / ``sum_max`` / ``summary_block_table``: the
    min/max summaries as :func:`~oasiskv_runtime.ops.score_topk.quest_scores` reads them; ``max_candidates``: ``J``,
    a host-side bound of ``num_candidates`` (read from the device when None)."""
    B, Hq, D = q.shape
    hkv = int(num_kv_heads)
    got = _gather_summaries(q, sum_min, sum_max, summary_block_table, num_candidates, hkv, max_candidates)
    if got is None:
        return torch.empty((B, hkv, 0), dtype=torch.float32, device=q.device)
    qf, lo, hi, ok = got                                                   # [B, Hkv, g, D], [B, J, Hkv, D] x 2
    bs = codes.shape[1]
    _, J, _, blocks = candidate_blocks(q, block_table, num_candidates, hkv, ok.shape[1])    # padding reads block 0
    step = level_step(lo, hi, bits)
    out = torch.empty((B, hkv, J), dtype=torch.float32, device=q.device)
    for h in range(hkv):  # one KV head at a time keeps the decoded keys [B, J, bs, D] small
        level = unpack_codes(codes[:, :, h][blocks], bits).float()                         # [B, J, bs, D]
        keys = lo[:, :, h].unsqueeze(2) + level * step[:, :, h].unsqueeze(2)
        if key_dtype is not None:
            keys = keys.to(key_dtype).float()
        logits = torch.bmm(qf[:, h], keys.view(B, J * bs, D).transpose(1, 2))                # [B, g, J * bs]
        out[:, h] = logits.view(B, -1, J, bs).amax(dim=3).amax(dim=1)
    return out.masked_fill_(~ok.view(B, 1, J), float("-inf"))


@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _candidates(CTAB, STAB, NCAND, n_cols, n_pages, n_code_cols, s_cb, s_sb, HKV: tl.constexpr, BS: tl.constexpr,
                    BLOCK_J: tl.constexpr, S: tl.constexpr = 1, s_ns=0):
        # A program's (request, KV head) and its BLOCK_J candidates: each one's code row and summary row (page, row);
        # with S query sets, the candidates of any of them (set s counts NCAND[s * s_ns + b]).
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        nc = tl.load(NCAND + b)
        for s in tl.static_range(1, S):
            nc = tl.maximum(nc, tl.load(NCAND + s * s_ns + b))
        ok = (j < nc) & (j < n_cols) & (j < n_code_cols)
        b64 = b.to(tl.int64)
        pg = j // BS
        page = tl.load(STAB + b64 * s_sb + pg, mask=ok & (pg < n_pages), other=0).to(tl.int64)
        crow = tl.load(CTAB + b64 * s_cb + j, mask=ok, other=0).to(tl.int64)
        ok = ok & (page >= 0) & (crow >= 0)
        return b64, h, j, ok, page, crow, j % BS

    @triton.jit
    def _levels_range(SMIN, SMAX, page, row, h, ok, s_mb, s_mt, s_mh, s_xb, s_xt, s_xh, D: tl.constexpr,
                      D_PAD: tl.constexpr, BITS: tl.constexpr):
        # The candidates' min rows and level spacing [BLOCK_J, D_PAD] (fp32): a coded key is lo + level * step.
        d = tl.arange(0, D_PAD)
        m2 = ok[:, None] & (d < D)[None, :]
        lo = tl.load(SMIN + (page * s_mb + row * s_mt + h * s_mh)[:, None] + d[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        hi = tl.load(SMAX + (page * s_xb + row * s_xt + h * s_xh)[:, None] + d[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        return lo, (hi - lo) * (1.0 / (2 ** BITS - 1)), m2

    # the kernels resolve their helpers in the module's globals (as ``tl``)
    globals().update(_candidates=_candidates, _levels_range=_levels_range)

    @triton.jit
    def _coded_score_kernel(
        Q, CODES, SMIN, SMAX, CTAB, STAB, NCAND, OUT, n_cols, n_pages, n_code_cols,
        s_qb, s_qh, s_cr, s_ct, s_ch, s_mb, s_mt, s_mh, s_xb, s_xt, s_xh, s_cb, s_sb, s_ob, s_oh,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
        BITS: tl.constexpr, BLOCK_J: tl.constexpr,
    ):
        # One program per (request, KV head, BLOCK_J candidates): each candidate's min/max row and, key by key, its
        # codes (a byte holds 8 / BITS dimensions, the lowest bits first) -> k^ = lo + level * step, the group's
        # largest q . k^ over the block's keys.
        b64, h, j, ok, page, crow, row = _candidates(CTAB, STAB, NCAND, n_cols, n_pages, n_code_cols, s_cb, s_sb,
                                                     HKV, BS, BLOCK_J)
        lo, step, m2 = _levels_range(SMIN, SMAX, page, row, h, ok, s_mb, s_mt, s_mh, s_xb, s_xt, s_xh, D, D_PAD, BITS)
        d = tl.arange(0, D_PAD)
        PER: tl.constexpr = 8 // BITS
        shift = (d % PER) * BITS
        cptr = CODES + (crow * s_cr + h * s_ch)[:, None] + (d // PER)[None, :]
        best = tl.full([BLOCK_J], float("-inf"), dtype=tl.float32)
        for t in range(BS):
            byte = tl.load(cptr + t * s_ct, mask=m2, other=0).to(tl.int32)
            key = lo + ((byte >> shift[None, :]) & (2 ** BITS - 1)).to(tl.float32) * step
            for gi in tl.static_range(G):
                qg = tl.load(Q + b64 * s_qb + (h * G + gi) * s_qh + d, mask=d < D, other=0.0).to(tl.float32)
                best = tl.maximum(best, tl.sum(qg[None, :] * key, 1))
        best = tl.where(ok, best, float("-inf"))
        tl.store(OUT + b64 * s_ob + h * s_oh + j, best, mask=j < n_cols)

    @triton.jit
    def _coded_tile_kernel(
        Q, CODES, SMIN, SMAX, CTAB, STAB, NCAND, OUT, n_cols, n_pages, n_code_cols,
        s_qb, s_qh, s_cr, s_ct, s_ch, s_mb, s_mt, s_mh, s_xb, s_xt, s_xh, s_cb, s_sb, s_ob, s_oh,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
        BS_PAD: tl.constexpr, BITS: tl.constexpr, BLOCK_J: tl.constexpr,
    ):
        # One program per (request, KV head, BLOCK_J candidates), all keys of a candidate at once: the levels as one
        # [BLOCK_J, BS_PAD, D_PAD] tile (one load; with the codes stored head-major a candidate's codes for a head are
        # one run), per query head one reduction over D of (q * step) . level plus q . lo.
        b64, h, j, ok, page, crow, row = _candidates(CTAB, STAB, NCAND, n_cols, n_pages, n_code_cols, s_cb, s_sb,
                                                     HKV, BS, BLOCK_J)
        lo, step, m2 = _levels_range(SMIN, SMAX, page, row, h, ok, s_mb, s_mt, s_mh, s_xb, s_xt, s_xh, D, D_PAD, BITS)
        d = tl.arange(0, D_PAD)
        t = tl.arange(0, BS_PAD)
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(CODES + (crow * s_cr + h * s_ch)[:, None, None] + (t * s_ct)[None, :, None]
                       + (d // PER)[None, None, :], mask=m2[:, None, :] & (t < BS)[None, :, None],
                       other=0).to(tl.int32)                                                  # [BLOCK_J, BS_PAD, D_PAD]
        level = ((byte >> ((d % PER) * BITS)[None, None, :]) & (2 ** BITS - 1)).to(tl.float32)
        best = tl.full([BLOCK_J], float("-inf"), dtype=tl.float32)
        for gi in tl.static_range(G):
            qg = tl.load(Q + b64 * s_qb + (h * G + gi) * s_qh + d, mask=d < D, other=0.0).to(tl.float32)
            logit = tl.sum((qg[None, :] * step)[:, None, :] * level, 2)                            # [BLOCK_J, BS_PAD]
            logit = tl.where((t < BS)[None, :], logit, float("-inf"))
            best = tl.maximum(best, tl.sum(qg[None, :] * lo, 1) + tl.max(logit, 1))
        best = tl.where(ok, best, float("-inf"))
        tl.store(OUT + b64 * s_ob + h * s_oh + j, best, mask=j < n_cols)

    @triton.jit
    def _coded_dot_kernel(
        Q, CODES, SMIN, SMAX, CTAB, STAB, NCAND, OUT, n_cols, n_pages, n_code_cols,
        s_qb, s_qh, s_cr, s_ct, s_ch, s_mb, s_mt, s_mh, s_xb, s_xt, s_xh, s_cb, s_sb, s_ob, s_oh, s_qs, s_ns, s_os,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
        BS_PAD: tl.constexpr, BITS: tl.constexpr, BLOCK_J: tl.constexpr, G_PAD: tl.constexpr, S: tl.constexpr,
        GP: tl.constexpr,
    ):
        # One program per (request, KV head, BLOCK_J candidates): the candidates' keys decoded in the query's dtype
        # and multiplied with the group's queries on the tensor cores. The product over D is taken as PER products,
        # one per level position p of a byte: product p pairs dimension c * PER + p of every byte c with the same
        # query dimensions, so each code byte is loaded once ([BLOCK_J, BS_PAD, D_PAD / PER]). With S query sets (a
        # step's queries and its draft's) the product's columns hold all of them, set s at columns s * GP + i: the
        # codes are read once for every set.
        b64, h, j, ok, page, crow, row = _candidates(CTAB, STAB, NCAND, n_cols, n_pages, n_code_cols, s_cb, s_sb,
                                                     HKV, BS, BLOCK_J, S, s_ns)
        PER: tl.constexpr = 8 // BITS
        c = tl.arange(0, D_PAD // PER)
        t = tl.arange(0, BS_PAD)
        g = tl.arange(0, G_PAD)
        gi = g % GP
        gq = (g // GP < S) & (gi < G)                          # a real query row: set g // GP, head h * G + gi
        mc = ok[:, None] & (c * PER < D)[None, :]
        # a key's code bytes masked by the candidate only where no byte is padding: a mask constant along them lets
        # the load read a key's bytes 16 at a time (one load a byte otherwise)
        mb = ok[:, None, None] & (t < BS)[None, :, None]
        if D < D_PAD:
            mb = mb & (c * PER < D)[None, None, :]
        byte = tl.load(CODES + (crow * s_cr + h * s_ch)[:, None, None] + (t * s_ct)[None, :, None] + c[None, None, :],
                       mask=mb, other=0).to(tl.int32)
        mrow = page * s_mb + row * s_mt + h * s_mh
        xrow = page * s_xb + row * s_xt + h * s_xh
        qrow = Q + b64 * s_qb + (g // GP) * s_qs + (h * G + gi) * s_qh
        acc = tl.zeros((BLOCK_J * BS_PAD, G_PAD), dtype=tl.float32)
        for p in tl.static_range(PER):
            dim = c * PER + p
            lo = tl.load(SMIN + mrow[:, None] + dim[None, :], mask=mc, other=0.0).to(tl.float32)
            hi = tl.load(SMAX + xrow[:, None] + dim[None, :], mask=mc, other=0.0).to(tl.float32)
            step = (hi - lo) * (1.0 / (2 ** BITS - 1))  # as level_step
            # the level as fp32 without a conversion instruction (a quarter-rate one): 2^23 + level's bits are the
            # fp32 2^23 + level, less 2^23 exactly
            level = tl.cast(((byte >> (p * BITS)) & (2 ** BITS - 1)) | 0x4B000000, tl.float32, bitcast=True) - 8388608.0
            key = (lo[:, None, :] + level * step[:, None, :]).to(Q.dtype.element_ty)   # [BLOCK_J, BS_PAD, D_PAD/PER]
            qp = tl.load(qrow[None, :] + dim[:, None], mask=gq[None, :] & (dim < D)[:, None], other=0.0)
            key = tl.reshape(key, (BLOCK_J * BS_PAD, D_PAD // PER))
            if Q.dtype.element_ty == tl.float32:
                acc = tl.dot(key, qp, acc, input_precision="ieee")
            else:
                acc = tl.dot(key, qp, acc)
        logit = tl.reshape(acc, (BLOCK_J, BS_PAD, G_PAD))
        logit = tl.where((t < BS)[None, :, None] & gq[None, None, :], logit, float("-inf"))
        best = tl.max(tl.reshape(tl.max(logit, 1), (BLOCK_J, G_PAD // GP, GP)), 2)       # [BLOCK_J, sets (padded)]
        col = tl.arange(0, G_PAD // GP)
        for s in tl.static_range(S):
            nc = tl.load(NCAND + s * s_ns + b64)
            bs_ = tl.max(tl.where(col[None, :] == s, best, float("-inf")), 1)
            bs_ = tl.where(ok & (j < nc), bs_, float("-inf"))
            tl.store(OUT + s * s_os + b64 * s_ob + h * s_oh + j, bs_, mask=j < n_cols)

    @triton.jit
    def _pack_rows_kernel(K, ROWS, OUT, s_kn, s_kt, s_kh, s_or, s_ot, s_oh, HKV: tl.constexpr, BS: tl.constexpr,
                          BS_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr):
        # One program per (block, KV head): the block's keys [BS, D] for the head, their min/max over the keys, each
        # dimension's nearest level as pack_codes computes it (IEEE division, ties to even), 8 / BITS levels a byte
        # (the lowest bits first), stored in code row ROWS[block].
        i = tl.program_id(0) // HKV
        h = tl.program_id(0) % HKV
        t = tl.arange(0, BS_PAD)
        d = tl.arange(0, D_PAD)
        m = (t < BS)[:, None] & (d < D)[None, :]
        k = tl.load(K + i.to(tl.int64) * s_kn + h * s_kh + t[:, None] * s_kt + d[None, :], mask=m, other=0.0)
        k = k.to(tl.float32)
        lo = tl.min(tl.where(m, k, float("inf")), 0)
        hi = tl.max(tl.where(m, k, float("-inf")), 0)
        step = (hi - lo) * (1.0 / (2 ** BITS - 1))                                     # as level_step
        pos = tl.math.div_rn(k - lo[None, :], tl.maximum(step, 1.1754943508222875e-38)[None, :])
        pos = tl.where((step > 0)[None, :], pos, 0.0)
        r = (pos + 12582912.0) - 12582912.0  # to the nearest integer, ties to even (exact below 2^22: 1.5 * 2^23)
        level = tl.minimum(tl.maximum(r, 0.0), 2 ** BITS - 1).to(tl.int32)
        PER: tl.constexpr = 8 // BITS
        sh = (tl.arange(0, PER) * BITS)[None, None, :]
        byte = tl.sum(tl.reshape(level, (BS_PAD, D_PAD // PER, PER)) << sh, 2)           # [BS_PAD, D_PAD / PER]
        c = tl.arange(0, D_PAD // PER)
        row = tl.load(ROWS + i).to(tl.int64)
        tl.store(OUT + row * s_or + h * s_oh + t[:, None] * s_ot + c[None, :], byte.to(tl.uint8),
                 mask=(t < BS)[:, None] & (c * PER < D)[None, :])

    from types import SimpleNamespace
    return SimpleNamespace(score=_coded_score_kernel, tile=_coded_tile_kernel, dot=_coded_dot_kernel,
                           pack=_pack_rows_kernel)


def pack_codes_into(out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, bits: int, *,
                    backend: str = "auto") -> None:
    """``out[rows] = pack_codes(keys, keys.amin(1), keys.amax(1), bits)``: full (or active) blocks ``keys`` ``[n,
    block_size, Hkv, D]`` coded within their own min/max into code rows ``rows`` ``[n]`` of ``out`` (``[R, block_size,
    Hkv, D * bits / 8]`` uint8, any strides: ``KeyCodes`` stores them head-major). One Triton launch (a decode step
    codes every request's active block in every layer: the PyTorch composition is ~20 small kernels), or with
    ``backend="ref"`` (and ``"auto"`` off CUDA) that composition; the same bytes."""
    if not keys.shape[0]:
        return
    if not use_triton(backend, keys, _kernels):
        out.index_copy_(0, rows, pack_codes(keys, keys.amin(dim=1), keys.amax(dim=1), bits))
        return
    n, bs, hkv, D = keys.shape
    check_code_bits(bits, D)
    if out.stride(-1) != 1:
        raise ValueError("code rows need a unit stride on their last dimension")
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    kernels = _kernels()
    rows = rows.to(device=keys.device)
    with on_device(keys):
        kernels.pack[(n * hkv,)](keys, rows, out, keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0),
                                 out.stride(1), out.stride(2), HKV=hkv, BS=bs, BS_PAD=next_pow2(bs), D=D,
                                 D_PAD=max(next_pow2(D), 8 // bits), BITS=bits, num_warps=2)


VARIANTS = ("auto", "cuda", "dot", "tile", "key")
"""``coded_scores``' kernels: ``auto`` picks ``cuda`` where it fits (:func:`cuda_misfit`), else ``dot`` for 16-bit
queries, else ``tile`` or ``key``."""

TILE_MAX_ELEMENTS = 16 * 128
"""The tile kernel holds a program's levels ``[block_j, block_size, D]`` (padded to powers of two) in registers: up to
this many a candidate (block size 16 at head dim 128, where it was measured), the key-by-key kernel beyond."""


def cuda_misfit(q: torch.Tensor, codes: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor,
                num_kv_heads: int, bits: int) -> Optional[str]:
    """Why ``csrc/coded_scores.cu`` (variant ``"cuda"``) cannot score these inputs, or None where it can: the
    product's shape only (2 bits, blocks of 16 keys, head dim 64 or 128, bf16 / fp16 queries and summaries, up to 8
    query columns a KV head: 2 sets of 4 query heads or 1 of 8, padded to powers of two), on a CUDA device of compute
    capability 8.0 or more, rows aligned for its vector loads. ``q``: ``[B, Hq, D]`` or ``[B, S, Hq, D]``."""
    sets = q.unsqueeze(1) if q.dim() == 3 else q
    _, S, Hq, D = sets.shape
    hkv = int(num_kv_heads)
    if q.dtype not in (torch.bfloat16, torch.float16) or sum_min.dtype != q.dtype or sum_max.dtype != q.dtype:
        return f"needs bf16 / fp16 queries and summaries of the same dtype (got {q.dtype}, {sum_min.dtype})"
    if bits != 2 or codes.dtype != torch.uint8:
        return f"needs 2-bit codes (bits={bits})"
    if codes.shape[1] != 16:
        return f"needs blocks of 16 keys (block size {codes.shape[1]})"
    if D not in (64, 128):
        return f"needs head dim 64 or 128 (got {D})"
    if Hq % hkv or S > 2 or S * next_pow2(Hq // hkv) > 8:
        return f"needs up to 8 query columns a KV head ({S} sets of {Hq // max(hkv, 1)} query heads)"
    code_unit, row_unit = D // 16, D // 32  # bytes a thread reads of a key; summary elements a lane reads
    if codes.data_ptr() % code_unit or any(st % code_unit for st in codes.stride()[:3]) or codes.stride(3) != 1:
        return f"needs code rows aligned to {code_unit} bytes"
    for t, unit in ((sum_min, row_unit), (sum_max, row_unit), (sets, 4)):
        if t.data_ptr() % (2 * unit) or any(st % unit for st in t.stride()[:3]) or t.stride(3) != 1:
            return f"needs summary and query rows aligned to {unit} elements"
    if not q.is_cuda:
        return "needs CUDA tensors"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "needs compute capability 8.0 (bf16 / fp16 tensor-core products)"
    return None


def _cuda_lib(device: torch.device) -> ctypes.CDLL:
    """``csrc/coded_scores.cu`` built for ``device``'s architecture (:func:`~oasiskv_runtime.ops.common.build_csrc`:
    once a process and architecture), its entry typed. Raises RuntimeError (no nvcc, or it failed) or OSError (the
    library does not load)."""
    return build_csrc("coded_scores", "sm_{}{}".format(*torch.cuda.get_device_capability(device)),
                      {"oasis_coded_scores": [ctypes.c_int, ctypes.c_int] + [ctypes.c_uint64] * 8
                       + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]})


_CUDA_OK: dict = {}


def cuda_available(device: torch.device) -> bool:
    """Whether the CUDA C kernel builds (nvcc) and loads for ``device``: ``auto`` runs Triton's ``dot`` otherwise
    (asked once a process and device)."""
    key = torch.device(device).index
    if key not in _CUDA_OK:
        try:
            _cuda_lib(device)
            _CUDA_OK[key] = True
        except (RuntimeError, OSError) as e:
            log.warning("coded scores: the CUDA C kernel is not available here (%s); running the Triton kernel "
                        "(~1.3x slower on an H100)", str(e).splitlines()[0])
            _CUDA_OK[key] = False
    return _CUDA_OK[key]


def _coded_scores_cuda(sets: torch.Tensor, codes: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor,
                       ctab: torch.Tensor, stab: torch.Tensor, nc: torch.Tensor, out: torch.Tensor, hkv: int) -> None:
    """``out`` ``[S, B, Hkv, J]`` from ``csrc/coded_scores.cu`` (one launch on the current stream; a CUDA graph
    captures it). Inputs as :func:`coded_scores` has prepared them for the Triton kernels."""
    B, S, Hq, D = sets.shape
    g = Hq // hkv
    for t in (ctab, stab):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block tables must be int32 or int64, got {t.dtype}")
    strides = (ctypes.c_int64 * 18)(
        sets.stride(0), sets.stride(1), sets.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
        sum_min.stride(0), sum_min.stride(1), sum_min.stride(2), sum_max.stride(0), sum_max.stride(1),
        sum_max.stride(2), ctab.stride(0), stab.stride(0), nc.stride(0), out.stride(0), out.stride(1), out.stride(2))
    shape = (ctypes.c_int * 10)(B, hkv, g, next_pow2(g), S, out.shape[3], stab.shape[1], ctab.shape[1],
                                int(ctab.dtype == torch.int64), int(stab.dtype == torch.int64))
    with on_device(sets):
        lib = _cuda_lib(sets.device)
        stream = torch.cuda.current_stream(sets.device).cuda_stream
        rc = lib.oasis_coded_scores(0 if sets.dtype == torch.bfloat16 else 1, D, sets.data_ptr(), codes.data_ptr(),
                                    sum_min.data_ptr(), sum_max.data_ptr(), ctab.data_ptr(), stab.data_ptr(),
                                    nc.data_ptr(), out.data_ptr(), ctypes.cast(strides, ctypes.c_void_p),
                                    ctypes.cast(shape, ctypes.c_void_p), stream)
    if rc != 0:
        raise RuntimeError(f"oasis_coded_scores failed with cudaError {rc}")


def coded_scores(q: torch.Tensor, codes: torch.Tensor, sum_min: torch.Tensor, sum_max: torch.Tensor,
                 block_table: torch.Tensor, summary_block_table: torch.Tensor, num_candidates: torch.Tensor,
                 num_kv_heads: int, bits: int, max_candidates: Optional[int] = None, block_j: Optional[int] = None,
                 *, num_warps: Optional[int] = None, variant: str = "auto", backend: str = "auto") -> torch.Tensor:
    """Each candidate block's largest logit over its coded keys, ``[B, Hkv, J]`` fp32, ``-inf`` beyond
    ``num_candidates``: a Triton kernel (one pass over the candidates' codes and min/max rows, no decoded keys in
    memory), or with ``backend="ref"`` (and ``"auto"`` off CUDA) :func:`coded_scores_ref`. Arguments as there.

    Several query sets over the same blocks (a decode step's queries and its draft's, whose candidates may count one
    block more): ``q`` ``[B, S, Hq, D]`` and ``num_candidates`` ``[S, B]`` give ``[S, B, Hkv, J]``, each set's
    scores as its own call would give them; the ``cuda`` and ``dot`` kernels read the codes once for all sets (the
    product's 8 / 16 columns hold ``S`` groups of query heads), the others run once a set.

    ``variant`` (:data:`VARIANTS`): ``"cuda"`` (``csrc/coded_scores.cu``, the product's shape only, see
    :func:`cuda_misfit`: the same rounded keys and tensor-core products as ``dot`` at about half its instructions, a
    warp a candidate; built by nvcc on first use), ``"dot"`` (the keys of ``block_j`` candidates decoded in fp32,
    rounded to the query's dtype and multiplied with the group's queries on the tensor cores, one product per level
    position of a byte; 4 candidates and 2 warps by default; its scores are the reference's with
    ``key_dtype=q.dtype``),
    ``"tile"`` (all keys of ``block_j`` candidates as one fp32 tile, one reduction over D per query head; 8
    candidates, 4 warps), ``"key"`` (key by key, 16 candidates, 2 warps) or ``"auto"`` (``dot`` for bf16 / fp16
    queries, else ``tile`` up to :data:`TILE_MAX_ELEMENTS` levels a candidate and ``key`` beyond; ``cuda`` first where
    it fits, nvcc builds it and ``backend`` is ``"auto"``). The fp32 kernels
    hold too many registers to hide their loads (the tile kernel: 255 a thread, 12% occupancy on the H100); timings
    in ``docs/accuracy.md``, "Keys coded". ``block_j`` / ``num_warps``: the launch, swept by ``bench_kernels.py
    --only coded``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: {', '.join(VARIANTS)}")
    d_pad, bs = max(16, next_pow2(q.shape[-1])), codes.shape[1]
    if variant == "auto":
        variant = ("cuda" if backend == "auto" and cuda_misfit(q, codes, sum_min, sum_max, num_kv_heads, bits) is None
                   and cuda_available(q.device)
                   else "dot" if q.dtype in (torch.bfloat16, torch.float16)
                   else "tile" if next_pow2(bs) * d_pad <= TILE_MAX_ELEMENTS else "key")
    elif variant == "cuda" and backend != "ref" and (backend != "auto" or q.is_cuda):
        why = cuda_misfit(q, codes, sum_min, sum_max, num_kv_heads, bits)
        if why:
            raise ValueError(f"variant='cuda' {why}; variant='dot' scores any shape")
    if q.dim() == 4:
        if tuple(num_candidates.shape) != (q.shape[1], q.shape[0]):
            raise ValueError(f"{q.shape[1]} query sets of {q.shape[0]} requests need num_candidates [S, B], "
                             f"got {tuple(num_candidates.shape)}")
        max_candidates = _num_cols(num_candidates, max_candidates)
    triton_ok = (backend != "ref" and q.is_cuda if variant == "cuda" else use_triton(backend, q, _kernels))
    if q.dim() == 4 and not (triton_ok and variant in ("dot", "cuda")):
        return torch.stack([coded_scores(q[:, s], codes, sum_min, sum_max, block_table, summary_block_table,
                                         num_candidates[s], num_kv_heads, bits, max_candidates, block_j,
                                         num_warps=num_warps, variant=variant, backend=backend)
                            for s in range(q.shape[1])])
    if not triton_ok:
        return coded_scores_ref(q, codes, sum_min, sum_max, block_table, summary_block_table, num_candidates,
                                num_kv_heads, bits, max_candidates)
    sets = q.unsqueeze(1) if q.dim() == 3 else q                                                # [B, S, Hq, D]
    B, S, Hq, D = sets.shape
    hkv = int(num_kv_heads)
    if Hq % hkv:
        raise ValueError(f"Hq={Hq} not a multiple of Hkv={hkv}")
    check_code_bits(bits, D)
    if codes.stride(-1) != 1 or sum_min.stride(-1) != 1 or sum_max.stride(-1) != 1:
        raise ValueError("codes and summaries need a unit stride on their last dimension")
    J = _num_cols(num_candidates, max_candidates)
    out = torch.empty((S, B, hkv, J), dtype=torch.float32, device=q.device)
    if J == 0 or B == 0:
        return out if q.dim() == 4 else out[0]
    sets = sets if sets.stride(-1) == 1 else sets.contiguous()
    stab = summary_block_table if summary_block_table.stride(-1) == 1 else summary_block_table.contiguous()
    ctab = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    nc = num_candidates.to(device=q.device, dtype=torch.int32).reshape(S, B).contiguous()
    if variant == "cuda":
        _coded_scores_cuda(sets, codes, sum_min, sum_max, ctab, stab, nc, out, hkv)
        return out if q.dim() == 4 else out[0]
    g = Hq // hkv
    kernels = _kernels()  # (binds ``triton`` here)
    args = (sets, codes, sum_min, sum_max, ctab, stab, nc, out, J, stab.shape[1], ctab.shape[1],
            sets.stride(0), sets.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
            sum_min.stride(0), sum_min.stride(1), sum_min.stride(2),
            sum_max.stride(0), sum_max.stride(1), sum_max.stride(2),
            ctab.stride(0), stab.stride(0), out.stride(1), out.stride(2))
    shape = dict(HKV=hkv, G=g, D=D, D_PAD=d_pad, BS=bs, BITS=bits)
    with on_device(q):
        if variant == "dot":
            per, gp = 8 // bits, next_pow2(g)
            block_j = max(block_j or 4, 16 // next_pow2(bs))  # the product needs 16 rows
            # the products need 16 bytes a key and 16 query rows (padded); the keys' fp32 arithmetic unfused, as
            # the reference's, so both round the same fp32 keys to the query's dtype
            kernels.dot[(B * hkv, triton.cdiv(J, block_j))](
                *args, sets.stride(1), nc.stride(0), out.stride(0),
                **{**shape, "D_PAD": max(16 * per, next_pow2(D))}, BS_PAD=next_pow2(bs), BLOCK_J=block_j,
                G_PAD=max(16, next_pow2(S) * gp), S=S, GP=gp, num_warps=num_warps or 2, enable_fp_fusion=False)
        elif variant == "tile":
            block_j = block_j or 8
            kernels.tile[(B * hkv, triton.cdiv(J, block_j))](*args, **shape, BS_PAD=next_pow2(bs), BLOCK_J=block_j,
                                                              num_warps=num_warps or 4)
        else:
            block_j = block_j or (16 if d_pad >= 128 else 32)
            kernels.score[(B * hkv, triton.cdiv(J, block_j))](*args, **shape, BLOCK_J=block_j,
                                                               num_warps=num_warps or 2)
    return out if q.dim() == 4 else out[0]
