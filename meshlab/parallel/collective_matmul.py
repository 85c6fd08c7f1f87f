"""Collective matmul: tensor parallelism's sequence all-gather and reduce-scatter split into
`ppermute` steps, each overlapped with a partial matmul (Wang et al., "Overlap communication with
dependent computation via decomposition", ASPLOS 2023; the shard_map collective-matmul example).

Under sequence parallelism (`act_seq: tensor`) a column-parallel projection (q|k|v, gate|up) needs
its input gathered over the sequence and a row-parallel one (o, down) reduce-scatters its output
back onto the sequence split. Written plainly, each collective finishes before (or starts after)
its GEMM: nothing hides it. Here, with p = tensor shards:

  gathered_matmul  x [b, s/p, d] on each device; p steps: multiply the chunk held, pass it to the
                   previous device while the next one arrives (p-1 ppermutes of one chunk: the
                   bytes of the all-gather), each chunk's product written at its sequence offset.
  scattered_matmul h [b, s, f/p]; p steps: receive the running partial sum of one output chunk,
                   add this device's product for that chunk, pass it on (p-1 ppermutes: the bytes
                   of the reduce-scatter); the last step leaves each device its own chunk, summed.

Autodiff transposes each into the other (a ppermute's transpose is the reverse ppermute), so the
backward overlaps too. The projections sharing an input (q, k, v) share one loop: one chunk moves,
several GEMMs read it, and their input gradients are summed before they travel back. Autodiff saves
the received chunks for the weight gradients (the gathered input, [b, s, d] per projection group
and layer under remat=none) where plain sequence parallelism re-gathers it in the backward: two
all-gathers per layer fewer on the wire, that activation more in memory (sharding_rules/fsdp_tp_sp_cm.yaml).
Under a remat policy the recomputed forward moves the chunks again (meshlab/plan/comm.py counts it).

The model calls these two helpers at its projections; they return the plain einsum unless the
installed rule file sets `strategies.collective_matmul: true` (checked in meshlab/rules.py). The
weight's tensor split is the Megatron one every shipped rule file uses: a column-parallel weight's
leading output dimension, a row-parallel weight's leading contracted dimension; a rule file that
splits a weight otherwise still computes the same values (shard_map reshards on entry), slower.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshlab import compat
from meshlab import rules as rules_mod

AXIS = "tensor"


def _active_size(seq_len: int) -> int:
    """Tensor shards to decompose over, or 0 for the plain einsum."""
    if not rules_mod.strategy("collective_matmul"):
        return 0
    a = rules_mod.active()
    n = a.mesh.shape[AXIS]
    if n == 1:
        raise rules_mod.RulesError(
            f"{a.rules.path}: `strategies.collective_matmul: true` on a mesh with tensor=1: there is no tensor "
            "collective to decompose; give the mesh a tensor axis > 1 (e.g. --mesh fsdp=-1,tensor=2) or use "
            "fsdp_tp_sp / fsdp without collective_matmul")
    if "stage" in a.manual and a.mesh.shape["stage"] > 1:
        # a pipeline forced over a rule file without one (load_rules refuses the file that names both)
        raise rules_mod.RulesError(
            f"{a.rules.path}: `strategies.collective_matmul: true` under a pipeline over stage="
            f"{a.mesh.shape['stage']}: its ppermutes over tensor are collectives of every stage's devices, inside "
            "branches only one stage takes; set `collective_matmul: false` or run on a mesh with stage=1")
    if AXIS in a.manual or seq_len % n:   # already manual (not a shipped layout), or a decode step: plain
        return 0
    return n


def _letters(spec: str):
    ins, out = spec.replace(" ", "").split("->")
    a, w = ins.split(",")
    return a, w, out


def _spec(letters: str, split: str | None) -> P:
    """A spec naming only the tensor axis: on the letter `split`, everything else left to the outer mesh."""
    return P(*(AXIS if c == split else None for c in letters))


def gathered_matmul(mm, spec: str, x, *ws):
    """Column-parallel projections of the sequence-split residual stream: `mm(spec, x_whole, w)` for each
    w, x [b, s, ...] split over the sequence (dim 1) by tensor. Returns a tuple, one output per weight,
    its sequence whole and its leading output feature split over tensor (as the plain einsum's)."""
    n = _active_size(x.shape[1])   # shapes are global here (GSPMD's view); the sequence is whole
    if not n:
        return tuple(mm(spec, x, w) for w in ws)
    a_l, w_l, o_l = _letters(spec)
    split = next(c for c in w_l if c in o_l and c not in a_l)     # the leading output feature

    def local(x, *ws):   # x [b, s/n, ...]: this device's chunk; ws: this device's columns
        idx = jax.lax.axis_index(AXIS)
        chunk = x.shape[1]
        outs = [None] * len(ws)
        for step in range(n):
            src = (idx + step) % n          # the device whose sequence chunk x is now
            if step < n - 1:                # next chunk in flight while this one multiplies
                nxt = jax.lax.ppermute(x, AXIS, perm=[(i, (i - 1) % n) for i in range(n)])
            for j, w in enumerate(ws):
                part = mm(spec, x, w)                                              # [b, s/n, ...]
                if outs[j] is None:
                    outs[j] = jnp.zeros((part.shape[0], chunk * n) + part.shape[2:], part.dtype)  # [b, s, ...]
                outs[j] = jax.lax.dynamic_update_slice_in_dim(outs[j], part, src * chunk, axis=1)
            if step < n - 1:
                x = nxt
        return tuple(outs)

    with jax.named_scope("collective_matmul"):
        return compat.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                                in_specs=(_spec(a_l, a_l[1]),) + (_spec(w_l, split),) * len(ws),
                                out_specs=(_spec(o_l, split),) * len(ws), axis_names={AXIS})(x, *ws)


def scattered_matmul(mm, spec: str, h, w):
    """Row-parallel projection: `mm(spec, h, w)` summed over tensor and left split over the sequence
    (dim 1 of the output), h [b, s, ...] with its contracted feature split over tensor."""
    n = _active_size(h.shape[1])
    if not n:
        return mm(spec, h, w)
    a_l, w_l, o_l = _letters(spec)
    split = next(c for c in w_l if c in a_l and c not in o_l)

    def local(h, w):     # h [b, s, f/n]: the whole sequence, this device's features
        idx = jax.lax.axis_index(AXIS)
        chunk = h.shape[1] // n
        acc = None
        for step in range(n):
            # The partial sum arriving at step `step` ends, after n-1-step more hops forward, at the
            # device that owns its chunk: this device adds its product for chunk idx-1-step.
            dst = (idx - 1 - step) % n
            part = mm(spec, jax.lax.dynamic_slice_in_dim(h, dst * chunk, chunk, axis=1), w)   # [b, s/n, d]
            acc = part if acc is None else jax.lax.ppermute(acc, AXIS, perm=[(i, (i + 1) % n) for i in range(n)]) + part
        return acc

    with jax.named_scope("collective_matmul"):
        return compat.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                                in_specs=(_spec(a_l, split), _spec(w_l, split)), out_specs=_spec(o_l, o_l[1]),
                                axis_names={AXIS})(h, w)
