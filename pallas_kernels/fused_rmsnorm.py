"""RMSNorm, optionally fused with the residual add, in one pass each way (Pallas Triton).

    s      = x + residual                       (when residual is given; else s = x)
    normed = s * rsqrt(mean(s^2) + eps) * weight   (math in fp32, result in x.dtype)
    returns normed, or (normed, s) with a residual.

Forward: one program per block of rows; each row is read once (x and residual), and s, normed
and the fp32 1/rms are written once. Backward: one kernel reads s, 1/rms, dnormed (and ds from
the residual stream) once, writes dx (= dresidual) and per-program partial sums of dweight;
the [programs, D] partials are summed in jnp (tiny).
Limits: memory-bound, and XLA already fuses the reference into one or two loops; measured, the
kernel wins forward-only and loses fwd+bwd, so the model's default is rms_norm_reference
(docs/benchmarks.md#fused-ops).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_rows: int = 4     # rows per program (a row of D=2048 bf16 is 4 KB)
    num_warps: int = 4
    num_stages: int = 1

    def validate(self):
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"BlockSizes.block_rows={self.block_rows} must be a power of two")
        if self.num_warps < 1:
            raise ValueError(f"BlockSizes.num_warps={self.num_warps} must be >= 1")


def rms_norm_reference(x, weight, *, eps, residual=None):
    """jnp reference with the same dtype policy as the kernel."""
    s = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    sf = s.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)
    normed = (sf * rstd * weight.astype(jnp.float32)).astype(x.dtype)
    return normed if residual is None else (normed, s)


def _tile(ref, r0, br, n, dp, d):
    """[br, dp] view of rows r0.. with a mask for the row tail and the column padding."""
    rows = r0 + jnp.arange(br)
    cols = jnp.arange(dp)
    mask = (rows < n)[:, None] & (cols < d)[None, :]
    return ref.at[pl.ds(r0, br), pl.ds(0, dp)], mask


def _fwd_kernel(*refs, n, d, dp, br, eps, has_res):
    if has_res:
        x_ref, r_ref, w_ref, y_ref, s_ref, rstd_ref = refs
    else:
        x_ref, w_ref, y_ref, rstd_ref = refs
    r0 = pl.program_id(0) * br
    xv, mask = _tile(x_ref, r0, br, n, dp, d)
    x = plgpu.load(xv, mask=mask, other=0)
    if has_res:
        rv, _ = _tile(r_ref, r0, br, n, dp, d)
        s = x.astype(jnp.float32) + plgpu.load(rv, mask=mask, other=0).astype(jnp.float32)
        s = s.astype(x_ref.dtype)  # the residual stream keeps its dtype; norm what is stored
        sv, _ = _tile(s_ref, r0, br, n, dp, d)
        plgpu.store(sv, s, mask=mask)
    else:
        s = x
    sf = s.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(sf * sf, axis=1) / d + eps)  # padded columns are 0: exact mean
    w = plgpu.load(w_ref.at[pl.ds(0, dp)], mask=jnp.arange(dp) < d, other=0).astype(jnp.float32)
    yv, _ = _tile(y_ref, r0, br, n, dp, d)
    plgpu.store(yv, (sf * rstd[:, None] * w[None, :]).astype(y_ref.dtype), mask=mask)
    plgpu.store(rstd_ref.at[pl.ds(r0, br)], rstd, mask=(r0 + jnp.arange(br)) < n)


def _bwd_kernel(*refs, n, d, dp, br, has_res):
    if has_res:
        s_ref, w_ref, rstd_ref, dy_ref, ds_ref, dx_ref, dw_ref = refs
    else:
        s_ref, w_ref, rstd_ref, dy_ref, dx_ref, dw_ref = refs
    i = pl.program_id(0)
    r0 = i * br
    sv, mask = _tile(s_ref, r0, br, n, dp, d)
    sf = plgpu.load(sv, mask=mask, other=0).astype(jnp.float32)
    rstd = plgpu.load(rstd_ref.at[pl.ds(r0, br)], mask=(r0 + jnp.arange(br)) < n, other=0)
    dyv, _ = _tile(dy_ref, r0, br, n, dp, d)
    dy = plgpu.load(dyv, mask=mask, other=0).astype(jnp.float32)
    w = plgpu.load(w_ref.at[pl.ds(0, dp)], mask=jnp.arange(dp) < d, other=0).astype(jnp.float32)
    s_hat = sf * rstd[:, None]
    g = dy * w[None, :]
    # d/ds of s*rstd: rstd * (g - s_hat * mean(g * s_hat))
    dx = rstd[:, None] * (g - s_hat * (jnp.sum(g * s_hat, axis=1) / d)[:, None])
    if has_res:
        dsv, _ = _tile(ds_ref, r0, br, n, dp, d)
        dx = dx + plgpu.load(dsv, mask=mask, other=0).astype(jnp.float32)
    dxv, _ = _tile(dx_ref, r0, br, n, dp, d)
    plgpu.store(dxv, dx.astype(dx_ref.dtype), mask=mask)
    # one partial dweight row per program; masked rows contribute 0 (dy loaded as 0)
    plgpu.store(dw_ref.at[pl.ds(i, 1), pl.ds(0, dp)], jnp.sum(dy * s_hat, axis=0)[None, :],
                mask=(jnp.arange(dp) < d)[None, :])


def _flat(a):
    return a.reshape(-1, a.shape[-1])


def _forward(x, weight, residual, eps, bs, interpret):
    shape, d = x.shape, x.shape[-1]
    xf = _flat(x)
    n = xf.shape[0]
    br, dp = bs.block_rows, pl.next_power_of_2(d)
    has_res = residual is not None
    kern = functools.partial(_fwd_kernel, n=n, d=d, dp=dp, br=br, eps=eps, has_res=has_res)
    outs = [jax.ShapeDtypeStruct((n, d), x.dtype)]
    if has_res:
        outs.append(jax.ShapeDtypeStruct((n, d), x.dtype))
    outs.append(jax.ShapeDtypeStruct((n,), jnp.float32))
    ins = (xf, _flat(residual), weight) if has_res else (xf, weight)
    res = pl.pallas_call(kern, out_shape=tuple(outs), grid=(pl.cdiv(n, br),), interpret=interpret,
                         compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
                         name="rmsnorm_fwd")(*ins)
    y, rstd = res[0].reshape(shape), res[-1]
    s = res[1].reshape(shape) if has_res else x
    return y, s, rstd


def _backward(s, weight, rstd, dy, ds, bs, interpret):
    shape, d = s.shape, s.shape[-1]
    n = rstd.shape[0]
    br, dp = bs.block_rows, pl.next_power_of_2(d)
    nb = pl.cdiv(n, br)
    has_res = ds is not None
    kern = functools.partial(_bwd_kernel, n=n, d=d, dp=dp, br=br, has_res=has_res)
    ins = [_flat(s), weight, rstd, _flat(dy)] + ([_flat(ds)] if has_res else [])
    dx, dw = pl.pallas_call(
        kern, out_shape=(jax.ShapeDtypeStruct((n, d), s.dtype), jax.ShapeDtypeStruct((nb, d), jnp.float32)),
        grid=(nb,), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages), name="rmsnorm_bwd",
    )(*ins)
    return dx.reshape(shape), jnp.sum(dw, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms(x, weight, eps, bs, interpret):
    return _forward(x, weight, None, eps, bs, interpret)[0]


def _rms_fwd(x, weight, eps, bs, interpret):
    y, s, rstd = _forward(x, weight, None, eps, bs, interpret)
    return y, (s, weight, rstd)


def _rms_bwd(eps, bs, interpret, res, dy):
    s, weight, rstd = res
    dx, dw = _backward(s, weight, rstd, dy, None, bs, interpret)
    return dx, dw.astype(weight.dtype)


_rms.defvjp(_rms_fwd, _rms_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rms_res(x, residual, weight, eps, bs, interpret):
    y, s, _ = _forward(x, weight, residual, eps, bs, interpret)
    return y, s


def _rms_res_fwd(x, residual, weight, eps, bs, interpret):
    y, s, rstd = _forward(x, weight, residual, eps, bs, interpret)
    return (y, s), (s, weight, rstd, jnp.zeros((0,), residual.dtype))  # dtype marker


def _rms_res_bwd(eps, bs, interpret, res, cts):
    s, weight, rstd, rdtype = res
    dy, ds = cts
    dx, dw = _backward(s, weight, rstd, dy, ds, bs, interpret)
    return dx, dx.astype(rdtype.dtype), dw.astype(weight.dtype)


_rms_res.defvjp(_rms_res_fwd, _rms_res_bwd)


def rms_norm(x, weight, *, eps, residual=None, interpret=False, block_sizes=None):
    """normed = rmsnorm(x [+ residual]) * weight; with a residual returns (normed, x + residual)."""
    if x.ndim < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"{weight.shape=} must be ({x.shape[-1] if x.ndim else '?'},) to match {x.shape=}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{residual.shape=} must equal {x.shape=}")
    if not eps > 0:
        raise ValueError(f"{eps=} must be > 0")
    bs = block_sizes or BlockSizes()
    bs.validate()
    if residual is None:
        return _rms(x, weight, float(eps), bs, bool(interpret))
    return _rms_res(x, residual, weight, float(eps), bs, bool(interpret))
