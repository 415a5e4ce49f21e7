"""Hugging Face packaging: ``PreTrainedConfig``s and ``PreTrainedModel``s that the Auto classes load
after ``import poslab`` (registration happens in ``poslab/models/__init__.py``).

The poslab ``ModelConfig`` (DSTG: ``DSTGConfig``) is the source of truth; ``SpecConfig`` carries it as a dict,
validates it and mirrors the few attributes the Hugging Face machinery reads. The models take the keywords
Hugging Face tools pass (hidden states, attentions, tuples, Trainer's token count) and refuse in one line
the inputs they cannot honour.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MaskedLMOutput
from transformers.utils.generic import can_return_tuple

from poslab.attention.module import cached_key_positions
from poslab.errors import ConfigError, InputError, check_attention_mask, check_position_ids, check_token_ids
from poslab.models.blocks import Block, make_norm
from poslab.models.cache import ActivationCache, CaptureGroup
from poslab.models.config import ModelConfig
from poslab.positional import AttentionGeometry, InputPositional, LayerPositional, build_positional, owned_once

if TYPE_CHECKING:
    from poslab.models.dstg_config import DSTGConfig

# Between transformers 5.17 and 5.24 the KV cache of model outputs and of generate()'s model inputs was
# renamed from `past_key_values` to `cache` (the old keyword deprecated, not gone): speak the installed one's.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


class SpecConfig(PreTrainedConfig):
    """A ``PreTrainedConfig`` carrying a poslab config dataclass as a dict (``SPEC_FIELD``), validated on
    construction, and mirroring the attributes the Hugging Face machinery reads (``MIRRORED``: Hugging Face
    name -> spec field; ``FIXED``: derived, refusing another value).

    The dict is the source of truth. At construction a mirrored keyword argument fills only what the dict leaves
    out (``PoslabConfig(hidden_size=64, num_hidden_layers=2)`` builds that model); where the dict sets a value it
    wins: config.json holds both, and a stale or hand-edited top-level copy must not undo it. Set afterwards -- Hugging Face sets
    ``from_pretrained(path, num_hidden_layers=2)``'s overrides on the built config, ``resize_token_embeddings``
    writes ``vocab_size``, or the dict is assigned whole -- a value goes into the dict, which is validated as a
    whole (a ``ConfigError`` if the result is no valid model) before the mirrors are refreshed from it."""

    SPEC_FIELD: ClassVar[str]
    SPEC_CLASS: ClassVar[type]
    MIRRORED: ClassVar[dict[str, str]] = {"vocab_size": "vocab_size", "num_hidden_layers": "n_layers",
                                          "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len",
                                          "pad_token_id": "pad_token_id"}
    FIXED: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self, **kwargs) -> None:
        given = {field: kwargs.pop(name) for name, field in self.MIRRORED.items() if name in kwargs}
        self._store(self.SPEC_CLASS.from_dict({**given, **(getattr(self, self.SPEC_FIELD) or {})}))
        super().__post_init__(**kwargs)

    def derived(self, spec) -> dict:
        """The FIXED attributes' values (and any other attribute set from the spec)."""
        return {}

    def _store(self, spec) -> None:
        object.__setattr__(self, self.SPEC_FIELD, spec.to_dict())
        for name, field_name in self.MIRRORED.items():
            object.__setattr__(self, name, getattr(spec, field_name))
        for name, value in self.derived(spec).items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value) -> None:
        values = self.__dict__.get(self.SPEC_FIELD)
        if values is None:  # still being constructed: __post_init__ sets the spec and its mirrors
            super().__setattr__(name, value)
        elif name == self.SPEC_FIELD:
            self._store(self.SPEC_CLASS.from_dict(value or {}))
        elif name in self.MIRRORED:
            if values.get(self.MIRRORED[name]) != value:
                self.change_spec(**{self.MIRRORED[name]: value})
        elif name in self.FIXED and getattr(self, name) != value:
            raise ConfigError(f"{name} of a {self.model_type} model follows from its '{self.SPEC_FIELD}' settings "
                              f"({getattr(self, name)!r}); change those instead of setting it to {value!r}")
        else:
            super().__setattr__(name, value)

    def checked_spec(self, **changes) -> ModelConfig | DSTGConfig:
        """The spec with ``changes``, validated as a whole (ConfigError if the result is invalid); not stored."""
        return self.SPEC_CLASS.from_dict({**getattr(self, self.SPEC_FIELD), **changes})

    def change_spec(self, **changes) -> None:
        self._store(self.checked_spec(**changes))

    @property
    def spec(self) -> ModelConfig | DSTGConfig:
        return self.SPEC_CLASS.from_dict(getattr(self, self.SPEC_FIELD))


class PoslabConfig(SpecConfig):
    model_type = "poslab"
    poslab: dict | None = None
    SPEC_FIELD = "poslab"
    SPEC_CLASS = ModelConfig
    MIRRORED = {**SpecConfig.MIRRORED, "hidden_size": "d_model", "tie_word_embeddings": "tie_embeddings"}
    FIXED = ("is_decoder",)

    def derived(self, spec: ModelConfig) -> dict:
        return {"is_decoder": spec.causal}


def output_capture(config: PreTrainedConfig, capture, hidden_states: bool | None, attentions: bool | None):
    """Hugging Face's ``output_hidden_states`` / ``output_attentions`` (argument, else the config's) as a
    capture run beside the caller's: -> (the capture to run with, the model's own collection or None).
    Its tensors keep their graph, as Hugging Face's do; asking for attentions runs attention eagerly."""
    hidden_states = config.output_hidden_states if hidden_states is None else hidden_states
    attentions = config.output_attentions if attentions is None else attentions
    names = (["embed", "blocks.*.resid_post", "final"] if hidden_states else []) + \
        (["blocks.*.attn.probs"] if attentions else [])
    if not names:
        return capture, None
    own = ActivationCache(names, detach=False)
    return CaptureGroup(capture, own), own


def collected_outputs(own: ActivationCache | None, n_layers: int) -> dict:
    """The output fields of a model's own collection: hidden_states = (embedding output, each block's output
    but the last, the final normed state), n_layers + 1 of (b, n, d), as Hugging Face models give them;
    attentions = each layer's probabilities (b, heads, n, past + n)."""
    if own is None:
        return {}
    out = {}
    if "final" in own:
        out["hidden_states"] = (own["embed"], *(own[f"blocks.{i}.resid_post"] for i in range(n_layers - 1)),
                                own["final"])
    if "blocks.0.attn.probs" in own:
        out["attentions"] = tuple(own[f"blocks.{i}.attn.probs"] for i in range(n_layers))
    return out


def require_input_ids(input_ids, inputs_embeds) -> None:
    """InputError unless the input is token ids: the models embed them themselves (a scheme may add its
    position table there), so they take no ``inputs_embeds``."""
    if inputs_embeds is not None:
        raise InputError("inputs_embeds is not supported: poslab models embed input_ids themselves (a scheme may "
                         "add its position table there); pass input_ids")
    if input_ids is None:
        raise InputError("input_ids is required: pass the token ids (batch, n)")
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be (batch, n), got shape {tuple(input_ids.shape)}; a single sequence is "
                         "input_ids[None]")


def scored_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy of logits (..., vocab) against labels (...), -100 ignored: the mean over scored labels,
    or with ``num_items_in_batch`` (Hugging Face Trainer's count over all of a step's accumulated batches)
    their sum divided by it, so gradient accumulation weights every token alike."""
    if num_items_in_batch is None:
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
    total = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


class PoslabPreTrainedModel(PreTrainedModel):
    config_class = PoslabConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    # Hugging Face's activation_checkpointing_enable() (or gradient_checkpointing_enable(), Trainer's
    # gradient_checkpointing=True) sets both on every module that has the flag: the trunks read them (run_block).
    supports_gradient_checkpointing = True
    gradient_checkpointing = False

    def run_block(self, block: nn.Module, *args, recompute: bool):
        """block(*args), its activations recomputed in the backward pass instead of kept when checkpointing is
        on and the model trains with gradients. ``recompute`` False runs it as it is: the trunks pass False with
        a KV cache (the recompute would write it again) or a capture (it would record twice)."""
        if recompute and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(block.__call__, *args)
        return block(*args)

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, is_init_check: bool = False,
                                              allow_all_kernels: bool = False) -> str:
        """Attention runs through the spec's ``attn_backend``; Hugging Face's ``attn_implementation`` names it, as
        'eager' (backend eager) or 'sdpa' (auto, sdpa, triton: the fused paths). Asking for the other one at load
        (``from_pretrained(path, attn_implementation="eager")``) sets the backend before the model is built;
        anything else is refused. Nested models share the config and ask again with the answer: a no-op."""
        backend = self.config.spec.attn_backend
        current = "eager" if backend == "eager" else "sdpa"
        if attn_implementation is not None and attn_implementation != current:
            if attn_implementation not in ("eager", "sdpa"):
                raise ConfigError(f"attn_implementation '{attn_implementation}' is not available for poslab models: "
                                  "use 'eager' or 'sdpa', or set the model config's attn_backend (auto, triton, "
                                  "sdpa, eager)")
            if not is_init_check:  # set_attn_implementation on a built model: its blocks keep their backend
                raise ConfigError(f"this model's attention was built for attn_backend '{backend}'; load it with "
                                  f"from_pretrained(path, attn_implementation='{attn_implementation}') instead")
            self.config.change_spec(attn_backend=attn_implementation)
            current = attn_implementation
        return current

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """Hugging Face guesses from the module's source, differently for DSTG (silently ignoring the request);
        every poslab model answers set_attn_implementation through the check above."""
        return True

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """Hugging Face's, with the new vocabulary checked against the config (e.g. its pad_token_id) before a
        weight changes: it writes config.vocab_size last, where a refusal left the model half-resized."""
        size = self.get_input_embeddings().num_embeddings if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
        self.config.checked_spec(vocab_size=size)
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

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

    @can_return_tuple
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, capture=None, cache=None, past_key_values=None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, inputs_embeds=None, **_unused) -> BaseModelOutputWithPast:
        """attention_mask (batch, past + n) 1 = real token; position_ids (batch, n), default past..past+n-1;
        ``cache`` (or ``past_key_values``) a Hugging Face KV ``Cache`` (decoders, incremental decoding; made
        with ``use_cache``). Other keywords (``token_type_ids``: no segment embedding here) are ignored."""
        require_input_ids(input_ids, inputs_embeds)
        cache = cache if cache is not None else past_key_values
        if cache is not None and not hasattr(cache, "get_seq_length"):
            raise InputError(f"past_key_values must be a transformers Cache (DynamicCache, what generate makes), got "
                             f"{type(cache).__name__}; the tuple-of-tensors layout of older transformers is not read")
        if use_cache and cache is None and self.config.is_decoder:
            cache = DynamicCache(config=self.config)
        check_token_ids(input_ids, self.embed.num_embeddings)
        n = input_ids.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        check_attention_mask(attention_mask, input_ids.shape[0], past + n)
        check_position_ids(position_ids, input_ids.shape[0], n)
        capture, own = output_capture(self.config, capture, output_hidden_states, output_attentions)
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
            x = self.run_block(block, x, positions, key_padding, capture, f"blocks.{i}", cache, key_positions,
                               recompute=cache is None and capture is None)
            if capture is not None:
                capture.record(f"blocks.{i}.resid_post", x)
        x = self.final_norm(x)
        if capture is not None:
            capture.record("final", x)
        return BaseModelOutputWithPast(last_hidden_state=x, **{CACHE_NAME: cache},
                                       **collected_outputs(own, len(self.blocks)))


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

    @can_return_tuple
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                capture=None, cache=None, past_key_values=None, use_cache: bool | None = None,
                num_items_in_batch=None, **kwargs) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if cache is not None and not hasattr(cache, "get_seq_length"):
            raise InputError(f"past_key_values must be a transformers Cache (DynamicCache, what generate makes), got "
                             f"{type(cache).__name__}; the tuple-of-tensors layout of older transformers is not read")
        out = self.model(input_ids, attention_mask, position_ids, capture, cache, use_cache=use_cache, return_dict=True,
                         **kwargs)
        logits = self.lm_head(out.last_hidden_state)
        # Shift the labels, not the logits: a slice of the logits would be copied, and its gradient zero-filled
        # and copied back. The loss and the gradients are the same (tests/test_models.py).
        loss = None if labels is None else scored_loss(logits, F.pad(labels[:, 1:], (0, 1), value=-100),
                                                       num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      attentions=out.attentions, **{CACHE_NAME: getattr(out, CACHE_NAME)})


class MLMHead(nn.Module):
    """NeoBERT's untied decoder: a biased linear map from the final hidden state to the vocabulary."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.decoder = nn.Linear(d_model, vocab_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


def masked_lm_output(head: MLMHead, hidden: torch.Tensor, labels: torch.Tensor | None, sparse: bool,
                     num_items_in_batch=None, **outputs) -> MaskedLMOutput:
    """MLM logits and cross-entropy over the labelled tokens (see ``scored_loss``). hidden (b, n, d); labels
    (b, n), -100 = not scored. Logits are (b, n, vocab), or with ``sparse`` and labels (labelled tokens, vocab)
    in row-major order (ModernBERT's ``sparse_prediction``): the same loss without scoring the ~80% of
    positions that have no label, which dominate a small model's step (BENCHMARKS.md). ``outputs``: the
    trunk's hidden_states / attentions."""
    if labels is None:
        return MaskedLMOutput(logits=head(hidden), **outputs)
    if sparse:
        scored = labels != -100
        hidden, labels = hidden[scored], labels[scored]
    logits = head(hidden)
    return MaskedLMOutput(loss=scored_loss(logits, labels, num_items_in_batch), logits=logits, **outputs)


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

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.mlm_head.decoder = value

    @can_return_tuple
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                capture=None, num_items_in_batch=None, **kwargs) -> MaskedLMOutput:
        out = self.model(input_ids, attention_mask, position_ids, capture, return_dict=True, **kwargs)
        return masked_lm_output(self.mlm_head, out.last_hidden_state, labels, self.sparse_prediction,
                                num_items_in_batch, hidden_states=out.hidden_states, attentions=out.attentions)
