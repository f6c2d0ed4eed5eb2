"""kvlab: the helper package of a hands-on course on the LLM KV cache.

Submodules hold one concept each (config, memory, attention, model, cache, generate, …);
import them as `kvlab.memory`, `kvlab.cache`, etc.
"""

from . import (
    attention,
    cache,
    config,
    env,
    fragmentation,
    generate,
    gqa,
    memory,
    model,
    pretrained,
    quality,
    quant,
    validate,
)
from .config import PRESETS, ModelConfig

__all__ = ["ModelConfig", "PRESETS", "attention", "cache", "config", "env", "fragmentation",
           "generate", "gqa", "memory", "model", "quant", "quality", "pretrained", "validate"]
__version__ = "0.1.0"
