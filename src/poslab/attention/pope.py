"""PoPE attention through SDPA in its real 2d form (papers/pope.md eq. 7-10)."""
from __future__ import annotations

import torch

from poslab.attention.core import attend
from poslab.functional import pope_frequencies, pope_polar


def pope_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor | None, *,
              base: float, causal: bool, scale: float) -> torch.Tensor:
    """q (batch, heads, n, d), k, v (batch, heads, m, d) -> (batch, heads, n, d); keys at 0..m-1, queries at
    m-n..m-1 (the last n, as ``attend``'s causal mask places them)."""
    n, m = q.shape[-2], k.shape[-2]
    theta = pope_frequencies(q.shape[-1], base, q.device)
    q2 = pope_polar(q, torch.arange(m - n, m, device=q.device), theta)
    k2 = pope_polar(k, torch.arange(k.shape[-2], device=k.device), theta, delta)
    out, _, _ = attend({"content": (q2, k2)}, v, scale=scale, causal=causal)
    return out
