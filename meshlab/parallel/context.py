"""Context parallelism: the one entry point the model's attention calls, and the data-side
zig-zag helpers.

What the caller (model / training pipeline) must do when the rule file selects
`strategies: {attention: ring}` with causal attention and a `context` axis of size n > 1:

1. Before sharding the batch, reorder the sequence axis of EVERY per-token array with
   `zigzag_reorder(x, n)`: tokens, labels (targets), loss mask, segment ids, and the
   positions used by RoPE. Positions must be the ORIGINAL positions (arange(s), or the
   per-segment positions of packed data) computed before the reorder and then reordered with
   the tokens -- never recomputed as arange(s) afterwards -- so RoPE still sees true
   positions. Targets must be shifted (next token) before the reorder, not after.
2. Everything token-wise (embeddings, norms, MLP, RoPE, the LM head, a per-token loss averaged
   over tokens) is order-invariant, so the model runs unchanged on the reordered sequence and
   the loss is exactly the single-device loss. Only attention knows about order, and
   `context_attention` is told (`zigzag=`) that the sequence is in zig-zag order.
3. `zigzag_restore` undoes it for anything consumed in sequence order (generation, printed
   per-position outputs). `uses_zigzag(strategy, causal, n)` says whether to reorder at all.

Ulysses accepts the same zig-zag input (it restores the order locally after its all-to-all),
so one pipeline can serve both strategies; it also accepts plain order (zigzag=False).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from meshlab.parallel.ring_attention import (ring_attention, ring_schedule, zigzag_inverse_permutation,
                                             zigzag_permutation)
from meshlab.parallel.ulysses import ulysses_attention

STRATEGIES = ("ring", "ulysses")
__all__ = ["context_attention", "zigzag_reorder", "zigzag_restore", "zigzag_batch", "uses_zigzag", "zigzag_permutation",
           "zigzag_inverse_permutation", "ring_schedule", "STRATEGIES"]


def uses_zigzag(strategy: str, causal: bool, n: int) -> bool:
    """Whether the data pipeline should put the sequence in zig-zag order for this strategy."""
    return strategy == "ring" and causal and n > 1


def zigzag_reorder(x, n: int, axis: int = 1):
    """x reordered along `axis` so that context shard i holds chunks i and 2n-1-i (of 2n).
    Works on jax and numpy arrays; the length must be divisible by 2n."""
    return jnp.take(x, jnp.asarray(zigzag_permutation(x.shape[axis], n)), axis=axis)


def zigzag_restore(x, n: int, axis: int = 1):
    """Inverse of `zigzag_reorder`."""
    return jnp.take(x, jnp.asarray(zigzag_inverse_permutation(x.shape[axis], n)), axis=axis)


def zigzag_batch(batch: dict, n: int, *, seq_len: int | None = None, tokens_key: str = "tokens") -> dict:
    """Step 1 of the module docstring for a whole batch dict of [b, s, ...] arrays (numpy or jax).

    Adds "positions" = arange(s) when the batch has none (packed data must bring its own
    per-segment positions), then reorders every array whose dim 1 is the sequence length.
    Call it on the global batch before sharding it (or per process on its rows: the reorder is
    along the sequence only). Labels must already be the shifted next tokens.
    """
    s = seq_len or batch[tokens_key].shape[1]
    out = dict(batch)
    if "positions" not in out:
        b = batch[tokens_key].shape[0]
        out["positions"] = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    perm = zigzag_permutation(s, n)
    for key, x in out.items():
        if getattr(x, "ndim", 0) >= 2 and x.shape[1] == s:
            out[key] = np.take(x, perm, axis=1) if isinstance(x, np.ndarray) else jnp.take(x, jnp.asarray(perm), axis=1)
    return out


def context_attention(q, k, v, *, strategy: str, mesh, causal: bool, segment_ids=None, sm_scale=None,
                      batch_axes=None, head_axes=None, axis_name: str = "context", zigzag: bool | None = None,
                      block_impl: str = "auto", attention_fn=None):
    """Self-attention with the sequence sharded over `axis_name`, by `strategy` ("ring" | "ulysses").

    q [b, s, h, d], k/v [b, s, kvh, d], segment_ids [b, s] or None: global arrays whose
    sequence dim is sharded over `axis_name` (batch over `batch_axes`, heads over `head_axes`,
    each a mesh axis name, a tuple of names, or None). zigzag: whether the sequence is in
    zig-zag order; default `uses_zigzag(strategy, causal, n)` -- i.e. what the pipeline did if
    it followed the module docstring. block_impl ("auto" | "jnp" | "pallas") is the ring's
    per-block kernel (auto: Pallas on GPU); attention_fn is Ulysses' local attention (default:
    `dot_product_attention(impl="auto")`, i.e. Pallas flash on GPU, xla on CPU). Returns
    [b, s, h, d] in the same order.
    """
    n = mesh.shape[axis_name]
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown context-parallel attention strategy {strategy!r}; choose one of {STRATEGIES}")
    if zigzag is None:
        zigzag = uses_zigzag(strategy, causal, n)
    common = dict(mesh=mesh, axis_name=axis_name, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale,
                  batch_axes=batch_axes, head_axes=head_axes, zigzag=zigzag)
    if strategy == "ring":
        return ring_attention(q, k, v, block_impl=block_impl, **common)
    return ulysses_attention(q, k, v, attention_fn=attention_fn or _auto_local_attention, **common)


def _auto_local_attention(q, k, v, *, causal, segment_ids=None, sm_scale=None):
    from pallas_kernels.attention import dot_product_attention
    return dot_product_attention(q, k, v, impl="auto", causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)
