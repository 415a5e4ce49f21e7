"""Transformer parts shared by every backbone: norms, feed-forward nets, the pre-norm block."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poslab.attention import MultiHeadAttention


def make_norm(kind: str, d: int, eps: float) -> nn.Module:
    """RMSNorm (NeoBERT) or LayerNorm without bias (nanoGPT with bias=False)."""
    return nn.RMSNorm(d, eps=eps) if kind == "rmsnorm" else nn.LayerNorm(d, eps=eps, bias=False)


class SwiGLU(nn.Module):
    """(batch, n, d) -> (batch, n, d): down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class GeluMLP(nn.Module):
    """(batch, n, d) -> (batch, n, d): down(gelu(up(x)))."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


MLP_CLASSES = {"swiglu": SwiGLU, "gelu": GeluMLP}


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg, positional, layer_idx: int = 0) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, causal=cfg.causal, positional=positional,
                                       backend=cfg.attn_backend, layer_idx=layer_idx)
        self.mlp_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = MLP_CLASSES[cfg.mlp](cfg.d_model, cfg.ffn_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_padding: torch.Tensor | None,
                capture=None, name: str = "blocks.0", kv_cache=None, key_positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        attn_out = self.attn(self.attn_norm(x), positions, key_padding, capture, f"{name}.attn", kv_cache,
                             key_positions)
        x = x + attn_out
        if capture is not None:
            capture.record(f"{name}.attn_out", attn_out)
            capture.record(f"{name}.resid_mid", x)
        return x + self.mlp(self.mlp_norm(x))
