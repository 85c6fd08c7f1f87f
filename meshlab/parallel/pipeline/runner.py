"""The pipelined loss-and-gradients: the step's micro-batch loop replaced by a schedule.

One shard_map, manual over `stage` and the data-parallel axes (`batch:`), Auto over the rest
(tensor, ...). Inside, each device runs its stage's row of the schedule (executor.py) on its
data-parallel rows; afterwards the gradients are reduced as the plain step reduces them:
parameters outside the layer stack (embedding, final norm, LM head) are summed over `stage`
(the tied embedding's gradient comes from the first stage's lookup and the last stage's head),
then the data-parallel sums (FSDP's per-layer reduce-scatter is the transpose of its gather and
has happened inside; ZeRO-2 scatters, data parallelism all-reduces, once per step).
Returns what the plain step returns: (loss, gradients in the accumulator's sharding, valid tokens).
The parameters come in the order the state stores them (layout.py: chunk order when virtual > 1),
which is the order the executor reads its chunks in; the gradients leave in the same order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshlab import compat
from meshlab import rules as rules_mod
from meshlab.parallel.pipeline import executor, layout, schedules

AXIS = "stage"


def _entries(spec):
    return [(dim, () if e is None else (e,) if isinstance(e, str) else tuple(e)) for dim, e in enumerate(spec)]


def _only(spec: P, axes) -> P:
    kept = [tuple(a for a in e if a in axes) for _, e in _entries(spec)]
    return P(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


def schedule_for(rules, mesh, microbatches: int, n_layers: int, pipeline: dict | None = None) -> schedules.Schedule:
    """The rule file's schedule (or `pipeline`, e.g. to force one on a 1-stage mesh), checked against the model."""
    pipe = pipeline or rules.strategies.get("pipeline")
    p = mesh.shape[AXIS]
    layout.check_layers(n_layers, p, pipe["virtual"], f"{rules.path}: ")
    return schedules.build(pipe["schedule"], p, microbatches, pipe["virtual"])


def check_order(stored, sched: schedules.Schedule, n_layers: int, rules) -> None:
    """The state's stored layer order (Layout.layer_order) is the one the schedule reads its chunks in."""
    want = layout.order_for(n_layers, sched.stages, sched.virtual)
    if stored != want:
        raise rules_mod.RulesError(
            f"{rules.path}: the train state stores its layers in {'model' if stored is None else 'chunk'} order "
            f"{list(stored or range(n_layers))[:8]}.., but a {sched.name} pipeline over {sched.stages} stages x "
            f"{sched.virtual} virtual stages reads them in {'model' if want is None else 'chunk'} order "
            f"{list(want or range(n_layers))[:8]}..; build the Layout from the rule file that names this pipeline "
            "(a forced `pipeline` must keep the rule file's virtual stages)")


# a weight's logical name and its activation's: GSPMD moves data between their splits inside a stage's layers
WEIGHT_AND_ACTIVATION = (("heads", "act_heads"), ("kv_heads", "act_kv_heads"), ("mlp", "act_mlp"),
                         ("embed", "act_embed"), ("vocab", "act_vocab"))


def check_specs(rules, mesh, names: dict, store: dict, layers_key: str) -> None:
    """The layer stack is split over `stage` and nothing else is; no weight and its activation are split over
    Auto axes that each lack in the other. That resharding is an all-to-all, which XLA lowers inside a stage's
    branch to a collective-permute whose pairs span every stage: the other stages, in other branches, never
    join it (a hang on CPU)."""
    p = mesh.shape[AXIS]
    if p == 1:
        return
    manual = set(rules.batch_axes(mesh)) | {AXIS}
    auto = lambda n: {a for a in rules.axes(n, mesh) if mesh.shape[a] > 1 and a not in manual}  # noqa: E731
    for w, act in WEIGHT_AND_ACTIVATION:
        if auto(w) - auto(act) and auto(act) - auto(w):
            raise rules_mod.RulesError(
                f"{rules.path}: under a pipeline, `{w}: {sorted(auto(w))}` and `{act}: {sorted(auto(act))}` split one "
                "dimension over different axes the batch is not split over; moving between them inside a stage needs "
                f"an all-to-all across stages. Map both to the same axes (e.g. `{act}` as `{w}`), or add those axes "
                "to `batch:`")
    for key, sub in names.items():
        leaves = jax.tree.leaves(sub, is_leaf=lambda x: isinstance(x, tuple))
        specs = jax.tree.leaves(store[key], is_leaf=lambda x: isinstance(x, P))
        for n, spec in zip(leaves, specs):
            on_stage = [dim for dim, axes in _entries(spec) if AXIS in axes]
            if key == layers_key and on_stage != [0]:
                raise rules_mod.RulesError(f"{rules.path}: a pipeline over `stage` needs the layer stack split over "
                                           "it: add `layers: stage` under `rules:`")
            if key != layers_key and on_stage:
                raise rules_mod.RulesError(f"{rules.path}: parameter {key} {n} is split over `stage`; only the layer "
                                           "stack may be (every stage holds the embedding/head it may use)")


def make_loss_and_grads(fns: executor.StageFns, names: dict, store: dict, acc: dict, rules, mesh, data_spec: P,
                        microbatches: int, sched: schedules.Schedule, layers_key: str = "layers"):
    """(params, batch, scale[, table]) -> (loss, grads, valid tokens), the layer stack of `params` and of
    the gradients in the schedule's stored order (layout.order_for: chunk order when virtual > 1).
    `table` defaults to the schedule's; passing another of the same shape (schedules.Schedule.padded)
    reuses the compiled program."""
    check_specs(rules, mesh, names, store, layers_key)
    manual = tuple(rules.batch_axes(mesh)) + ((AXIS,) if mesh.shape[AXIS] > 1 else ())
    batch_axes = rules.batch_axes(mesh)
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    default_table = jnp.asarray(sched.table)

    def body(params, batch, scale, table):
        mbs = {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:]) for k, v in batch.items()}
        n_valid = jnp.sum(batch["labels"] >= 0).astype(jnp.float32)
        n_valid = jax.lax.psum(n_valid, batch_axes) if batch_axes else n_valid
        seed = scale / jnp.maximum(n_valid, 1.0)
        with rules_mod.manual_axes(manual, rules, mesh):
            loss, grads = executor.run(sched, table, fns, params, layers_key, mbs, seed, AXIS)
        with jax.named_scope("collectives"):
            if AXIS in manual:
                loss = jax.lax.psum(loss, AXIS)
                grads = {k: (g if k == layers_key else jax.tree.map(lambda x: jax.lax.psum(x, AXIS), g))
                         for k, g in grads.items()}
            grads = jax.tree.map(lambda g, st, ac: _reduce(g, st, ac, batch_axes), grads, store, acc, is_leaf=is_p)
            loss = jax.lax.psum(loss, batch_axes) if batch_axes else loss
        return loss / jnp.maximum(n_valid, 1.0), grads, n_valid

    def run(params, batch, scale, table=None):
        table = default_table if table is None else table
        if manual:
            in_specs = (jax.tree.map(lambda s: _only(s, manual), store, is_leaf=is_p),
                        {k: _only(data_spec, manual) for k in batch}, P(), P())
            out_specs = (P(), jax.tree.map(lambda s: _only(s, manual), acc, is_leaf=is_p), P())
            return compat.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                    axis_names=manual)(params, batch, scale, table)
        # one stage and no data parallelism: the executor forced on one device, measured on its own
        return body(params, batch, scale, table)
    return run


def _reduce(g, st: P, ac: P, batch_axes):
    """The data-parallel reduction of one gradient leaf (as meshlab/train/step.py does it): ZeRO-2's
    reduce-scatter onto the accumulator's split, then an all-reduce over the remaining batch axes."""
    if not batch_axes:
        return g
    stored = {a for _, axes in _entries(st) for a in axes if a in batch_axes}
    scattered = set()
    for dim, axes in _entries(ac):
        axes = tuple(a for a in axes if a in batch_axes and a not in stored)
        if axes:
            g = jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=dim, tiled=True)
            scattered |= set(axes)
    rest = tuple(a for a in batch_axes if a not in stored and a not in scattered)
    return jax.lax.psum(g, rest) if rest else g
