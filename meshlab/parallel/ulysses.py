"""All-to-all (DeepSpeed-Ulysses style) context parallelism over the mesh axis `context`.

Around attention the sharding is switched from sequence to heads with one `all_to_all` per
tensor: each device then holds the *whole* sequence for h / n query heads (and kvh / n kv
heads), runs ordinary single-device attention, and a last `all_to_all` switches the output
back to sequence sharding. Communication per device per layer is ~ 4 x (b s h d / n) elements
(q, k, v in, out back; less k/v with GQA) independent of the ring's n steps -- cheaper than
the ring when heads are plentiful and the interconnect has good all-to-all bandwidth, but the
context size is capped by the number of (kv) heads, and the local attention needs memory for
the full sequence of h / n heads (use a flash kernel as `attention_fn` for long S).

Segment ids are small ([b, s] int32) and every head needs the whole sequence's ids, so they are
all-gathered along the sequence; k and v are never gathered.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshlab.parallel.ring_attention import (_axis_size, shard_map_region, zigzag_inverse_permutation,
                                             zigzag_permutation)


def _default_attention(q, k, v, *, causal, segment_ids=None, sm_scale=None):
    from pallas_kernels.attention import xla_attention
    return xla_attention(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)


def kv_head_repeats(kv_heads_local: int, heads_local: int, n: int) -> int:
    """How many times each local kv head is repeated before the all-to-all (1 = none).

    The query heads are split into n contiguous groups; a group must find its kv heads on the
    same device. When kv heads are fewer than n, each kv head is copied n / kvh times (costs
    that much more k/v traffic and memory; said aloud because it is a replication)."""
    if heads_local % n:
        raise ValueError(f"ulysses attention needs the (per-device) query heads ({heads_local}) divisible by "
                         f"the context size ({n}); use fewer context shards, more heads, or ring attention")
    if kv_heads_local % n == 0:
        return 1
    if n % kv_heads_local == 0:
        return n // kv_heads_local
    raise ValueError(f"ulysses attention needs the (per-device) kv heads ({kv_heads_local}) divisible by the "
                     f"context size ({n}), or dividing it (then kv heads are replicated); "
                     "use ring attention or another context size")


def ulysses_attention(q, k, v, *, mesh, axis_name: str = "context", causal: bool = True, segment_ids=None,
                      sm_scale=None, attention_fn=None, batch_axes=None, head_axes=None, zigzag: bool = False):
    """Attention over a sequence sharded along `axis_name`, by all-to-all to head sharding.

    q [b, s, h, d], k/v [b, s, kvh, d] global; sequence split over `axis_name`, batch over
    `batch_axes`, heads over `head_axes` (e.g. "tensor"). Per device, the query heads h/|head_axes|
    must be divisible by the context size n. kv heads: divisible by n, or dividing n -- then each
    kv head is REPLICATED n/kvh times before the all-to-all (more traffic, no error).
    segment_ids: [b, s] int, same order as q. attention_fn(q, k, v, *, causal, segment_ids,
    sm_scale) runs on [b, s, h/n, d] (default: pallas_kernels.attention.xla_attention).
    zigzag=True: the sequence arrives in ring attention's zig-zag order (so one data pipeline
    serves both strategies); it is restored locally after the all-to-all and reapplied to the
    output (a local gather, no communication).
    """
    n = mesh.shape[axis_name]
    b, s, h, d = q.shape
    kvh = k.shape[2]
    if k.shape[1] != s or v.shape != k.shape:
        raise ValueError(f"ulysses attention is self-attention: got q {q.shape}, k {k.shape}, v {v.shape}")
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if s % n:
        raise ValueError(f"sequence length ({s}) must be divisible by the '{axis_name}' size ({n})")
    mesh, axis_names, (batch_axes, head_axes) = shard_map_region(mesh, axis_name, batch_axes, head_axes)
    t = _axis_size(mesh, head_axes)
    if h % t or kvh % t:
        raise ValueError(f"heads ({h}) and kv heads ({kvh}) must be divisible by the head axes {head_axes} ({t})")
    reps = kv_head_repeats(kvh // t, h // t, n)
    attn = attention_fn or _default_attention
    zz = bool(zigzag and causal)
    perm = jnp.asarray(zigzag_permutation(s, n)) if zz else None
    inv = jnp.asarray(zigzag_inverse_permutation(s, n)) if zz else None
    has_seg = segment_ids is not None

    def local(q, k, v, *seg):
        if reps > 1:  # query head group p uses kv head p // reps after the split
            k, v = jnp.repeat(k, reps, axis=2), jnp.repeat(v, reps, axis=2)
        # sequence-sharded [b, s/n, H, d] -> head-sharded [b, s, H/n, d]
        to_heads = functools.partial(lax.all_to_all, axis_name=axis_name, split_axis=2, concat_axis=1, tiled=True)
        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        ids = lax.all_gather(seg[0], axis_name, axis=1, tiled=True) if has_seg else None
        if zz:
            q, k, v = q[:, inv], k[:, inv], v[:, inv]
            ids = None if ids is None else ids[:, inv]
        o = attn(q, k, v, causal=causal, segment_ids=ids, sm_scale=sm_scale)
        if zz:
            o = o[:, perm]
        return lax.all_to_all(o, axis_name, split_axis=1, concat_axis=2, tiled=True)

    qs = P(batch_axes, axis_name, head_axes, None)
    in_specs = (qs, qs, qs) + ((P(batch_axes, axis_name),) if has_seg else ())
    # check_vma=False: attention_fn may be a Pallas kernel (needs it inside shard_map).
    kw = {} if axis_names is None else {"axis_names": set(axis_names)}
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=qs, check_vma=False, **kw)
    args = (q, k, v) + ((_self_ids(segment_ids),) if has_seg else ())
    return fn(*args)


def _self_ids(segment_ids):
    if isinstance(segment_ids, tuple):
        q_ids, kv_ids = segment_ids
        if q_ids is not kv_ids:
            raise ValueError("ulysses attention is self-attention: pass one segment_ids array [b, s]")
        return q_ids
    return segment_ids
