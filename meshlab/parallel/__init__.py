"""shard_map strategies: the model calls `attention`, the active rule file decides how it runs."""
from __future__ import annotations

from meshlab import rules as _rules
from pallas_kernels.attention import dot_product_attention


def attention(q, k, v, *, impl: str, causal: bool = True, segment_ids=None):
    """q [b, s, h, d], k/v [b, s, kvh, d] -> [b, s, h, d]; ring/ulysses when the rules say so."""
    strategy = _rules.strategy("attention") or "plain"
    if strategy == "plain":
        return dot_product_attention(q, k, v, impl=impl, causal=causal, segment_ids=segment_ids)
    from meshlab.parallel.context import context_attention  # shard_map over `context`
    act = _rules.active()
    return context_attention(q, k, v, strategy=strategy, mesh=act.mesh, causal=causal, segment_ids=segment_ids,
                             batch_axes=act.rules.axes("act_batch", act.mesh),
                             head_axes=act.rules.axes("act_heads", act.mesh))
