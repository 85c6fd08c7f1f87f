"""The one pipeline executor: walks a schedule table (schedules.py) tick by tick inside a shard_map
that is manual over `stage`, every stage running its own row of the table.

Per tick every stage runs one op in a `lax.switch` (idle, F, B, BI, W), then every stage, whatever
its op, takes part in the same two `ppermute`s: activations one stage on, cotangents one stage
back. No collective over `stage` sits inside a branch (a branch only some stages take would wait
for the others forever); collectives over other axes may (FSDP's gathers, tensor-parallel sums):
every device of such a group belongs to the same stage and takes the same branch.

The backward is written by hand, one `jax.vjp` per layer and micro-batch: autodiff cannot interleave
the forward and backward of different micro-batches (1F1B). F runs the chunk's layers with
`jax.vjp` and stores each layer's residuals (the vjp closure's arrays, not the parameters it
closes over) in a stash slot; B replays them in reverse; BI stores the cotangent entering each
layer instead of the weight gradients, and W turns those into weight gradients later (zero
bubble). The model's remat policy applies per layer as in the plain step. On the first chunk F
embeds the tokens and B takes the embedding's gradient; on the last chunk F also runs the loss
head and its gradient at once, leaving the cotangent of the last layer's output in the backward
inbox, so the stash never holds the head's logits.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from meshlab.parallel.pipeline.schedules import COLS, IDLE, Schedule

_C = {c: i for i, c in enumerate(COLS)}


@dataclasses.dataclass(frozen=True)
class StageFns:
    """What the executor needs from the model, in pure functions of parameter pytrees."""
    embed: Callable    # (params, tokens [b, s]) -> x [b, s, d]
    layer: Callable    # (one_layer_params, x, positions, segment_ids) -> x
    head: Callable     # (params, x, labels) -> sum of token losses (fp32 scalar)


class _Residuals:
    """The layout of one layer's vjp closure: which of its arrays are the layer's own parameters
    (taken from the parameters again in the backward, never stashed) and the avals of the rest."""

    def __init__(self, layer, w1, x, aux):
        box = {}

        def probe(w, x, aux):
            _, vjp = jax.vjp(lambda w, x: layer(w, x, *aux), w, x)
            leaves, box["treedef"] = jax.tree.flatten(vjp)
            if any(leaf is vjp for leaf in leaves):   # a pytree in jax 0.10 (api.VJP) and earlier (Partial)
                raise RuntimeError(f"jax {jax.__version__}: jax.vjp's pullback is not a pytree; the pipeline "
                                   "executor stores its arrays between ticks and needs one")
            box["where"] = self.param_positions(leaves, w)
            return [leaf for leaf, k in zip(leaves, box["where"]) if k < 0]
        self.avals = jax.eval_shape(probe, w1, x, aux)
        self.treedef, self.where = box["treedef"], box["where"]

    @staticmethod
    def param_positions(leaves, w) -> list[int]:
        w_leaves = jax.tree.leaves(w)
        return [next((k for k, p in enumerate(w_leaves) if leaf is p), -1) for leaf in leaves]

    def split(self, vjp, w) -> list:
        leaves = jax.tree.leaves(vjp)
        if self.param_positions(leaves, w) != self.where:
            raise RuntimeError("pipeline: a layer's vjp closure changed layout between two traces")
        return [leaf for leaf, k in zip(leaves, self.where) if k < 0]

    def join(self, kept, w):
        w_leaves, it = jax.tree.leaves(w), iter(kept)
        leaves = [next(it) if k < 0 else w_leaves[k] for k in self.where]
        return jax.tree.unflatten(self.treedef, leaves)


def _when(pred, yes, no, *args):
    """lax.cond, or the branch itself when the predicate is a Python bool."""
    if isinstance(pred, bool):
        return (yes if pred else no)(*args)
    return jax.lax.cond(pred, yes, no, *args)


def _at(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _chunk(layers, c, size: int, virtual: int):
    if virtual == 1:
        return layers
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * size, size), layers)


def _add_chunk(acc, g, c, size: int, virtual: int):
    if virtual == 1:
        return jax.tree.map(jnp.add, acc, g)

    def one(a, d):
        cur = jax.lax.dynamic_slice_in_dim(a, c * size, size)
        return jax.lax.dynamic_update_slice_in_dim(a, cur + d.astype(a.dtype), c * size, 0)
    return jax.tree.map(one, acc, g)


def run(sched: Schedule, table, fns: StageFns, params, layers_key: str, mbs: dict, seed, axis: str = "stage"):
    """Inside a shard_map manual over `axis` (and the data-parallel axes): run the schedule.

    params: this device's parameters, `params[layers_key]` its stacked [virtual * Lc, ...] layers
    (chunk c = rows c*Lc .. (c+1)*Lc). mbs: {tokens, labels, positions, segment_ids} as [M, b, s].
    seed: the cotangent of each micro-batch's loss sum (loss scale / valid tokens). table: the
    schedule's int32 [ticks, stages, NCOL] (an argument, so schedules of one shape share a program).
    Returns (this stage's sum of token losses, the gradient of `params` on this stage: layer
    gradients of its own layers, embedding/head gradients where it used them, zero elsewhere).
    """
    p, v = sched.stages, sched.virtual
    stage = jax.lax.axis_index(axis) if p > 1 else 0
    layers = params[layers_key]
    n_local = jax.tree.leaves(layers)[0].shape[0]
    lc = n_local // v
    seg = mbs.get("segment_ids")
    aux_at = lambda i: (_at(mbs["positions"], i), None if seg is None else _at(seg, i))  # noqa: E731
    x_aval = jax.eval_shape(fns.embed, params, mbs["tokens"][0])
    w1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
    res = _Residuals(fns.layer, w1, x_aval, jax.eval_shape(lambda: aux_at(0)))
    split = sched.slots["gch"] > 0

    def buf(n, shape, dtype):
        return jnp.zeros((n,) + tuple(shape), dtype)
    carry0 = {
        "fin": buf(sched.slots["fin"] + 1, x_aval.shape, x_aval.dtype),    # + the trash slot
        "bin": buf(sched.slots["bin"] + 1, x_aval.shape, x_aval.dtype),
        "res": [buf(sched.slots["res"], (lc,) + a.shape, a.dtype) for a in res.avals],
        "gch": buf(sched.slots["gch"] if split else 0, (lc,) + x_aval.shape, x_aval.dtype),
        "grads": jax.tree.map(jnp.zeros_like, params),
        "loss": jnp.zeros((), jnp.float32),
    }
    zero_x = jnp.zeros(x_aval.shape, x_aval.dtype)
    # The embedding and head are differentiated w.r.t. the parameters outside the layer stack only
    # (no zero gradient of the whole stack made and added per micro-batch).
    rest_of = lambda tree: {key: val for key, val in tree.items() if key != layers_key}  # noqa: E731

    def add_rest(grads, g):
        return {**grads, **jax.tree.map(jnp.add, rest_of(grads), g)}

    def ctx(row):
        mb, c = row[_C["mb"]], row[_C["chunk"]]
        # Python bools where the mesh decides alone (one stage, one chunk: every op embeds and runs the
        # head), so no cond is traced there; traced predicates otherwise.
        first = (stage == 0) if v == 1 else (stage == 0) & (c == 0)
        last = (stage == p - 1) if v == 1 else (stage == p - 1) & (c == v - 1)
        return dict(row=row, mb=mb, c=c, first=first, last=last, w=_chunk(layers, c, lc, v), aux=aux_at(mb))

    def idle(k, carry):
        return carry, zero_x, zero_x

    def forward(k, carry):
        row, mb = k["row"], k["mb"]
        x = _when(k["first"], lambda: fns.embed(params, _at(mbs["tokens"], mb)).astype(x_aval.dtype),
                         lambda: carry["fin"][row[_C["fin"]]])

        def body(state, wj_j):
            x, stash = state
            wj, j = wj_j
            y, vjp = jax.vjp(lambda w, x: fns.layer(w, x, *k["aux"]), wj, x)
            kept = res.split(vjp, wj)
            stash = [s.at[row[_C["res"]], j].set(r) for s, r in zip(stash, kept)]
            return (y, stash), None
        (y, stash), _ = jax.lax.scan(body, (x, carry["res"]), (k["w"], jnp.arange(lc)))
        carry = dict(carry, res=stash)

        def head(carry):   # the loss head and its gradient, at once: its cotangent waits in the inbox
            labels = _at(mbs["labels"], mb)
            loss, vjp = jax.vjp(lambda rest, h: fns.head({**rest, layers_key: layers}, h, labels), rest_of(params), y)
            g_rest, g_y = vjp(jnp.asarray(seed, loss.dtype))
            return dict(carry, loss=carry["loss"] + loss, grads=add_rest(carry["grads"], g_rest),
                        bin=carry["bin"].at[row[_C["bin"]]].set(g_y.astype(x_aval.dtype))), zero_x
        carry, out = _when(k["last"], head, lambda carry: (carry, y), carry)
        return carry, out, zero_x

    def layer_vjps(k, carry, j):
        row = k["row"]
        wj = _at(k["w"], j)
        return wj, res.join([s[row[_C["res"]], j] for s in carry["res"]], wj)

    def input_grad(k, carry, dx):
        """The first chunk hands dx to the embedding (its gradient); the others send it back."""
        def embed_grad(carry):
            tokens = _at(mbs["tokens"], k["mb"])
            _, vjp = jax.vjp(lambda rest: fns.embed({**rest, layers_key: layers}, tokens).astype(x_aval.dtype),
                             rest_of(params))
            (g,) = vjp(dx)
            return dict(carry, grads=add_rest(carry["grads"], g)), zero_x
        return _when(k["first"], embed_grad, lambda carry: (carry, dx), carry)

    def backward(k, carry):
        def body(g, j):
            _, vjp = layer_vjps(k, carry, j)
            dw, dx = vjp(g)
            return dx, dw
        dx, dw = jax.lax.scan(body, carry["bin"][k["row"][_C["bin"]]], jnp.arange(lc), reverse=True)
        carry = dict(carry, grads={**carry["grads"], layers_key: _add_chunk(carry["grads"][layers_key], dw,
                                                                            k["c"], lc, v)})
        carry, out = input_grad(k, carry, dx)
        return carry, zero_x, out

    def backward_input(k, carry):
        slot = k["row"][_C["gch"]]

        def body(state, j):
            g, chain = state
            _, vjp = layer_vjps(k, carry, j)
            _, dx = vjp(g)
            return (dx, chain.at[slot, j].set(g)), None
        (dx, chain), _ = jax.lax.scan(body, (carry["bin"][k["row"][_C["bin"]]], carry["gch"]), jnp.arange(lc),
                                      reverse=True)
        carry, out = input_grad(k, dict(carry, gch=chain), dx)
        return carry, zero_x, out

    def backward_weight(k, carry):
        slot = k["row"][_C["gch"]]

        def body(_, j):
            _, vjp = layer_vjps(k, carry, j)
            dw, _ = vjp(carry["gch"][slot, j])
            return None, dw
        _, dw = jax.lax.scan(body, None, jnp.arange(lc))
        grads = {**carry["grads"], layers_key: _add_chunk(carry["grads"][layers_key], dw, k["c"], lc, v)}
        return dict(carry, grads=grads), zero_x, zero_x

    branches = [idle, forward, backward] + ([backward_input, backward_weight] if split else [])
    fwd_perm = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]
    bwd_perm = [(d, s) for s, d in fwd_perm]

    def tick(carry, rows):
        row = jax.lax.dynamic_index_in_dim(rows, stage, keepdims=False) if p > 1 else rows[0]
        k = ctx(row)
        op = jnp.minimum(row[_C["op"]], len(branches) - 1)
        carry, out_f, out_b = jax.lax.switch(op, [lambda c, f=f: f(k, c) for f in branches], carry)
        # Outside any branch: every stage sends and receives every tick.
        if p > 1:
            out_f = jax.lax.ppermute(out_f, axis, fwd_perm)
            out_b = jax.lax.ppermute(out_b, axis, bwd_perm)
        carry = dict(carry, fin=carry["fin"].at[row[_C["recv_f"]]].set(out_f),
                     bin=carry["bin"].at[row[_C["recv_b"]]].set(out_b))
        return carry, None

    carry, _ = jax.lax.scan(tick, carry0, table)
    return carry["loss"], carry["grads"]


__all__ = ["StageFns", "run", "IDLE"]
