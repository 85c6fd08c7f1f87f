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

from meshlab import rules
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
    Mosaic kernels) run their forward outside the custom_vjp (flash_residuals.attention_with_saved_forward)
    with the residuals behind an optimization barrier (flash_residuals.named_residuals): on the H200
    that is 16 forward launches per 16-layer step, as cuDNN's; without the barrier
    XLA's dynamic-slice fusion cloned the forward (32 launches: 287.6 ms a step in one call, 275.4 and
    275.8 with the barrier in the next two)."""
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return {"full": None,                                               # save only the layer inputs
            "save_dots": jax.checkpoint_policies.checkpoint_dots,       # keep every matmul output
            "save_dots_no_batch": dots,
            "save_dots_attn": lambda prim, *a, **p: dots(prim, *a, **p) or _saves_attention(prim, *a, **p)}[policy]


def _not_gathered(prim, *_, **params) -> bool:
    """Save every residual but a gathered weight. The name alone is not enough: its input, the
    all-gather's output, would be saved instead. An all_gather inside the layer is the FSDP gather
    (sequence-parallel gathers are placed by GSPMD, not written), as is a shard_map holding only
    all_gathers (rules.materialize's nested gather under tensor parallelism)."""
    if prim.name in ("all_gather", "name"):
        return prim.name == "name" and params.get("name") != rules.GATHERED
    if prim.name == "shard_map":
        jaxpr = params.get("jaxpr")
        eqns = getattr(jaxpr, "eqns", None) or getattr(getattr(jaxpr, "jaxpr", None), "eqns", [])
        return not (eqns and all(e.primitive.name == "all_gather" for e in eqns))
    return True


def remat(fn, policy: str, prevent_cse: bool = False):
    """fn under jax.checkpoint with `model.remat`'s policy (fn itself for "none"). Where the layer
    all-gathers its weights (ZeRO-3), `strategies.fsdp_gather` decides whether they are saved for the
    backward (keep) or gathered again there (per_layer: under "none", everything else is saved).
    prevent_cse: needed outside a scan (unrolled layers), where XLA would otherwise merge the
    backward's recomputation with the forward and keep everything, whatever the policy; a scan
    body cannot be merged that way, and the barriers would only cost there."""
    gather = rules.strategy("fsdp_gather") if rules.gathers_weights() else None
    if policy == "none":
        if gather != "per_layer":
            return fn
        return jax.checkpoint(fn, policy=_not_gathered, prevent_cse=prevent_cse)
    base = remat_policy(policy)
    if gather == "keep":
        names = jax.checkpoint_policies.save_only_these_names(rules.GATHERED)
        base = names if base is None else (lambda prim, *a, _b=base, **p: _b(prim, *a, **p) or names(prim, *a, **p))
    return jax.checkpoint(fn, policy=base, prevent_cse=prevent_cse)
