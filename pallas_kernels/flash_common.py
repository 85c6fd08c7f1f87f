"""Math shared by the FlashAttention kernels of both backends (Triton and Mosaic GPU).

- Base-2 softmax constants: the kernels compute exp2(s * scale * LOG2E - m) and keep lse in base 2
  (lse2 = lse / LN2), one multiply-add per score.
- `output_grad_rowsum`: delta = rowsum(dO * O), the softmax-Jacobian term of every flash backward
  here (Triton, Mosaic, ring attention, the jnp blocks).
- `flash_attention_reference`: the pure-jnp float32 attention both kernels are tested against.
Layout is `jax.nn.dot_product_attention`'s: q [b, q_len, h, d], k/v [b, kv_len, kv_h, d]. Causal
masking aligns queries to the end of the keys; rows that see no key give 0 (and lse = -inf).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")


def output_grad_rowsum(out, do):
    """delta = rowsum(dO * O) in fp32, [b, h, q] from out/dO [b, q, h, d]: the backward's
    softmax-Jacobian term (dS = P (dP - delta)), shared by every flash backward here."""
    return jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))


def flash_attention_reference(q, k, v, *, causal=False, segment_ids=None, sm_scale=None,
                              causal_offset=None, return_lse=False):
    """Pure-jnp float32 attention with the kernels' semantics (rows with no visible key give 0)."""
    b, q_len, h, d = q.shape
    kv_len, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    scale = sm_scale if sm_scale is not None else d ** -0.5
    qf = q.astype(jnp.float32).reshape(b, q_len, kvh, g, d)   # [b, q, kvh, g, d]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qf, k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale    # [b, kvh, g, q, s]
    mask = jnp.ones((1, q_len, kv_len), bool)
    if causal_offset is None and causal:
        causal_offset = kv_len - q_len
    if causal_offset is not None:
        mask = mask & (jnp.arange(q_len)[:, None] + causal_offset >= jnp.arange(kv_len)[None, :])[None]
    if segment_ids is not None:
        qi, ki = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        mask = mask & (qi[:, :, None] == ki[:, None, :])
    mask = mask[:, None, None]
    s = jnp.where(mask, s, NEG_INF)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    o = o.reshape(b, q_len, h, d)
    return (o, lse.reshape(b, h, q_len)) if return_lse else o
