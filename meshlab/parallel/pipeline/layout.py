"""Which layers sit on which stage, and the order the train state stores the layer stack in.

The stacked layers are sharded over `stage` in contiguous blocks (rule `layers: stage`). With
virtual = 1 stage s holds layers s*L/p .. (s+1)*L/p - 1 and the stored order is the model's. With
virtual = v > 1 (interleaved 1F1B, or GPipe over virtual stages) stage s runs chunks s, p + s,
2p + s, .. (each L/(p*v) layers), so the state stores the stack in that chunk order
(`chunk_order`): stage s's contiguous block is already its chunks, the step reads them in place and
its gradients and Adam moments come out in the same order. No permutation runs in the step.

Where it is declared: the rule file's `strategies.pipeline.virtual` with the mesh's `stage` size
(`stored_order`), computed once per program by `meshlab.layout.Layout.build` (`Layout.layer_order`:
None for model order). The step checks that the schedule it runs reads the stack in that order; a
fresh state is initialised in it (meshlab/train/state.py), so every layout starts from the same model.

Checkpoints record the order they were written in (meta key `layer_order`: stacked row k holds model
layer order[k]; no key means model order, as every checkpoint written before the record did). A
restore converts to the order its caller's layout stores (`reorder_placed`, once, on the restored arrays):
fsdp / dp / non-interleaved pipelines (model order), or an interleaved pipeline of other stages or
virtual stages, in either direction. Whatever reads parameters as a model sees model order: serving
(`meshlab.checkpoint.restore_params`, and through it Hugging Face export), the validation forward
and the end-of-run sample (converted in their programs), the planner and explain.py (stage_map
names model layers). What converting costs: one gather of the layer leaves (a collective over
`stage`) per restore, per fresh init and per validation batch; never per train step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.rules import RulesError

LAYERS_KEY = "layers"        # the stacked layers' key in the parameter tree (and in the optimizer's mirrors of it)
META_KEY = "layer_order"     # the checkpoint meta's record of the stored order


class LayoutError(RulesError):
    """The model's layers do not split over the rule file's stages (a rule-file/model mismatch), or a
    recorded layer order does not fit the model."""


def check_layers(n_layers: int, stages: int, virtual: int, where: str = "") -> int:
    """Layers per chunk; one clear error when the layers do not split evenly."""
    chunks = stages * virtual
    if n_layers % chunks:
        fits = [n for n in range(chunks, 4 * chunks + 1, chunks)]
        raise LayoutError(f"{where}pipeline over {stages} stages x {virtual} virtual stages needs model.n_layers "
                          f"divisible by {chunks} (every stage holds the same stacked shape in lockstep SPMD), but "
                          f"the model has {n_layers}; use n_layers in {fits[:3]}, or change the `stage` mesh size "
                          "or `strategies.pipeline.virtual`")
    return n_layers // chunks


def chunk_order(n_layers: int, stages: int, virtual: int) -> np.ndarray:
    """perm with stored[i] = model_layer[perm[i]]: stage s's contiguous block holds its chunks c*p + s
    (c = 0..v-1) in order. The identity when virtual == 1 or stages == 1."""
    lc = check_layers(n_layers, stages, virtual)
    return np.array([(c * stages + s) * lc + j for s in range(stages) for c in range(virtual) for j in range(lc)],
                    np.int32)


def order_for(n_layers: int, stages: int, virtual: int, where: str = "") -> tuple[int, ...] | None:
    """The stored order of a pipeline over (stages, virtual): None where it is the model's."""
    check_layers(n_layers, stages, virtual, where)
    order = chunk_order(n_layers, stages, virtual)
    return None if (order == np.arange(n_layers)).all() else tuple(int(i) for i in order)


def stored_order(rules, mesh, n_layers: int) -> tuple[int, ...] | None:
    """The order a train state under (rules, mesh) stores its layers in: the chunk order of the rule
    file's pipeline when the mesh has stage > 1 and it names virtual > 1, else None (model order)."""
    pipe = rules.strategies.get("pipeline")
    stages = dict(mesh.shape).get("stage", 1)
    if stages == 1 or not pipe:
        return None
    if pipe["virtual"] == 1:
        check_layers(n_layers, stages, 1, f"{rules.path}: ")   # before a rule's split error names a leaf
        return None
    return order_for(n_layers, stages, pipe["virtual"], f"{rules.path}: ")


def stage_map(n_layers: int, stages: int, virtual: int) -> list[list[tuple[int, list[int]]]]:
    """Per stage: [(virtual stage index, [model layers])] in the order it runs them."""
    lc = check_layers(n_layers, stages, virtual)
    return [[(c * stages + s, list(range((c * stages + s) * lc, (c * stages + s + 1) * lc))) for c in range(virtual)]
            for s in range(stages)]


def _check(order, n: int, what: str) -> np.ndarray:
    if order is None:
        return np.arange(n)
    arr = np.asarray(order)
    if arr.shape != (n,) or sorted(arr.tolist()) != list(range(n)):
        raise LayoutError(f"{what} layer order {list(order)[:12]}{' ..' if len(order) > 12 else ''} is not an order of "
                          f"the model's {n} layers: the checkpoint was written for another model (another "
                          "model.n_layers); restore it with that model's config")
    return arr


def _is_stacked(path) -> bool:
    return any(isinstance(k, jax.tree_util.DictKey) and k.key == LAYERS_KEY for k in path)


def _stacked(tree, src, dst):
    """(flat leaves with paths, treedef, indices of the stacked layer leaves, the row gather) or None."""
    if src is None and dst is None:
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    idx = [i for i, (path, leaf) in enumerate(flat) if _is_stacked(path) and getattr(leaf, "ndim", 0) >= 1]
    if not idx:
        return None
    n = flat[idx[0]][1].shape[0]
    bad = [jax.tree_util.keystr(flat[i][0]) for i in idx if flat[i][1].shape[0] != n]
    if bad:
        raise LayoutError(f"stacked layer leaves of different depths ({bad[:3]} vs {n}): not one layer stack")
    take = np.argsort(_check(src, n, "the stored"))[_check(dst, n, "the wanted")]
    return None if (take == np.arange(n)).all() else (flat, treedef, idx, take)


def _replace(flat, treedef, idx, moved):
    out = [leaf for _, leaf in flat]
    for i, a in zip(idx, moved):
        out[i] = a
    return jax.tree_util.tree_unflatten(treedef, out)


def reorder(tree, src, dst):
    """`tree` (parameters, or a whole train state: Adam's moments mirror the parameters) with every
    stacked layer leaf (one under a `layers` key) moved from stored order `src` to `dst` (None: model
    order). Numpy leaves are permuted on the host, others with jnp.take (inside a trace: a gather in
    that program, a collective over `stage` where the stack is split over it)."""
    got = _stacked(tree, src, dst)
    if got is None:
        return tree
    flat, treedef, idx, take = got
    mod = np if all(isinstance(flat[i][1], np.ndarray) for i in idx) else jnp
    return _replace(flat, treedef, idx, [mod.take(flat[i][1], take, axis=0) for i in idx])


def reorder_placed(tree, src, dst, donate: bool = False):
    """`reorder` of placed arrays (a restored state) by one jitted gather that keeps every leaf's
    sharding; `donate` frees the input's layer leaves (a restore's: never read again). Costs one pass
    over the layers, once per restore."""
    got = _stacked(tree, src, dst)
    if got is None:
        return tree
    flat, treedef, idx, take = got
    leaves = [flat[i][1] for i in idx]
    moved = jax.jit(lambda ls: [jnp.take(a, take, axis=0) for a in ls], out_shardings=[a.sharding for a in leaves],
                    donate_argnums=(0,) if donate else ())(leaves)
    return _replace(flat, treedef, idx, moved)
