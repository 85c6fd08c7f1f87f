"""Remat (activation checkpointing) policies by the names `model.remat` takes.

  none                nothing recomputed
  full                only the layer inputs saved: the whole layer recomputed in the backward
  save_dots           every matmul output saved
  save_dots_no_batch  matmul outputs without batch dims saved (projections, MLP): attention's
                      batched dots and the elementwise ops recomputed
  save_dots_attn      save_dots_no_batch + the flash attention forward's output and lse
"""
from __future__ import annotations

import jax

from pallas_kernels.flash_attention import ATTENTION_LSE, ATTENTION_OUT

REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch", "save_dots_attn")

_SAVE_ATTENTION_NAMES = jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE)


def _saves_attention(prim, *args, **params) -> bool:
    """A flash attention forward's residuals (output and log-sum-exp): cuDNN's (jax.nn.dot_product_attention)
    as the outputs of its forward primitive, ours by checkpoint name (pallas_kernels/flash_attention*)."""
    return prim.name.startswith("dot_product_attention_fwd") or _SAVE_ATTENTION_NAMES(prim, *args, **params)


def remat_policy(policy: str):
    """The jax.checkpoint policy of `model.remat` (None: save only the layer inputs).
    save_dots_attn: save_dots_no_batch that also keeps the attention forward's output and
    log-sum-exp, so the backward does not run the attention forward again: b*s*h*hd (+ fp32 b*h*s)
    more bytes per layer, one attention forward less per layer and step. Measured (H200, jax 0.11.2,
    llama3_1b batch 4 x 4096): cuDNN 58,574-58,850 vs 56,597 tokens/s, +1 GiB. Ours (Triton and
    Mosaic kernels) run their forward outside the custom_vjp (flash_attention.attention_with_saved_forward)
    with the residuals behind an optimization barrier (flash_attention.named_residuals): on the H200
    (2026-12-01) that is 16 forward launches per 16-layer step, as cuDNN's; without the barrier
    XLA's dynamic-slice fusion cloned the forward (32 launches: 287.6 ms a step in one call, 275.4 and
    275.8 with the barrier in the next two)."""
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return {"full": None,                                               # save only the layer inputs
            "save_dots": jax.checkpoint_policies.checkpoint_dots,       # keep every matmul output
            "save_dots_no_batch": dots,
            "save_dots_attn": lambda prim, *a, **p: dots(prim, *a, **p) or _saves_attention(prim, *a, **p)}[policy]


def remat(fn, policy: str):
    """fn under jax.checkpoint with `model.remat`'s policy (fn itself for "none")."""
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=remat_policy(policy), prevent_cse=False)
