"""Ring attention: context parallelism with keys/values travelling around the `context` ring.

Each device keeps its query shard. Key/value shards (and their segment ids) move one hop per
step with `ppermute`; the send for the next step is issued before this step's attention so
XLA's async collective-permute can hide it behind the block computation. Partial results are
merged with the log-sum-exp rule. The backward pass (a `jax.custom_vjp`; the forward runs outside
it, so remat="save_dots_attn" keeps its output and lse) runs the same ring: k/v travel again
together with their dK/dV accumulators, which take one extra hop at the end to get home. Nothing
of size S x S is ever formed: the per-block jnp attention is itself tiled over keys (`block_k`),
so per-device temporaries are ~ (S / context) x block_k.

Causal load balance (zig-zag). With a contiguous split device n-1 attends to everything and
device 0 to one block. Instead the global sequence is cut into 2n chunks and device i holds
chunks i and 2n-1-i (`zigzag_permutation`); then every device computes 2n+1 of the
(half-shard x half-shard) blocks. The caller must put the sequence in that order before
sharding (see meshlab/parallel/context.py). The schedule -- which (q chunk, kv chunk) pairs
each device computes at each step, and with which mask -- is the pure function
`ring_schedule`; the traced code is generated from it, so what tests count is what runs.

Composition: batch and head dims may be sharded over other mesh axes (`batch_axes`,
`head_axes`), and the call may sit inside the training step's shard_map that is already manual
over the data-parallel axes (those axes then drop out of the specs; see `shard_map_region`).

Layout: q [b, s, h, d], k/v [b, s, kvh, d] (GQA: h a multiple of kvh), lse [b, h, s] fp32.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshlab.parallel.attention_blocks import (NEG, _block_fns, jnp_block_bwd, jnp_block_fwd,  # noqa: F401
                                               jnp_flash_attention, resolve_block_impl)
from meshlab.mesh import axes_entry, entry_axes
from pallas_kernels.flash_attention import output_grad_rowsum
from pallas_kernels.flash_residuals import attention_with_saved_forward, named_residuals


# ----------------------------------------------------------------------------- zig-zag order
def zigzag_permutation(seq_len: int, n: int) -> np.ndarray:
    """Indices `perm` with x_zigzag = x[perm]: shard i of the result is chunks (i, 2n-1-i)."""
    if seq_len % (2 * n):
        raise ValueError(f"zig-zag needs the sequence length ({seq_len}) divisible by 2 x context "
                         f"size ({2 * n}); pad the sequence or change the context size")
    c = seq_len // (2 * n)
    chunks = [np.arange(j * c, (j + 1) * c) for j in range(2 * n)]
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def zigzag_inverse_permutation(seq_len: int, n: int) -> np.ndarray:
    """Indices undoing `zigzag_permutation`: x == x_zigzag[inverse]."""
    return np.argsort(zigzag_permutation(seq_len, n))


def _chunks_of(device: int, n: int, zigzag: bool) -> tuple[int, int]:
    """Global chunk indices (out of 2n) held by `device`, in local order."""
    return (device, 2 * n - 1 - device) if zigzag else (2 * device, 2 * device + 1)


# ----------------------------------------------------------------------------- schedule
class BlockPair(NamedTuple):
    q_chunk: int   # global chunk index (of 2n) of the queries
    kv_chunk: int  # global chunk index of the keys/values
    kind: str      # "full" (no causal mask) or "causal" (the diagonal chunk)


def ring_schedule(n: int, *, causal: bool = True, zigzag: bool = True) -> list[list[tuple[BlockPair, ...]]]:
    """schedule[device][step]: the half-shard blocks `device` computes at ring step `step`.

    At step t device i holds the k/v shard of device (i - t) mod n. A pair whose keys all lie
    after its queries (causal) is fully masked and is left out: that is the skipping.
    """
    sched = []
    for i in range(n):
        steps = []
        for t in range(n):
            j = (i - t) % n
            pairs = []
            for qc in _chunks_of(i, n, zigzag):
                for kc in _chunks_of(j, n, zigzag):
                    if not causal or kc < qc:
                        pairs.append(BlockPair(qc, kc, "full"))
                    elif kc == qc:
                        pairs.append(BlockPair(qc, kc, "causal"))
            steps.append(tuple(pairs))
        sched.append(steps)
    return sched


def blocks_per_device(schedule) -> list[int]:
    """Number of computed (not skipped) half-shard blocks per device."""
    return [sum(len(s) for s in steps) for steps in schedule]


class _Call(NamedTuple):
    q_halves: tuple[int, ...]   # contiguous local halves of the query shard (0, 1 or both)
    kv_halves: tuple[int, ...]  # contiguous local halves of the k/v shard
    causal: bool                # bottom-right aligned causal mask (the diagonal is the last kv half)


def _plan(pairs: tuple[BlockPair, ...], i: int, j: int, n: int, zigzag: bool):
    """Turn one device-step's pairs into as few attention calls as possible (bigger calls run
    faster). Returns a hashable tuple of _Call in local half indices."""
    qloc = {c: a for a, c in enumerate(_chunks_of(i, n, zigzag))}
    kloc = {c: b for b, c in enumerate(_chunks_of(j, n, zigzag))}
    per_q: dict[int, list[tuple[int, str]]] = {}
    for p in pairs:
        per_q.setdefault(qloc[p.q_chunk], []).append((kloc[p.kv_chunk], p.kind))
    calls = []
    for a, kvs in sorted(per_q.items()):
        kvs.sort()
        kinds = [k for _, k in kvs]
        # The diagonal pair, when present, is the last kv half (local order follows positions).
        assert "causal" not in kinds[:-1]
        causal = kinds[-1] == "causal"
        halves = tuple(b for b, _ in kvs)
        calls.append(_Call((a,), halves, causal))
    if len(calls) == 2 and calls[0][1:] == calls[1][1:] and not calls[0].causal:  # same kv, no mask
        calls = [_Call((0, 1), calls[0].kv_halves, False)]
    return tuple(calls)


# ----------------------------------------------------------------------------- the ring
@dataclasses.dataclass(frozen=True)
class _Cfg:
    n: int
    axis: str
    causal: bool
    zigzag: bool
    scale: float
    block_impl: str
    block_k: int

    @functools.cached_property
    def steps(self):
        """Per step: (distinct plans, per-device index into them) -- derived from ring_schedule."""
        sched = ring_schedule(self.n, causal=self.causal, zigzag=self.zigzag)
        out = []
        for t in range(self.n):
            plans = [_plan(sched[i][t], i, (i - t) % self.n, self.n, self.zigzag) for i in range(self.n)]
            distinct = sorted(set(plans))
            out.append((distinct, np.array([distinct.index(p) for p in plans], np.int32)))
        return out


def _sl(halves, c):
    return slice(halves[0] * c, (halves[-1] + 1) * c)


def _run_step(cfg, t, fn, *operands):
    """Call fn(plan, *operands) with this device's plan for step t (a switch only if plans differ)."""
    plans, table = cfg.steps[t]
    if len(plans) == 1:
        return fn(plans[0], *operands)
    idx = jnp.asarray(table)[lax.axis_index(cfg.axis)]
    return lax.switch(idx, [functools.partial(fn, p) for p in plans], *operands)


def _fwd_local(cfg, q, k, v, q_seg, kv_seg):
    block_fwd, _ = _block_fns(cfg.block_impl, cfg.block_k)
    b, sl, h, d = q.shape
    c = sl // 2
    perm = [(i, (i + 1) % cfg.n) for i in range(cfg.n)]

    def apply(plan, o, lse, kv):
        kk, vv, ks = kv
        for call in plan:
            qs, ksl = _sl(call.q_halves, c), _sl(call.kv_halves, c)
            ob, lb = block_fwd(q[:, qs], kk[:, ksl], vv[:, ksl], None if q_seg is None else q_seg[:, qs],
                               None if ks is None else ks[:, ksl], causal=call.causal, scale=cfg.scale)
            # Merge: m = max of the two log-sum-exps; both partial results are rescaled by
            # exp(lse_part - m), i.e. the old accumulator by exp(m_old - m_new).
            lo = lse[:, :, qs]
            m = jnp.maximum(lo, lb)
            wo, wb = jnp.exp(lo - m), jnp.exp(lb - m)
            den = wo + wb
            to_o = lambda w: jnp.swapaxes(w / den, 1, 2)[..., None]  # noqa: E731  [b,h,q]->[b,q,h,1]
            o = o.at[:, qs].set(o[:, qs] * to_o(wo) + ob * to_o(wb))
            lse = lse.at[:, :, qs].set(m + jnp.log(den))
        return o, lse

    o = jnp.zeros((b, sl, h, d), jnp.float32)
    lse = jnp.full((b, h, sl), NEG, jnp.float32)
    kv = (k, v, kv_seg)
    for t in range(cfg.n):
        nxt = lax.ppermute(kv, cfg.axis, perm) if t < cfg.n - 1 else None  # in flight during compute
        o, lse = _run_step(cfg, t, lambda plan, o, lse, kv: apply(plan, o, lse, kv), o, lse, kv)
        kv = nxt
    return o.astype(q.dtype), lse


def _bwd_local(cfg, q, k, v, q_seg, kv_seg, o, lse, do):
    _, block_bwd = _block_fns(cfg.block_impl, cfg.block_k)
    b, sl, h, d = q.shape
    c = sl // 2
    perm = [(i, (i + 1) % cfg.n) for i in range(cfg.n)]
    delta = output_grad_rowsum(o, do)                                                          # [b, h, sl]

    def apply(plan, dq, dk, dv, kv):
        kk, vv, ks = kv
        for call in plan:
            qs, ksl = _sl(call.q_halves, c), _sl(call.kv_halves, c)
            gq, gk, gv = block_bwd(q[:, qs], kk[:, ksl], vv[:, ksl], do[:, qs], lse[:, :, qs], delta[:, :, qs],
                                   None if q_seg is None else q_seg[:, qs], None if ks is None else ks[:, ksl],
                                   causal=call.causal, scale=cfg.scale)
            dq = dq.at[:, qs].add(gq)
            dk = dk.at[:, ksl].add(gk)
            dv = dv.at[:, ksl].add(gv)
        return dq, dk, dv

    dq = jnp.zeros(q.shape, jnp.float32)
    # dK/dV travel with the k/v shard they belong to, in fp32 because each is a sum over up to n
    # devices' contributions: per hop that is 2x the bytes of bf16 k/v (the backward's main traffic).
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    kv = (k, v, kv_seg)
    for t in range(cfg.n):
        nxt = lax.ppermute(kv, cfg.axis, perm) if t < cfg.n - 1 else None
        dq, dk, dv = _run_step(cfg, t, lambda plan, dq, dk, dv, kv: apply(plan, dq, dk, dv, kv), dq, dk, dv, kv)
        if cfg.n > 1:  # after the last step this hop brings dK/dV back to their owner
            dk, dv = lax.ppermute((dk, dv), cfg.axis, perm)
        kv = nxt
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def shard_map_region(mesh, axis_name, *axis_groups):
    """(mesh, axis_names, axis groups) for a shard_map that may be nested in a manual region.

    The training step is itself a shard_map, manual over the data-parallel axes. Inside it the
    arrays are already local along those axes, so they are dropped from our specs, and the
    inner shard_map must be given the context's abstract mesh and made manual over the rest.
    """
    am = jax.sharding.get_abstract_mesh()
    live = am is not None and not getattr(am, "empty", True)
    manual = frozenset(getattr(am, "manual_axes", ()) or ()) if live else frozenset()
    if axis_name in manual:
        raise ValueError(f"'{axis_name}' is already manual here (inside a shard_map over it); "
                         "call context attention outside that region")

    def drop(axes):
        return axes_entry(a for a in entry_axes(axes) if a not in manual)
    groups = tuple(drop(tuple(g) if isinstance(g, list) else g) for g in axis_groups)
    if not manual:
        return mesh, None, groups
    return am, frozenset(a for a in am.axis_names if a not in manual), groups


def _axis_size(mesh, axes) -> int:
    axes = entry_axes(axes)
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


@functools.lru_cache(maxsize=None)
def _build(cfg: _Cfg, mesh, axis_names, batch_axes, head_axes, has_seg: bool):
    qs = P(batch_axes, cfg.axis, head_axes, None)
    ss = P(batch_axes, cfg.axis)
    ls = P(batch_axes, head_axes, cfg.axis)
    segs = (ss, ss) if has_seg else ()

    # check_vma=False: the block code is mesh-agnostic (its scan carries start replicated) and
    # Pallas calls need it; safe because JAX never differentiates these regions (the forward runs on
    # stop_gradient inputs and the custom_vjp below supplies the backward ring).
    def smap(f, in_specs, out_specs):
        kw = {} if axis_names is None else {"axis_names": set(axis_names)}
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **kw)

    def unpack(args):
        return (*args, None, None) if not has_seg else args

    fwd_sm = smap(lambda *a: _fwd_local(cfg, *unpack(a)), (qs, qs, qs, *segs), (qs, ls))
    bwd_sm = smap(lambda *a: _bwd_local(cfg, *unpack(a[:-3]), *a[-3:]), (qs, qs, qs, *segs, qs, ls, qs), (qs, qs, qs))

    def fwd(q, k, v, *segs_):
        return named_residuals(*fwd_sm(q, k, v, *segs_))

    def bwd(inputs, outs, cts):
        q, k, v, *segs_ = inputs
        return bwd_sm(q, k, v, *segs_, *outs, cts[0])

    # The ring forward runs outside the custom_vjp and its (o, lse) enter it as named inputs
    # (pallas_kernels/flash_residuals.py): remat="save_dots_attn" keeps them, and the backward then
    # runs one ring (k/v and dK/dV hops) instead of two (the forward's again, then the backward's).
    def attn(q, k, v, *segs_):
        return attention_with_saved_forward(fwd, bwd, (q, k, v, *segs_), n_diff=3, n_ret=1)[0]
    return attn


# Keys per tile of the jnp blocks where they divide a block's keys (the planner's memory_context reads it)
BLOCK_K = 512


def ring_attention(q, k, v, *, mesh, axis_name: str = "context", causal: bool = True, segment_ids=None,
                   sm_scale=None, zigzag: bool = True, block_impl: str = "jnp", batch_axes=None,
                   head_axes=None, block_k: int = BLOCK_K):
    """Attention over a sequence sharded along `axis_name` of `mesh`, by ring.

    q [b, s, h, d], k/v [b, s, kvh, d]: global arrays; the sequence dim is split over
    `axis_name`, the batch dim over `batch_axes` and both head dims over `head_axes` (mesh
    axis name, tuple of names, or None). With `causal and zigzag` the sequence must already be
    in zig-zag order (`zigzag_permutation(s, context size)`); the output is in the same order.
    segment_ids: [b, s] int (same order as q), or a (q_ids, kv_ids) pair; tokens attend only
    within their segment. block_impl: "jnp" (tiled over `block_k` keys; a causal diagonal call
    computes its masked half too), "pallas" (`pallas_kernels.flash_attention` block kernels,
    GPU; skips masked tiles) or "auto" (pallas on GPU when usable, else jnp).
    Returns [b, s, h, d] in q.dtype.
    """
    n = mesh.shape[axis_name]
    b, s, h, d = q.shape
    if k.shape[1] != s or v.shape != k.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"ring attention is self-attention: got q {q.shape}, k {k.shape}, v {v.shape}")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[2]})")
    if s % (2 * n):
        raise ValueError(f"ring attention needs the sequence length ({s}) divisible by 2 x the "
                         f"'{axis_name}' size ({2 * n}); pad the sequence")
    scale = float(sm_scale) if sm_scale is not None else d ** -0.5
    block_impl = resolve_block_impl(block_impl, d)
    cfg = _Cfg(n, axis_name, bool(causal), bool(zigzag) and bool(causal), scale, block_impl, int(block_k))
    _block_fns(block_impl, block_k)  # fail early with the clear message
    mesh, axis_names, (batch_axes, head_axes) = shard_map_region(mesh, axis_name, batch_axes, head_axes)
    if k.shape[2] % _axis_size(mesh, head_axes):
        raise ValueError(f"kv heads ({k.shape[2]}) must be divisible by the head axes {head_axes} "
                         f"({_axis_size(mesh, head_axes)}); replicate kv heads over them or change the rule")
    fn = _build(cfg, mesh, axis_names, batch_axes, head_axes, segment_ids is not None)
    if segment_ids is None:
        return fn(q, k, v)
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    return fn(q, k, v, q_ids, kv_ids)
