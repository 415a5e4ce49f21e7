"""Fused PoPE flash attention in Triton: forward and backward, polar transform inside the kernel.

PoPE's score a_ts = sum_c mu_q,c mu_k,c cos((s - t) theta_c + delta_c) is the real dot product of the
2d-wide Cartesian vectors q~ = mu_q [cos(t theta), sin(t theta)] and k~ = mu_k [cos(s theta + delta),
sin(s theta + delta)]. The PoPE authors materialised q~, k~ (twice the q/k memory and bandwidth) and ran
a FlashAttention-2 kernel on them. Here every tile of q~/k~ is built in registers and the 2d-wide
tensors never reach memory. The magnitudes mu = softplus(x) come from one d-wide elementwise pass,
since recomputing them in every tile that visits a row costs two special-function-unit operations per
element, the units the softmax's exp2 needs; positions and cos/sin are computed inside the kernels.
The rest is FlashAttention-2: online softmax in base 2 with fp32 accumulation, the backward recomputing
probabilities from the saved log-sum-exp (O(n) extra memory, never O(n^2)).

Phases. t theta_c is huge at long positions (1e6 rad at t = 1e6), where an fp32 product is off by up to
0.03 rad. Phases are carried in turns (theta_c / 2 pi). A tile's phases are (p0 + j) theta_c: the start
p0 theta_c (plus delta_c for keys) is reduced modulo one turn in fp64 on a d-vector per tile; cos/sin of
the row part j theta_c (j < 256, split so that its fp32 product is exact) are the same for every tile,
so each program computes that table once, before its loop; per element the angle-addition formula
combines the two with four FMAs. cos/sin come from a quadrant reduction and short polynomials. The phase
error stays ~1e-7 turns for any position below 2^30.

Padding. ``seq_lens[b]`` is the number of valid keys in batch row b; keys at index >= seq_lens[b] get
no weight. A query whose position q_start + i lies at or past the end of the valid keys
(k_start + seq_lens[b]) is a padding query: its output row is zero and it passes no gradient. So is any
query that sees no key at all (causal with every key in its future). Without ``seq_lens`` every query row
is real.

Backward. Two passes (CUDA_BACKWARD picks per head-dim class): "split" runs a dq kernel over query tiles,
then a dk/dv kernel over key tiles, each rebuilding the probabilities; "atomic" runs the dk/dv kernel
alone, which also adds each key tile's share of dq into an fp32 buffer with atomics (FlashAttention-2's
scheme): fewer matmuls, non-deterministic summation order, so deterministic runs get "split".

Cost. The keys' Cartesian form is rebuilt for every query tile that reads them (and the queries' for
every key tile in the dk/dv pass): O(n^2 d / BLOCK) elementwise work on top of FlashAttention's, the
price of never storing q~/k~. Measured on an H200 with the split backward (BENCHMARKS.md, 2026-11-30):
the forward+backward took 1.0-2.5x the time of RoPE through SDPA (d = 64) and 1.2-3.5x (d = 128) from
n = 1k to 16k, at 0.6x RoPE's peak memory; RoPE's time there includes its fp32 rotation, most of it at short
lengths: per unit of attention work the kernel costs about 3x (d = 64) and 4.4x (d = 128) SDPA's flash
kernel, where the matmul count alone gives 1.57x. The atomic backward is correct there too; at d = 64 its
one kernel took 11-16% less time than the split pass's two.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import triton
import triton.language as tl

from poslab.errors import require
from poslab.functional import pope_frequencies

__all__ = ["pope_flash_attention"]

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _sincos_turns(r):
    """cos(2 pi r), sin(2 pi r) for fp32 r: quadrant reduction, then Cephes' sinf/cosf polynomials on
    [-pi/4, pi/4] (~1e-7 absolute). Plain FMAs: libdevice's sinf/cosf inline a large-argument path per
    element that costs registers, and the special-function units are busy with the softmax's exp2."""
    k = tl.floor(4.0 * r + 0.5)
    x = (r - 0.25 * k) * 6.283185307179586
    z = x * x
    sin_x = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * x + x
    cos_x = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0
    quadrant = k.to(tl.int32) & 3  # 2 pi r = quadrant * pi/2 + x
    swap = (quadrant & 1) == 1
    cos_v = tl.where(swap, sin_x, cos_x)
    sin_v = tl.where(swap, cos_x, sin_x)
    cos_v = tl.where((quadrant == 1) | (quadrant == 2), -cos_v, cos_v)
    sin_v = tl.where(quadrant >= 2, -sin_v, sin_v)
    return cos_v, sin_v


@triton.jit
def _row_phases(j, turns_hi, turns_lo):
    """cos, sin of j theta_c for the rows j < 256 of a tile, fp32, shaped like j broadcast against the
    turns. turns_hi has 16 significant bits, so j * turns_hi is exact in fp32 and turns_lo is tiny: the
    phase error stays ~1e-7 turns. The same for every tile, so kernels compute it once, before their loop."""
    jf = j.to(tl.float32)
    local = jf * turns_hi
    return _sincos_turns((local - tl.floor(local + 0.5)) + jf * turns_lo)


@triton.jit
def _start_phases(p0, turns, bias_turns):
    """cos, sin of p0 theta_c + bias_c, a d-vector, for the tile whose first row sits at position p0.
    The large product (1e6 rad at p0 = 1e6, where an fp32 product is off by 0.03 rad) is reduced modulo
    one turn in fp64, once per tile; positions below 2^30 keep ~1e-7 turns."""
    base = p0.to(tl.float64) * turns
    return _sincos_turns((base - tl.floor(base + 0.5)).to(tl.float32) + bias_turns)


@triton.jit
def _add_angles(c_row, s_row, c_start, s_start):
    """cos, sin of (row + start) phases: the angle-addition formula, four FMAs per element in place of
    a sine and a cosine."""
    return c_row * c_start - s_row * s_start, s_row * c_start + c_row * s_start


@triton.jit
def _key_range(start_m, q_start, k_start, k_len, q_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):
    """For the query tile at start_m: key tiles [0, full) need no mask, [full, hi) do."""
    if CAUSAL:
        t_lo = q_start + start_m  # every row of the tile sees keys at positions <= t_lo
        full = tl.minimum(k_len, t_lo - k_start + 1)
        hi = tl.minimum(k_len, t_lo + BLOCK_M - k_start)
    else:
        full = k_len
        hi = k_len
    hi = tl.where(start_m < q_len, tl.maximum(hi, 0), 0)  # a tile of padding queries reads nothing
    full = tl.minimum(tl.maximum(full, 0) // BLOCK_N * BLOCK_N, hi)
    return full, hi


@triton.jit
def _query_range(start_n, q_start, k_start, k_len, q_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """For the key tile at start_n: query tiles [lo, mid) and [full, hi) need masks, [mid, full) do not."""
    hi = tl.where(start_n < k_len, q_len, 0)
    if CAUSAL:
        lo = tl.maximum(k_start + start_n - q_start, 0) // BLOCK_M * BLOCK_M
        last_key = k_start + start_n + BLOCK_N - 1  # rows at or past this position see the whole tile
        mid = (tl.maximum(last_key - q_start, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = hi * 0
        mid = hi * 0
    mid = tl.where(start_n + BLOCK_N <= k_len, mid, hi)  # a ragged key tile is masked throughout
    lo = tl.minimum(lo, hi)
    mid = tl.minimum(tl.maximum(mid, lo), hi)
    full = tl.maximum(mid, hi // BLOCK_M * BLOCK_M)
    return lo, mid, full, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, qx, qy, MK_base, V_base, svn, c_row, s_row, turns, bias, t_pos, k_start, k_len, lo,
               hi, D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               PRECISION: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        muT_ptrs = MK_base + offs_n[None, :] * D + offs_d[:, None]
        v_ptrs = V_base + offs_n[:, None] * svn + offs_d[None, :]
        if MASKED:
            key_in = offs_n < k_len
            muT = tl.load(muT_ptrs, mask=key_in[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_in[:, None], other=0.0)
        else:
            muT = tl.load(muT_ptrs)
            v = tl.load(v_ptrs)
        c0, s0 = _start_phases(k_start + start_n, turns, bias)
        c, s = _add_angles(c_row, s_row, c0[:, None], s0[:, None])
        mu = muT.to(tl.float32)
        z = tl.dot(qx, (mu * c).to(muT.dtype), input_precision=PRECISION)
        z = tl.dot(qy, (mu * s).to(muT.dtype), z, input_precision=PRECISION)  # (M, N), log2 units
        if MASKED:
            ok = key_in[None, :]
            if CAUSAL:
                ok = ok & ((k_start + offs_n)[None, :] <= t_pos[:, None])
            z = tl.where(ok, z, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(z, 1))
            m_use = m_new
        p = tl.exp2(z - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(MQ, MK, V, O, LSE, TURNS, TURNS32, DELTA, QSTART, KSTART, KLEN, QLEN,
                svb, svh, svn, sob, soh, son, H, NQ, NK, qk_scale,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_DELTA: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile. MQ, MK: softplus(q), softplus(k), contiguous (batch, heads, n, D)."""
    pid_m = tl.program_id(0)
    # int64: batch and head strides times their index pass 2^31 elements on large batches
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    q_start = tl.load(QSTART + b)
    k_start = tl.load(KSTART + b)
    k_len = tl.load(KLEN + b)
    q_len = tl.load(QLEN + b)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_in = offs_m < NQ
    turns = tl.load(TURNS + offs_d)  # theta / 2 pi, fp64
    turns_hi = tl.load(TURNS32 + offs_d)  # the same in fp32, split in two
    turns_lo = tl.load(TURNS32 + D + offs_d)
    if HAS_DELTA:
        bias = tl.load(DELTA + h * D + offs_d)
    else:
        bias = tl.zeros([D], dtype=tl.float32)

    mu = tl.load(MQ + pid_bh * NQ * D + offs_m[:, None] * D + offs_d[None, :], mask=row_in[:, None],
                 other=0.0)
    t_pos = q_start + offs_m
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_M)[:, None], turns_hi[None, :], turns_lo[None, :])
    c0, s0 = _start_phases(start_m + q_start, turns, 0.0)
    c, s = _add_angles(c_row, s_row, c0[None, :], s0[None, :])
    mu_f = mu.to(tl.float32) * qk_scale  # scale * log2(e) folded in: the softmax runs on exp2
    qx = (mu_f * c).to(mu.dtype)
    qy = (mu_f * s).to(mu.dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    MK_base = MK + pid_bh * NK * D
    V_base = V + b * svb + h * svh
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_N)[None, :], turns_hi[:, None], turns_lo[:, None])  # keys, (D, N)
    full, hi = _key_range(start_m, q_start, k_start, k_len, q_len, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, qx, qy, MK_base, V_base, svn, c_row, s_row, turns, bias, t_pos,
                               k_start, k_len, 0, full, D, BLOCK_N, CAUSAL, False, PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, qx, qy, MK_base, V_base, svn, c_row, s_row, turns, bias, t_pos,
                               k_start, k_len, full, hi, D, BLOCK_N, CAUSAL, True, PRECISION)

    # != 0, not > 0: a NaN or inf from q or k must come out as NaN, not as a silently zeroed row
    live = (offs_m < q_len) & (l_i != 0.0)
    l_safe = tl.where(live, l_i, 1.0)
    out = tl.where(live[:, None], acc / l_safe[:, None], 0.0)
    # +inf makes every recomputed probability of a dead row exactly 0 in the backward pass
    lse = tl.where(live, m_i + tl.log2(l_safe), float("inf"))
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_in[:, None])
    tl.store(LSE + pid_bh * NQ + offs_m, lse, mask=row_in)


@triton.jit
def _dq_inner(dqx, dqy, qx, qy, do, lse, dsum, MK_base, V_base, svn, c_row, s_row, turns, bias, t_pos, k_start,
              k_len, lo, hi, D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              PRECISION: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        muT_ptrs = MK_base + offs_n[None, :] * D + offs_d[:, None]
        vT_ptrs = V_base + offs_n[None, :] * svn + offs_d[:, None]
        if MASKED:
            key_in = offs_n < k_len
            muT = tl.load(muT_ptrs, mask=key_in[None, :], other=0.0)
            vT = tl.load(vT_ptrs, mask=key_in[None, :], other=0.0)
        else:
            muT = tl.load(muT_ptrs)
            vT = tl.load(vT_ptrs)
        c0, s0 = _start_phases(k_start + start_n, turns, bias)
        c, s = _add_angles(c_row, s_row, c0[:, None], s0[:, None])
        mu = muT.to(tl.float32)
        kxT = (mu * c).to(muT.dtype)
        kyT = (mu * s).to(muT.dtype)
        z = tl.dot(qx, kxT, input_precision=PRECISION)
        z = tl.dot(qy, kyT, z, input_precision=PRECISION)
        p = tl.exp2(z - lse[:, None])
        if MASKED:
            ok = key_in[None, :]
            if CAUSAL:
                ok = ok & ((k_start + offs_n)[None, :] <= t_pos[:, None])
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = (p * (dp - dsum[:, None])).to(muT.dtype)  # d loss / d logit
        dqx = tl.dot(ds, tl.trans(kxT), dqx, input_precision=PRECISION)
        dqy = tl.dot(ds, tl.trans(kyT), dqy, input_precision=PRECISION)
    return dqx, dqy


@triton.jit
def _bwd_dq_kernel(Q, MQ, MK, V, O, DO, DQ, LSE, DSUM, TURNS, TURNS32, DELTA, QSTART, KSTART, KLEN, QLEN,
                   sqb, sqh, sqn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon,
                   sdqb, sdqh, sdqn, H, NQ, NK, qk_scale, scale,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_DELTA: tl.constexpr, PRECISION: tl.constexpr):
    """dq for one query tile; also stores dsum = rowsum(dO * O), which the dk/dv kernel reads next."""
    pid_m = tl.program_id(0)
    # int64: batch and head strides times their index pass 2^31 elements on large batches
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    q_start = tl.load(QSTART + b)
    k_start = tl.load(KSTART + b)
    k_len = tl.load(KLEN + b)
    q_len = tl.load(QLEN + b)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_in = offs_m < NQ
    turns = tl.load(TURNS + offs_d)  # theta / 2 pi, fp64
    turns_hi = tl.load(TURNS32 + offs_d)  # the same in fp32, split in two
    turns_lo = tl.load(TURNS32 + D + offs_d)
    if HAS_DELTA:
        bias = tl.load(DELTA + h * D + offs_d)
    else:
        bias = tl.zeros([D], dtype=tl.float32)

    mu_ptrs = MQ + pid_bh * NQ * D + offs_m[:, None] * D + offs_d[None, :]
    mu = tl.load(mu_ptrs, mask=row_in[:, None], other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdon + offs_d[None, :], mask=row_in[:, None],
                 other=0.0)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], mask=row_in[:, None], other=0.0)
    dsum = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DSUM + pid_bh * NQ + offs_m, dsum, mask=row_in)
    lse = tl.load(LSE + pid_bh * NQ + offs_m, mask=row_in, other=float("inf"))

    t_pos = q_start + offs_m
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_M)[:, None], turns_hi[None, :], turns_lo[None, :])
    c0, s0 = _start_phases(start_m + q_start, turns, 0.0)
    c, s = _add_angles(c_row, s_row, c0[None, :], s0[None, :])
    mu_f = mu.to(tl.float32) * qk_scale
    qx = (mu_f * c).to(mu.dtype)
    qy = (mu_f * s).to(mu.dtype)
    dqx = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    dqy = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    MK_base = MK + pid_bh * NK * D
    V_base = V + b * svb + h * svh
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_N)[None, :], turns_hi[:, None], turns_lo[:, None])  # keys, (D, N)
    full, hi = _key_range(start_m, q_start, k_start, k_len, q_len, BLOCK_M, BLOCK_N, CAUSAL)
    dqx, dqy = _dq_inner(dqx, dqy, qx, qy, do, lse, dsum, MK_base, V_base, svn, c_row, s_row, turns, bias, t_pos,
                         k_start, k_len, 0, full, D, BLOCK_N, CAUSAL, False, PRECISION)
    dqx, dqy = _dq_inner(dqx, dqy, qx, qy, do, lse, dsum, MK_base, V_base, svn, c_row, s_row, turns, bias, t_pos,
                         k_start, k_len, full, hi, D, BLOCK_N, CAUSAL, True, PRECISION)

    # back through q~ = mu [cos, sin] (the logit is scale * q~ . k~) and mu = softplus(q). Recomputing
    # cos/sin here is cheaper than keeping two fp32 tiles alive through the loop.
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_M)[:, None], turns_hi[None, :], turns_lo[None, :])
    c, s = _add_angles(c_row, s_row, c0[None, :], s0[None, :])
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=row_in[:, None], other=0.0)
    dq = (dqx * c + dqy * s) * scale * tl.sigmoid(q.to(tl.float32))
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqn + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_in[:, None])


@triton.jit
def _dkdv_inner(dv, dkx, dky, kx, ky, v, MQ_base, DO_base, LSE_base, DSUM_base, DQ_base, sdon, c_row, s_row,
                turns, offs_n, q_start, k_start, k_len, q_len, qk_scale, lo, hi,
                D: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr):
    # Padding queries (index >= q_len) are read as zeros in the masked tiles, the only ones that hold them:
    # whatever their rows hold (NaN included) never reaches a real key's gradient.
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        muT_ptrs = MQ_base + offs_m[None, :] * D + offs_d[:, None]
        do_ptrs = DO_base + offs_m[:, None] * sdon + offs_d[None, :]
        if MASKED:
            row_in = offs_m < q_len
            muT = tl.load(muT_ptrs, mask=row_in[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_in[:, None], other=0.0)
            lse = tl.load(LSE_base + offs_m, mask=row_in, other=float("inf"))
            dsum = tl.load(DSUM_base + offs_m, mask=row_in, other=0.0)
        else:
            muT = tl.load(muT_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(LSE_base + offs_m)
            dsum = tl.load(DSUM_base + offs_m)
        c0, s0 = _start_phases(q_start + start_m, turns, 0.0)
        c, s = _add_angles(c_row, s_row, c0[:, None], s0[:, None])
        mu = muT.to(tl.float32) * qk_scale
        qxT = (mu * c).to(muT.dtype)
        qyT = (mu * s).to(muT.dtype)
        zT = tl.dot(kx, qxT, input_precision=PRECISION)
        zT = tl.dot(ky, qyT, zT, input_precision=PRECISION)  # (N, M)
        pT = tl.exp2(zT - lse[None, :])
        if MASKED:
            ok = (offs_n < k_len)[:, None]
            if CAUSAL:
                ok = ok & ((k_start + offs_n)[:, None] <= (q_start + offs_m)[None, :])
            pT = tl.where(ok, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = (pT * (dpT - dsum[None, :])).to(muT.dtype)
        dkx = tl.dot(dsT, tl.trans(qxT), dkx, input_precision=PRECISION)
        dky = tl.dot(dsT, tl.trans(qyT), dky, input_precision=PRECISION)
        if ATOMIC_DQ:
            # this key tile's share of d q~ = ds k~, rotated back to the queries' magnitudes (only they
            # carry a gradient: q's phases are positions) while cos/sin are at hand: d wide, not 2d
            dqxT = tl.dot(tl.trans(kx), dsT, input_precision=PRECISION)  # (D, M)
            dqyT = tl.dot(tl.trans(ky), dsT, input_precision=PRECISION)
            dq_ptrs = DQ_base + offs_m[None, :] * D + offs_d[:, None]
            if MASKED:
                tl.atomic_add(dq_ptrs, dqxT * c + dqyT * s, mask=row_in[None, :], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dqxT * c + dqyT * s, sem="relaxed")
    return dv, dkx, dky


@triton.jit
def _bwd_dkdv_kernel(K, MQ, MK, V, DO, DK, DV, DQACC, DDELTA, LSE, DSUM, TURNS, TURNS32, DELTA, QSTART, KSTART, KLEN,
                     QLEN, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                     sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, H, NQ, NK, qk_scale,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     HAS_DELTA: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr):
    """dk, dv for one key tile, and this tile's share of d(delta) (summed on the host: deterministic).
    With ATOMIC_DQ also this tile's share of dq / (scale * sigmoid(q)), added atomically in fp32 into DQACC,
    contiguous (batch, heads, n, D): the "atomic" backward, which needs no dq kernel."""
    pid_n = tl.program_id(0)
    # int64: batch and head strides times their index pass 2^31 elements on large batches
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    q_start = tl.load(QSTART + b)
    k_start = tl.load(KSTART + b)
    k_len = tl.load(KLEN + b)
    q_len = tl.load(QLEN + b)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    key_in = offs_n < NK
    # Keys past the valid ones are read as zeros: whatever padding holds (NaN included) gets zero dk and dv
    # and adds nothing to d(delta), a parameter every row shares, nor to the atomic dq of real queries.
    key_real = offs_n < k_len
    turns = tl.load(TURNS + offs_d)  # theta / 2 pi, fp64
    turns_hi = tl.load(TURNS32 + offs_d)  # the same in fp32, split in two
    turns_lo = tl.load(TURNS32 + D + offs_d)
    if HAS_DELTA:
        bias = tl.load(DELTA + h * D + offs_d)
    else:
        bias = tl.zeros([D], dtype=tl.float32)

    mu_ptrs = MK + pid_bh * NK * D + offs_n[:, None] * D + offs_d[None, :]
    mu = tl.load(mu_ptrs, mask=key_real[:, None], other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], mask=key_real[:, None], other=0.0)
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_N)[:, None], turns_hi[None, :], turns_lo[None, :])
    c0, s0 = _start_phases(k_start + start_n, turns, bias)
    c, s = _add_angles(c_row, s_row, c0[None, :], s0[None, :])
    mu_f = mu.to(tl.float32)
    kx = (mu_f * c).to(mu.dtype)
    ky = (mu_f * s).to(mu.dtype)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dkx = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dky = tl.zeros([BLOCK_N, D], dtype=tl.float32)

    MQ_base = MQ + pid_bh * NQ * D
    DO_base = DO + b * sdob + h * sdoh
    LSE_base = LSE + pid_bh * NQ
    DSUM_base = DSUM + pid_bh * NQ
    DQ_base = DQACC + pid_bh * NQ * D
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_M)[None, :], turns_hi[:, None], turns_lo[:, None])  # queries, (D, M)
    lo, mid, full, hi = _query_range(start_n, q_start, k_start, k_len, q_len, BLOCK_M, BLOCK_N, CAUSAL)
    dv, dkx, dky = _dkdv_inner(dv, dkx, dky, kx, ky, v, MQ_base, DO_base, LSE_base, DSUM_base, DQ_base, sdon, c_row,
                               s_row, turns, offs_n, q_start, k_start, k_len, q_len, qk_scale, lo, mid,
                               D, BLOCK_M, CAUSAL, True, ATOMIC_DQ, PRECISION)
    dv, dkx, dky = _dkdv_inner(dv, dkx, dky, kx, ky, v, MQ_base, DO_base, LSE_base, DSUM_base, DQ_base, sdon, c_row,
                               s_row, turns, offs_n, q_start, k_start, k_len, q_len, qk_scale, mid, full,
                               D, BLOCK_M, CAUSAL, False, ATOMIC_DQ, PRECISION)
    dv, dkx, dky = _dkdv_inner(dv, dkx, dky, kx, ky, v, MQ_base, DO_base, LSE_base, DSUM_base, DQ_base, sdon, c_row,
                               s_row, turns, offs_n, q_start, k_start, k_len, q_len, qk_scale, full, hi,
                               D, BLOCK_M, CAUSAL, True, ATOMIC_DQ, PRECISION)

    # q~ carried scale * log2(e); d k~ needs scale alone. The keys' cos/sin and magnitudes are recomputed
    # and reloaded rather than kept alive through the loop (registers).
    c_row, s_row = _row_phases(tl.arange(0, BLOCK_N)[:, None], turns_hi[None, :], turns_lo[None, :])
    c, s = _add_angles(c_row, s_row, c0[None, :], s0[None, :])
    dkx = dkx * 0.6931471805599453
    dky = dky * 0.6931471805599453
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :], mask=key_real[:, None], other=0.0)
    dk = (dkx * c + dky * s) * tl.sigmoid(k.to(tl.float32))
    tl.store(DK + b * sdkb + h * sdkh + offs_n[:, None] * sdkn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=key_in[:, None])
    tl.store(DV + b * sdvb + h * sdvh + offs_n[:, None] * sdvn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=key_in[:, None])
    if HAS_DELTA:
        mu = tl.load(mu_ptrs, mask=key_real[:, None], other=0.0).to(tl.float32)
        dphase = mu * (dky * c - dkx * s)  # zero on keys outside the tile: their dkx, dky are zero
        tl.store(DDELTA + (pid_bh * tl.num_programs(0) + pid_n) * D + offs_d, tl.sum(dphase, 0))


@triton.jit
def _row_block(X, sxb, sxh, sxn, H, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pointers (BLOCK_M, D) to the query rows of program (row block, batch * heads) in a (batch, heads, n,
    D) tensor of the given strides, and their row indices (BLOCK_M,)."""
    pid_bh = tl.program_id(1).to(tl.int64)  # as in the attention kernels
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ptrs = X + (pid_bh // H) * sxb + (pid_bh % H) * sxh + offs_m[:, None] * sxn + tl.arange(0, D)[None, :]
    return ptrs, offs_m


@triton.jit
def _bwd_rowsum_kernel(O, DO, DSUM, sob, soh, son, sdob, sdoh, sdon, H, NQ, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """rowsum(dO * O) in fp32 into DSUM (batch * heads, n): what the atomic backward needs of a dq pass,
    without the fp32 copies of both tensors that torch would make."""
    o_ptrs, offs_m = _row_block(O, sob, soh, son, H, D, BLOCK_M)
    do_ptrs, _ = _row_block(DO, sdob, sdoh, sdon, H, D, BLOCK_M)
    row_in = offs_m[:, None] < NQ
    o = tl.load(o_ptrs, mask=row_in, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=row_in, other=0.0).to(tl.float32)
    tl.store(DSUM + tl.program_id(1).to(tl.int64) * NQ + offs_m, tl.sum(o * do, 1), mask=offs_m < NQ)


@triton.jit
def _dq_finish_kernel(DQACC, Q, DQ, sab, sah, san, sqb, sqh, sqn, sdqb, sdqh, sdqn, H, NQ, scale,
                      D: tl.constexpr, BLOCK_M: tl.constexpr):
    """dq = DQACC * scale * sigmoid(q) in q's dtype, DQACC being the atomic backward's fp32 sum over key
    tiles: softplus' derivative applied once per element, in one pass."""
    acc_ptrs, offs_m = _row_block(DQACC, sab, sah, san, H, D, BLOCK_M)
    q_ptrs, _ = _row_block(Q, sqb, sqh, sqn, H, D, BLOCK_M)
    dq_ptrs, _ = _row_block(DQ, sdqb, sdqh, sdqn, H, D, BLOCK_M)
    row_in = offs_m[:, None] < NQ
    dq = tl.load(acc_ptrs, mask=row_in) * tl.sigmoid(tl.load(q_ptrs, mask=row_in).to(tl.float32)) * scale
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_in)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head-dim class ("wide": d > 64) on CUDA: the
# fastest of benchmarks/pope_kernel_configs.py's candidates on an H200 (bf16, causal, n 4096; Triton 3.6,
# 2026-11-30), each checked there against PoPE through SDPA (BENCHMARKS.md).
CUDA_LAUNCH = {
    ("fwd", False): (128, 64, 8, 3), ("fwd", True): (64, 32, 4, 3),
    ("dq", False): (128, 64, 8, 2), ("dq", True): (64, 16, 4, 3),
    ("dkdv", False): (32, 128, 8, 3), ("dkdv", True): (16, 64, 4, 2),
    ("dkdq", False): (64, 128, 8, 2), ("dkdq", True): (16, 32, 4, 2),
}
# The backward pass per head-dim class. "split" (a dq kernel, then a dk/dv kernel) rebuilds the
# probabilities twice: 11 d-wide matmuls per tile pair against FlashAttention-2's 5 for RoPE, so forward
# and backward do (3 + 11) / (2 + 5) = 2x RoPE's matmul work. "atomic" (one dk/dv kernel adding dq into
# fp32 with atomics, as FlashAttention-2 does) needs 8, 1.57x RoPE's work, at the price of an fp32 dq
# buffer, atomic traffic and a non-deterministic summation order. On the H200 (BENCHMARKS.md) the atomic
# kernel beat the split pair at d 64 and lost at d 128 (19.0 vs 14.6 ms fwd+bwd at n 4096), but at d 64
# its fp32 host-side passes then cost ~0.8 ms and 1.8x the memory, which left it 1-6% ahead at n >= 4k
# and behind below. Those passes are Triton kernels now, not yet timed: split stays until they are.
CUDA_BACKWARD = {False: "split", True: "split"}


def _launch_config(kernel: str, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a kernel and head dim. The interpreter gets 16x16
    tiles so that small test shapes still cross several tiles and ragged tails."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 16, 16, 4, 1
    return CUDA_LAUNCH[kernel, d > 64]


def _rows_per_program() -> int:
    """Query rows per program of the elementwise backward kernels (rowsum, dq finish): memory-bound, any
    size that fills a few warps will do; the interpreter's 16 keeps small tests crossing ragged tails."""
    return 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64


def _backward_mode(d: int) -> str:
    """"split" or "atomic" (see CUDA_BACKWARD); split whenever PyTorch is asked for deterministic
    algorithms, since atomics add dq's shares in a varying order."""
    if torch.are_deterministic_algorithms_enabled():
        return "split"
    return CUDA_BACKWARD[d > 64]


@functools.lru_cache(maxsize=64)
def _turns(d: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """theta_c / (2 pi) as fp64 (d,) and as fp32 (2, d) = [hi, lo] with hi holding 16 significant bits,
    so that j * hi is exact in fp32 for any tile row j < 256. theta_c is poslab.functional's fp32 value."""
    # Cached across calls and saved for backward: a first call under torch.inference_mode() would cache
    # inference tensors, which every later call with autograd refuses to save.
    with torch.inference_mode(False):
        turns = pope_frequencies(d, base, device).double() / (2 * math.pi)
        mantissa, exponent = torch.frexp(turns.float())
        hi = torch.ldexp(torch.trunc(mantissa * 2**16) / 2**16, exponent)
        return turns, torch.stack([hi, (turns - hi.double()).float()])


def _magnitudes(x: torch.Tensor) -> torch.Tensor:
    """softplus(x) as a contiguous (batch, heads, n, d) tensor in x's dtype: the kernels read magnitudes,
    d wide like x, instead of recomputing a softplus (two special-function-unit ops) per element of every
    tile they visit. Transient: the backward pass recomputes it from the saved x."""
    # CUDA autocast computes softplus in fp32; the backward, outside autocast, would recompute bf16 magnitudes
    # and rebuild other probabilities than the forward normalised.
    return torch.nn.functional.softplus(x).to(x.dtype).contiguous()


class _PopeFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, delta, turns, turns32, q_start, k_start, k_len, q_len, causal, scale):
        b, h, nq, d = q.shape
        nk = k.shape[2]
        o = torch.empty_like(q)
        lse = torch.empty((b, h, nq), device=q.device, dtype=torch.float32)
        has_delta = delta is not None
        # the kernels add the bias in turns; d(delta) comes back per radian
        bias = delta / (2 * math.pi) if has_delta else turns32  # never read without delta
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        bm, bn, warps, stages = _launch_config("fwd", d)
        _fwd_kernel[(triton.cdiv(nq, bm), b * h)](
            _magnitudes(q), _magnitudes(k), v, o, lse, turns, turns32, bias, q_start, k_start, k_len, q_len,
            *v.stride()[:3], *o.stride()[:3], h, nq, nk, scale * LOG2E,
            D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_DELTA=has_delta, PRECISION=precision,
            num_warps=warps, num_stages=stages,
        )
        ctx.save_for_backward(q, k, v, o, lse, bias, turns, turns32, q_start, k_start, k_len, q_len)
        ctx.causal, ctx.scale, ctx.has_delta, ctx.precision = causal, scale, has_delta, precision
        return o

    @staticmethod
    # The kernels' outputs carry no graph: a second derivative would silently see only the host-side ops
    # around them, so it raises instead.
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, bias, turns, turns32, q_start, k_start, k_len, q_len = ctx.saved_tensors
        b, h, nq, d = q.shape
        nk = k.shape[2]
        do = do if do.stride(-1) == 1 else do.contiguous()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        mq, mk = _magnitudes(q), _magnitudes(k)
        flags = dict(D=d, CAUSAL=ctx.causal, HAS_DELTA=ctx.has_delta, PRECISION=ctx.precision)
        atomic = _backward_mode(d) == "atomic"

        if atomic:  # dq comes out of the dk/dv kernel; rowsum(dO * O) is all the dq kernel would add
            dsum = torch.empty_like(lse)
            rows = _rows_per_program()
            _bwd_rowsum_kernel[(triton.cdiv(nq, rows), b * h)](
                o, do, dsum, *o.stride()[:3], *do.stride()[:3], h, nq, D=d, BLOCK_M=rows)
            dq = torch.zeros((b, h, nq, d), device=q.device, dtype=torch.float32)
        else:
            dsum = torch.empty_like(lse)
            dq = torch.empty_like(q)
            bm, bn, warps, stages = _launch_config("dq", d)
            _bwd_dq_kernel[(triton.cdiv(nq, bm), b * h)](
                q, mq, mk, v, o, do, dq, lse, dsum, turns, turns32, bias, q_start, k_start, k_len, q_len,
                *q.stride()[:3], *v.stride()[:3], *o.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
                h, nq, nk, ctx.scale * LOG2E, ctx.scale,
                BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags,
            )
        bm, bn, warps, stages = _launch_config("dkdq" if atomic else "dkdv", d)
        n_tiles = triton.cdiv(nk, bn)  # the kernel reads dq (as DQACC) only when atomic
        ddelta = torch.zeros((b * h, n_tiles, d), device=q.device, dtype=torch.float32) if ctx.has_delta else lse
        _bwd_dkdv_kernel[(n_tiles, b * h)](
            k, mq, mk, v, do, dk, dv, dq, ddelta, lse, dsum, turns, turns32, bias, q_start, k_start, k_len, q_len,
            *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            h, nq, nk, ctx.scale * LOG2E,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, ATOMIC_DQ=atomic, **flags,
        )
        if atomic:
            dq_acc, dq = dq, torch.empty_like(q)
            _dq_finish_kernel[(triton.cdiv(nq, rows), b * h)](
                dq_acc, q, dq, *dq_acc.stride()[:3], *q.stride()[:3], *dq.stride()[:3], h, nq, ctx.scale,
                D=d, BLOCK_M=rows)
        ddelta = ddelta.view(b, h, n_tiles, d).sum((0, 2)) if ctx.has_delta else None
        return dq, dk, dv, ddelta, None, None, None, None, None, None, None, None


# The kernels index batch and head in int64 but rows within one (batch, head) slice in int32, and CUDA allows
# 65,535 programs on the grid axis that holds batch x heads. Start positions stay below 2^29 in magnitude so
# that the kernels' int32 differences of two starts plus a length cannot overflow.
ROW_SPAN_LIMIT = 2**31
GRID_Y_LIMIT = 65535
POSITION_LIMIT = 2**29


def _span(x: torch.Tensor) -> int:
    """Elements one (batch, head) slice of x (batch, heads, n, d) spans, by its strides."""
    return (x.shape[2] - 1) * x.stride(2) + x.shape[3]


def launchable(q: torch.Tensor, *kv: torch.Tensor, starts: tuple[int, ...] = ()) -> bool:
    """Whether the kernels' launch limits hold (grid, 32-bit row offsets, start positions): what
    ``pope_flash_attention`` refuses otherwise, for callers that fall back to SDPA instead."""
    return (q.shape[0] * q.shape[1] <= GRID_Y_LIMIT and all(_span(x) < ROW_SPAN_LIMIT for x in (q, *kv))
            and all(abs(start) < POSITION_LIMIT for start in starts))


def _per_batch(value, b: int, name: str, device) -> torch.Tensor:
    """An int or a (batch,) integer tensor -> (batch,) int32 on device (a tensor costs one host sync to check)."""
    if isinstance(value, torch.Tensor):
        require(value.shape == (b,) and value.dtype != torch.bool and not value.is_floating_point()
                and not value.is_complex(),
                f"{name} must be an int or an integer tensor of shape ({b},), got {value.dtype} {tuple(value.shape)}")
        require(bool((value.abs() < POSITION_LIMIT).all()), f"{name} must stay below 2^29 in magnitude")
        return value.to(device=device, dtype=torch.int32)
    require(abs(int(value)) < POSITION_LIMIT, f"{name} must stay below 2^29 in magnitude, got {value}")
    return torch.full((b,), int(value), device=device, dtype=torch.int32)


def pope_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor | None = None, *,
    base: float = 10000.0, causal: bool = False, scale: float | None = None,
    q_start: int | torch.Tensor = 0, k_start: int | torch.Tensor = 0, seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * a_ts) @ v with the PoPE score, fused; differentiable in q, k, v and delta.

    q (batch, heads, n, d); k, v (batch, heads, m, d); delta (heads, d) or None (phase bias on the keys);
    d in {16, 32, 64, 128}; fp32, bf16 or fp16 (all three alike), CUDA tensors (CPU tensors only under
    TRITON_INTERPRET=1). Query i sits at position q_start + i and key j at k_start + j (ints or (batch,)
    integer tensors, for incremental decoding); causal masks keys at later positions than the query.
    seq_lens (batch,) counts the valid keys per row (see the module docstring for padding queries).
    scale defaults to 1/sqrt(d). Returns (batch, heads, n, d) in q's dtype.
    """
    require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
            f"q, k, v must be (batch, heads, n, d), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, nq, d = q.shape
    require(k.shape == v.shape and k.shape[:2] == (b, h) and k.shape[3] == d,
            f"k and v must be (batch={b}, heads={h}, m, d={d}), got {tuple(k.shape)} and {tuple(v.shape)}")
    require(d in SUPPORTED_HEAD_DIMS, f"head dim {d} is not supported by the fused kernel; use one of "
            f"{SUPPORTED_HEAD_DIMS} or attn_backend 'sdpa'")
    require(q.dtype in SUPPORTED_DTYPES and q.dtype == k.dtype == v.dtype,
            f"q, k, v must share one dtype of float32/bfloat16/float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    require(q.device == k.device == v.device, "q, k, v must be on one device")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    require(q.is_cuda or interpret, "the fused PoPE kernel needs CUDA tensors (TRITON_INTERPRET=1 runs it on "
            "CPU, slowly); use attn_backend 'sdpa' on this device")
    if delta is not None:
        require(delta.shape == (h, d), f"delta must be (heads={h}, d={d}), got {tuple(delta.shape)}")
    require(math.isfinite(base) and base > 1, f"base must be a finite number > 1, got {base}")
    require(b * h <= GRID_Y_LIMIT, f"batch x heads = {b * h} passes the {GRID_Y_LIMIT} programs CUDA allows on "
            "a grid axis; split the batch")
    span = max(_span(x) for x in (q, k, v))
    require(span < ROW_SPAN_LIMIT, f"one (batch, head) slice of q, k or v spans {span} elements, past the fused "
            "kernel's 32-bit row offsets; make q, k, v contiguous as (batch, heads, n, d), shorten the sequence "
            "or use attn_backend 'sdpa'")
    q_start_t = _per_batch(q_start, b, "q_start", q.device)
    k_start_t = _per_batch(k_start, b, "k_start", q.device)
    if seq_lens is not None:
        seq_lens = _per_batch(seq_lens, b, "seq_lens", q.device)
        require(bool(((seq_lens >= 0) & (seq_lens <= k.shape[2])).all()),
                f"seq_lens must lie in [0, {k.shape[2]}] (the key length)")
    return launch_checked(q, k, v, delta, base=base, causal=causal, scale=scale, q_start=q_start_t,
                          k_start=k_start_t, seq_lens=seq_lens)


def launch_checked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor | None, *, base: float, causal: bool,
    scale: float | None, q_start: torch.Tensor, k_start: torch.Tensor, seq_lens: torch.Tensor | None,
) -> torch.Tensor:
    """``pope_flash_attention`` past its checks, for a caller that made them: q_start, k_start and seq_lens
    are (batch,) int32 tensors on q's device. Checking a tensor's values costs a host sync, which a model
    pays once per forward (PolarLayer), not once per layer."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    if seq_lens is None:
        k_len = torch.full((b,), nk, device=q.device, dtype=torch.int32)
        q_len = torch.full((b,), nq, device=q.device, dtype=torch.int32)
    else:
        k_len = seq_lens
        # a query at or past the end of the valid keys is padding
        q_len = (k_start + k_len - q_start).clamp(0, nq).to(torch.int32)
    turns, turns32 = _turns(d, float(base), q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    delta_f = None if delta is None else delta.float().contiguous()
    # Triton launches on the current CUDA device, not the inputs' (inputs on cuda:1 while cuda:0 is current
    # fail); autograd runs the backward on the inputs' device by itself.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return _PopeFlash.apply(q, k, v, delta_f, turns, turns32, q_start, k_start, k_len, q_len, bool(causal),
                                scale)
