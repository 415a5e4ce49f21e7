"""Attention kernels behind one call (``attend``) and the multi-head attention module."""
from poslab.attention.core import BACKENDS, attend
from poslab.attention.module import MultiHeadAttention

__all__ = ["BACKENDS", "attend", "MultiHeadAttention"]
