"""Model registry: engines take a model by name, never by hard-coded architecture."""
from __future__ import annotations

import dataclasses

from models import llama, moe

ARCHITECTURES = {"llama": (llama.LlamaConfig, llama.Llama, llama.PRESETS),
                 "moe": (moe.MoeConfig, moe.MoeLM, moe.PRESETS)}


def preset(name: str):
    """The config of a named model shape (e.g. `tiny`, `llama3_1b`, `moe_1b_8e`)."""
    for cfg_cls, _, presets in ARCHITECTURES.values():
        if name in presets:
            return dataclasses.replace(presets[name])
    names = [n for _, _, p in ARCHITECTURES.values() for n in p]
    raise KeyError(f"unknown model {name!r}; known: {', '.join(names)}")


def model_class(cfg):
    # exact type first: MoeConfig is a LlamaConfig too
    for cfg_cls, cls, _ in ARCHITECTURES.values():
        if type(cfg) is cfg_cls:
            return cls
    for cfg_cls, cls, _ in ARCHITECTURES.values():
        if isinstance(cfg, cfg_cls):
            return cls
    raise TypeError(f"no model for config type {type(cfg).__name__}")


def build(cfg, rngs):
    return model_class(cfg)(cfg, rngs)


def hidden_and_aux(model, tokens, positions=None, segment_ids=None):
    """(final hidden states, auxiliary training terms): {} for dense models; a mixture of experts
    gives its router losses and load statistics (models/moe.py) for the train step."""
    if hasattr(model, "hidden_and_aux"):
        return model.hidden_and_aux(tokens, positions, segment_ids)
    return model.hidden(tokens, positions, segment_ids), {}


def aux_metrics(aux: dict, rows: int) -> dict:
    """Step metrics from the auxiliary terms summed over a global batch of `rows` rows."""
    return moe.aux_metrics(aux, rows) if "counts" in aux else {}
