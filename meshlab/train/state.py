"""Train state and its shardings: where each ZeRO stage keeps params, grads and Adam moments.

The state is a plain pytree: {"step", "params" (fp32 master weights, a nested dict),
"opt" (optax state), "loss_scale" (fp16 only)}. Every leaf's sharding comes from the rule
file: params use the storage spec (`state.params`), Adam moments the optimizer spec
(`state.optimizer`), the gradient accumulator the grads spec (`state.grads`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import models
from meshlab.rules import Rules


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


def model_def(cfg) -> ModelDef:
    abstract_model = nnx.eval_shape(lambda: models.build(cfg, nnx.Rngs(0)))
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


def is_names(x):
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def tree_paths(tree) -> dict:
    return jax.tree_util.tree_map_with_path(lambda p, _: jax.tree_util.keystr(p), tree)


def leaf_specs(md: ModelDef, rules: Rules, mesh, kind: str) -> dict:
    """PartitionSpec per parameter leaf for `kind` in params | grads | optimizer."""
    return jax.tree.map(
        lambda names, a, path: rules.state_spec(kind, names, a.shape, mesh, path=f"params{path}"),
        md.names, md.abstract, tree_paths(md.abstract), is_leaf=is_names)


def only_axes(spec: P, axes) -> P:
    """Keep only `axes` in a spec (the manual ones of a shard_map region)."""
    def keep(entry):
        if entry is None:
            return None
        entry = (entry,) if isinstance(entry, str) else entry
        kept = tuple(a for a in entry if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(keep(e) for e in spec))


def make_optimizer_specs(tx, md: ModelDef, opt_param_specs: dict):
    """Shardings of the optax state: moments mirror the params' optimizer spec, counters replicated."""
    abstract_opt = jax.eval_shape(tx.init, md.abstract)
    return optax.tree_map_params(tx, lambda _, spec: spec, abstract_opt, opt_param_specs,
                                 transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))


def state_specs(md: ModelDef, rules: Rules, mesh, tx, loss_scaling: bool) -> dict:
    specs = {"step": P(), "params": leaf_specs(md, rules, mesh, "params"),
             "opt": make_optimizer_specs(tx, md, leaf_specs(md, rules, mesh, "optimizer"))}
    if loss_scaling:
        specs["loss_scale"] = {"scale": P(), "good_steps": P()}
    return specs


def to_shardings(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _init_fn(md: ModelDef, tx, loss_scaling: bool, initial_scale: float):
    """key -> the whole train state; one definition for the real and the abstract state."""
    def init(key):
        params = nnx.to_pure_dict(nnx.state(models.build(md.cfg, nnx.Rngs(key)), nnx.Param))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": tx.init(params)}
        if loss_scaling:
            state["loss_scale"] = {"scale": jnp.asarray(initial_scale, jnp.float32),
                                   "good_steps": jnp.zeros((), jnp.int32)}
        return state
    return init


def init_state(md: ModelDef, tx, shardings, seed: int, loss_scaling: bool, initial_scale: float = 2.0 ** 15):
    """Initialise directly into the target shardings (no host copy of the whole model)."""
    init = _init_fn(md, tx, loss_scaling, initial_scale)
    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def abstract_state(md: ModelDef, tx, shardings, loss_scaling: bool):
    """ShapeDtypeStructs carrying `shardings`: what compiling and orbax's resharding restore need."""
    shapes = jax.eval_shape(_init_fn(md, tx, loss_scaling, 1.0), jax.random.key(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
