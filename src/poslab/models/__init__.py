"""Backbones: a GPT-style decoder and a NeoBERT-style encoder, each taking any positional scheme,
packaged as Hugging Face models; DSTG-NeoBERT lives in ``dstg.py``.

``build_model(config)`` picks the class from ``config['arch']`` via ``ARCHS`` -- one line per family.
"""
from __future__ import annotations

import importlib
from typing import Any

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

from poslab.errors import ConfigError, unknown_key_message
from poslab.models.cache import ActivationCache
from poslab.models.config import ModelConfig
from poslab.models.dstg import DSTGNeoBertConfig, DSTGNeoBertForMaskedLM, DSTGNeoBertModel
from poslab.models.hf import PoslabConfig, PoslabForCausalLM, PoslabForMaskedLM, PoslabModel

AutoConfig.register("poslab", PoslabConfig, exist_ok=True)
AutoModel.register(PoslabConfig, PoslabModel, exist_ok=True)
AutoModelForCausalLM.register(PoslabConfig, PoslabForCausalLM, exist_ok=True)
AutoModelForMaskedLM.register(PoslabConfig, PoslabForMaskedLM, exist_ok=True)
AutoConfig.register("dstg_neobert", DSTGNeoBertConfig, exist_ok=True)
AutoModel.register(DSTGNeoBertConfig, DSTGNeoBertModel, exist_ok=True)
AutoModelForMaskedLM.register(DSTGNeoBertConfig, DSTGNeoBertForMaskedLM, exist_ok=True)

# arch -> "module:function" taking the model config dict and returning a PreTrainedModel.
ARCHS: dict[str, str] = {
    "decoder": "poslab.models:build_poslab",
    "encoder": "poslab.models:build_poslab",
    "dstg": "poslab.models.dstg:build_dstg",
}


def build_poslab(values: dict[str, Any]):
    config = PoslabConfig(poslab=ModelConfig.from_dict(values).to_dict())
    return PoslabForCausalLM(config) if config.spec.causal else PoslabForMaskedLM(config)


def build_model(config: dict[str, Any] | ModelConfig):
    """A ready model (LM head for decoders, MLM head for encoders) from a config dict or ModelConfig."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    arch = values.get("arch", "decoder")
    if arch not in ARCHS:
        raise ConfigError(unknown_key_message("arch", arch, ARCHS))
    module, fn = ARCHS[arch].split(":")
    return getattr(importlib.import_module(module), fn)(values)


__all__ = ["ARCHS", "ActivationCache", "ModelConfig", "PoslabConfig", "PoslabForCausalLM", "PoslabForMaskedLM",
           "PoslabModel", "build_model"]
