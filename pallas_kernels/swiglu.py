"""SwiGLU gate/up projection with the activation in the matmul epilogue (Pallas Triton).

    swiglu(x [T, d], w_gate [d, f], w_up [d, f]) = silu(x @ w_gate) * (x @ w_up)

Forward: one GEMM-like kernel over [bm, bn] output tiles with two fp32 accumulators (gate and up
share each loaded x tile), silu(a) * b applied in registers, only the product written. The [T, f]
pre-activations never reach memory and are not saved: the custom_vjp keeps x, w_gate, w_up only.
Backward: one kernel recomputes a, b tile by tile and writes da = dy * b * silu'(a) and
db = dy * silu(a); the four large matmuls go to XLA/cuBLAS, which a Triton GEMM does not beat.
Cost: one extra 2-GEMM recomputation in the backward (about +1/3 of this layer's backward FLOPs)
for 2 x T x f activations saved per layer. Speed and memory: docs/benchmarks.md#fused-ops.

    silu_mul(gate, up) = silu(gate) * up                    (after unfused gate/up GEMMs)

No kernel: the fp32 expression, whose custom_vjp saves gate and up as given and recomputes the rest
in its backward (the MoE experts'; models/vjp_ops.swiglu_pair shares its gradient formula).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
from pallas_kernels.triton_tiles import load_tile, store_tile


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int = 128   # tokens per tile
    block_n: int = 128   # mlp columns per tile (two fp32 accumulators of bm x bn)
    block_k: int = 64    # contraction chunk over d
    num_warps: int = 8
    num_stages: int = 3

    def validate(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"BlockSizes.{name}={v} must be a power of two >= 16")


def swiglu_reference(x, w_gate, w_up):
    a = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    b = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    return (jax.nn.silu(a) * b).astype(x.dtype)


def silu_mul_grads(a, b, dy):
    """(da, db) of silu(a) * b for fp32 a, b, dy: silu'(a) = s (1 + a (1 - s)) with s = sigmoid(a)."""
    sig = jax.nn.sigmoid(a)
    return dy * b * sig * (1 + a * (1 - sig)), dy * a * sig


@jax.custom_vjp
def silu_mul(gate, up):
    """silu(gate) * up elementwise in fp32, returned in gate's dtype: the activation after unfused
    gate/up GEMMs. Its residuals are gate and up as given. Autodiff of the fp32 expression saves its
    fp32 intermediates instead, which a layer scan stacks into [n_layers, T, f] fp32 buffers (five at
    remat=none, 5x the bytes of two bf16 inputs) written in the forward and read in the backward."""
    return _silu_mul_fwd(gate, up)[0]


def _silu_mul_fwd(gate, up):
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype), (gate, up)


def _silu_mul_bwd(res, dh):
    gate, up = res
    da, db = silu_mul_grads(gate.astype(jnp.float32), up.astype(jnp.float32), dh.astype(jnp.float32))
    return da.astype(gate.dtype), db.astype(up.dtype)


silu_mul.defvjp(_silu_mul_fwd, _silu_mul_bwd)


def _gate_up(x_ref, wg_ref, wu_ref, r0, c0, *, bm, bn, bk, T, d, f, mt, mf, md):
    def body(k, acc):
        a, b = acc
        xk = load_tile(x_ref, r0, bm, T, k * bk, bk, d, mask_r=mt, mask_c=md)
        gk = load_tile(wg_ref, k * bk, bk, d, c0, bn, f, mask_r=md, mask_c=mf)
        uk = load_tile(wu_ref, k * bk, bk, d, c0, bn, f, mask_r=md, mask_c=mf)
        return (a + jnp.dot(xk, gk, preferred_element_type=jnp.float32),
                b + jnp.dot(xk, uk, preferred_element_type=jnp.float32))

    z = jnp.zeros((bm, bn), jnp.float32)
    return lax.fori_loop(0, pl.cdiv(d, bk), body, (z, z))


def _fwd_kernel(x_ref, wg_ref, wu_ref, o_ref, **kw):
    r0, c0 = pl.program_id(0) * kw["bm"], pl.program_id(1) * kw["bn"]
    a, b = _gate_up(x_ref, wg_ref, wu_ref, r0, c0, **kw)
    out = a * jax.nn.sigmoid(a) * b
    store_tile(o_ref, r0, kw["bm"], kw["T"], c0, kw["bn"], kw["f"], out.astype(o_ref.dtype), mask_r=kw["mt"],
           mask_c=kw["mf"])


def _bwd_kernel(x_ref, wg_ref, wu_ref, dy_ref, da_ref, db_ref, **kw):
    bm, bn, T, f, mt, mf = kw["bm"], kw["bn"], kw["T"], kw["f"], kw["mt"], kw["mf"]
    r0, c0 = pl.program_id(0) * bm, pl.program_id(1) * bn
    a, b = _gate_up(x_ref, wg_ref, wu_ref, r0, c0, **kw)
    dy = load_tile(dy_ref, r0, bm, T, c0, bn, f, mask_r=mt, mask_c=mf).astype(jnp.float32)
    sig = jax.nn.sigmoid(a)
    silu = a * sig
    # silu'(a) = sig * (1 + a * (1 - sig))
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    db = dy * silu
    store_tile(da_ref, r0, bm, T, c0, bn, f, da.astype(da_ref.dtype), mask_r=mt, mask_c=mf)
    store_tile(db_ref, r0, bm, T, c0, bn, f, db.astype(db_ref.dtype), mask_r=mt, mask_c=mf)


def _kw(x, w_gate, bs):
    t, d = x.shape
    f = w_gate.shape[1]
    bk = min(bs.block_k, max(16, pl.next_power_of_2(d)))
    if max(x.dtype.itemsize, w_gate.dtype.itemsize) >= 4:
        # fp32 operands double the shared memory per pipeline stage: x tile + two weight tiles
        # at 128/128/64 and 3 stages is 288 KB > the H200's 227 KB, so halve the k chunk.
        bk = min(bk, 32)
    return dict(bm=bs.block_m, bn=bs.block_n, bk=bk, T=t, d=d, f=f, mt=t % bs.block_m != 0,
                mf=f % bs.block_n != 0, md=d % bk != 0)


def _forward(x, w_gate, w_up, bs, interpret):
    kw = _kw(x, w_gate, bs)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, **kw), out_shape=jax.ShapeDtypeStruct((kw["T"], kw["f"]), x.dtype),
        grid=(pl.cdiv(kw["T"], kw["bm"]), pl.cdiv(kw["f"], kw["bn"])), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages), name="swiglu_fwd",
    )(x, w_gate, w_up)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _swiglu(x, w_gate, w_up, bs, interpret):
    return _forward(x, w_gate, w_up, bs, interpret)


def _swiglu_fwd(x, w_gate, w_up, bs, interpret):
    return _forward(x, w_gate, w_up, bs, interpret), (x, w_gate, w_up)  # no [T, f] residuals


def _swiglu_bwd(bs, interpret, res, dy):
    x, w_gate, w_up = res
    kw = _kw(x, w_gate, bs)
    gdt = jnp.promote_types(x.dtype, w_gate.dtype)  # bf16 in bf16 training: cuBLAS operands below
    shp = jax.ShapeDtypeStruct((kw["T"], kw["f"]), gdt)
    da, db = pl.pallas_call(
        functools.partial(_bwd_kernel, **kw), out_shape=(shp, shp),
        grid=(pl.cdiv(kw["T"], kw["bm"]), pl.cdiv(kw["f"], kw["bn"])), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages), name="swiglu_bwd",
    )(x, w_gate, w_up, dy)
    f32 = jnp.float32
    dx = (jnp.dot(da, w_gate.T, preferred_element_type=f32) + jnp.dot(db, w_up.T, preferred_element_type=f32))
    dwg = jnp.dot(x.T, da, preferred_element_type=f32)
    dwu = jnp.dot(x.T, db, preferred_element_type=f32)
    return dx.astype(x.dtype), dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(x, w_gate, w_up, *, interpret=False, block_sizes=None):
    """silu(x @ w_gate) * (x @ w_up), [T, f] in x.dtype; fp32 accumulation; recomputes in backward."""
    if x.ndim != 2:
        raise ValueError(f"{x.shape=} must be [tokens, d]")
    if w_gate.ndim != 2 or w_gate.shape[0] != x.shape[1]:
        raise ValueError(f"{w_gate.shape=} must be [d, f] with d = {x.shape[1]}")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"{w_up.shape=} must equal {w_gate.shape=}")
    bs = block_sizes or BlockSizes()
    bs.validate()
    return _swiglu(x, w_gate, w_up, bs, bool(interpret))
