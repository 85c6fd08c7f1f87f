"""Model registry: engines take a model by name, never by hard-coded architecture."""
from __future__ import annotations

import dataclasses

from models import llama

ARCHITECTURES = {"llama": (llama.LlamaConfig, llama.Llama, llama.PRESETS)}


def preset(name: str):
    """The config of a named model shape (e.g. `tiny`, `llama3_1b`)."""
    for cfg_cls, _, presets in ARCHITECTURES.values():
        if name in presets:
            return dataclasses.replace(presets[name])
    names = [n for _, _, p in ARCHITECTURES.values() for n in p]
    raise KeyError(f"unknown model {name!r}; known: {', '.join(names)}")


def model_class(cfg):
    for cfg_cls, cls, _ in ARCHITECTURES.values():
        if isinstance(cfg, cfg_cls):
            return cls
    raise TypeError(f"no model for config type {type(cfg).__name__}")


def build(cfg, rngs):
    return model_class(cfg)(cfg, rngs)
