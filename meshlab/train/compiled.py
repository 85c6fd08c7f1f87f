"""What the compiler says about a train step: the planner's proof, read from the compiled program.

`measure(cfg)` lowers and compiles the real train step (meshlab.train.loop.build_trainer) on
abstract inputs (ShapeDtypeStructs with shardings: nothing is allocated, so mid-size models
compile on a laptop) and returns per-device state bytes from the program's input shardings,
gradient bytes from the loss-and-grads region's output shardings, the memory analysis, and
the collectives of the HLO with loop bodies multiplied by their trip count (the layer scan).
It sits in the training engine, above the planner it checks (the planner never imports training).
One compile costs 10-40 s on 2 CPU cores (the grads read-out compiles the loss-and-grads region
again: `grads=False` skips it); results are cached per config.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.plan import hlo
from meshlab.train.config import to_yaml
from meshlab.train.loop import build_trainer
from meshlab.train.state import abstract_state
from meshlab.train.step import BATCH_KEYS, make_loss_and_grads


@dataclasses.dataclass
class Measured:
    rules: str
    mesh: dict
    params: int
    grads: int
    optimizer: int
    argument: int
    output: int
    alias: int
    temp: int
    collectives: list            # hlo.Collective, as found in the text
    per_step: dict               # kind -> bytes per step (loop bodies x n_layers)
    text: str = dataclasses.field(repr=False, default="")


def _shard_bytes(sds, sharding) -> int:
    return int(math.prod(sharding.shard_shape(sds.shape)) * np.dtype(sds.dtype).itemsize)


def abstract_batch(tr):
    sh = tr.layout.batch_sharding
    shape = (tr.cfg.data.global_batch, tr.cfg.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh) for k in BATCH_KEYS}


def grads_bytes(tr) -> int:
    """Per-device bytes of the gradient accumulator, from the compiled loss-and-grads region's output
    shardings (the train step consumes them internally, so its own signature does not show them)."""
    fn = make_loss_and_grads(tr.md, tr.rules, tr.mesh, tr.cfg.data.microbatches, layout=tr.layout)
    st = abstract_state(tr.md, tr.tx, tr.shardings, False)
    # read for its output shardings only: LLVM's cheapest code generation, as in measure()
    opts = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    compiled = tr.layout.jit(fn).lower(st["params"], abstract_batch(tr), jnp.float32(1.0)).compile(compiler_options=opts)
    out_sh = compiled.output_shardings[1]
    shapes = jax.eval_shape(lambda p: p, st["params"])
    return sum(_shard_bytes(a, s) for a, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(out_sh)))


def compiled_step(tr, state=None):
    """The trainer's step compiled for its shardings (`.memory_analysis()`, `.as_text()`), on the
    abstract state when none is given. Given the state a run returned, jax's cache hands back the
    program that run compiled: reading its memory costs no second compile."""
    if state is None:
        state = abstract_state(tr.md, tr.tx, tr.shardings, tr.cfg.model.dtype == "float16")
    return tr.step_fn.lower(state, abstract_batch(tr)).compile()   # traced under its own rules (Layout.jit)


_CACHE: dict = {}


def measure(cfg, keep_text: bool = False, grads: bool = True) -> Measured:
    key = (to_yaml(cfg), grads)
    if key in _CACHE:
        return _CACHE[key]
    tr = build_trainer(cfg)
    st = abstract_state(tr.md, tr.tx, tr.shardings, cfg.model.dtype == "float16")
    # Compiled to be read, never run: on CPU, LLVM's cheapest code generation (the HLO, its
    # collectives and the buffer assignment are settled before it; ~25% less compile time).
    opts = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    compiled = tr.step_fn.lower(st, abstract_batch(tr)).compile(compiler_options=opts)
    in_sh = compiled.input_shardings[0][0]
    params = sum(_shard_bytes(a, s) for a, s in zip(jax.tree.leaves(st["params"]), jax.tree.leaves(in_sh["params"])))
    opt_leaves = [(a, s) for a, s in zip(jax.tree.leaves(st["opt"]), jax.tree.leaves(in_sh["opt"])) if a.ndim > 0]
    optimizer = sum(_shard_bytes(a, s) for a, s in opt_leaves)
    ma = compiled.memory_analysis()
    text = compiled.as_text()
    colls = hlo.collectives(text)
    per_step = {k: 0 for k in hlo.KINDS}
    for c in colls:
        per_step[c.kind] += c.bytes * (cfg.model.n_layers if c.in_loop else 1)
    m = Measured(tr.rules.name, {a: s for a, s in tr.mesh.shape.items() if s > 1}, params, grads_bytes(tr) if grads else -1, optimizer,
                 ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes, ma.temp_size_in_bytes,
                 colls, per_step, text if keep_text else "")
    _CACHE[key] = m
    return m
