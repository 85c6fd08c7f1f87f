"""Data-parallel gradient reductions at each weight's point of use, inside the backward layer scan.

ZeRO-2: params are replicated but the gradient accumulator is split over the data-parallel axes.
Left to autodiff, the layer scan's backward writes every layer's full-size gradient into one stacked
[n_layers, ...] buffer and the reduce-scatter runs after it: the full gradient exists at the peak.
Here the step differentiates a *sink* per leaf instead: zeros of the reduced gradient's local shape.
`Tied(w, sink, acc)` stands in the parameter tree where the weight was; the model reads a weight
with `var[...]`, which calls `Tied.__getitem__`: an identity on `w` whose backward reduces the
weight's gradient over the data-parallel axes and hands the result to the sink. Under the layer
scan `w`, `sink` and `acc` are sliced per layer, so the collective sits in the backward loop body
(XLA can overlap it with the next layer's backward) and the stacked buffer holds only the result.

dp / zero1 (DDP's no_sync): earlier micro-batches accumulate locally; in the last one each layer
leaf's tie carries the local sum in (`acc`) and reduces sum + this micro-batch's gradient (dp: psum,
zero1: psum_scatter onto the Adam shards) per layer: one reduction's bytes, as after the backward.

Cost: the same bytes as one reduction after the backward (a tied embedding, used twice, is
reduce-scattered twice under zero2); memory (zero2): one layer's full gradient, transient.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax


def _reduce(g, plan):
    scatters, sums = plan
    for dim, axes in scatters:   # dim counted from the end: the same after the scan drops the layer dim
        g = jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=g.ndim + dim, tiled=True)
    return jax.lax.psum(g, sums) if sums else g


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def tie(w, sink, acc, plan):
    """w, unchanged; its gradient (plus `acc`, the earlier micro-batches' local sum, if any) goes to
    `sink`, reduced as `plan` says: ((scattered dim from the end, axes), ...), summed axes."""
    del sink, acc
    return w


def _tie_fwd(w, sink, acc, plan):
    del sink
    return w, acc


def _tie_bwd(plan, acc, g):
    with jax.named_scope("collectives"):
        return None, _reduce(g if acc is None else g + acc, plan), None


tie.defvjp(_tie_fwd, _tie_bwd)


@partial(jax.tree_util.register_dataclass, data_fields=["w", "sink", "acc"], meta_fields=["plan"])
@dataclasses.dataclass
class Tied:
    """A parameter leaf whose gradient is reduced at use (see the module docstring)."""
    w: jax.Array
    sink: jax.Array
    acc: jax.Array | None
    plan: tuple   # (((dim from the end, mesh axes), ...) scattered, mesh axes summed)

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError("a ZeRO-2 parameter is read whole (var[...]); index the value it returns")
        return tie(self.w, self.sink, self.acc, self.plan)

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
    """ZeRO-2, every micro-batch: scatter the dims the accumulator splits over manual axes the stored
    params do not (each as [(dim, axes)] from step._axes_in); () when there are none."""
    have = {a for _, axes in stored for a in axes}
    plan = []
    for dim, axes in accumulated:
        axes = tuple(a for a in axes if a not in have)
        if axes:
            plan.append((dim - ndim, axes))
    return (tuple(plan), ()) if plan else ()


def final_plan(accumulated: tuple, reduced: tuple, manual: tuple, ndim: int) -> tuple:
    """dp / zero1, last micro-batch: from the accumulator's split to the optimizer's (`reduced`),
    scatter what the optimizer splits further (zero1), sum over the manual axes left (dp)."""
    done = {a for _, axes in accumulated for a in axes}
    scatters = []
    for dim, axes in reduced:
        axes = tuple(a for a in axes if a not in done)
        if axes:
            scatters.append((dim - ndim, axes))
            done |= set(axes)
    sums = tuple(a for a in manual if a not in done)
    return (tuple(scatters), sums) if scatters or sums else ()
