"""Multi-head self-attention that asks its positional scheme what to do, never which scheme it is."""
from __future__ import annotations

import math

import torch
from torch import nn

from poslab.attention.core import attend
from poslab.errors import ConfigError, InputError
from poslab.positional.base import LayerPositional


class MultiHeadAttention(nn.Module):
    """x (batch, n, d_model) -> (batch, n, d_model).

    ``positional`` is this layer's scheme module (or None). It is held by reference, not registered:
    the model owns each scheme module once, so a module shared by all layers is saved once.
    ``backend``: "auto" (a scheme's fused kernel when it has one for these inputs, else SDPA),
    "sdpa", "eager", or "triton" (the fused kernel or an error; decoding with a KV cache and captures of
    probabilities, logits, q or k go through SDPA or eager attention, which the kernel cannot serve).
    """

    def __init__(self, d_model: int, n_heads: int, *, causal: bool, positional: LayerPositional | None,
                 backend: str = "auto", layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.causal, self.backend = n_heads, d_model // n_heads, causal, backend
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.__dict__["positional"] = positional

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_padding: torch.Tensor | None = None,
                capture=None, name: str = "attn", kv_cache=None, key_positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """positions (batch or 1, n) long; key_padding (batch, past + n), 1 = real token.

        ``kv_cache`` is a Hugging Face ``Cache`` for incremental decoding: keys are stored after the
        positional transform, so earlier tokens are never transformed again. With a cache, ``key_positions``
        (batch or 1, past + n) are the positions of the cached and the new keys (``cached_key_positions``).
        """
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scale = 1.0 / math.sqrt(self.head_dim)
        pos = self.positional
        wanted_terms = [f"{name}.logits.content", f"{name}.logits.bias"]
        eager = self.backend == "eager" or (capture is not None and capture.wants_some([f"{name}.probs", *wanted_terms]))
        inspect = eager or (capture is not None and capture.wants_some([f"{name}.q", f"{name}.k"]))
        if pos is not None and capture is not None and capture.wants_some([f"{name}.freq_norms.q", f"{name}.freq_norms.k"]):
            norms = pos.qk_frequency_norms(q, k)
            if norms is not None:
                capture.record(f"{name}.freq_norms.q", norms[0])
                capture.record(f"{name}.freq_norms.k", norms[1])

        # A KV cache holds keys after the positional transform, which a fused kernel never makes, and inspection
        # needs the probabilities or q and k: both go the unfused way, with "triton" forced too.
        if pos is not None and self.backend in ("auto", "triton") and not inspect and kv_cache is None:
            fused = pos.fused_attention(q, k, v, positions, positions, causal=self.causal, scale=scale,
                                        key_padding=key_padding)
            if fused is not None:
                return self.out(fused.transpose(1, 2).reshape(b, n, -1))
            if self.backend == "triton":
                raise ConfigError("attn_backend 'triton' needs a CUDA GPU with Triton, pope with its softplus "
                                  "magnitudes, position_ids shared by the batch that count up by one, and right "
                                  "padding only; use attn_backend 'auto' to fall back to SDPA where these fail (a "
                                  "saved model: set it in its config.json, or load it with "
                                  "attn_implementation='eager')")

        bias, k_positions = None, positions
        if pos is not None:
            q, k = pos.transform_qk(q, k, positions, positions)
        if kv_cache is not None:
            past = kv_cache.get_seq_length(self.layer_idx)
            k, v = kv_cache.update(k, v, self.layer_idx)
            # A preallocated cache (StaticCache) returns every slot, the empty ones too, which the mask would
            # let the queries see: the keys must be exactly the past and the new tokens.
            if k.shape[-2] != past + n:
                raise InputError(f"the KV cache returned {k.shape[-2]} keys for {past} cached and {n} new tokens: "
                                 "poslab models take a cache that grows with the sequence (transformers' "
                                 "DynamicCache, generate's default), not a preallocated one such as StaticCache")
            if key_positions is None or key_positions.shape[-1] != past + n:
                raise ValueError("attention with a KV cache needs the positions of its past + n keys "
                                 "(key_positions, from cached_key_positions)")
            k_positions = key_positions
        if pos is not None:
            # One "bias" term for analysis: the positions' bias plus the bias read off q and k (CoPE's), which
            # sees every key, the cached ones too.
            bias = pos.logit_bias(positions, k_positions)
            content = pos.content_bias(q, k, causal=self.causal, key_padding=key_padding)
            if content is not None:
                bias = content if bias is None else bias + content
        out, probs, terms = attend({"content": (q, k)}, v, scale=scale, causal=self.causal,
                                   biases={"bias": bias}, key_padding=key_padding, eager=eager)
        if capture is not None:
            capture.record(f"{name}.q", q)
            capture.record(f"{name}.k", k)
            capture.record(f"{name}.probs", probs)
            for term, logits in (terms or {}).items():
                capture.record(f"{name}.logits.{term}", logits)
        return self.out(out.transpose(1, 2).reshape(b, n, -1))


def cached_key_positions(cache, positions: torch.Tensor) -> torch.Tensor:
    """(batch or 1, past + n): where every key sits once this step's n new ones (``positions``, (batch or 1, n))
    are in ``cache``; the cache keeps them for the next step.

    Hugging Face caches hold keys and values only, and bias schemes (ALiBi, T5) need the keys' positions: after
    position_ids with a jump (packed documents, an offset) the cached keys do not sit just before the new ones.
    A cache cut back (``crop``) keeps the positions of the keys it kept. One that lacks them, or holds a batch
    they no longer fit (expanded by contrastive search), is taken to hold consecutive positions ending just
    before each row's first new one, which is what ``generate`` makes."""
    past = cache.get_seq_length()
    held = getattr(cache, "poslab_key_positions", None)
    if held is not None and held.shape[-1] >= past and held.device == positions.device \
            and (held.shape[0] == positions.shape[0] or 1 in (held.shape[0], positions.shape[0])):
        held = held[:, :past]
    else:
        held = torch.arange(past, device=positions.device)[None] + (positions[:, :1] - past)
    batch = max(held.shape[0], positions.shape[0])
    keys = torch.cat([held.expand(batch, -1), positions.expand(batch, -1)], dim=1)
    cache.poslab_key_positions = keys
    return keys
