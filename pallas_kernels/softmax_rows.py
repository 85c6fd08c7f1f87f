"""The cross-entropy's passes over a logits slab, one HBM pass each (Pallas, Triton lowering).

    softmax_stats(logits [n, V], labels [n]) -> (lse [n], label_logit [n])        fp32
        lse in one read of the slab; the n label logits gathered beside it
    softmax_grad(logits, lse, labels, cp [n], cy [n]) -> dlogits [n, V]           out_dtype
        dlogits = cp * exp(logits - lse) - cy * onehot(labels)

Why kernels: besides its three GEMMs the one-pass loss (cross_entropy_onepass.py) is memory-bound
over its [n, V] logits slab, and XLA:GPU reads it once for the max, again for the sum of exponentials,
again for the label's logit, and more for the gradient. Here: one read for an online log-sum-exp
(running max, sums rescaled when it grows; Milakov & Gimelshein 2018), one read + write for dlogits.
logits may be fp32 or bf16 (the math stays fp32). Speed: docs/benchmarks.md#fused-ops.

Not differentiated: the one-pass loss calls these inside its own custom_vjp forward, where the
gradient is what it computes; there is no cotangent to pass through them.

Labels outside [0, V) (the ignore index) hit no column: their label_logit is 0 and their row of
dlogits has no onehot term (the caller zeroes cp and cy for ignored rows).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
from pallas_kernels.triton_tiles import load_tile, load_vec, store_tile, store_vec

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """Tile sizes (powers of two, Triton's requirement) and launch parameters of both kernels.

    stats: one program per `stats_rows` rows, looping over the vocabulary `stats_cols` columns at a
    time (0: 16 KiB of logits a tile, 4096 fp32 or 8192 bf16 columns, the best of the H200 sweep in
    docs/archive/benchmarks-diary.md for either dtype); a full tile loads unmasked, the vocabulary's
    tail (V % stats_cols) once, masked.
    grad: one program per [grad_rows, grad_cols] tile (a 2-D grid: many small programs keep every
    SM's loads in flight; an elementwise pass needs nothing across tiles).
    """
    stats_rows: int = 1
    stats_cols: int = 0
    grad_rows: int = 16
    grad_cols: int = 512
    num_warps: int = 8
    num_stages: int = 2

    def validate(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < (0 if f.name == "stats_cols" else 1):
                raise ValueError(f"RowBlocks.{f.name}={v!r} must be a positive int")
        for name in ("stats_rows", "stats_cols", "grad_rows", "grad_cols"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"RowBlocks.{name}={v} must be a power of two (Triton tiles)")


# --------------------------------------------------------------------------- references

def softmax_stats_reference(logits, labels):
    """Plain jnp: lse [n] and the label's logit [n] (0 for a label outside [0, V)), fp32."""
    x = logits.astype(F32)
    lse = jax.nn.logsumexp(x, axis=-1)
    hit = lax.broadcasted_iota(jnp.int32, x.shape, 1) == labels[:, None]
    return lse, jnp.sum(jnp.where(hit, x, 0.0), axis=-1)


def softmax_grad_reference(logits, lse, labels, cp, cy, out_dtype):
    """Plain jnp: cp * softmax - cy * onehot, rounded once to out_dtype."""
    x = logits.astype(F32)
    hit = lax.broadcasted_iota(jnp.int32, x.shape, 1) == labels[:, None]
    g = cp[:, None] * jnp.exp(x - lse[:, None]) - jnp.where(hit, cy[:, None], 0.0)
    return g.astype(out_dtype)


# --------------------------------------------------------------------------- kernels

def _stats_kernel(x_ref, lse_ref, *, n, v, br, bc, mask_r):
    r0 = pl.program_id(0) * br

    def tile(c0, carry, mask_c):
        m, s = carry
        # Out-of-range columns load as -inf: exp(-inf) = 0 adds nothing and never wins the max.
        x = load_tile(x_ref, r0, br, n, c0, bc, v, mask_r=mask_r, mask_c=mask_c, other=-jnp.inf).astype(F32)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))                          # [br]: one cross-lane max a tile
        # The sums stay per lane ([br, bc]) and are rescaled when the row max grows; they are
        # reduced across lanes once, after the loop.
        s = s * jnp.exp(m - m_new)[:, None] + jnp.exp(x - m_new[:, None])   # [br, bc]
        return m_new, s

    # m starts finite: a first tile rescales exp(-1e30 - m_new) = 0 (not exp(nan)); a padding row past n
    # (all -inf) keeps m = -1e30, s = 0, and its store is masked.
    carry = (jnp.full((br,), -1e30, F32), jnp.zeros((br, bc), F32))
    full = v // bc
    carry = lax.fori_loop(0, full, lambda j, c: tile(j * bc, c, False), carry)
    if v % bc:  # a traced start: the tail tile's slice runs past V, which only its mask makes legal
        carry = tile(r0 * 0 + full * bc, carry, True)
    m, s = carry
    store_vec(lse_ref, r0, br, n, m + jnp.log(jnp.sum(s, axis=1)), mask_r)


def _grad_kernel(x_ref, lse_ref, lab_ref, cp_ref, cy_ref, g_ref, *, n, v, br, bc, mask_r, mask_c):
    r0, c0 = pl.program_id(0) * br, pl.program_id(1) * bc
    lse = load_vec(lse_ref, r0, br, n, 0.0, mask_r)
    lab = load_vec(lab_ref, r0, br, n, -1, mask_r)
    cp = load_vec(cp_ref, r0, br, n, 0.0, mask_r)
    cy = load_vec(cy_ref, r0, br, n, 0.0, mask_r)
    x = load_tile(x_ref, r0, br, n, c0, bc, v, mask_r=mask_r, mask_c=mask_c).astype(F32)
    hit = (c0 + jnp.arange(bc))[None, :] == lab[:, None]
    g = cp[:, None] * jnp.exp(x - lse[:, None]) - jnp.where(hit, cy[:, None], 0.0)
    store_tile(g_ref, r0, br, n, c0, bc, v, g.astype(g_ref.dtype), mask_r=mask_r, mask_c=mask_c)


# --------------------------------------------------------------------------- wrappers

def _fit(block, extent):
    """The tile, shrunk (by halving) to the smallest power of two covering a short extent."""
    while block > 16 and block // 2 >= extent:
        block //= 2
    return block


def _check(logits, labels, *vecs):
    if logits.ndim != 2:
        raise ValueError(f"{logits.shape=} must be [rows, vocab]")
    n = logits.shape[0]
    for name, a in (("labels", labels),) + vecs:
        if a.shape != (n,):
            raise ValueError(f"{name}.shape={a.shape} must be [rows] = ({n},)")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"{labels.dtype=} must be an integer type")


def softmax_stats(logits, labels, *, blocks: RowBlocks | None = None, interpret: bool = False):
    """(lse [n], label_logit [n]) in fp32 from logits [n, V] (fp32 or bf16): the log-sum-exp in one read
    of the slab (the kernel), the label's logit by a gather of n values beside it."""
    _check(logits, labels)
    bs = blocks or RowBlocks()
    bs.validate()
    n, v = logits.shape
    br, bc = _fit(bs.stats_rows, n), _fit(bs.stats_cols or 16384 // jnp.dtype(logits.dtype).itemsize, v)
    kern = functools.partial(_stats_kernel, n=n, v=v, br=br, bc=bc, mask_r=n % br != 0)
    lse = pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((n,), F32), grid=(pl.cdiv(n, br),), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages), name="softmax_stats",
    )(logits)
    hit = (labels >= 0) & (labels < v)
    picked = jnp.take_along_axis(logits, jnp.where(hit, labels, 0)[:, None].astype(jnp.int32), axis=1)[:, 0]  # [n]
    return lse, jnp.where(hit, picked.astype(F32), 0.0)


def softmax_grad(logits, lse, labels, cp, cy, *, out_dtype, blocks: RowBlocks | None = None,
                 interpret: bool = False):
    """dlogits [n, V] in out_dtype = cp * exp(logits - lse) - cy * onehot(labels), one read + one write."""
    _check(logits, labels, ("lse", lse), ("cp", cp), ("cy", cy))
    bs = blocks or RowBlocks()
    bs.validate()
    n, v = logits.shape
    br, bc = _fit(bs.grad_rows, n), _fit(bs.grad_cols, v)
    kern = functools.partial(_grad_kernel, n=n, v=v, br=br, bc=bc, mask_r=n % br != 0, mask_c=v % bc != 0)
    return pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((n, v), jnp.dtype(out_dtype)), grid=(pl.cdiv(n, br), pl.cdiv(v, bc)),
        interpret=interpret, compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name="softmax_grad",
    )(logits, lse.astype(F32), labels.astype(jnp.int32), cp.astype(F32), cy.astype(F32))
