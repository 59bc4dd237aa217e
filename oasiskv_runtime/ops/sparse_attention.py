"""Look-ahead sparse decode attention over a per-head paged KV working set.

SPEC mechanism item 1 (look-ahead attention) on top of item 5 (per-head KV mapping):
the normal token's query (row 0) and the draft token's query (row 1) are stacked in
ONE launch and attend over the same resident sparse working set. Only the draft row
also sees the draft token's own K/V (``extra_k`` / ``extra_v``): the normal token
precedes the draft, so it must never attend to it.

Layouts (fixed, shared with the engine):

* ``q``: ``[B, Q, Hq, D]``, ``Q`` in {1, 2}. Hq = g * Hkv (GQA; query head ``hq`` reads
  KV head ``hq // g``).
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, Hkv, D]``.
* ``block_ids``: ``[B, Hkv, N]`` int32, physical block per (request, kv head, slot);
  ``-1`` = empty slot (skipped). Listed blocks are full (block_size valid tokens).
* ``local_block``: ``[B]`` int32 physical id of the partially filled block, shared by
  all heads; ``local_len``: ``[B]`` int32 valid tokens in it (1..block_size).
* ``extra_k``, ``extra_v``: ``[B, Hkv, D]`` (only with Q == 2).
* ``num_full`` (optional): ``[B]`` int32, slots ``>= num_full[b]`` are empty for every head of
  request ``b`` (a dense table padded to a bucket of ``N``): the kernel's loop stops there instead
  of running over the padding, and the local block counts as slot ``num_full[b]``.
* returns ``out``: ``[B, Q, Hq, D]`` in q's dtype.
* ``slot_lse`` (optional output): ``[B, Hkv, g, N]`` fp32, per query head of the normal row (row 0) and
  working-set slot, the natural-log sum of ``exp(scale * q.k)`` over the slot's tokens (``-inf`` for an empty
  slot or one past ``num_full``). A softmax of it over the slots, summed over the group, is the mass the step's
  attention gave each block (:func:`oasiskv_runtime.ops.attention_mass.slot_mass`, ``attended_blocks``): the
  kernel has those exp-sums in hand, so it costs no second read of the keys. It sums the online softmax's own
  ``p`` per slot with one small ``tl.dot`` of P (in V's dtype, as P @ V reads it) against the tile's token-to-slot
  one-hot, so a slot ~100 nats under the row's running maximum reads ``-inf`` (no mass, as the softmax gives it).

Two implementations live here:

* :func:`sparse_decode_attention_ref`: plain PyTorch (gather, mask, softmax in fp32).
  Runs anywhere; it is the CPU path and the oracle for the kernel.
* the Triton kernel behind :func:`sparse_decode_attention`: split-K flash decoding.
  Grid = (B * Hkv, n_splits). One program owns one (request, kv head) pair and a
  contiguous range of slots; its M rows are the Q * g query rows of that KV head
  (padded to >= 16 for ``tl.dot``), so each K/V byte is read once for the whole GQA
  group and both the normal and the draft query. Per iteration it gathers ``SLOTS``
  blocks (``SLOTS * block_size`` tokens) of K and V with masked loads (empty slots,
  the local block's tail and out-of-range slots are never read), keeps an online
  softmax in fp32 (exp2 with the scale folded in) and accumulates P @ V in fp32.
  The local block is virtual slot ``N``, or ``num_full[b]`` with counts (the split that
  holds that slot owns it; with counts the loop ends there), and the draft's
  own K/V is folded in by the last split, for query row 1 only. A second tiny kernel
  merges the per-split (max, sum, acc) partials. With one split the first kernel
  writes the normalised output directly.

Triton is imported lazily (the module imports on machines without Triton or CUDA);
CPU tensors or a missing Triton fall back to the reference.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from oasiskv_runtime.ops.common import lazy_kernels, loads, next_pow2, on_device

__all__ = [
    "sparse_decode_attention",
    "sparse_decode_attention_ref",
    "default_config",
]

triton = None  # set by _kernels()
tl = None


_next_pow2 = next_pow2
DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")  # Triton's tl.dot input_precision values used here


def _check_shapes(q, k_cache, v_cache, block_ids, local_block, local_len, extra_k, extra_v, num_full=None):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Q, Hq, D], got {tuple(q.shape)}")
    B, Qn, Hq, D = q.shape
    if Qn not in (1, 2):
        raise ValueError(f"Q must be 1 or 2, got {Qn}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache/v_cache must be equal-shaped [num_blocks, block_size, Hkv, D]")
    _, _, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q {D} vs cache {Dk}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if block_ids.dim() != 3 or block_ids.shape[0] != B or block_ids.shape[1] != Hkv:
        raise ValueError(f"block_ids must be [B={B}, Hkv={Hkv}, N], got {tuple(block_ids.shape)}")
    if local_block.shape != (B,) or local_len.shape != (B,):
        raise ValueError("local_block and local_len must be [B]")
    if num_full is not None and num_full.shape != (B,):
        raise ValueError("num_full must be [B]")
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v go together")
    if extra_k is not None:
        if Qn != 2:
            raise ValueError("extra_k/extra_v (the draft token's own K/V) need Q == 2")
        if extra_k.shape != (B, Hkv, D) or extra_v.shape != (B, Hkv, D):
            raise ValueError(f"extra_k/extra_v must be [B, Hkv, D] = {(B, Hkv, D)}")
    return B, Qn, Hq, D, Hkv


def _check_slot_lse(slot_lse: torch.Tensor, B: int, Hkv: int, g: int, N: int) -> None:
    if slot_lse.shape != (B, Hkv, g, N) or slot_lse.dtype != torch.float32 or not slot_lse.is_contiguous():
        raise ValueError(f"slot_lse must be a contiguous float32 [B, Hkv, g, N] = {(B, Hkv, g, N)}, got "
                         f"{tuple(slot_lse.shape)} {slot_lse.dtype}")


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def sparse_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    local_block: torch.Tensor,
    local_len: torch.Tensor,
    scale: float,
    extra_k: Optional[torch.Tensor] = None,
    extra_v: Optional[torch.Tensor] = None,
    num_full: Optional[torch.Tensor] = None,
    slot_lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plain-PyTorch reference: gather the working set densely, mask, softmax in fp32."""
    B, Qn, Hq, D, Hkv = _check_shapes(q, k_cache, v_cache, block_ids, local_block, local_len,
                                      extra_k, extra_v, num_full)
    if num_full is not None:  # slots past a request's count are empty by contract: drop whatever is there
        N = block_ids.shape[2]
        past = torch.arange(N, device=block_ids.device).view(1, 1, N) >= num_full.to(block_ids.device).view(B, 1, 1)
        block_ids = block_ids.masked_fill(past, -1)
    BS = k_cache.shape[1]
    g = Hq // Hkv
    dev = q.device
    ids = torch.cat(
        [block_ids.to(dev, torch.long),
         local_block.to(dev, torch.long).view(B, 1, 1).expand(B, Hkv, 1)], dim=2)  # [B,Hkv,S]
    S = ids.shape[2]
    present = ids >= 0
    safe = ids.clamp_min(0)
    hidx = torch.arange(Hkv, device=dev).view(1, Hkv, 1).expand_as(safe)
    k = k_cache[safe, :, hidx, :].float()  # [B, Hkv, S, BS, D]
    v = v_cache[safe, :, hidx, :].float()
    rows = torch.arange(BS, device=dev)
    tok_ok = present.unsqueeze(-1).expand(B, Hkv, S, BS).clone()
    tok_ok[:, :, S - 1, :] &= rows.view(1, 1, BS) < local_len.to(dev).view(B, 1, 1)
    k = k.reshape(B, Hkv, S * BS, D)
    v = v.reshape(B, Hkv, S * BS, D)
    tok_ok = tok_ok.reshape(B, Hkv, 1, 1, S * BS).expand(B, Hkv, Qn, g, S * BS)
    if extra_k is not None:
        k = torch.cat([k, extra_k.to(dev).float().unsqueeze(2)], dim=2)
        v = torch.cat([v, extra_v.to(dev).float().unsqueeze(2)], dim=2)
        ex_ok = torch.zeros(B, Hkv, Qn, g, 1, dtype=torch.bool, device=dev)
        ex_ok[:, :, 1] = True  # only the draft row sees the draft token itself
        tok_ok = torch.cat([tok_ok, ex_ok], dim=-1)
    qf = q.float().reshape(B, Qn, Hkv, g, D).permute(0, 2, 1, 3, 4)  # [B,Hkv,Qn,g,D]
    s = torch.einsum("bhqgd,bhld->bhqgl", qf, k) * scale
    s = s.masked_fill(~tok_ok, float("-inf"))
    if slot_lse is not None:  # the normal row's logits over the N listed slots, per slot
        _check_slot_lse(slot_lse, B, Hkv, g, S - 1)
        slot_lse.copy_(torch.logsumexp(s[:, :, 0, :, :(S - 1) * BS].reshape(B, Hkv, g, S - 1, BS), dim=-1))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhqgl,bhld->bhqgd", p, v)  # [B,Hkv,Qn,g,D]
    return o.permute(0, 2, 1, 3, 4).reshape(B, Qn, Hq, D).to(q.dtype)


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------
@lazy_kernels(globals())
def _kernels():

    @triton.jit
    def _sparse_attn_fwd(
        Q, K, V, BIDS, LBLK, LLEN, NFULL, EK, EV,
        OUT, MID_O, MID_M, MID_L, SLOT_LSE,
        qk_scale,  # softmax scale * log2(e)
        N, slots_per_split, n_splits,
        s_qb, s_qq, s_qh,
        s_kb, s_kt, s_kh,
        s_vb, s_vt, s_vh,
        s_ib, s_ih,
        s_eb, s_eh, s_fb, s_fh,
        s_ob, s_oq, s_oh,
        HKV: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, QN: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BS_PAD: tl.constexpr,
        SLOTS: tl.constexpr, M_PAD: tl.constexpr,
        HAS_EXTRA: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, HAS_NFULL: tl.constexpr,
        HAS_LSE: tl.constexpr, SL_PAD: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bh // HKV
        h = pid_bh % HKV

        rows = tl.arange(0, M_PAD)
        qi = rows // G
        gi = rows % G
        row_ok = rows < QN * G
        hq = h * G + gi
        d = tl.arange(0, D_PAD)
        d_ok = d < D

        q_ptrs = Q + b.to(tl.int64) * s_qb + qi[:, None] * s_qq + hq[:, None] * s_qh + d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        lblk = tl.load(LBLK + b)
        llen = tl.load(LLEN + b)
        if HAS_NFULL:  # slots past the request's count are padding: the local block is slot nf
            nf = tl.minimum(tl.load(NFULL + b), N)
        else:
            nf = N
        start = pid_s * slots_per_split
        end = tl.minimum(start + slots_per_split, nf + 1)

        t = tl.arange(0, SLOTS * BS_PAD)
        tslot = t // BS_PAD
        trow = t % BS_PAD

        m_i = tl.full([M_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([M_PAD], dtype=tl.float32)
        acc = tl.zeros([M_PAD, D_PAD], dtype=tl.float32)

        bid_base = BIDS + b.to(tl.int64) * s_ib + h * s_ih
        # without counts: a uniform trip count (the last split's surplus slots are masked, nothing is read);
        # with them the loop ends at the request's last slot (a split past it runs no iteration)
        for s0 in range(start, end if HAS_NFULL else start + slots_per_split, SLOTS):
            slot = s0 + tslot
            in_rng = slot < end
            bid = tl.load(bid_base + slot, mask=in_rng & (slot < nf), other=-1)
            bid = tl.where(slot == nf, lblk, bid)
            valid = in_rng & (bid >= 0) & (trow < BS) & ((slot < nf) | (trow < llen))
            bid64 = bid.to(tl.int64)
            kmask = valid[:, None] & d_ok[None, :]
            k = tl.load(K + (bid64 * s_kb + trow * s_kt + h * s_kh)[:, None] + d[None, :],
                        mask=kmask, other=0.0)
            v = tl.load(V + (bid64 * s_vb + trow * s_vt + h * s_vh)[:, None] + d[None, :],
                        mask=kmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            pv = p.to(v.dtype)
            if HAS_LSE:  # per slot of the tile, the normal row's log-sum-exp (natural log) over its tokens, from
                # the softmax's own exp2s: m_new + log2(the slot's sum of p), the sums one small tl.dot of P (as
                # P @ V reads it) with the tile's token-to-slot one-hot (a slot ~100 nats under the running max
                # underflows to -inf, i.e. no mass, which is what the softmax gives it to fp32 precision)
                sc = tl.arange(0, SL_PAD)
                onehot = (tslot[:, None] == sc[None, :]).to(v.dtype)                     # [tokens, SL_PAD]
                ps = tl.dot(pv, onehot, input_precision=DOT_PREC)                          # [M_PAD, SL_PAD]
                lse = (m_new[:, None] + tl.log2(ps)) * 0.6931471805599453
                sl = s0 + sc
                lse_ok = (rows < G)[:, None] & ((sc < SLOTS) & (sl < nf) & (sl < end))[None, :]
                lse_row = (b * HKV + h).to(tl.int64) * G + gi
                tl.store(SLOT_LSE + lse_row[:, None] * N + sl[None, :], lse, mask=lse_ok)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
            m_i = m_new

        if HAS_EXTRA:
            if pid_s == n_splits - 1:
                ek = tl.load(EK + b.to(tl.int64) * s_eb + h * s_eh + d, mask=d_ok, other=0.0)
                ev = tl.load(EV + b.to(tl.int64) * s_fb + h * s_fh + d, mask=d_ok, other=0.0)
                se = tl.sum(q.to(tl.float32) * ek.to(tl.float32)[None, :], 1) * qk_scale
                se = tl.where(row_ok & (qi == 1), se, float("-inf"))
                m_new = tl.maximum(m_i, se)
                alpha = tl.exp2(m_i - m_new)
                pe = tl.exp2(se - m_new)
                l_i = l_i * alpha + pe
                acc = acc * alpha[:, None] + pe[:, None] * ev.to(tl.float32)[None, :]
                m_i = m_new

        if DIRECT:
            o = acc / l_i[:, None]
            o_ptrs = OUT + b.to(tl.int64) * s_ob + qi[:, None] * s_oq + hq[:, None] * s_oh + d[None, :]
            tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            rid = (b * QN + qi) * HQ + hq
            mid = rid.to(tl.int64) * n_splits + pid_s
            tl.store(MID_O + mid[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
            tl.store(MID_M + mid, m_i, mask=row_ok)
            tl.store(MID_L + mid, l_i, mask=row_ok)

    @triton.jit
    def _sparse_attn_merge(
        OUT, MID_O, MID_M, MID_L, n_splits,
        s_ob, s_oq, s_oh,
        QN: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
    ):
        rid = tl.program_id(0)
        b = rid // (QN * HQ)
        qi = (rid // HQ) % QN
        hq = rid % HQ
        sp = tl.arange(0, S_PAD)
        s_ok = sp < n_splits
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        base = rid.to(tl.int64) * n_splits
        m = tl.load(MID_M + base + sp, mask=s_ok, other=float("-inf"))
        l = tl.load(MID_L + base + sp, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - m_max)
        denom = tl.sum(w * l, 0)
        o = tl.load(MID_O + (base + sp)[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(w[:, None] * o, 0) / denom
        tl.store(OUT + b.to(tl.int64) * s_ob + qi * s_oq + hq * s_oh + d, o.to(OUT.dtype.element_ty),
                 mask=d_ok)

    from types import SimpleNamespace
    return SimpleNamespace(fwd=_sparse_attn_fwd, merge=_sparse_attn_merge)


def _triton_available() -> bool:
    return loads(_kernels)


def default_config(B: int, Hkv: int, N: int, block_size: int, head_dim: int,
                   num_sms: int = 132) -> dict:
    """Launch configuration heuristic (tuned on the H200 with bench/bench_kernels.py).

    ``slots``: blocks gathered per loop iteration (tokens per tile = slots * block_size,
    64 for 16-token blocks); ``n_splits``: programs per (request, kv head) along the
    slot axis. Device time (CUDA-graph replay) on the H200, 129 x 16 tokens, D=128, Q=2:

    * B=64, Hkv=8 (512 pairs): 1 split 134 us (4.04 TB/s), 2: 144, 3: 153, 4: 162 us;
      num_stages 3 or 4 (134 us) beat 2 (180 us at 1 split); slots 4 beat 2 (146) and
      8 (151); 8 warps were slower;
    * B=16 (128 pairs): 1 split 70 us, 2: 48, 4: 47, 5: 54, 8: 52, 17: 52 us;
    * B=4 (32 pairs): 1 split 66 us, 4: 24, 8: 19, 17: 19, 33: 20 us.

    So: no split once there are >= 2 (request, head) pairs per SM, else enough splits
    for ~2 programs per SM, keeping >= 2 tiles of work per program.

    ``dot_prec`` (``None``: by dtype): the precision of the two ``tl.dot`` per tile for float32
    inputs. ``"ieee"`` runs them as plain fp32 FMAs over the padded 16-row tile, and at float32
    that was 86% of a SmolLM2 generation step on the H200 (4.7 ms per layer at 1,014 requests,
    docs/benchmarks.md, "Kernels"), ~17x its K/V read. The default ``"tf32x3"`` splits each fp32
    operand into a TF32 high and low part and sums three tensor-core products, which keeps
    about fp32 accuracy. bf16/fp16 inputs use the tensor cores natively (the setting is moot).
    """
    bs_pad = _next_pow2(block_size)
    slots = max(1, 64 // bs_pad)
    if head_dim > 128:
        slots = max(1, slots // 2)
    total = N + 1
    pairs = max(1, B * Hkv)
    if pairs >= 2 * num_sms:
        n_splits = 1
    else:
        want = math.ceil(2 * num_sms / pairs)
        max_splits = max(1, math.ceil(total / (2 * slots)))
        n_splits = max(1, min(want, max_splits, 64))
    return {"slots": slots, "n_splits": n_splits, "num_warps": 4, "num_stages": 3, "dot_prec": None}


def _sparse_decode_attention_triton(q, k_cache, v_cache, block_ids, local_block, local_len,
                                    scale, extra_k, extra_v, out=None, config=None, num_full=None, slot_lse=None):
    B, Qn, Hq, D, Hkv = _check_shapes(q, k_cache, v_cache, block_ids, local_block, local_len,
                                      extra_k, extra_v, num_full)
    K = _kernels()
    BS = k_cache.shape[1]
    N = block_ids.shape[2]
    g = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a unit stride on head_dim")
    block_ids = block_ids.to(torch.int32)
    if block_ids.stride(-1) != 1:
        block_ids = block_ids.contiguous()
    local_block = local_block.to(torch.int32).contiguous()
    local_len = local_len.to(torch.int32).contiguous()
    has_nfull = num_full is not None
    nfull = num_full.to(torch.int32).contiguous() if has_nfull else local_len  # unused without counts
    has_extra = extra_k is not None
    if has_extra:
        extra_k = extra_k if extra_k.stride(-1) == 1 else extra_k.contiguous()
        extra_v = extra_v if extra_v.stride(-1) == 1 else extra_v.contiguous()
    if out is None:
        out = torch.empty((B, Qn, Hq, D), dtype=q.dtype, device=q.device)
    elif out.shape != (B, Qn, Hq, D) or out.stride(-1) != 1:
        raise ValueError("out must be [B, Q, Hq, D] with unit last stride")

    if slot_lse is not None:
        _check_slot_lse(slot_lse, B, Hkv, g, N)
        if has_nfull:  # the kernel writes every slot before a request's count; the padding past it stays empty
            slot_lse.fill_(float("-inf"))
    num_sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
               if q.is_cuda else 132)
    cfg = default_config(B, Hkv, N, BS, D, num_sms)
    if config:
        cfg.update(config)
    slots = int(cfg["slots"])
    while slots * _next_pow2(BS) < 16:  # tl.dot needs >= 16 along every dimension
        slots *= 2
    total = N + 1
    n_splits = max(1, min(int(cfg["n_splits"]), total))
    slots_per_split = math.ceil(total / n_splits)
    n_splits = math.ceil(total / slots_per_split)  # no empty splits
    direct = n_splits == 1
    D_PAD = max(16, _next_pow2(D))
    M_PAD = max(16, _next_pow2(Qn * g))
    if direct:
        mid_o = mid_m = mid_l = out  # unused
    else:
        rows = B * Qn * Hq
        mid_o = torch.empty((rows * n_splits, D_PAD), dtype=torch.float32, device=q.device)
        mid_m = torch.empty((rows * n_splits,), dtype=torch.float32, device=q.device)
        mid_l = torch.empty((rows * n_splits,), dtype=torch.float32, device=q.device)
    ek = extra_k if has_extra else q
    ev = extra_v if has_extra else q
    e_strides = (ek.stride(0), ek.stride(1), ev.stride(0), ev.stride(1)) if has_extra else (0, 0, 0, 0)
    dot_prec = str(cfg.get("dot_prec") or ("tf32x3" if q.dtype == torch.float32 else "tf32"))
    if dot_prec not in DOT_PRECISIONS:
        raise ValueError(f"dot_prec must be one of {DOT_PRECISIONS}, got {dot_prec!r}")
    with on_device(q):
        K.fwd[(B * Hkv, n_splits)](
            q, k_cache, v_cache, block_ids, local_block, local_len, nfull, ek, ev,
            out, mid_o, mid_m, mid_l, slot_lse if slot_lse is not None else mid_m,
            float(scale) * 1.4426950408889634,
            N, slots_per_split, n_splits,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_ids.stride(0), block_ids.stride(1),
            *e_strides,
            out.stride(0), out.stride(1), out.stride(2),
            HKV=Hkv, HQ=Hq, G=g, QN=Qn, D=D, D_PAD=D_PAD, BS=BS, BS_PAD=_next_pow2(BS),
            SLOTS=slots, M_PAD=M_PAD, HAS_EXTRA=has_extra, DIRECT=direct, DOT_PREC=dot_prec,
            HAS_NFULL=has_nfull, HAS_LSE=slot_lse is not None, SL_PAD=max(16, _next_pow2(slots)),
            num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
        )
        if not direct:
            K.merge[(B * Qn * Hq,)](
                out, mid_o, mid_m, mid_l, n_splits,
                out.stride(0), out.stride(1), out.stride(2),
                QN=Qn, HQ=Hq, D=D, D_PAD=D_PAD, S_PAD=max(2, _next_pow2(n_splits)),
                num_warps=4 if D_PAD >= 128 else 2,
            )
    return out


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    local_block: torch.Tensor,
    local_len: torch.Tensor,
    scale: float,
    extra_k: Optional[torch.Tensor] = None,
    extra_v: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    config: Optional[dict] = None,
    num_full: Optional[torch.Tensor] = None,
    slot_lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Stacked look-ahead decode attention over the per-head sparse working set.

    ``backend``: ``"auto"`` (Triton on CUDA tensors, else the reference), ``"triton"`` or
    ``"ref"``. ``config`` overrides :func:`default_config` keys (slots, n_splits,
    num_warps, num_stages, dot_prec). ``out`` (optional) receives the result in place.
    ``num_full`` (optional ``[B]``): per request, the slots that may hold blocks; the rest of
    its table is padding, never visited (see the module docstring). ``slot_lse`` (optional, a contiguous
    float32 ``[B, Hkv, g, N]``) receives the normal row's per-slot log-sum-exp (the module docstring).
    """
    use_triton = backend == "triton" or (
        backend == "auto" and q.is_cuda and k_cache.is_cuda and _triton_available())
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"unknown backend {backend!r}")
    if not use_triton:
        res = sparse_decode_attention_ref(q, k_cache, v_cache, block_ids, local_block, local_len,
                                          scale, extra_k, extra_v, num_full, slot_lse)
        if out is not None:
            out.copy_(res)
            return out
        return res
    return _sparse_decode_attention_triton(q, k_cache, v_cache, block_ids, local_block,
                                           local_len, scale, extra_k, extra_v, out=out,
                                           config=config, num_full=num_full, slot_lse=slot_lse)
