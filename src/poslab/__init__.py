"""poslab: build, train and dissect Transformers whose positional information is explicit."""
from poslab import models as _models  # noqa: F401  (registers the Hugging Face Auto classes)
from poslab.models import ActivationCache, ModelConfig, build_model

__version__ = "0.1.0"
__all__ = ["ActivationCache", "ModelConfig", "build_model", "__version__"]
