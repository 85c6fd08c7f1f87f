"""Masked 2-D tile loads and stores for the Triton-lowered kernels (cross-entropy, SwiGLU, decode).

A tile is `[nr, nc]` rows x columns of a 2-D ref starting at (r0, c0); `rlim`/`clim` are the
array's true extents. A mask is built only along a dimension the caller says may run past its
extent (`mask_r`, `mask_c`): a statically whole tile loads and stores unmasked, since masks cost
registers and predicate every access. Masked loads fill with `other`.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def tile_mask(r0, nr, rlim, c0, nc, clim, mask_r, mask_c):
    """[nr, nc] in-bounds mask of a tile, or None when both dims are statically whole."""
    mask = None
    if mask_r:
        mask = ((r0 + jnp.arange(nr)) < rlim)[:, None]
    if mask_c:
        mc = ((c0 + jnp.arange(nc)) < clim)[None, :]
        mask = mc if mask is None else mask & mc
    return None if mask is None else jnp.broadcast_to(mask, (nr, nc))


def load_tile(ref, r0, nr, rlim, c0, nc, clim, *, mask_r, mask_c, other=0):
    """2-D tile load, masked only along dims that are not a multiple of the tile."""
    mask = tile_mask(r0, nr, rlim, c0, nc, clim, mask_r, mask_c)
    view = ref.at[pl.ds(r0, nr), pl.ds(c0, nc)]
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=other)


def store_tile(ref, r0, nr, rlim, c0, nc, clim, val, *, mask_r, mask_c):
    """2-D tile store of `val`, masked only along dims that are not a multiple of the tile."""
    mask = tile_mask(r0, nr, rlim, c0, nc, clim, mask_r, mask_c)
    view = ref.at[pl.ds(r0, nr), pl.ds(c0, nc)]
    if mask is None:
        plgpu.store(view, val)
    else:
        plgpu.store(view, val, mask=mask)


def load_vec(ref, r0, n, lim, other, mask_r):
    """1-D load of n values from r0, masked past `lim` when `mask_r`."""
    if not mask_r:
        return plgpu.load(ref.at[pl.ds(r0, n)])
    return plgpu.load(ref.at[pl.ds(r0, n)], mask=(r0 + jnp.arange(n)) < lim, other=other)


def store_vec(ref, r0, n, lim, val, mask_r):
    """1-D store of n values at r0, masked past `lim` when `mask_r`."""
    view = ref.at[pl.ds(r0, n)]
    if not mask_r:
        plgpu.store(view, val)
    else:
        plgpu.store(view, val, mask=(r0 + jnp.arange(n)) < lim)
