"""Hugging Face packaging: a ``PreTrainedConfig`` and ``PreTrainedModel``s that the Auto classes load
after ``import poslab`` (registration happens in ``poslab/models/__init__.py``).

The poslab ``ModelConfig`` is the source of truth; ``PoslabConfig`` carries it as a dict (``poslab``),
validates it on construction and mirrors the few attributes the Hugging Face machinery reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MaskedLMOutput

from poslab.attention.module import cached_key_positions
from poslab.errors import ConfigError, check_token_ids
from poslab.models.blocks import Block, make_norm
from poslab.models.config import ModelConfig
from poslab.positional import AttentionGeometry, InputPositional, LayerPositional, build_positional, owned_once

# Between transformers 5.17 and 5.24 the KV cache of model outputs and of generate()'s model inputs was
# renamed from `past_key_values` to `cache` (the old keyword deprecated, not gone): speak the installed one's.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


class PoslabConfig(PreTrainedConfig):
    model_type = "poslab"
    poslab: dict | None = None

    def __post_init__(self, **kwargs) -> None:
        spec = ModelConfig.from_dict(self.poslab or {})
        self.poslab = spec.to_dict()
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.d_model
        self.num_hidden_layers = spec.n_layers
        self.num_attention_heads = spec.n_heads
        self.max_position_embeddings = spec.max_seq_len
        self.tie_word_embeddings = spec.tie_embeddings
        self.pad_token_id = spec.pad_token_id
        self.is_decoder = spec.causal
        super().__post_init__(**kwargs)

    @property
    def spec(self) -> ModelConfig:
        return ModelConfig.from_dict(self.poslab)


class PoslabPreTrainedModel(PreTrainedModel):
    config_class = PoslabConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        spec = self.config.spec
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=spec.init_mean, std=spec.init_std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, (InputPositional, LayerPositional)):
            module.init_weights(spec.init_mean, spec.init_std)


class PoslabModel(PoslabPreTrainedModel):
    """The trunk: token embedding (+ input positional), blocks, final norm.
    input_ids (batch, n) -> last_hidden_state (batch, n, d_model)."""

    def __init__(self, config: PoslabConfig) -> None:
        super().__init__(config)
        spec = config.spec
        self.embed = nn.Embedding(spec.vocab_size, spec.d_model)
        geometry = AttentionGeometry(spec.n_layers, spec.n_heads, spec.head_dim, spec.d_model, spec.max_seq_len,
                                     spec.causal)
        input_pos, layer_pos = build_positional(spec.positional, geometry)
        self.input_positional = input_pos
        self.layer_positional = owned_once(layer_pos)
        self.blocks = nn.ModuleList(Block(spec, pos, i) for i, pos in enumerate(layer_pos))
        self.final_norm = make_norm(spec.norm, spec.d_model, spec.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, capture=None, cache=None, past_key_values=None,
                **_unused) -> BaseModelOutputWithPast:
        """attention_mask (batch, past + n) 1 = real token; position_ids (batch, n), default past..past+n-1;
        ``cache`` (or ``past_key_values``) a Hugging Face KV ``Cache`` (decoders, incremental decoding)."""
        cache = cache if cache is not None else past_key_values
        check_token_ids(input_ids, self.embed.num_embeddings)
        n = input_ids.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        positions = position_ids if position_ids is not None else torch.arange(past, past + n, device=input_ids.device)[None]
        key_padding = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
        key_positions = cached_key_positions(cache, positions) if cache is not None else None
        x = self.embed(input_ids)
        if self.input_positional is not None:
            x = self.input_positional(x, positions)
        if capture is not None:
            capture.record("embed", x)
        for i, block in enumerate(self.blocks):
            if capture is not None:
                capture.record(f"blocks.{i}.resid_pre", x)
            x = block(x, positions, key_padding, capture, f"blocks.{i}", cache, key_positions)
            if capture is not None:
                capture.record(f"blocks.{i}.resid_post", x)
        x = self.final_norm(x)
        if capture is not None:
            capture.record("final", x)
        return BaseModelOutputWithPast(last_hidden_state=x, **{CACHE_NAME: cache})


class PoslabForCausalLM(PoslabPreTrainedModel, GenerationMixin):
    """GPT-style decoder with an LM head (optionally tied to the embedding). Labels are not shifted:
    logits at position i are scored against labels at i + 1, -100 ignored."""

    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config: PoslabConfig) -> None:
        super().__init__(config)
        if not config.spec.causal:
            raise ConfigError("a causal LM needs arch 'decoder'; encoders load with AutoModelForMaskedLM")
        self.model = PoslabModel(config)
        self.lm_head = nn.Linear(config.spec.d_model, config.spec.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                capture=None, cache=None, past_key_values=None, use_cache: bool | None = None,
                **_unused) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        hidden = self.model(input_ids, attention_mask, position_ids, capture, cache).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: cache})


class MLMHead(nn.Module):
    """NeoBERT's untied decoder: a biased linear map from the final hidden state to the vocabulary."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.decoder = nn.Linear(d_model, vocab_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


def masked_lm_output(head: MLMHead, hidden: torch.Tensor, labels: torch.Tensor | None, sparse: bool) -> MaskedLMOutput:
    """MLM logits and mean cross-entropy over the labelled tokens. hidden (b, n, d); labels (b, n), -100 =
    not scored. Logits are (b, n, vocab), or with ``sparse`` and labels (labelled tokens, vocab) in row-major
    order (ModernBERT's ``sparse_prediction``): the same loss without scoring the ~80% of positions that
    have no label, which dominate a small model's step (BENCHMARKS.md)."""
    if labels is None:
        return MaskedLMOutput(logits=head(hidden))
    if sparse:
        scored = labels != -100
        hidden, labels = hidden[scored], labels[scored]
    logits = head(hidden)
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
    return MaskedLMOutput(loss=loss, logits=logits)


class PoslabForMaskedLM(PoslabPreTrainedModel):
    """NeoBERT-style encoder with an MLM head. Labels hold the original ids at masked positions, -100
    elsewhere."""

    def __init__(self, config: PoslabConfig) -> None:
        super().__init__(config)
        if config.spec.causal:
            raise ConfigError("a masked LM needs arch 'encoder'; decoders load with AutoModelForCausalLM")
        self.model = PoslabModel(config)
        self.mlm_head = MLMHead(config.spec.d_model, config.spec.vocab_size)
        self.sparse_prediction = config.spec.sparse_prediction  # config.spec validates a dict: not per forward
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.mlm_head.decoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                capture=None, **_unused) -> MaskedLMOutput:
        hidden = self.model(input_ids, attention_mask, position_ids, capture).last_hidden_state
        return masked_lm_output(self.mlm_head, hidden, labels, self.sparse_prediction)
