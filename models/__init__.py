"""Model registry: engines take a model by name, never by hard-coded architecture.

A model is a config dataclass (its counts as methods: `matmul_param_count`, `train_flops_per_token`)
and an nnx module; `model_def` gives the engines its graph, abstract params and logical names.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

from meshlab.layout import is_names
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


@dataclasses.dataclass
class ModelDef:
    """A model without its weights: graph, abstract params and their logical names."""
    cfg: Any
    graphdef: Any
    abstract: dict          # path -> ShapeDtypeStruct (nested dict)
    names: dict             # path -> tuple of logical names (nested dict)

    def bind(self, params):
        """A callable model over these params (inside jit: no copies)."""
        return nnx.merge(self.graphdef, params)

    def param_count(self) -> int:
        """Stored parameters (every leaf, the padded vocabulary included)."""
        return int(sum(math.prod(a.shape) for a in jax.tree.leaves(self.abstract)))

    def name_leaves(self) -> list:
        return jax.tree.leaves(self.names, is_leaf=is_names)


def model_def(cfg) -> ModelDef:
    abstract_model = nnx.eval_shape(lambda: build(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract_model, nnx.Param)
    names: dict = {}
    for path, var in nnx.to_flat_state(state):
        n = tuple(var.get_metadata()["logical"])
        if len(var.get_value().shape) == len(n) + 1:  # stacked by the layer scan
            n = ("layers",) + n
        node = names
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = n
    return ModelDef(cfg, graphdef, nnx.to_pure_dict(state), names)


def mfu_formula(cfg, seq_len: int) -> str:
    """The MFU line the training loop prints: what N, L, S and d are for this config."""
    n = cfg.matmul_param_count()
    what = "active matmul params" if hasattr(cfg, "active_mlp_dim") else "matmul params"
    return (f"MFU = tokens/s x (6N + 6*L*S*d) / peak;  N={n:,} {what}, L={cfg.n_layers}, "
            f"S={seq_len}, d={cfg.n_heads * cfg.head_dim}  ->  {cfg.train_flops_per_token(seq_len):,.0f} FLOP/token")
