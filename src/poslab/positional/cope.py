"""CoPE (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual Position Encoding: Learning to Count What's
Important", arXiv 2405.18719): positions counted from content, not from token indices.

For query i and key j <= i of one head (raw q, k of width d, s = 1/sqrt(d)):

    g_ij = sigmoid(s q_i . k_j)                 a gate per visible key (0 for future and padding keys);
    p_ij = min(sum_{t=j..i} g_it, npos_max - 1)  how many gated keys lie from j up to i: a fractional position;
    bias_ij = (1 - w) q_i . E[:, floor p_ij] + w q_i . E[:, ceil p_ij],  w = p_ij - floor p_ij,

and the logits are s q_i . k_j + bias_ij. E (head_dim, npos_max) is a learned table of position vectors, one per
layer, shared by the layer's heads. A gate near 1 on some tokens only (sentence ends, a marked symbol) makes
p count those tokens, so a head can attend to "the second sentence back" wherever it starts.

The bias is computed as z = q @ E, (batch, heads, n, npos_max), and two ``gather``s of z at floor p and the entry
above it: the E[:, p] vectors of every (query, key) pair are never built. The gradient reaches the gates through
w (the table's slope between the two neighbouring entries), as in the paper's code; floor is piecewise constant,
and past the clamp p gets no gradient.

Following the paper's reference code (its appendix):
- the gates use the scaled logits s q . k, the position term the unscaled q: q . E, not s q . E (a table
  learned for the one is the other's times sqrt(d), so nothing is lost, but E's values are the paper's);
- E starts at zeros, so a new model is NoPE; the model's normal(mean, std) init is ignored for it (as T5's
  table's is), since the gradient to E, sum over keys of the interpolation weights times q, is not zero at zero:
  E moves from its first step. ``init_std > 0`` draws it from normal(0, init_std) instead (tests use it so the
  bias is not zero);
- p is the reverse cumulative sum of the masked gates along the keys, clamped at npos_max - 1.

poslab's choices:
- ``npos_max`` defaults to the model's max_seq_len: a position is a count of at most i - j + 1 <= max_seq_len
  keys, clamped at max_seq_len - 1, so within the training length only the largest count there is (every gate
  open from the first key of a full-length sequence) loses one; the paper's counting tasks use smaller tables
  (64), which ``npos_max`` sets. Longer sequences (generation past max_seq_len) are clamped, not refused.
- Gates, their cumulative sum and the bias are computed in at least fp32 (fp64 stays fp64, for gradcheck): a bf16
  sum of thousands of gates cannot tell n from n + 1 past 256. Attention casts the bias to its logits' dtype,
  as it does ALiBi's and KERPLE's.
- Only causal models (``causal_only``): the count runs from j up to i, which the paper defines for decoders;
  encoders refuse it in one line.
- ``relative = True`` in the registry's sense: CoPE never reads position ids, so shifting them all changes
  nothing (as for NoPE); its positions are relative counts from the query back, computed from content.
- No fused kernel: q k^T is computed a second time for the gates (the SDPA path never shows attention the
  logits), and the gates, positions and interpolation tensors are materialised, in chunks of queries past
  ``CHUNK_ELEMENTS`` (recomputed in backward), so a model keeps one (batch, heads, n, m) bias per layer on top
  of what SDPA's math path keeps for a trained bias. With a KV cache the gates are computed against
  every cached key, which holds raw k (CoPE does not transform q or k). ``--plan``'s FLOP counter sees its two
  matmuls, q k^T (2 n m d per head) and q E (2 n d npos_max per head), forward and backward.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init

from poslab.attention.core import visible_keys
from poslab.errors import require
from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass


# Elements of one (batch, heads, rows, m) tensor past which the bias is computed in chunks of rows: 16 MB in fp32,
# under glibc's largest mmap threshold (32 MB), so chunks reuse heap memory instead of mapping fresh pages, whose
# faults took most of a forward + backward's time at n 2048 (BENCHMARKS.md).
CHUNK_ELEMENTS = 1 << 22


@options_dataclass
class CoPEOptions:
    scheme = "cope"
    #: Entries of the position table E: positions are clamped to at most npos_max - 1. None = the model's
    #: max_seq_len (no count within the training length is clamped); the paper's counting tasks use 64.
    npos_max: int | None = None
    #: 0 = the paper's zero table (the model starts as NoPE); > 0 draws E from normal(0, init_std).
    init_std: float = 0.0

    def __post_init__(self) -> None:
        require(self.npos_max is None or self.npos_max >= 1,
                f"cope.npos_max must be >= 1 (entries of the position table), got {self.npos_max}; omit it for "
                f"the model's max_seq_len")
        require(self.init_std >= 0, f"cope.init_std must be >= 0 (0 = the paper's zero table), got {self.init_std}")


class CoPELayer(LayerPositional):
    """One layer's CoPE. Parameter: ``pos_emb`` E (head_dim, npos_max), shared by the layer's heads."""

    def __init__(self, opts: CoPEOptions, head_dim: int, npos_max: int) -> None:
        super().__init__()
        self.opts, self.npos_max = opts, npos_max
        self.pos_emb = nn.Parameter(torch.empty(head_dim, npos_max))
        self.init_weights(0.0, 0.0)

    def init_weights(self, mean: float, std: float) -> None:
        # Its own init, not the model's normal(mean, std): the paper starts from a zero table (NoPE).
        if self.opts.init_std > 0:
            init.normal_(self.pos_emb, std=self.opts.init_std)
        else:
            init.zeros_(self.pos_emb)

    def positions(self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q (batch, heads, n, d), k (batch, heads, m, d), visible bool (batch or 1, 1, n, m) -> the contextual
        positions p (batch, heads, n, m) in q's dtype (at least fp32 from ``content_bias``), in [0, npos_max - 1].

        p_ij is the sum of the gates of the visible keys from j to the end of the row: the keys up to the query,
        since later ones are not visible. A masked key's own p is finite (attention never uses its logit).
        """
        gates = torch.sigmoid((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~visible, 0.0)
        return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.npos_max - 1)

    def content_bias(self, q: torch.Tensor, k: torch.Tensor, *, causal: bool, key_padding: torch.Tensor | None
                     ) -> torch.Tensor:
        """q (batch, heads, n, d), k (batch, heads, m, d), the queries the last n of the m keys ->
        (batch, heads, n, m), at least fp32.

        A query's row depends on its own gates only, so past CHUNK_ELEMENTS per (batch, heads, n, m) tensor the
        rows are computed in chunks, each recomputed in backward (``torch.utils.checkpoint``): the gates,
        positions and interpolation tensors of one chunk at a time instead of the whole (n, m) of each.
        """
        # Under autocast (bf16 training) the matmuls and the count would be bf16 again, whatever dtype q has.
        if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
            with torch.autocast(q.device.type, enabled=False):
                return self.content_bias(q, k, causal=causal, key_padding=key_padding)
        dtype = torch.promote_types(torch.promote_types(q.dtype, self.pos_emb.dtype), torch.float32)
        q, k, table = q.to(dtype), k.to(dtype), self.pos_emb.to(dtype)
        n, m = q.shape[-2], k.shape[-2]
        visible = visible_keys(n, m, causal=causal, key_padding=key_padding, device=q.device, q_offset=m - n)
        per_row = q.shape[0] * q.shape[1] * m
        if n * per_row <= CHUNK_ELEMENTS:
            return self._bias(q, k, table, visible)
        rows = max(1, CHUNK_ELEMENTS // per_row)
        # Not on the meta device: --plan would count the recomputation as a fourth pass of the two matmuls.
        keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, table)) and not q.is_meta
        chunks = []
        for i in range(0, n, rows):
            args = (q[..., i:i + rows, :], k, table, visible[..., i:i + rows, :])
            chunks.append(checkpoint(self._bias, *args, use_reentrant=False) if keep else self._bias(*args))
        return torch.cat(chunks, dim=-2)

    def _bias(self, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The bias of the rows of q (batch, heads, r, d) against k (batch, heads, m, d): (batch, heads, r, m)."""
        p = self.positions(q, k, visible)
        z = q @ table  # q . E[:, e] for every entry e: (batch, heads, r, npos_max)
        low = p.detach().floor().long()
        # The entry above floor p, not ceil p: at an integral p the slope is the next segment's instead of 0, and
        # lerp saves fewer (batch, heads, n, m) tensors for backward than (1 - w) a + w b.
        high = (low + 1).clamp_(max=self.npos_max - 1)
        return torch.lerp(z.gather(-1, low), z.gather(-1, high), p - low)


class CoPE(Scheme):
    name = "cope"
    relative = True
    causal_only = True
    causal_reason = ("its positions count the gated keys from a key up to its query, an order only a decoder has; "
                     "use rope or t5 for encoders")
    # Its bias counts gated keys: a contextual position, read off content, not a token distance.
    bias_label = "contextual"
    Options = CoPEOptions

    @classmethod
    def build(cls, options: CoPEOptions, geometry: AttentionGeometry):
        npos_max = geometry.max_seq_len if options.npos_max is None else options.npos_max
        # One table per layer, shared by its heads (the paper's code).
        return None, [CoPELayer(options, geometry.head_dim, npos_max) for _ in range(geometry.n_layers)]
