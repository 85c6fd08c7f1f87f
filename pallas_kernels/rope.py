"""Rotary position embedding for Q and K in one kernel (Pallas Triton), Llama-3 scaling.

Convention: rotate-half (Hugging Face Llama): head_dim splits into a first and a second half,
    out1 = x1 cos - x2 sin,   out2 = x2 cos + x1 sin,   angle = position * inv_freq[i]
with angles and products in fp32, the result cast back to the input dtype.

`rope_frequencies` and `apply_rope_reference` are the jnp versions the model uses directly.
The kernel reads positions once per row block, computes cos/sin in registers (no [s, d] table
in memory) and rotates every Q and K head of those rows in one launch. Backward is the same
kernel with the angle negated (a rotation's transpose), so nothing but positions is saved.
Limits: slower than XLA's fusion of the reference (likely the [rows, heads, d/2] half-row tiles'
strided accesses; not yet profiled), so the model uses apply_rope_reference and this kernel stays
a correct, tested starting point (docs/benchmarks.md#fused-ops).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_rows: int = 16   # (batch*seq) rows per program; each row carries all heads
    num_warps: int = 4
    num_stages: int = 1

    def validate(self):
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"BlockSizes.block_rows={self.block_rows} must be a power of two")


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None):
    """inv_freq [head_dim // 2] float32; with `scaling`, Llama-3's piecewise rescaling: long
    wavelengths (> original_len / low_freq_factor) divided by `factor`, short ones
    (< original_len / high_freq_factor) kept, a linear blend in between."""
    if head_dim % 2:
        raise ValueError(f"{head_dim=} must be even")
    if not theta > 0:
        raise ValueError(f"{theta=} must be > 0")
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    missing = [k for k in _SCALING_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"{scaling=} must have keys {_SCALING_KEYS}; missing {missing}")
    factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    if not hi > lo:
        raise ValueError(f"{scaling=} must have high_freq_factor > low_freq_factor")
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = jnp.where(wavelen > old / lo, inv / factor, inv)
    medium = (wavelen <= old / lo) & (wavelen >= old / hi)
    return jnp.where(medium, blended, out)


def _rotate_ref(x, positions, inv_freq):
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, half]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope_reference(q, k, positions, *, theta, scaling=None):
    """jnp RoPE on q [b, s, h, d] and k [b, s, kvh, d] at positions [b, s]."""
    _check(q, k, positions)
    inv = rope_frequencies(q.shape[-1], theta, scaling)
    return _rotate_ref(q, positions, inv), _rotate_ref(k, positions, inv)


def _check(q, k, positions):
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"{q.shape=} and {k.shape=} must be [batch, seq, heads, head_dim]")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{k.shape=} must share batch, seq and head_dim with {q.shape=}")
    if positions.shape != q.shape[:2]:
        raise ValueError(f"{positions.shape=} must be [batch, seq] = {q.shape[:2]}")
    if q.shape[3] % 2:
        raise ValueError(f"head_dim={q.shape[3]} must be even")


def _rot_one(x_ref, o_ref, cos, sin, r0, *, br, n, h, half):
    # h and half are powers of two here (the wrapper pads otherwise): Pallas refuses static
    # slices past the array, so only the (dynamic) row tail is masked, and only when it exists.
    mask = None
    if n % br:
        mask = jnp.broadcast_to(((r0 + jnp.arange(br)) < n)[:, None, None], (br, h, half))
    v1 = x_ref.at[pl.ds(r0, br), pl.ds(0, h), pl.ds(0, half)]
    v2 = x_ref.at[pl.ds(r0, br), pl.ds(0, h), pl.ds(half, half)]
    x1 = plgpu.load(v1, mask=mask, other=None if mask is None else 0).astype(jnp.float32)
    x2 = plgpu.load(v2, mask=mask, other=None if mask is None else 0).astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    plgpu.store(o_ref.at[pl.ds(r0, br), pl.ds(0, h), pl.ds(0, half)], (x1 * c - x2 * s).astype(o_ref.dtype),
                mask=mask)
    plgpu.store(o_ref.at[pl.ds(r0, br), pl.ds(0, h), pl.ds(half, half)], (x2 * c + x1 * s).astype(o_ref.dtype),
                mask=mask)


def _kernel(q_ref, k_ref, pos_ref, inv_ref, qo_ref, ko_ref, *, br, n, hq, hk, half, sign):
    r0 = pl.program_id(0) * br
    pos = plgpu.load(pos_ref.at[pl.ds(r0, br)], mask=(r0 + jnp.arange(br)) < n, other=0)
    inv = plgpu.load(inv_ref.at[pl.ds(0, half)])
    ang = pos.astype(jnp.float32)[:, None] * inv[None, :]  # cos/sin computed once, used for all heads
    cos, sin = jnp.cos(ang), jnp.sin(ang) * sign
    _rot_one(q_ref, qo_ref, cos, sin, r0, br=br, n=n, h=hq, half=half)
    _rot_one(k_ref, ko_ref, cos, sin, r0, br=br, n=n, h=hk, half=half)


def _pad_heads(x, hp, dp):
    """[n, h, d] -> [n, hp, 2*dp] with each half zero-padded to dp (only for awkward shapes:
    this is a copy; Llama's 32/8 heads of 64 or 128 never take it)."""
    n, h, d = x.shape
    half = d // 2
    if (h, half) == (hp, dp):
        return x
    x = x.reshape(n, h, 2, half)
    return jnp.pad(x, ((0, 0), (0, hp - h), (0, 0), (0, dp - half))).reshape(n, hp, 2 * dp)


def _unpad_heads(x, h, half):
    n, hp, d2 = x.shape
    if (hp, d2 // 2) == (h, half):
        return x
    return x.reshape(n, hp, 2, d2 // 2)[:, :h, :, :half].reshape(n, h, 2 * half)


def _call(q, k, positions, inv_freq, sign, bs, interpret):
    b, s, hq, d = q.shape
    hk, half = k.shape[2], d // 2
    n = b * s
    hqp, hkp, dp = pl.next_power_of_2(hq), pl.next_power_of_2(hk), pl.next_power_of_2(half)
    qf = _pad_heads(q.reshape(n, hq, d), hqp, dp)
    kf = _pad_heads(k.reshape(n, hk, d), hkp, dp)
    inv = jnp.pad(inv_freq, (0, dp - half))
    kern = functools.partial(_kernel, br=bs.block_rows, n=n, hq=hqp, hk=hkp, half=dp, sign=sign)
    qo, ko = pl.pallas_call(
        kern, out_shape=(jax.ShapeDtypeStruct(qf.shape, q.dtype), jax.ShapeDtypeStruct(kf.shape, k.dtype)),
        grid=(pl.cdiv(n, bs.block_rows),), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages), name="rope",
    )(qf, kf, positions.reshape(n).astype(jnp.int32), inv)
    return _unpad_heads(qo, hq, half).reshape(q.shape), _unpad_heads(ko, hk, half).reshape(k.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _rope(q, k, positions, inv_freq, bs, interpret):
    return _call(q, k, positions, inv_freq, 1.0, bs, interpret)


def _rope_fwd(q, k, positions, inv_freq, bs, interpret):
    return _call(q, k, positions, inv_freq, 1.0, bs, interpret), (positions, inv_freq)


def _rope_bwd(bs, interpret, res, cts):
    positions, inv_freq = res
    dq, dk = cts
    dq, dk = _call(dq, dk, positions, inv_freq, -1.0, bs, interpret)  # inverse rotation = transpose
    return dq, dk, None, None  # frequencies are constants of the model, not trained


_rope.defvjp(_rope_fwd, _rope_bwd)


def apply_rope(q, k, positions, *, theta, scaling=None, interpret=False, block_sizes=None):
    """(q, k) rotated at `positions` in one Pallas kernel; same result as apply_rope_reference."""
    _check(q, k, positions)
    bs = block_sizes or BlockSizes()
    bs.validate()
    inv = rope_frequencies(q.shape[-1], theta, scaling)
    return _rope(q, k, positions, inv, bs, bool(interpret))
