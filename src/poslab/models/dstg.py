"""DSTG-NeoBERT (Lequeu et al., "Give it Space!"; papers/dstg.md): an encoder whose residual stream is
split into an absolute-position part and a semantic part that read each other only in the FFN (and
meet in attention only through the one softmax over their summed logits).

    x = [AP (d_ap) | sem (d_sem)]          AP: learned table over positions; sem: token embedding
    attention, per head:  logit = q_sem.k_sem / sqrt(d_qk) + q_ap.k_ap / sqrt(d_qk) + rp_bias
                          one softmax P; AP value/output path P @ v_ap -> AP, semantic P @ v_sem -> sem
    FFN (SwiGLU):         reads [AP | sem]; hidden units [AP share | sem share] write to their stream only
    MLM head:             on the semantic part of the final state only

Everything is pre-RMSNorm, bias-free, bidirectional, with a separate norm per stream everywhere (no
statistic crosses streams). The streams travel as a dict {"ap": (b, n, d_ap), "sem": (b, n, d_sem)} so
separation is structural: the FFN's block-diagonal down-projection is two matrices, not a masked one,
and the AP stream simply is not there when ``d_ap`` is 0.

``poslab params [--scale quick|paper] [--match]`` (``register`` below) prints the parameter counts of
DSTG and its three baselines (RoPE-, AP-, RP-NeoBERT: ``arch: encoder``) from the ready configs in
``poslab/configs/models/<scale>/``.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from transformers.modeling_outputs import MaskedLMOutput
from transformers.utils import ModelOutput
from transformers.utils.generic import can_return_tuple

from poslab.attention import attend
from poslab.errors import (ConfigError, InputError, check_attention_mask, check_position_ids, check_token_ids,
                           unknown_key_message)
from poslab.models.dstg_config import DSTGConfig
from poslab.models.hf import (MLMHead, PoslabPreTrainedModel, SpecConfig, collected_outputs, masked_lm_output,
                              output_capture, require_input_ids)
from poslab.positional import AttentionGeometry, LayerPositional, build_positional, owned_once

Streams = dict[str, torch.Tensor]


def _record(capture, name: str, x: Streams) -> None:
    """Record the concatenated residual [AP | sem] under ``name`` and each stream under ``name.<stream>``."""
    if capture is None:
        return
    if capture.wants(name):
        capture.record(name, torch.cat(list(x.values()), dim=-1))
    for stream, value in x.items():
        capture.record(f"{name}.{stream}", value)


class StreamNorm(nn.Module):
    """One RMSNorm per stream: {stream: (b, n, d_s)} -> same shapes."""

    def __init__(self, streams: dict[str, int], eps: float) -> None:
        super().__init__()
        self.norms = nn.ModuleDict({s: nn.RMSNorm(d, eps=eps) for s, d in streams.items()})

    def forward(self, x: Streams) -> Streams:
        return {s: self.norms[s](v) for s, v in x.items()}


class DSTGAttention(nn.Module):
    """Bidirectional attention with one q/k pair per stream, one softmax, and per-stream values.

    Per stream s: qkv[s] maps (b, n, d_s) to q, k (heads x qk_head_dim each, the same width for every
    stream) and v (d_s: d_s / heads per head); out[s] maps the attended v back to d_s. The logit terms
    are named after their stream ("ap", "sem") plus "rp" for the relative bias; ``attend`` concatenates
    the per-stream q and k so SDPA's one dot product is their sum.
    """

    def __init__(self, cfg: DSTGConfig, rp: LayerPositional | None) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.backend = cfg.n_heads, cfg.head_dim, cfg.attn_backend
        self.widths = cfg.streams
        qk = 2 * cfg.n_heads * cfg.head_dim
        self.qkv = nn.ModuleDict({s: nn.Linear(d, qk + d, bias=False) for s, d in self.widths.items()})
        self.out = nn.ModuleDict({s: nn.Linear(d, d, bias=False) for s, d in self.widths.items()})
        # Held by reference: the model owns each relative-bias module once (see PoslabModel).
        self.__dict__["rp"] = rp

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(b, n, heads * d) -> (b, heads, n, d)."""
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, -1).transpose(1, 2)

    def forward(self, x: Streams, positions: torch.Tensor, key_padding: torch.Tensor | None = None,
                capture=None, name: str = "attn") -> Streams:
        """x {stream: (b, n, d_s)} (normed); positions (b or 1, n); key_padding (b, n), 1 = real token."""
        b, n = next(iter(x.values())).shape[:2]
        width = self.n_heads * self.head_dim
        qk, values = {}, {}
        for s, xs in x.items():
            q, k, v = self.qkv[s](xs).split([width, width, self.widths[s]], dim=-1)
            qk[s] = (self._heads(q), self._heads(k))
            values[s] = self._heads(v)
        bias = None if self.rp is None else self.rp.logit_bias(positions, positions)
        inspected = [f"{name}.probs", *(f"{name}.logits.{t}" for t in [*qk, "rp"])]
        eager = self.backend == "eager" or (capture is not None and capture.wants_some(inspected))
        first, *rest = values
        out, probs, terms = attend(qk, values[first], values={s: values[s] for s in rest}, biases={"rp": bias},
                                   scale=1.0 / math.sqrt(self.head_dim), causal=False, key_padding=key_padding,
                                   eager=eager)
        if capture is not None:
            self._record(capture, name, qk, probs, terms)
        # out (b, heads, n, sum_s d_s / heads): per-head value slices in stream order.
        pieces = out.transpose(1, 2).split([d // self.n_heads for d in self.widths.values()], dim=-1)
        return {s: self.out[s](p.reshape(b, n, -1)) for s, p in zip(values, pieces)}

    def _record(self, capture, name: str, qk, probs, terms) -> None:
        for s, (q, k) in qk.items():
            capture.record(f"{name}.q.{s}", q)
            capture.record(f"{name}.k.{s}", k)
        # What the fast path sees: the per-stream q/k concatenated along the head dim.
        if capture.wants_some([f"{name}.q", f"{name}.k"]):
            capture.record(f"{name}.q", torch.cat([q for q, _ in qk.values()], dim=-1))
            capture.record(f"{name}.k", torch.cat([k for _, k in qk.values()], dim=-1))
        capture.record(f"{name}.probs", probs)
        for term, logits in (terms or {}).items():
            capture.record(f"{name}.logits.{term}", logits)


class BlockDiagonalSwiGLU(nn.Module):
    """SwiGLU over [AP | sem] whose down-projection is block-diagonal: the first ``cfg.ffn_ap`` hidden
    units write only to AP, the rest only to sem -- two separate matrices, so weights and gradients
    cannot leak across the blocks. The only place where the streams interact directly."""

    def __init__(self, cfg: DSTGConfig) -> None:
        super().__init__()
        units = {"ap": cfg.ffn_ap, "sem": cfg.ffn_size - cfg.ffn_ap}
        self.split = {s: units[s] for s in cfg.streams}
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_size, bias=False)
        self.down = nn.ModuleDict({s: nn.Linear(self.split[s], d, bias=False) for s, d in cfg.streams.items()})

    def hidden(self, x: Streams) -> torch.Tensor:
        """{stream: (b, n, d_s)} -> SwiGLU activations (b, n, ffn_hidden), AP units first."""
        gate, up = self.gate_up(torch.cat(list(x.values()), dim=-1)).chunk(2, dim=-1)
        return F.silu(gate) * up

    def down_project(self, h: torch.Tensor) -> Streams:
        """(..., ffn_hidden) -> {stream: (..., d_s)}, each stream from its own hidden slice only."""
        return {s: self.down[s](p) for s, p in zip(self.split, h.split(list(self.split.values()), dim=-1))}

    def forward(self, x: Streams) -> Streams:
        return self.down_project(self.hidden(x))


class DSTGBlock(nn.Module):
    """Pre-norm block on both streams: x + attn(norm(x)), then + ffn(norm(x)), norms per stream."""

    def __init__(self, cfg: DSTGConfig, rp: LayerPositional | None) -> None:
        super().__init__()
        self.attn_norm = StreamNorm(cfg.streams, cfg.norm_eps)
        self.attn = DSTGAttention(cfg, rp)
        self.mlp_norm = StreamNorm(cfg.streams, cfg.norm_eps)
        self.mlp = BlockDiagonalSwiGLU(cfg)

    def forward(self, x: Streams, positions: torch.Tensor, key_padding: torch.Tensor | None,
                capture=None, name: str = "blocks.0") -> Streams:
        attn_out = self.attn(self.attn_norm(x), positions, key_padding, capture, f"{name}.attn")
        x = {s: x[s] + attn_out[s] for s in x}
        _record(capture, f"{name}.attn_out", attn_out)
        _record(capture, f"{name}.resid_mid", x)
        mlp_out = self.mlp(self.mlp_norm(x))
        return {s: x[s] + mlp_out[s] for s in x}


# ---------------------------------------------------------------------------------------------------
# Hugging Face packaging


class DSTGNeoBertConfig(SpecConfig):
    """Carries the ``DSTGConfig`` as a dict (``dstg``), validated on construction, like ``PoslabConfig``."""

    model_type = "dstg_neobert"
    dstg: dict | None = None
    SPEC_FIELD = "dstg"
    SPEC_CLASS = DSTGConfig
    FIXED = ("hidden_size", "tie_word_embeddings", "is_decoder")

    def derived(self, spec: DSTGConfig) -> dict:
        return {"hidden_size": spec.d_model, "tie_word_embeddings": False, "is_decoder": False}


class DSTGPreTrainedModel(PoslabPreTrainedModel):
    """Same init as the poslab backbones: normal(init_mean, init_std) for linear maps and tables, ones
    for norms, the relative-bias module's own init (zeros for T5, as in the authors' code)."""

    config_class = DSTGNeoBertConfig
    _no_split_modules = ["DSTGBlock"]


@dataclass
class DSTGModelOutput(ModelOutput):
    """last_hidden_state (b, n, d_ap + d_sem) = [AP | sem] after the final norms; ap_state (b, n, d_ap)
    or None when AP is off; semantic_state (b, n, d_sem); hidden_states and attentions as Hugging Face
    models give them (``output_hidden_states``, ``output_attentions``), states as [AP | sem]."""

    last_hidden_state: torch.Tensor | None = None
    ap_state: torch.Tensor | None = None
    semantic_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class DSTGNeoBertModel(DSTGPreTrainedModel):
    """The trunk: input_ids (b, n) -> DSTGModelOutput."""

    def __init__(self, config: DSTGNeoBertConfig) -> None:
        super().__init__(config)
        spec = self.spec = config.spec  # read every forward; validating the dict each time would be waste
        self.embed = nn.Embedding(spec.vocab_size, spec.d_sem)
        self.ap_embed = nn.Embedding(spec.table_size, spec.d_ap) if spec.d_ap else None
        layer_rp: list[LayerPositional | None] = [None] * spec.n_layers
        if spec.rp is not None:
            geometry = AttentionGeometry(spec.n_layers, spec.n_heads, spec.head_dim, spec.d_model, spec.max_seq_len,
                                         False)
            _, layer_rp = build_positional(spec.rp, geometry)
        self.layer_positional = owned_once(layer_rp)
        self.blocks = nn.ModuleList(DSTGBlock(spec, rp) for rp in layer_rp)
        self.final_norm = StreamNorm(spec.streams, spec.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed = value

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(b or 1, n) long: position_ids if given, else non-pad tokens counted from ``position_start``;
        in training, plus one random offset per sequence in [0, position_offset_max]."""
        spec = self.spec
        n = input_ids.shape[1]
        if position_ids is not None:
            positions = position_ids
            # In training the random offset is added to given positions too: it must stay inside the table.
            limit = spec.table_size - (spec.position_offset_max if self.training else 0)
            if self.ap_embed is not None and positions.numel() and not (
                    0 <= int(positions.min()) and int(positions.max()) < limit):
                offset = f" (in training, a random offset up to {spec.position_offset_max} is added)" \
                    if limit < spec.table_size else ""
                raise InputError(f"position_ids must lie in [0, {limit}) for the AP table of this model{offset}; "
                                 f"got [{int(positions.min())}, {int(positions.max())}]")
        else:
            if self.ap_embed is not None and n > spec.max_seq_len:
                raise InputError(f"a sequence of {n} tokens is longer than this model's max_seq_len "
                                 f"({spec.max_seq_len}), the size of its AP table; split or truncate the input")
            mask = None if attention_mask is None else attention_mask.long()
            if mask is None or bool((mask[:, 1:] <= mask[:, :-1]).all()):
                # No padding, or right padding only: every real token's count is its index, so one row of
                # positions serves the batch and (without a random offset) the relative bias is built once,
                # not per sequence. Pad tokens, never attended to, get the indices past the end.
                positions = torch.arange(n, device=input_ids.device)[None] + spec.position_start
            else:
                positions = (mask.cumsum(1) - 1).clamp(min=0) + spec.position_start
        if self.training and spec.position_offset_max:
            offset = torch.randint(0, spec.position_offset_max + 1, (input_ids.shape[0], 1), device=input_ids.device)
            positions = positions + offset
        return positions

    @can_return_tuple
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, capture=None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, inputs_embeds=None, **_unused) -> DSTGModelOutput:
        """attention_mask (b, n) 1 = real token; position_ids (b, n) override the counted positions. Other
        keywords (``token_type_ids``: no segment embedding here) are ignored."""
        require_input_ids(input_ids, inputs_embeds)
        b = input_ids.shape[0]
        check_token_ids(input_ids, self.embed.num_embeddings)
        check_attention_mask(attention_mask, b, input_ids.shape[1])
        check_position_ids(position_ids, b, input_ids.shape[1])
        capture, own = output_capture(self.config, capture, output_hidden_states, output_attentions)
        positions = self.positions(input_ids, attention_mask, position_ids)
        key_padding = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
        x = {"sem": self.embed(input_ids)}
        if self.ap_embed is not None:
            ap = self.ap_embed(positions).to(x["sem"].dtype)
            x = {"ap": ap.expand(b, -1, -1), **x}
        _record(capture, "embed", x)
        for i, block in enumerate(self.blocks):
            _record(capture, f"blocks.{i}.resid_pre", x)
            x = self.run_block(block, x, positions, key_padding, capture, f"blocks.{i}", recompute=capture is None)
            _record(capture, f"blocks.{i}.resid_post", x)
        x = self.final_norm(x)
        _record(capture, "final", x)
        return DSTGModelOutput(last_hidden_state=torch.cat(list(x.values()), dim=-1), ap_state=x.get("ap"),
                               semantic_state=x["sem"], **collected_outputs(own, len(self.blocks)))

    def semantic_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(b, n, d_sem): the final semantic stream. No position embedding is added to it, but position still
        reaches it, through which tokens attention mixes and through every FFN, whose input is [AP | sem]: the
        same text at other positions gives other semantic states."""
        return self(input_ids, attention_mask, position_ids, return_dict=True).semantic_state


class DSTGNeoBertForMaskedLM(DSTGPreTrainedModel):
    """DSTG trunk + NeoBERT's untied, biased MLM decoder on the semantic part only. Labels hold the
    original ids at masked positions, -100 elsewhere."""

    def __init__(self, config: DSTGNeoBertConfig) -> None:
        super().__init__(config)
        self.model = DSTGNeoBertModel(config)
        self.mlm_head = MLMHead(config.spec.d_sem, config.spec.vocab_size)
        self.post_init()
        self._freeze_unreachable()

    def _freeze_unreachable(self) -> None:
        """The head reads the semantic stream only, so what writes the last AP state -- the last FFN's AP
        down-projection and the final AP norm -- can never get a gradient. Frozen, they keep their init as
        before, but stay out of the optimizer (whose saved state a resume must match) and out of DDP's
        gradient reduction (which would wait for them)."""
        if self.model.spec.d_ap:
            self.model.blocks[-1].mlp.down["ap"].requires_grad_(False)
            self.model.final_norm.norms["ap"].requires_grad_(False)

    def tie_weights(self, *args, **kwargs):
        """Nothing to tie (the MLM decoder is untied); from_pretrained calls this after loading, whose new
        parameters would otherwise make the unreachable ones trainable again."""
        super().tie_weights(*args, **kwargs)
        self._freeze_unreachable()

    def get_output_embeddings(self) -> nn.Module:
        return self.mlm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.mlm_head.decoder = value

    def ap_table(self) -> torch.Tensor | None:
        """The learned AP table (positions, d_ap), row i for position ``position_start + i`` (rows below
        position_start are never read, so analysis should not see them), or None when AP is off."""
        return None if self.model.ap_embed is None else self.model.ap_embed.weight[self.model.spec.position_start:]

    def semantic_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(b, n, d_sem); see ``DSTGNeoBertModel.semantic_states``."""
        return self.model.semantic_states(input_ids, attention_mask, position_ids)

    @can_return_tuple
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                capture=None, num_items_in_batch=None, **kwargs) -> MaskedLMOutput:
        out = self.model(input_ids, attention_mask, position_ids, capture, return_dict=True, **kwargs)
        return masked_lm_output(self.mlm_head, out.semantic_state, labels, self.model.spec.sparse_prediction,
                                num_items_in_batch, hidden_states=out.hidden_states, attentions=out.attentions)


def build_dstg(values: dict[str, Any]) -> DSTGNeoBertForMaskedLM:
    """``build_model``'s entry for ``arch: dstg``."""
    return DSTGNeoBertForMaskedLM(DSTGNeoBertConfig(dstg=DSTGConfig.from_dict(values).to_dict()))


# ---------------------------------------------------------------------------------------------------
# Ready configs: DSTG and its baselines at matched parameter counts

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
READY = ("dstg", "rope_neobert", "ap_neobert", "rp_neobert")
SCALES = ("quick", "paper")


def ready_config(name: str, scale: str = "paper") -> dict[str, Any]:
    """The model section of a ready config: ``configs/models/<scale>/<name>.yaml``."""
    if scale not in SCALES:
        raise ConfigError(unknown_key_message("scale", scale, SCALES))
    if name not in READY:
        raise ConfigError(unknown_key_message("ready model config", name, READY))
    return yaml.safe_load((CONFIG_DIR / scale / f"{name}.yaml").read_text())


def count_parameters(values: dict[str, Any]) -> int:
    """Parameters of the model a config builds, without allocating its weights: all of them, DSTG's frozen last
    AP down-projection and norm (``_freeze_unreachable``) included, as the model holds and saves them."""
    from poslab.models import build_model  # late: poslab.models imports this module

    with torch.device("meta"):
        return build_model(values).num_parameters()


def match_ffn_hidden(values: dict[str, Any], target: int) -> int:
    """The ``ffn_hidden`` that brings a config's parameter count closest to ``target`` (binary search:
    the count grows with the hidden width)."""
    def count(hidden: int) -> int:
        return count_parameters({**values, "ffn_hidden": hidden})

    lo, hi = 32, 64  # the smallest widths give the AP share no hidden unit at paper ratios
    while count(hi) < target:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) < target else (lo, mid)
    return min((lo, hi), key=lambda h: abs(count(h) - target))


def parameter_table(models: dict[str, dict[str, Any]]) -> list[tuple[str, int, float]]:
    """(name, parameters, ratio to RoPE-NeoBERT) for each model section (name -> model config)."""
    counts = {name: count_parameters(values) for name, values in models.items()}
    return [(name, c, c / counts["rope_neobert"]) for name, c in counts.items()]


def register(subparsers) -> None:
    """``poslab params``: the CLI hook (the lead's cli.py lists this module)."""
    parser = subparsers.add_parser("params", help="parameter counts of DSTG-NeoBERT and its baselines: the ready "
                                   "configs and the models the dstg recipe trains from them")
    parser.add_argument("--scale", choices=SCALES, action="append", help="default: every scale")
    parser.add_argument("--match", action="store_true",
                        help="also print the DSTG ffn_hidden that matches RoPE-NeoBERT's count")
    parser.set_defaults(func=print_parameter_counts)


def print_parameter_counts(args: argparse.Namespace) -> int:
    # Late: the recipe (which imports the analysis) changes the ready configs per scale, and a user asking for a
    # scale's counts means those it trains as well as the configs on disk.
    from poslab.experiments.dstg import SCALES as RECIPE_SCALES, model_sections

    for scale in args.scale or SCALES:
        ready = {name: ready_config(name, scale) for name in READY}
        for title, models in ((f"ready configs (configs/models/{scale}/)", ready),
                              (f"as `poslab reproduce dstg --scale {scale}` trains them (at the ready configs' "
                               "vocabulary; a run takes its tokenizer's)", model_sections(RECIPE_SCALES[scale]))):
            print(f"{scale}, {title}:")
            for name, count, ratio in parameter_table(models):
                print(f"  {name:<14}{count:>14,d}  {ratio:7.4f} x rope_neobert")
        if args.match:
            target = count_parameters(ready["rope_neobert"])
            print(f"  ready dstg ffn_hidden matching rope_neobert: {match_ffn_hidden(ready['dstg'], target)}")
    return 0
