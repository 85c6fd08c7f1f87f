"""The custom_vjp plumbing both FlashAttention backends share, and the names remat keys on.

A flash forward kernel runs outside the custom_vjp, on stop_gradient inputs
(`attention_with_saved_forward`); its (out, lse) come back named ATTENTION_OUT / ATTENTION_LSE
(`named_residuals`) and enter the custom_vjp as plain inputs. So they are residuals a remat policy
can keep (models/remat.py, remat="save_dots_attn") and the backward then runs without a second
forward. Without remat the same kernels run the same number of times as a plain custom_vjp.
Used by flash_attention.py (Triton) and flash_attention_mgpu.py (Mosaic GPU); backend-neutral,
no kernel code here. Why each piece exists: docs/jax-notes.md.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

# The forward's residuals carry these checkpoint names, so a remat policy can keep them and skip
# the forward's recomputation in the backward (models/remat.py remat="save_dots_attn").
ATTENTION_OUT, ATTENTION_LSE = "attention_out", "attention_lse"


def named_residuals(out, lse):
    """A forward kernel's (out, lse) named for remat="save_dots_attn", behind an optimization barrier.
    Why the barrier: when the layer scan stacks these residuals, XLA:GPU's dynamic-slice fusion
    (on by default in jax 0.11.2) fuses the kernel's custom call with the stacking update-slice and
    keeps a clone of the call for the layer's own use of `out`, so the kernel ran twice per layer.
    Behind the barrier the update-slice no longer reads the call's result directly, and the kernel
    runs once."""
    out, lse = lax.optimization_barrier((out, lse))
    return checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)


def attention_with_saved_forward(fwd, bwd, inputs, n_diff, n_ret=None):
    """fwd(*inputs) -> outs; returns outs[:n_ret] (all by default), differentiable in inputs[:n_diff]
    through bwd(inputs, outs, cotangents of the returned outs) -> the inputs' cotangents.

    The forward kernel runs outside the custom_vjp, on stop_gradient inputs, and its outs (named
    ATTENTION_OUT / ATTENTION_LSE by fwd, through named_residuals) become the custom_vjp's inputs.
    So its residuals are plain values a remat policy can keep (remat="save_dots_attn"), not values
    made inside a fwd rule, which jax.checkpoint on jax 0.11.2 re-ran whatever the policy
    (docs/jax-notes.md)."""
    stopped = [lax.stop_gradient(x) if i < n_diff else x for i, x in enumerate(inputs)]
    outs = tuple(fwd(*stopped))
    return _saved(bwd, len(inputs), len(outs) if n_ret is None else n_ret, *inputs, *outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _saved(bwd, n_in, n_ret, *args):
    return tuple(args[n_in:n_in + n_ret])


def _saved_fwd(bwd, n_in, n_ret, *args):
    return tuple(args[n_in:n_in + n_ret]), args


def _saved_bwd(bwd, n_in, n_ret, res, cts):
    ins, outs = res[:n_in], res[n_in:]
    grads = tuple(bwd(ins, outs, cts))
    # no cotangent for the non-differentiable inputs nor for outs (computed from stopped inputs)
    return grads + (None,) * (n_in - len(grads) + len(outs))


_saved.defvjp(_saved_fwd, _saved_bwd)
