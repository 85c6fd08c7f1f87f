"""Train state and its shardings: where each ZeRO stage keeps params, grads and Adam moments.

The state is a plain pytree: {"step", "params" (fp32 master weights, a nested dict),
"opt" (optax state), "loss_scale" (fp16 only)}. Every leaf's sharding comes from the rule
file: params use the storage spec (`state.params`), Adam moments the optimizer spec
(`state.optimizer`), the gradient accumulator the grads spec (`state.grads`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
from meshlab.layout import Layout, is_spec
from meshlab.parallel.pipeline.layout import reorder
from meshlab.rules import Rules
from models import ModelDef


def make_optimizer_specs(tx, md: ModelDef, opt_param_specs: dict):
    """Shardings of the optax state: moments mirror the params' optimizer spec, counters replicated."""
    abstract_opt = jax.eval_shape(tx.init, md.abstract)
    return optax.tree_map_params(tx, lambda _, spec: spec, abstract_opt, opt_param_specs,
                                 transform_non_params=lambda _: P(), is_leaf=is_spec)


def state_specs(md: ModelDef, rules: Rules, mesh, tx, loss_scaling: bool, layout: Layout | None = None) -> dict:
    """Spec tree of the whole train state; `layout`: the step's, whose parameter trees it reuses."""
    layout = layout or Layout.build(md, rules, mesh)
    specs = {"step": P(), "params": layout.params, "opt": make_optimizer_specs(tx, md, layout.optimizer)}
    if loss_scaling:
        specs["loss_scale"] = {"scale": P(), "good_steps": P()}
    return specs


def _init_fn(md: ModelDef, tx, loss_scaling: bool, initial_scale: float, layer_order=None):
    """key -> the whole train state; one definition for the real and the abstract state. The layer
    stack stored in `layer_order` (Layout.layer_order: an interleaved pipeline's chunk order; None:
    model order), so a layout's fresh state is the model of the same seed under any rule file."""
    def init(key):
        params = nnx.to_pure_dict(nnx.state(models.build(md.cfg, nnx.Rngs(key)), nnx.Param))
        params = reorder(params, None, layer_order)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": tx.init(params)}
        if loss_scaling:
            state["loss_scale"] = {"scale": jnp.asarray(initial_scale, jnp.float32),
                                   "good_steps": jnp.zeros((), jnp.int32)}
        return state
    return init


def init_state(md: ModelDef, tx, shardings, seed: int, loss_scaling: bool, initial_scale: float = 2.0 ** 15,
               layer_order=None):
    """Initialise directly into the target shardings (no host copy of the whole model), the layers in
    `layer_order` (the layout's: Layout.layer_order)."""
    init = _init_fn(md, tx, loss_scaling, initial_scale, layer_order)
    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def abstract_state(md: ModelDef, tx, shardings, loss_scaling: bool):
    """ShapeDtypeStructs carrying `shardings`: what compiling and orbax's resharding restore need."""
    shapes = jax.eval_shape(_init_fn(md, tx, loss_scaling, 1.0), jax.random.key(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
