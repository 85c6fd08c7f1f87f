"""shard_map strategies: the model calls `attention`, the active rule file decides how it runs."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshlab import compat
from meshlab import rules as _rules
from meshlab.mesh import entry_axes
from pallas_kernels.attention import dot_product_attention


def attention(q, k, v, *, impl: str, causal: bool = True, segment_ids=None):
    """q [b, s, h, d], k/v [b, s, kvh, d] -> [b, s, h, d]; ring/ulysses when the rules say so."""
    strategy = _rules.strategy("attention") or "plain"
    act = _rules.active()
    if strategy == "plain":
        if act is not None and act.manual:
            return _per_device(act, q, k, v, impl, causal, segment_ids)
        return dot_product_attention(q, k, v, impl=impl, causal=causal, segment_ids=segment_ids)
    from meshlab.parallel.context import context_attention  # shard_map over `context`
    return context_attention(q, k, v, strategy=strategy, mesh=act.mesh, causal=causal, segment_ids=segment_ids,
                             batch_axes=act.rules.axes("act_batch", act.mesh),
                             head_axes=act.rules.axes("act_heads", act.mesh))


def _per_device(act, q, k, v, impl, causal, segment_ids):
    """Plain attention inside the step's shard_map (manual over the batch axes): a nested
    shard_map makes the remaining axes manual too, so each device attends over its own heads.
    Why: cuDNN attention is a custom_partitioning op, and XLA's partitioner callback fails in a
    partially manual region (seen on 2 H200s under dp/fsdp, jax 0.11.2); a Pallas call there
    would be replicated over `tensor` instead of split by heads.

    Each device must hold what its rows and query heads read, whatever the rule file says of the
    activations around: whole sequences (a sequence split by `act_attn_seq` would attend only to its
    own keys; ring and ulysses are the strategies that split it), and the kv heads of its query
    heads, so k and v take q's head split (GQA groups are contiguous). Where that split does not
    divide the kv heads, k and v are first repeated to one head per query head (the bytes of q)."""
    auto = tuple(a for a in act.mesh.axis_names if a not in act.manual)
    q_spec = act.rules.spec(("act_batch", None, "act_heads", None), q.shape, act.mesh, drop=act.manual)
    entries = tuple(q_spec) + (None,) * (4 - len(q_spec))                  # trailing Nones restored
    batch_entry, heads_entry = entries[0], entries[2]
    head_shards = math.prod(act.mesh.shape[a] for a in entry_axes(heads_entry))
    if k.shape[2] % head_shards:
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)      # [b, s, h, d]
    kv_spec = q_spec
    args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
    if segment_ids is not None:
        args.append(segment_ids)
        specs.append(P(batch_entry))

    def local(q, k, v, seg=None):
        return dot_product_attention(q, k, v, impl=impl, causal=causal, segment_ids=seg)

    return compat.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=tuple(specs),
                            out_specs=q_spec, axis_names=set(auto))(*args)
