"""Ops whose backward is written by hand, for the precision or the passes autodiff would get wrong:
a GEMM with an fp32 output whose backward stays in the operands' dtype (`mm_f32_out`), a row lookup
whose gradient sums in fp32 (`take_rows`), and SwiGLU over interleaved gate|up with a one-pass
backward (`swiglu_pair`). tests/models/test_embedding.py and test_gate_up.py check the last two."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.swiglu import silu_mul_grads

F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def mm_f32_out(spec, x, w):
    """einsum with an fp32 output (logits feeding a softmax) whose backward GEMMs still run in the
    operands' dtype: the fp32 cotangent is rounded once, as torch autocast does, instead of JAX's
    default transpose upcasting both [T, V]-sized GEMMs to fp32."""
    return jnp.einsum(spec, x, w, preferred_element_type=F32)


def _mm_f32_fwd(spec, x, w):
    return mm_f32_out(spec, x, w), (x, w)


def _mm_f32_bwd(spec, res, g):
    x, w = res
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), x, w)
    return vjp(g.astype(x.dtype))


mm_f32_out.defvjp(_mm_f32_fwd, _mm_f32_bwd)


@jax.custom_vjp
def take_rows(w, tokens):
    """Rows of w [V, d] for tokens [b, s] -> [b, s, d]; the gradient adds each token's rows in fp32 and
    rounds the sum once (models.llama.embed_lookup says why)."""
    return jnp.take(w, tokens, axis=0)                                    # [b, s, d]


def _take_rows_fwd(w, tokens):
    return take_rows(w, tokens), (tokens, jnp.zeros((w.shape[0], 0), w.dtype))   # V and dtype, no bytes


def _take_rows_bwd(res, dx):
    tokens, like = res
    dw = jnp.zeros((like.shape[0], dx.shape[-1]), F32).at[tokens].add(dx.astype(F32))   # [V, d] fp32 sums
    return dw.astype(like.dtype), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@jax.custom_vjp
def swiglu_pair(gate_up):
    """silu(gate) * up of gate_up [..., f, 2] (gate, up interleaved), fp32 math, in gate_up's dtype. Its
    residual is gate_up alone and its backward writes d(gate|up) [..., f, 2] in one pass: autodiff of
    the two slices would save them besides gate_up and run one elementwise pass per slice."""
    return _swiglu_pair_fwd(gate_up)[0]


def _swiglu_pair_fwd(gate_up):
    gate, up = gate_up[..., 0].astype(F32), gate_up[..., 1].astype(F32)      # [..., f] x2
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype), gate_up


def _swiglu_pair_bwd(gate_up, dh):
    gate, up = gate_up[..., 0].astype(F32), gate_up[..., 1].astype(F32)      # [..., f] x2
    d_gate, d_up = silu_mul_grads(gate, up, dh.astype(F32))
    return (jnp.stack([d_gate, d_up], axis=-1).astype(gate_up.dtype),)        # [..., f, 2]


swiglu_pair.defvjp(_swiglu_pair_fwd, _swiglu_pair_bwd)
