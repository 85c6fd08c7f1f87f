"""What the cross-entropy implementations share: argument checks and the per-token loss.

    loss_t = lse_t - logit_t[label_t] + z_loss * lse_t**2     (0 where label_t == ignore_index)

Used by the reference, the chunked jnp loss and the Pallas kernels (fused_cross_entropy.py) and by
the one-pass sum (cross_entropy_onepass.py), so every variant checks and finishes the same way.
Layout: hidden [tokens, d], weight [d, vocab], labels [tokens] (integers).
"""
from __future__ import annotations

import jax.numpy as jnp


def check_args(hidden, weight, labels, ignore_index, z_loss):
    """One clear error for shapes, dtypes or options the losses do not take."""
    if hidden.ndim != 2:
        raise ValueError(f"{hidden.shape=} must be [tokens, d]")
    if weight.ndim != 2 or weight.shape[0] != hidden.shape[1]:
        raise ValueError(f"{weight.shape=} must be [d, vocab] with d = hidden.shape[1] = {hidden.shape[1]}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"{labels.shape=} must be [tokens] = {hidden.shape[:1]}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"{labels.dtype=} must be an integer type")
    if z_loss < 0:
        raise ValueError(f"{z_loss=} must be >= 0")
    if not isinstance(ignore_index, int):
        raise ValueError(f"{ignore_index=} must be a python int")


def token_loss(lse, label_logit, labels, ignore_index, z_loss):
    """Per-token loss from the log-sum-exp and the label's logit [T]; 0 on ignored tokens."""
    valid = labels != ignore_index
    loss = lse - label_logit + (z_loss * lse * lse if z_loss else 0.0)
    return jnp.where(valid, loss, 0.0)
