"""The one pipeline executor: walks a schedule table (schedules.py) tick by tick inside a shard_map
that is manual over `stage`, every stage running its own row of the table.

Per tick every stage runs the ops its row names, each in its own two-way `lax.cond` (run it, or
pass through): F (a chunk's forward), the loss head (F on the last chunk), B, BI, W, the embedding's
gradient (B/BI on the first chunk). Then every stage, whatever it ran, takes part in the same two
`ppermute`s: activations one stage on, cotangents one stage back. No collective over `stage` sits
inside a cond (one that only some stages take would wait for the others forever); collectives over
other axes may (FSDP's gathers, tensor-parallel sums): every device of such a group belongs to the
same stage and takes the same branch.

The backward is written by hand, one `jax.vjp` per layer and micro-batch: autodiff cannot interleave
the forward and backward of different micro-batches (1F1B). F runs the chunk's layers with
`jax.vjp` and stores each layer's residuals (the vjp closure's arrays, not the parameters it
closes over) in a stash slot; B replays them in reverse, adding each layer's weight gradient into
its row of the accumulator as it goes; BI stores the cotangent entering each layer instead of the
weight gradients, and W turns those into weight gradients later (zero bubble). The model's remat
policy applies per layer as in the plain step. The first chunk's F embeds the tokens; the last
chunk's loss head and its gradient run at once, leaving the cotangent of the last layer's output
in the backward inbox, so the stash never holds the head's logits.

Buffers stay in place. The stash, the inboxes and the gradient accumulators are the tick loop's
carry; each cond takes only the buffers its op writes and hands them back untouched when it does
not run. That shape is the one XLA's copy insertion keeps in place: one `lax.switch` over all ops
with the whole carry (three or more branches, or conds nested inside a branch) made it copy every
carried buffer on every tick (the stash and the fp32 gradients: about 8 GB at llama3_1b, seq 4096,
1 stage, ~4 ms a tick on an H200). Layer gradients go into their accumulator row by row inside the
backward layer scan (a dynamic-update-slice of one layer), never through a stacked [layers, ...]
temporary and a whole-stack add.

Per-tick overhead budget (what an empty tick costs): the table row's scalars, one predicate per
op (F, head, B, and on the first chunk the embedding's gradient; BI and W for zero bubble), each
cond's pass-through (no data moves; on GPU the predicate is read by the host: ~10 us each), one
zero [b, s, d] activation per cond output that did not run (one micro-batch's residual stream:
16 MB at llama3_1b, seq 4096, a few us of memset), the two inbox writes of what arrived (the same
size, to the trash slot when nothing did), and with stage > 1 the two ppermutes of that size. No
buffer bigger than one micro-batch's activation is touched by a tick that runs nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from meshlab.parallel.pipeline.schedules import B, BI, COLS, F, IDLE, W, Schedule

_C = {c: i for i, c in enumerate(COLS)}


@dataclasses.dataclass(frozen=True)
class StageFns:
    """What the executor needs from the model, in pure functions of parameter pytrees."""
    embed: Callable    # (params, tokens [b, s]) -> x [b, s, d]
    layer: Callable    # (one_layer_params, x, positions, segment_ids) -> x
    head: Callable     # (params, x, labels) -> sum of token losses (fp32 scalar)
    # x [b, s, d] -> x laid out as the rule file lays out the residual stream. Every cond that hands on an
    # activation places it so in both branches: XLA's verifier refuses a cond whose branches leave it
    # differently placed (a sequence split on the embedded branch, none on the inbox's).
    stream: Callable = lambda x: x


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


def _and(a, b):
    """a & b where either may be a Python bool (decided by the mesh alone: no predicate traced)."""
    if isinstance(a, bool) or isinstance(b, bool):
        a, b = (a, b) if isinstance(a, bool) else (b, a)
        return b if a else False
    return a & b


def _when(pred, yes, no, *args):
    """lax.cond, or the branch itself when the predicate is a Python bool."""
    if isinstance(pred, bool):
        return (yes if pred else no)(*args)
    return jax.lax.cond(pred, yes, no, *args)


def _maybe(pred, fn, state, *zeros, place=None):
    """fn(state) -> (state, *outs) when pred holds; else state untouched and `zeros` for the outs.
    The one cond shape that updates `state` in place (module docstring). place: applied to the outs
    in both branches (StageFns.stream)."""
    if place is None:
        return _when(pred, fn, lambda s: (s, *zeros), state)

    def run(s):
        s, *outs = fn(s)
        return (s, *map(place, outs))
    return _when(pred, run, lambda s: (s, *map(place, zeros)), state)


def _at(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(buf, val, i, j):
    """buf[i, j] = val (one layer's slice of a [slots, layers, ...] stash), in place."""
    return jax.lax.dynamic_update_slice(buf, val[None, None].astype(buf.dtype), (i, j) + (0,) * val.ndim)


def _get(buf, i, j):
    return jax.lax.dynamic_slice(buf, (i, j) + (0,) * (buf.ndim - 2), (1, 1) + buf.shape[2:])[0, 0]


def _add_row(acc, g, i):
    """acc[i] += g for every leaf: one layer's gradient into its row, in place."""
    return jax.tree.map(lambda a, d: jax.lax.dynamic_update_index_in_dim(a, _at(a, i) + d.astype(a.dtype), i, 0),
                        acc, g)


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
    # The embedding and head are differentiated w.r.t. the parameters outside the layer stack only.
    rest = {key: val for key, val in params.items() if key != layers_key}

    def buf(n, shape, dtype):
        return jnp.zeros((n,) + tuple(shape), dtype)
    carry0 = {
        "fin": buf(sched.slots["fin"] + 1, x_aval.shape, x_aval.dtype),    # + the trash slot
        "bin": buf(sched.slots["bin"] + 1, x_aval.shape, x_aval.dtype),
        "res": [buf(sched.slots["res"], (lc,) + a.shape, a.dtype) for a in res.avals],
        "gch": buf(sched.slots["gch"] if split else 0, (lc,) + x_aval.shape, x_aval.dtype),
        "glayers": jax.tree.map(jnp.zeros_like, layers),
        "grest": jax.tree.map(jnp.zeros_like, rest),
        "loss": jnp.zeros((), jnp.float32),
    }
    zero_x = jnp.zeros(x_aval.shape, x_aval.dtype)

    def ctx(row):
        mb, c = row[_C["mb"]], row[_C["chunk"]]
        # Python bools where the mesh decides alone (one stage, one chunk: every F embeds and runs the
        # head), so no cond is traced there; traced predicates otherwise.
        first = (stage == 0) if v == 1 else (stage == 0) & (c == 0)
        last = (stage == p - 1) if v == 1 else (stage == p - 1) & (c == v - 1)
        return dict(row=row, mb=mb, first=first, last=last, base=c * lc, aux=aux_at(mb),
                    res=row[_C["res"]], bin=row[_C["bin"]], gch=row[_C["gch"]])

    def layer_vjp(k, stash, j):
        wj = _at(layers, k["base"] + j)
        return res.join([_get(s, k["res"], j) for s in stash], wj)

    def forward(k, fin, stash):
        """The chunk's layers on the embedded tokens or the inbox; each layer's residuals into the stash."""
        x = _when(k["first"], lambda: fns.stream(fns.embed(params, _at(mbs["tokens"], k["mb"])).astype(x_aval.dtype)),
                  lambda: fns.stream(fin[k["row"][_C["fin"]]]))

        def body(state, j):
            x, stash = state
            wj = _at(layers, k["base"] + j)
            y, vjp = jax.vjp(lambda w, x: fns.layer(w, x, *k["aux"]), wj, x)
            stash = [_put(s, r, k["res"], j) for s, r in zip(stash, res.split(vjp, wj))]
            return (y, stash), None
        (y, stash), _ = jax.lax.scan(body, (x, stash), jnp.arange(lc))
        return stash, y

    def head(k, state, y):
        """The loss head and its gradient at once: its cotangent waits in the backward inbox."""
        labels = _at(mbs["labels"], k["mb"])
        loss, vjp = jax.vjp(lambda rest, h: fns.head({**rest, layers_key: layers}, h, labels), rest, y)
        g_rest, g_y = vjp(jnp.asarray(seed, loss.dtype))
        return {"loss": state["loss"] + loss, "grest": jax.tree.map(jnp.add, state["grest"], g_rest),
                "bin": jax.lax.dynamic_update_index_in_dim(state["bin"], g_y.astype(x_aval.dtype), k["bin"], 0)}

    def backward(k, stash, bin_, glayers):
        """Input and weight gradients of the chunk, each layer's added into its accumulator row."""
        def body(state, j):
            g, acc = state
            dw, dx = layer_vjp(k, stash, j)(g)
            return (dx, _add_row(acc, dw, k["base"] + j)), None
        (dx, glayers), _ = jax.lax.scan(body, (bin_[k["bin"]], glayers), jnp.arange(lc), reverse=True)
        return glayers, dx

    def backward_input(k, stash, bin_, gch):
        """Input gradients only; the cotangent entering each layer kept for W."""
        def body(state, j):
            g, chain = state
            _, dx = layer_vjp(k, stash, j)(g)
            chain = _put(chain, g, k["gch"], j)
            return (dx, chain), None
        (dx, gch), _ = jax.lax.scan(body, (bin_[k["bin"]], gch), jnp.arange(lc), reverse=True)
        return gch, dx

    def backward_weight(k, stash, gch, glayers):
        def body(acc, j):
            dw, _ = layer_vjp(k, stash, j)(_get(gch, k["gch"], j))
            return _add_row(acc, dw, k["base"] + j), None
        return jax.lax.scan(body, glayers, jnp.arange(lc))[0]

    def embed_grad(k, grest, dx):
        tokens = _at(mbs["tokens"], k["mb"])
        _, vjp = jax.vjp(lambda rest: fns.embed({**rest, layers_key: layers}, tokens).astype(x_aval.dtype), rest)
        (g,) = vjp(dx)
        return jax.tree.map(jnp.add, grest, g)

    fwd_perm = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]
    bwd_perm = [(d, s) for s, d in fwd_perm]

    def tick(carry, rows):
        row = jax.lax.dynamic_index_in_dim(rows, stage, keepdims=False) if p > 1 else rows[0]
        k, op = ctx(row), row[_C["op"]]
        c = dict(carry)
        c["res"], out_f = _maybe(op == F, lambda s: forward(k, c["fin"], s), c["res"], zero_x, place=fns.stream)
        head_state = {key: c[key] for key in ("loss", "grest", "bin")}
        c.update(_maybe(_and(op == F, k["last"]), lambda s: (head(k, s, out_f),), head_state)[0])
        c["glayers"], out_b = _maybe(op == B, lambda g: backward(k, c["res"], c["bin"], g), c["glayers"], zero_x,
                                    place=fns.stream)
        if split:
            c["gch"], dx_i = _maybe(op == BI, lambda g: backward_input(k, c["res"], c["bin"], g), c["gch"],
                                       zero_x, place=fns.stream)
            c["glayers"] = _maybe(op == W, lambda g: (backward_weight(k, c["res"], c["gch"], g),), c["glayers"])[0]
            out_b = jnp.where(op == BI, dx_i, out_b)
        c["grest"] = _maybe(_and((op == B) | (op == BI), k["first"]), lambda g: (embed_grad(k, g, out_b),),
                            c["grest"])[0]
        # Outside any cond: every stage sends and receives every tick (what it did not compute is
        # a zero, or a value its neighbour drops in the trash slot).
        if p > 1:
            out_f = jax.lax.ppermute(out_f, axis, fwd_perm)
            out_b = jax.lax.ppermute(out_b, axis, bwd_perm)
        c["fin"] = jax.lax.dynamic_update_index_in_dim(c["fin"], out_f, row[_C["recv_f"]], 0)
        c["bin"] = jax.lax.dynamic_update_index_in_dim(c["bin"], out_b, row[_C["recv_b"]], 0)
        return c, None

    carry, _ = jax.lax.scan(tick, carry0, table)
    return carry["loss"], {**carry["grest"], layers_key: carry["glayers"]}


__all__ = ["StageFns", "run", "IDLE"]
