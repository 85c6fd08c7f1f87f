"""ZeRO-2's gradient reduce-scatter at each weight's point of use, inside the backward layer scan.

Params are replicated but the gradient accumulator is split over the data-parallel axes. Left to
autodiff, the layer scan's backward writes every layer's full-size gradient into one stacked
[n_layers, ...] buffer and the reduce-scatter runs after it: the full gradient exists at the peak.
Here the step differentiates a *sink* per leaf instead: zeros of the accumulator's local (sharded)
shape. `Tied(w, sink)` stands in the parameter tree where the weight was; the model reads a weight
with `var[...]`, which calls `Tied.__getitem__`: an identity on `w` whose backward reduce-scatters
the weight's gradient over the data-parallel axes and hands the shard to the sink. Under the layer
scan both `w` and `sink` are sliced per layer, so the reduce-scatter sits in the backward loop body
(XLA can overlap it with the next layer's backward) and the stacked buffer holds only shards.

Cost: the same reduce-scatter bytes per micro-batch as one after the backward (a tied embedding,
used twice, is reduce-scattered twice); memory: one layer's full gradient, transient, instead of all.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax


def _scatter(g, plan):
    for dim, axes in plan:   # dim counted from the end: the same after the scan drops the layer dim
        g = jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=g.ndim + dim, tiled=True)
    return g


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def tie(w, sink, plan):
    """w, unchanged; its gradient goes to `sink`, reduce-scattered as `plan` says."""
    del sink
    return w


def _tie_fwd(w, sink, plan):
    del sink
    return w, None


def _tie_bwd(plan, _, g):
    with jax.named_scope("collectives"):
        return None, _scatter(g, plan)


tie.defvjp(_tie_fwd, _tie_bwd)


@partial(jax.tree_util.register_dataclass, data_fields=["w", "sink"], meta_fields=["plan"])
@dataclasses.dataclass
class Tied:
    """A parameter leaf whose gradient is reduce-scattered at use (see the module docstring)."""
    w: jax.Array
    sink: jax.Array
    plan: tuple   # ((dim from the end, mesh axes), ...)

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError("a ZeRO-2 parameter is read whole (var[...]); index the value it returns")
        return tie(self.w, self.sink, self.plan)

    @property
    def shape(self):
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def ndim(self):
        return self.w.ndim


def scatter_plan(stored: tuple, accumulated: tuple, ndim: int) -> tuple:
    """((dim from the end, axes), ...): the dims the accumulator splits over manual axes the stored
    params do not (each as [(dim, axes)] from step._axes_in)."""
    have = {a for _, axes in stored for a in axes}
    plan = []
    for dim, axes in accumulated:
        axes = tuple(a for a in axes if a not in have)
        if axes:
            plan.append((dim - ndim, axes))
    return tuple(plan)
