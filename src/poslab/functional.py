"""Pure tensor functions, no state. The names below are a contract: other code and checks
call them, so their meaning does not change without a deprecation.

Shapes: ``(batch, heads, n, d)`` for attention inputs, positions 0-based.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from poslab.analysis.similarity import adjacency_score, cosine_self_similarity
from poslab.errors import InputError

__all__ = [
    "adjacency_score",
    "cosine_self_similarity",
    "pope_frequencies",
    "POPE_MAGNITUDES",
    "pope_polar",
    "pope_scores",
    "pope_attention",
]


def pope_frequencies(d: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """theta_c = base^(-c/d) for c = 0..d-1: d frequencies, one per component (not d/2 pairs). (d,) fp32."""
    return base ** (-torch.arange(d, device=device, dtype=torch.float32) / d)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


#: How PoPE turns a q/k component into its magnitude: softplus (the paper's PoPE), and the paper's 124M
#: ablations ReLU and "no softplus" (identity: the raw component, whose sign then turns the phase by pi).
POPE_MAGNITUDES = {"softplus": F.softplus, "relu": F.relu, "identity": _identity}


def pope_polar(
    x: torch.Tensor, positions: torch.Tensor, theta: torch.Tensor, phase_bias: torch.Tensor | None = None,
    magnitude: str = "softplus",
) -> torch.Tensor:
    """PoPE's Cartesian form: [mu cos(phi), mu sin(phi)] with mu = softplus(x) (or another of
    ``POPE_MAGNITUDES``), phi = pos * theta (+ bias).

    x (batch, heads, n, d); positions (n,) or (batch, n); theta (d,); phase_bias (heads, d) or None.
    Returns (batch, heads, n, 2d) in x's dtype, computed in fp32 (fp64 for fp64 x). theta is taken as given
    (the model's fp32 table: those are the frequencies it uses, for queries and keys alike); pos * theta is
    formed in fp64 and reduced mod 2 pi before that cast, so the phase of a position, and the difference of
    two, is exact to fp32 rounding: as an fp32 product it is 0.03 rad off at position 10^6, and in half
    precision it loses the fractional part before 10^4. The fp64 table is (batch | 1, 1, n, d),
    shared by the heads, so it costs a fraction of x's own work.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    pos = positions.to(torch.float64)
    pos = pos[None, None, :, None] if pos.dim() == 1 else pos[:, None, :, None]
    phase = torch.remainder(pos * theta.to(torch.float64), 2 * math.pi).to(compute)  # (b|1, 1, n, d)
    if phase_bias is not None:
        phase = phase + phase_bias.to(compute)[None, :, None, :]
    mu = POPE_MAGNITUDES[magnitude](x.to(compute))
    return torch.cat([mu * torch.cos(phase), mu * torch.sin(phase)], dim=-1).to(x.dtype)


def pope_scores(
    q: torch.Tensor, k: torch.Tensor, delta: torch.Tensor | None = None, base: float = 10000.0,
    q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None, magnitude: str = "softplus",
) -> torch.Tensor:
    """The explicit formula a_ts = sum_c mu_q,c mu_k,c cos((s - t) theta_c + delta_c), unscaled; mu = softplus
    (or another of ``POPE_MAGNITUDES``).

    q (batch, heads, n, d), k (batch, heads, m, d) -> (batch, heads, n, m). Positions default as
    ``pope_attention`` places them: keys at 0..m-1, queries at m-n..m-1 (the last n). O(n m d) memory: a
    reference for tests, not a fast path.
    """
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    t = torch.arange(m - n, m, device=q.device) if q_positions is None else q_positions
    s = torch.arange(m, device=q.device) if k_positions is None else k_positions
    theta = pope_frequencies(d, base, q.device).double()
    rel = (s.double()[None, :] - t.double()[:, None])[None, :, :, None] * theta  # (1, n, m, d)
    delta = torch.zeros(q.shape[1], d, dtype=torch.float64, device=q.device) if delta is None else delta.double()
    rel = rel + delta[:, None, None, :]  # (heads, n, m, d)
    mu_q, mu_k = POPE_MAGNITUDES[magnitude](q.double()), POPE_MAGNITUDES[magnitude](k.double())
    return torch.einsum("bhnc,bhmc,hnmc->bhnm", mu_q, mu_k, torch.cos(rel)).to(q.dtype)


def _check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor | None) -> None:
    """InputError (one line) unless q (b, h, n, d), k (b, h, m, d), v (b, h, m, dv) and delta (h, d) fit."""
    shapes = f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.dim() == k.dim() == v.dim() == 4:
        raise InputError(f"pope_attention takes 4-D q, k, v (batch, heads, length, head dim); {shapes}")
    b, h, _, d = q.shape
    if k.shape[:2] != (b, h) or k.shape[-1] != d or v.shape[:3] != k.shape[:3]:
        raise InputError(f"pope_attention needs q (b, h, n, d), k (b, h, m, d) and v (b, h, m, dv); {shapes}")
    if delta is not None and tuple(delta.shape) != (h, d):
        raise InputError(f"pope_attention's delta is one phase per head and channel, ({h}, {d}); got "
                         f"{tuple(delta.shape)}")


def pope_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor | None = None, *,
    base: float = 10000.0, causal: bool = False, scale: float | None = None,
) -> torch.Tensor:
    """softmax(scale * a_ts) @ v with the PoPE score a_ts (see ``pope_scores``).

    q (batch, heads, n, d), k, v (batch, heads, m, d), n <= m: keys at positions 0..m-1, queries at m-n..m-1
    (the last n, e.g. new tokens after m-n cached ones); delta (heads, d) or None; scale defaults to 1/sqrt(d)
    (the pre-doubling d, as in the reference implementation). Returns (batch, heads, n, d). Runs the fused
    Triton kernel on CUDA when it is available, otherwise the Cartesian form through SDPA.
    """
    from poslab.attention.pope import pope_sdpa  # late: attention imports this module

    _check_attention_shapes(q, k, v, delta)
    if q.shape[-2] > k.shape[-2]:
        raise InputError(f"pope_attention takes at most as many queries as keys (the queries are the last of "
                         f"them), got {q.shape[-2]} queries and {k.shape[-2]} keys")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    from poslab.kernels import fused_pope_supports

    if q.is_cuda and fused_pope_supports(q, k, v):
        from poslab.kernels.pope_flash import pope_flash_attention

        return pope_flash_attention(q, k, v, delta, base=base, causal=causal, scale=scale,
                                    q_start=k.shape[-2] - q.shape[-2])
    return pope_sdpa(q, k, v, delta, base=base, causal=causal, scale=scale)
