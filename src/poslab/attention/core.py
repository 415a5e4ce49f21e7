"""One attention call, two paths.

``sdpa`` (default) sends everything through ``torch.nn.functional.scaled_dot_product_attention``:
several dot-product terms are concatenated along the head dim (their dot products add up), additive
biases and masks fold into one float mask. ``eager`` computes each logit term on its own and returns
them with the attention probabilities, which analysis needs. Both compute the same function
(tests/test_models.py::test_eager_and_sdpa_agree, tests/test_pope.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "eager", "triton")


def visible_keys(n: int, m: int, *, causal: bool, key_padding: torch.Tensor | None, device, q_offset: int = 0
                 ) -> torch.Tensor:
    """Bool (batch or 1, 1, n, m): True where query i may attend to key j; the queries sit at
    ``q_offset``..``q_offset + n - 1`` of the m keys (``m - n`` while decoding with a KV cache).

    key_padding (batch, m) is 1 for real tokens. A query may always see its own position, so rows of
    padding queries are never empty (their outputs are ignored, but NaNs would poison gradients).
    """
    q_idx = torch.arange(n, device=device)[:, None] + q_offset
    k_idx = torch.arange(m, device=device)[None, :]
    allowed = torch.ones(1, 1, n, m, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (k_idx <= q_idx)
    if key_padding is not None:
        allowed = allowed & (key_padding.bool()[:, None, None, :] | (k_idx == q_idx))
    return allowed


def mask_bias(n: int, m: int, *, causal: bool, key_padding: torch.Tensor | None, device, q_offset: int = 0
              ) -> torch.Tensor | None:
    """Additive (batch or 1, 1, n, m) mask of 0 / -inf over ``visible_keys``, or None when nothing is masked."""
    if not causal and key_padding is None:
        return None
    allowed = visible_keys(n, m, causal=causal, key_padding=key_padding, device=device, q_offset=q_offset)
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))


def attend(
    qk: dict[str, tuple[torch.Tensor, torch.Tensor]],
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    biases: dict[str, torch.Tensor] | None = None,
    key_padding: torch.Tensor | None = None,
    eager: bool = False,
    values: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]:
    """softmax(scale * sum_t q_t k_t^T + sum_b bias_b + mask) @ v.

    qk:      named (q, k) pairs, q (batch, heads, n, d_t), k (batch, heads, m, d_t); each is one logit term
    v:       (batch, heads, m, d_v)
    biases:  named additive terms (batch or 1, heads, n, m), already in logit units
    values:  extra value tensors (batch, heads, m, d_x) that share the same attention weights
             (DSTG's per-stream values); their outputs come back in the same order after ``v``'s
    Returns (out (batch, heads, n, d_v [+ d_x...]), probs or None, {term: logits} or None); probs and
    terms only on the eager path.
    """
    biases = {name: b for name, b in (biases or {}).items() if b is not None}
    vs = [v, *(values or {}).values()]
    n, m = next(iter(qk.values()))[0].shape[-2], v.shape[-2]
    # Queries are the last n of the m positions (m > n while decoding with a KV cache).
    mask = mask_bias(n, m, causal=causal, key_padding=key_padding, device=v.device, q_offset=m - n)
    if eager:
        terms = {name: scale * (_wide(q) @ _wide(k).transpose(-1, -2)) for name, (q, k) in qk.items()}
        terms.update({name: _wide(b).expand_as(next(iter(terms.values()))) for name, b in biases.items()})
        logits = sum(terms.values())
        if mask is not None:
            logits = logits + mask
        probs = torch.softmax(logits, dim=-1)
        out = torch.cat([(probs.to(x.dtype) @ x) for x in vs], dim=-1)
        return out, probs, terms
    q, k, v_all = (_joined(parts) for parts in ([q for q, _ in qk.values()], [k for _, k in qk.values()], vs))
    additive = None
    for b in biases.values():
        additive = b.to(q.dtype) if additive is None else additive + b.to(q.dtype)
    use_is_causal = causal and additive is None and key_padding is None and n == m
    if mask is not None and not use_is_causal:
        additive = mask.to(q.dtype) if additive is None else additive + mask.to(q.dtype)
    # SDPA's fused kernels need equal q/k and v head dims; otherwise torch falls back to its slow math
    # path. Zero-padding v keeps the fused kernel and costs only the extra PV columns -- unless a bias
    # that needs a gradient sends SDPA to the math path anyway, where padding is pure waste.
    d_v = v_all.shape[-1]
    math_path = additive is not None and additive.requires_grad and torch.is_grad_enabled()
    if d_v < q.shape[-1] and not math_path:
        v_all = F.pad(v_all, (0, q.shape[-1] - d_v))
    if math_path and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64):
        out = _sdpa_math(q, k, v_all, additive, scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v_all, attn_mask=additive, is_causal=use_is_causal, scale=scale)
    return out[..., :d_v], None, None


def _sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive: torch.Tensor, scale: float
               ) -> torch.Tensor:
    """SDPA's math path as torch computes it for fp32/fp64 on the CPU (sqrt(scale) on q and on k), with a
    plain softmax where torch calls ``_safe_softmax``. Its guard against wholly masked rows costs 5-38% of the
    call forward and backward (benchmarks/attention.py; DSTG's and T5's trained biases take this path), and
    ``mask_bias`` never masks a whole row, so the result and every gradient are the same bit for bit
    (tests/test_models.py::test_cpu_math_path_is_sdpa_bit_for_bit). q, k (b, h, n, d), v (b, h, m, d_v),
    additive (b or 1, h, n, m) -> (b, h, n, d_v)."""
    root = math.sqrt(scale)
    return torch.softmax((q * root) @ (k.transpose(-2, -1) * root) + additive, dim=-1) @ v


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts side by side along the last dim; one part as it is (``torch.cat`` would copy it)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: half-precision logits lose the analysis' small terms; fp64 stays fp64 (gradcheck)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
