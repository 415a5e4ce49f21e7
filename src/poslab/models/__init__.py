"""Backbones: a GPT-style decoder and a NeoBERT-style encoder, each taking any positional scheme,
packaged as Hugging Face models; DSTG-NeoBERT lives in ``dstg.py``.

``build_model(config)`` picks the class from ``config['arch']`` via ``ARCHS`` -- one line per family.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

from poslab.errors import ConfigError, lookup, shown
from poslab.models.cache import ActivationCache
from poslab.models.config import ModelConfig
from poslab.models.dstg import DSTGNeoBertConfig, DSTGNeoBertForMaskedLM, DSTGNeoBertModel, build_dstg
from poslab.models.dstg_config import DSTGConfig
from poslab.models.hf import PoslabConfig, PoslabForCausalLM, PoslabForMaskedLM, PoslabModel

AutoConfig.register("poslab", PoslabConfig, exist_ok=True)
AutoModel.register(PoslabConfig, PoslabModel, exist_ok=True)
AutoModelForCausalLM.register(PoslabConfig, PoslabForCausalLM, exist_ok=True)
AutoModelForMaskedLM.register(PoslabConfig, PoslabForMaskedLM, exist_ok=True)
AutoConfig.register("dstg_neobert", DSTGNeoBertConfig, exist_ok=True)
AutoModel.register(DSTGNeoBertConfig, DSTGNeoBertModel, exist_ok=True)
AutoModelForMaskedLM.register(DSTGNeoBertConfig, DSTGNeoBertForMaskedLM, exist_ok=True)


def build_poslab(values: dict[str, Any]):
    config = PoslabConfig(poslab=ModelConfig.from_dict(values).to_dict())
    return PoslabForCausalLM(config) if config.spec.causal else PoslabForMaskedLM(config)


# arch -> (its validated config dataclass, the builder taking that config's dict). One line per family.
ARCHS: dict[str, tuple[type, Callable[[dict[str, Any]], Any]]] = {
    "decoder": (ModelConfig, build_poslab),
    "encoder": (ModelConfig, build_poslab),
    "dstg": (DSTGConfig, build_dstg),
}


def build_model(config: dict[str, Any] | ModelConfig | DSTGConfig):
    """A ready model (LM head for decoders, MLM head for encoders and DSTG) from a config dict or dataclass."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):  # dict() of a string or a list raises TypeError or ValueError
        raise ConfigError(f"model config must be a mapping (e.g. {{'arch': 'decoder', 'd_model': 128}}) or a "
                          f"ModelConfig or DSTGConfig, got {shown(config)}")
    values = dict(config)
    config_cls, builder = lookup("arch", values.get("arch", "decoder"), ARCHS)
    return builder(config_cls.from_dict(values).to_dict())


__all__ = ["ARCHS", "ActivationCache", "DSTGConfig", "ModelConfig", "PoslabConfig", "PoslabForCausalLM",
           "PoslabForMaskedLM", "PoslabModel", "build_model"]
