"""Expert dispatch for mixture-of-experts layers: tokens grouped by expert, sent to the device that
holds it (all-to-all over the rule file's `experts` axes), computed, sent back, restored to order.

The model routes (models/moe.py: router, top-k, each assignment's place in its row's queue) and
calls `moe_ffn`; the active rule file decides where the experts live:
  experts: expert   expert parallelism. Each device of the `expert` axis holds E/ep experts and
                    its own rows of the batch (`expert` is a batch axis: the dense layers are data
                    parallel over it). Tokens travel by all-to-all; the weights never move.
  mlp: tensor       each expert's hidden width split Megatron-style (gate/up column-parallel, down
                    row-parallel, one psum over `tensor` after the down projection).
Inside the train step's shard_map the batch axes are already manual; anything still Auto
(tensor, or everything in an eval/serving program) becomes manual in a nested shard_map here.

Two dispatch modes (`strategies.experts.dispatch` of the rule file):
  capacity  each row of the batch gives every expert at most C = ceil(factor * s * k / E)
            assignments, first choices first, then by position (GShard's priority). Those past C
            are dropped (the residual stream carries the token on; the step reports the count).
            C depends on the row only, so the same tokens drop on 1 device and on 8. Buffers are
            [E, rows, C, d]: one plain all_to_all each way and a padded batched GEMM.
  dropless  every assignment is computed: rows sorted by expert, grouped GEMMs over ragged
            groups (pallas_kernels/grouped_matmul.py). With ep > 1 each device sends each peer
            the rows for the peer's experts. Receive buffer: ep * A rows, A = local rows * s * k,
            the exact worst case (every assignment of every peer lands on this device), so it
            cannot overflow; the price is ep times the local assignment buffer in memory. The
            exchange is `ragged_all_to_all` on GPU (only the rows sent move) and an all_to_all
            of the padded [ep, A, d] buffer elsewhere (XLA:CPU cannot compile the ragged one):
            same layout, same result.

Overlap (`strategies.experts.chunks: n`, default 1): each device's dispatch is cut into n pieces,
each exchanged, computed and returned on its own, so the all-to-all of piece i+1 depends on nothing
piece i computes and XLA's latency-hiding scheduler (meshlab/xla_flags.py) can run it under piece
i's expert GEMMs. Routing, capacity and drops are decided before the cut, so they do not change.
  capacity  the [E, rows*C, d] buffer's token slots split into n pieces of ceil(rows*C/n) (the last
            padded with empty slots when n does not divide rows*C): n all-to-alls of 1/n the bytes
            each way.
  dropless  the rows sent to each peer split into n near-equal pieces (piece c of P rows: rows
            ceil(cP/n) .. ceil((c+1)P/n)), each a [ep, ceil(A/n), d] buffer: still the exact worst
            case, so still no overflow. On one device (nothing to exchange) the sorted rows are cut
            into n static slices: it prices the smaller GEMMs alone.
The cost: n smaller GEMMs, n partial weight gradients summed (one [E/ep, d, f] read per extra piece
and weight) and, dropless with ep > 1, a re-sort of each received piece by expert.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshlab import compat
from meshlab import rules as rules_mod
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.swiglu import silu_mul

DISPATCH = ("dropless", "capacity")
DEFAULT = {"dispatch": "dropless", "capacity_factor": 1.25, "chunks": 1}
F32 = jnp.float32


def settings() -> dict:
    """The active rule file's `strategies.experts` over the defaults (dropless, factor 1.25, 1 chunk)."""
    return {**DEFAULT, **(rules_mod.strategy("experts") or {})}


def queue_positions(expert_idx, n_experts: int):
    """expert_idx [b, s, k] -> each assignment's place in its row's queue for its expert [b, s, k].
    Order: the row's first choices by position, then its second choices, ... (GShard)."""
    b, s, k = expert_idx.shape
    flat = jnp.swapaxes(expert_idx, 1, 2).reshape(b, k * s)                  # [b, k*s] slot-major
    onehot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)                # [b, k*s, E]
    pos = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)        # [b, k*s]
    return jnp.swapaxes(pos.reshape(b, k, s), 1, 2)                          # [b, s, k]


def row_capacity(seq: int, top_k: int, n_experts: int, factor: float) -> int:
    """Assignments one row may give one expert in capacity mode."""
    return max(1, math.ceil(factor * seq * top_k / n_experts))


def moe_ffn(x, route, weights, *, dispatch: str, capacity: int, backend: str = "auto", chunks: int = 1):
    """x [b, s, d]; route = (expert_idx, combine_w, keep, pos), each [b, s, k] (combine_w fp32);
    weights = (w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d]) in the compute dtype -> [b, s, d].
    chunks: pieces the dispatch is cut into (exchange of one piece overlaps the GEMMs of another)."""
    if dispatch not in DISPATCH:
        raise ValueError(f"expert dispatch {dispatch!r} must be one of {DISPATCH}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"expert dispatch chunks={chunks!r} must be a whole number >= 1 "
                         "(strategies.experts.chunks in the rule file)")
    act = rules_mod.active()
    if act is None:
        return _local(x, *route, *weights, dispatch=dispatch, capacity=capacity, ep_axes=(), ep=1, tp_axes=(),
                      backend=backend, chunks=chunks)
    mesh, r = act.mesh, act.rules
    ep_axes, batch = r.axes("experts", mesh), r.axes("act_batch", mesh)
    # The width is split Megatron-style only over axes that are still Auto and do not split the rows: over
    # a manual (batch) axis, or an Auto one that act_batch splits the tokens over in the shard_map below,
    # the ranks hold different rows and the weight arrives whole there (gathered, or stored replicated),
    # so a psum over it would add other rows' outputs.
    tp_axes = tuple(a for a in r.axes("mlp", mesh) if a not in act.manual and a not in batch)
    if not set(ep_axes) <= set(batch):
        raise rules_mod.RulesError(f"{r.path}: rule `experts: {list(ep_axes)}` needs those axes in `act_batch` and "
                                   f"`batch:` too (expert-parallel ranks hold different rows); act_batch is "
                                   f"{list(batch)}")
    kw = dict(dispatch=dispatch, capacity=capacity, ep_axes=ep_axes, ep=math.prod(mesh.shape[a] for a in ep_axes),
              tp_axes=tp_axes, backend=backend, chunks=chunks)
    auto = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in act.manual)
    if not auto:
        return _local(x, *route, *weights, **kw)
    keep = lambda axes: tuple(a for a in axes if a in auto)  # noqa: E731
    one = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
    tok = P(one(keep(batch)))
    w_in, w_out = P(one(keep(ep_axes)), None, one(keep(tp_axes))), P(one(keep(ep_axes)), one(keep(tp_axes)), None)

    # An input replicated over an Auto axis (the tokens over the width split, a weight over the batch's) gets
    # its cotangent psummed over it by shard_map's transpose: on XLA:CPU a bf16 one aborts (compat.all_gather's
    # note), so there the tokens and weights cross the boundary in fp32.
    dtypes = (x.dtype,) + tuple(w.dtype for w in weights)
    widen = lambda a: a.astype(jnp.float32) if compat.bf16_on_cpu(a.dtype) else a  # noqa: E731

    def local(x, idx, comb, kp, pos, wg, wu, wd):
        x, wg, wu, wd = (a.astype(dt) for a, dt in zip((x, wg, wu, wd), dtypes))
        return _local(x, idx, comb, kp, pos, wg, wu, wd, **kw)

    return compat.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=(tok,) * 5 + (w_in, w_in, w_out),
                            out_specs=tok, axis_names=set(auto))(widen(x), *route, *map(widen, weights))


# -- per device -----------------------------------------------------------------------------------
def _local(x, idx, comb, keep, pos, wg, wu, wd, *, dispatch, capacity, ep_axes, ep, tp_axes, backend, chunks):
    """Everything manual: x [b, s, d] this device's rows, weights its E/ep experts (and f/tp width)."""
    b, s, d = x.shape
    k = idx.shape[-1]
    if dispatch == "capacity":
        y = _capacity(x, idx, keep, pos, wg, wu, wd, capacity, ep_axes, ep, tp_axes, chunks)  # [b*s*k, d]
    else:
        y = _dropless(x.reshape(b * s, d), idx.reshape(-1), wg, wu, wd, ep_axes, ep, tp_axes, backend, k, chunks)
    y = y.reshape(b, s, k, d).astype(F32) * comb[..., None]                  # [b, s, k, d]
    return jnp.sum(y, axis=2).astype(x.dtype)


def _tp_sum(y, tp_axes):
    """The down projection's partial sums over the expert width split (row-parallel)."""
    return compat.psum(y, tp_axes) if tp_axes else y


def _exchange(buf, axes, split_axis, concat_axis):
    return jax.lax.all_to_all(buf, axes if len(axes) > 1 else axes[0], split_axis, concat_axis, tiled=True)


def _bounds(c, total, n):
    """First row of piece c when `total` rows are cut into n near-equal pieces: ceil(c * total / n)."""
    return (c * total + n - 1) // n


def _capacity(x, idx, keep, pos, wg, wu, wd, C, ep_axes, ep, tp_axes, n):
    """Padded buffers [E, b, C, d], their b*C token slots cut into n pieces; returns each assignment's
    expert output [b*s*k, d] (0 if dropped)."""
    b, s, d = x.shape
    k = idx.shape[-1]
    E = wg.shape[0] * ep
    e = idx.reshape(-1)                                                      # [A]
    row = jnp.repeat(jnp.arange(b), s * k)                                   # [A]
    slot = jnp.where(keep, pos, C).reshape(-1)                               # [A]; C: out of bounds, dropped
    src = jnp.broadcast_to(x[:, :, None, :], (b, s, k, d)).reshape(-1, d)    # [A, d]
    buf = jnp.zeros((E, b, C, d), x.dtype).at[e, row, slot].set(src, mode="drop")
    buf = buf.reshape(E, b * C, d)                                           # [E, bC, d]
    tc = -(-b * C // n)                                                      # slots per piece
    buf = jnp.pad(buf, ((0, 0), (0, n * tc - b * C), (0, 0)))                # [E, n*tc, d]
    y = [_capacity_piece(buf[:, i * tc:(i + 1) * tc], wg, wu, wd, ep_axes, ep, tp_axes) for i in range(n)]
    y = jnp.concatenate(y, axis=1)[:, :b * C].reshape(E, b, C, d)            # [E, b, C, d]
    return y.at[e, row, slot].get(mode="fill", fill_value=0)                 # [A, d]


def _capacity_piece(buf, wg, wu, wd, ep_axes, ep, tp_axes):
    """[E, t, d] token slots -> to the experts' owners, padded batched GEMMs, back -> [E, t, d]."""
    if ep > 1:
        buf = _exchange(buf, ep_axes, 0, 1)                                  # [E/ep, ep*t, d] source-major
    h = silu_mul(jnp.einsum("etd,edf->etf", buf, wg), jnp.einsum("etd,edf->etf", buf, wu))  # [El, t', f]
    y = _tp_sum(jnp.einsum("etf,efd->etd", h, wd), tp_axes)                  # [El, t', d]
    return _exchange(y, ep_axes, 1, 0) if ep > 1 else y                      # [E, t, d]


def _expert_mlp(xs, wg, wu, wd, group_sizes, tp_axes, backend, all_rows=False):
    """Rows sorted by local expert xs [R, d] -> [R, d]; rows past sum(group_sizes) give 0 (all_rows: none)."""
    gmm = lambda a, w: grouped_matmul(a, w, group_sizes, backend=backend, all_rows=all_rows)  # noqa: E731
    h = silu_mul(gmm(xs, wg), gmm(xs, wu))      # [R, f]; saves gate and up, not fp32 intermediates
    return _tp_sum(gmm(h, wd), tp_axes)                                      # [R, d]


def _inverse(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


@jax.custom_vjp
def _permute(x, order, inverse):
    """x[order] for a permutation `order` whose inverse is `inverse`. Autodiff would transpose the gather
    into a scatter-add (atomics on GPU); a permutation's transpose is the inverse gather."""
    return x[order]


def _permute_fwd(x, order, inverse):
    return x[order], (order, inverse)


def _permute_bwd(res, g):
    order, inverse = res
    return g[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _dropless(xt, e, wg, wu, wd, ep_axes, ep, tp_axes, backend, k, n):
    """xt [T, d] tokens, e [A = T*k] their experts -> expert outputs [A, d] in assignment order."""
    El = wg.shape[0]
    E = El * ep
    A, d = e.shape[0], xt.shape[1]
    order = jnp.argsort(e, stable=True)                                      # [A] grouped by expert
    inv = _inverse(order)
    xa = jnp.broadcast_to(xt[:, None, :], (xt.shape[0], k, d)).reshape(-1, d)  # [A, d]
    xs = _permute(xa, order, inv)                                            # [A, d] sorted by expert
    counts = jnp.bincount(e, length=E).astype(jnp.int32)                     # [E]
    if ep == 1:
        return _permute(_dropless_one_device(xs, counts, wg, wu, wd, tp_axes, backend, n), inv, order)
    dest = e[order] // El                                                    # [A] owner device, ascending
    per_dest = counts.reshape(ep, El).sum(axis=1)                            # [ep]
    offset = jnp.arange(A) - (jnp.cumsum(per_dest) - per_dest)[dest]         # [A] place in dest's block
    sent = jnp.maximum(per_dest[dest], 1)                                    # [A] rows for that dest
    piece = offset * n // sent                                               # [A] its piece (balanced)
    slot = offset - _bounds(piece, sent, n)                                  # [A] place in that piece
    Ac = -(-A // n)                                                          # piece bound: ceil(A/n)
    send = jnp.zeros((n, ep, Ac, d), xt.dtype).at[piece, dest, slot].set(xs)  # [n, ep, Ac, d]
    recv_counts = _exchange(counts.reshape(ep, El), ep_axes, 0, 0)           # [ep src, El]
    recv_total = recv_counts.sum(axis=1)                                     # [ep src]
    ends = jnp.cumsum(recv_counts, axis=1)                                   # [ep, El]
    back = []
    for c in range(n):
        s_lo, s_hi = _bounds(c, per_dest, n), _bounds(c + 1, per_dest, n)    # [ep] rows of piece c sent
        r_lo, r_hi = _bounds(c, recv_total, n), _bounds(c + 1, recv_total, n)  # [ep] and received
        recv = exchange_rows(send[c], s_hi - s_lo, r_hi - r_lo, ep_axes)      # [ep src, Ac, d]
        yr = _received_piece(recv, ends, r_lo, r_hi, wg, wu, wd, tp_axes, backend)
        back.append(exchange_rows(yr, r_hi - r_lo, s_hi - s_lo, ep_axes))      # [ep dest, Ac, d]
    ret = jnp.stack(back)                                                    # [n, ep, Ac, d]
    return _permute(ret[piece, dest, slot], inv, order)                      # [A, d]


def _received_piece(recv, ends, r_lo, r_hi, wg, wu, wd, tp_axes, backend):
    """recv [ep src, Ac, d]: block i holds rows r_lo[i]..r_hi[i] of source i's block (sorted by local
    expert, `ends` [ep, El] its cumulative counts), then padding -> expert outputs in the same layout."""
    ep, Ac, d = recv.shape
    El = ends.shape[1]
    at = r_lo[:, None] + jnp.arange(Ac)[None, :]                             # [ep, Ac] place in the source's block
    local_e = jax.vmap(lambda en, p: jnp.searchsorted(en, p, side="right"))(ends, at)  # [ep, Ac]
    local_e = jnp.where(at < r_hi[:, None], local_e, El)                     # El = padding
    order2 = jnp.argsort(local_e.reshape(-1), stable=True)                   # [ep*Ac] by local expert
    inv2 = _inverse(order2)
    lo, hi = r_lo[:, None], r_hi[:, None]
    starts = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=1)  # [ep, El]
    sizes = (jnp.clip(ends, lo, hi) - jnp.clip(starts, lo, hi)).sum(axis=0)  # [El] rows per local expert
    xr = _permute(recv.reshape(ep * Ac, d), order2, inv2)                    # [ep*Ac, d]
    yr = _expert_mlp(xr, wg, wu, wd, sizes.astype(jnp.int32), tp_axes, backend)
    return _permute(yr, inv2, order2).reshape(ep, Ac, -1)                    # [ep src, Ac, d]


def _dropless_one_device(xs, counts, wg, wu, wd, tp_axes, backend, n):
    """Nothing to exchange: xs [A, d] sorted by expert, cut into n static slices (each still sorted),
    every row real -> [A, d]."""
    A = xs.shape[0]
    ends = jnp.cumsum(counts)                                                # [E]
    starts = ends - counts
    out = []
    for c in range(n):
        lo, hi = _bounds(c, A, n), _bounds(c + 1, A, n)                      # static
        if hi == lo:                                                         # more pieces than rows
            continue
        sizes = (jnp.clip(ends, lo, hi) - jnp.clip(starts, lo, hi)).astype(jnp.int32)  # [E], sum hi - lo
        out.append(_expert_mlp(xs[lo:hi], wg, wu, wd, sizes, tp_axes, backend, all_rows=True))
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=0)         # [A, d]


def exchange_rows(buf, send_sizes, recv_sizes, ep_axes, impl: str = "auto"):
    """buf [ep, A, d]: block j holds send_sizes[j] rows for peer j, then padding -> [ep, A, d]: block i
    holds the recv_sizes[i] rows peer i sent, then zeros. `ragged` moves only the rows (GPU);
    `padded` moves whole blocks with all_to_all (the padding is zero, so the results agree)."""
    impl = ("ragged" if jax.default_backend() == "gpu" else "padded") if impl == "auto" else impl
    if impl == "padded":
        return _exchange(buf, ep_axes, 0, 0)
    ep, A, d = buf.shape
    name = ep_axes if len(ep_axes) > 1 else ep_axes[0]
    me = jax.lax.axis_index(name)
    starts = jnp.arange(ep, dtype=jnp.int32) * A
    out = jax.lax.ragged_all_to_all(buf.reshape(ep * A, d), jnp.zeros((ep * A, d), buf.dtype), starts,
                                    send_sizes.astype(jnp.int32), jnp.full((ep,), me * A, jnp.int32),
                                    recv_sizes.astype(jnp.int32), axis_name=name)
    return out.reshape(ep, A, d)
