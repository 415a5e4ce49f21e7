"""Triton kernels. ``pope_flash`` holds the fused PoPE flash attention (forward and backward).

This package imports nothing heavy: ``triton_available()`` says whether the kernels can run here, and
callers import ``poslab.kernels.pope_flash`` only when it is True.
"""
from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["fused_pope_supports", "triton_available"]


def triton_available() -> bool:
    """True when Triton imports and either a CUDA device is present or ``TRITON_INTERPRET=1`` (tests).

    The interpreter runs the same kernels on CPU tensors through NumPy: correct, but orders of magnitude
    slower, which is why only tests set it.
    """
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def fused_pope_supports(q: torch.Tensor, *kv: torch.Tensor, starts: tuple[int, ...] = ()) -> bool:
    """Whether the fused PoPE kernel can run on this q here, and on k and v when given: they must have q's
    dtype and head dim (pope_attention takes a v of another width, which only SDPA serves), and the
    kernel's launch limits must hold for them and for the start positions ``starts``."""
    if not triton_available() or not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    from poslab.kernels.pope_flash import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, launchable

    return (q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in SUPPORTED_DTYPES
            and all(x.dtype == q.dtype and x.shape[-1] == q.shape[-1] for x in kv)
            and launchable(q, *kv, starts=starts))
