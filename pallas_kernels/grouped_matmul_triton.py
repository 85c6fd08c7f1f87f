"""Grouped (ragged) matmul in Pallas, Triton lowering: out[m] = x[m] @ w[g(m)], forward, dX and dW kernels.

The GPU path of pallas_kernels/grouped_matmul.py off Hopper (A100, L40, RTX: any CUDA GPU Triton
compiles for), and `backend="triton"` anywhere, CPU included with `interpret=True`.
- forward and dX: one kernel, grid (column tiles, row tiles). Each row tile lies inside one group:
  its list ([4, T] int32: group, aligned tile start, first row, end row) is built in jnp from
  group_sizes, T = cdiv(M, block_m) + G (static). Rows past sum(group_sizes) form one more group
  whose tiles store zeros, so the output is fully defined. dX = dy @ w[g]^T reads w transposed.
- dW[g] = x_g^T dy_g: grid (K tiles, N tiles, groups), each program loops over its group's rows
  in block_m chunks (bounds from the group offsets); an empty group stores zeros.
fp32 accumulation, outputs in x's dtype (dW in w's). Any M, K, N (edges masked); tiles are powers
of two >= 16, shrunk to a dimension's size. Tiles: `TritonTiles`. Speed: docs/benchmarks.md#pipeline-and-moe.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import on_hopper
from pallas_kernels.compat import TritonCompilerParams

F32 = jnp.float32
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class TritonTiles:
    """Forward/dX tiles (rows x output columns x contraction chunk) and launch settings, and the dW
    kernel's (output [dw_block_k of K, dw_block_n of N], dw_block_m rows of x per step). Powers of
    two >= 16. bf16 defaults: (128x32 + 32x128) x 2 B x 4 stages = 64 KiB of shared memory, within
    every sm_80+ part's; `default(dtype)` halves the stages for 4-byte inputs, and on Hopper takes
    HOPPER_BF16 (144 KiB: past the 99 KiB of sm_86/89 parts)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 4
    dw_block_m: int = 32
    dw_block_k: int = 128
    dw_block_n: int = 128
    dw_num_warps: int = 4
    dw_num_stages: int = 4

    @classmethod
    def default(cls, dtype) -> "TritonTiles":
        if jnp.dtype(dtype).itemsize >= 4:
            return cls(num_stages=2, dw_num_stages=2)
        return HOPPER_BF16 if on_hopper() else cls()

    def validate(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith(("warps", "stages")):
                if v < 1:
                    raise ValueError(f"grouped_matmul_triton: TritonTiles.{f.name}={v} must be >= 1")
            elif v < 16 or v & (v - 1):
                raise ValueError(f"grouped_matmul_triton: TritonTiles.{f.name}={v} must be a power of two >= 16")


# The fastest forward tile of bench_moe.py's sweep on an H100 (32768 x 2048 x 1536, 16 experts: 0.395 ms
# against 0.474 at the defaults); the dW tiles are the defaults, the faster of the two row chunks timed.
HOPPER_BF16 = TritonTiles(block_n=256, block_k=64, num_warps=8, num_stages=3)


def fit(block: int, size: int) -> int:
    """A tile no longer than the dimension rounded up to a power of two (and >= 16, Triton's smallest dot)."""
    return min(block, max(16, 1 << (max(size, 1) - 1).bit_length()))


def row_tiles(group_sizes, m: int, block_m: int):
    """[4, cdiv(m, block_m) + G] int32, one column per row tile of the grid: (group, start of its
    aligned block_m tile, first row, end row). Group G is the padding past sum(group_sizes) (tiles
    that store zeros); unused columns are (G, 0, 0, 0), storing nothing. A group is cut at block_m
    boundaries, so each of the G + 1 groups adds at most one tile to cdiv(m, block_m)."""
    g = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)                 # [G]
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])                     # [G+1], the padding last
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first, last = starts // block_m, (ends - 1) // block_m
    count = jnp.where(ends > starts, last - first + 1, 0)                            # tiles per group
    offsets = jnp.cumsum(count)                                                      # inclusive
    t = jnp.arange(-(-m // block_m) + g, dtype=jnp.int32)
    grp = jnp.searchsorted(offsets, t, side="right", method="compare_all").astype(jnp.int32)   # G + 1: unused
    gc = jnp.minimum(grp, g)
    tile = first[gc] + t - (offsets[gc] - count[gc])                                 # aligned tile index
    r0 = tile * block_m
    lo, hi = jnp.maximum(starts[gc], r0), jnp.minimum(ends[gc], r0 + block_m)
    used = grp <= g
    zero = jnp.zeros_like(t)
    return jnp.stack([jnp.minimum(grp, g), jnp.where(used, r0, zero), jnp.where(used, lo, zero),
                      jnp.where(used, hi, zero)]).astype(jnp.int32)


def _dot(a, b, trans_a=False, trans_b=False):
    """2-D matmul with fp32 accumulation, transposes folded into the contraction (no copy). fp32
    operands are multiplied exactly (Triton's IEEE input precision, off the tensor cores): Pallas
    Triton's default precision would round them to TF32 (3e-4 relative error at K = 1000 on an H100)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    exact = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, b, dims, precision=exact, preferred_element_type=F32)


def _mask(*parts):
    """AND of the [r, 1] / [1, c] masks given (None: that dimension is whole); None when all are None."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def _load(view, mask, shape):
    """A tile load; masked-off elements read as 0 (they meet a 0 or are never stored)."""
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=jnp.broadcast_to(mask, shape), other=0)


def _gmm_kernel(meta_ref, lhs_ref, rhs_ref, out_ref, *, bm, bn, bk, groups, m, kc, no, trans_rhs):
    """One [bm, bn] output tile: rows of one group (or the padding), columns j*bn..; the contraction
    (kc: K forward, N for dX) in bk chunks, whole ones unmasked in a loop, a ragged last one after it.
    lhs [M, kc]; rhs [G, kc, no] or, trans_rhs, [G, no, kc]; out [M, no]."""
    j, t = pl.program_id(0), pl.program_id(1)
    g, r0, lo, hi = meta_ref[0, t], meta_ref[1, t], meta_ref[2, t], meta_ref[3, t]
    r0, c0 = pl.multiple_of(r0, bm), pl.multiple_of(j * bn, bn)
    live = g < groups                                    # the padding group (and unused tiles) only store zeros
    gw = jnp.minimum(g, groups - 1)
    rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
    # Rows of the tile outside [lo, hi) belong to a neighbouring group: loaded (a row's products stay
    # in its row) but never stored. Only rows past M need a mask on the load.
    row_in = rows < m if m % bm else None
    col_in = cols < no if no % bn else None

    def chunk(k0, acc, ragged):
        k_row = (k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < kc if ragged else None   # [1, bk]
        a = _load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], _mask(row_in, k_row), (bm, bk))
        if trans_rhs:                                    # w[g] [no, kc] read as is: dot(a, b^T)
            col_t = (c0 + lax.broadcasted_iota(jnp.int32, (bn, 1), 0)) < no if no % bn else None
            b = _load(rhs_ref.at[gw, pl.ds(c0, bn), pl.ds(k0, bk)], _mask(col_t, k_row), (bn, bk))
            return acc + _dot(a, b, trans_b=True)
        k_col = (k0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)) < kc if ragged else None   # [bk, 1]
        b = _load(rhs_ref.at[gw, pl.ds(k0, bk), pl.ds(c0, bn)], _mask(k_col, col_in), (bk, bn))
        return acc + _dot(a, b)

    full, tail = kc // bk, kc % bk
    # trip counts as int32 products: Pallas Triton lowers a select of two Python ints to an i1 select,
    # which Triton's scf.for refuses as a bound ("all of {lowerBound, upperBound, step} have same type")
    live32 = live.astype(jnp.int32)
    acc = jnp.zeros((bm, bn), F32)
    if full:
        acc = lax.fori_loop(0, live32 * full,
                            lambda i, acc: chunk(pl.multiple_of(i * bk, bk), acc, False), acc)
    if tail:
        # a traced start (i is 0): a static one past the edge would be refused when tracing
        acc = lax.fori_loop(0, live32, lambda i, acc: chunk(full * bk + i * bk, acc, True), acc)
    store = _mask((rows >= lo) & (rows < hi), col_in)
    plgpu.store(out_ref.at[pl.ds(r0, bm), pl.ds(c0, bn)], acc.astype(out_ref.dtype),
                mask=jnp.broadcast_to(store, (bm, bn)))


def _dw_kernel(off_ref, x_ref, dy_ref, dw_ref, *, bm, bk, bn, k, n):
    """dW[g][i*bk.., j*bn..] = sum over the group's rows, bm at a time, of x^T dy (rows masked to the group)."""
    i, j, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = off_ref[g], off_ref[g + 1]
    k0, n0 = pl.multiple_of(i * bk, bk), pl.multiple_of(j * bn, bn)
    k_in = (k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < k if k % bk else None
    n_in = (n0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n if n % bn else None

    def body(s, acc):
        r0 = lo + s * bm
        r_in = (r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < hi
        a = _load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], _mask(r_in, k_in), (bm, bk))
        b = _load(dy_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], _mask(r_in, n_in), (bm, bn))
        return acc + _dot(a, b, trans_a=True)

    acc = lax.fori_loop(0, lax.div(jnp.maximum(hi - lo, 0) + (bm - 1), jnp.int32(bm)), body, jnp.zeros((bk, bn), F32))
    kr = (k0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)) < k if k % bk else None
    mask = _mask(kr, n_in)
    view = dw_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)]
    val = acc.astype(dw_ref.dtype)
    if mask is None:
        plgpu.store(view, val)
    else:
        plgpu.store(view, val, mask=jnp.broadcast_to(mask, (bk, bn)))


def _whole(a):
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)   # pointers: tiles are picked in the kernel


def gmm_call(lhs, w, group_sizes, tiles: TritonTiles, interpret: bool, trans_rhs: bool = False):
    """lhs [M, kc] @ w[g] ([G, kc, no], or trans_rhs: [G, no, kc] read transposed) -> [M, no] in lhs's dtype."""
    m, kc = lhs.shape
    groups, no = w.shape[0], w.shape[1] if trans_rhs else w.shape[2]
    if m == 0 or no == 0 or kc == 0 or groups == 0:
        return jnp.zeros((m, no), lhs.dtype)
    bm, bn, bk = fit(tiles.block_m, m), fit(tiles.block_n, no), fit(tiles.block_k, kc)
    meta = row_tiles(group_sizes, m, bm)
    kernel = functools.partial(_gmm_kernel, bm=bm, bn=bn, bk=bk, groups=groups, m=m, kc=kc, no=no,
                               trans_rhs=trans_rhs)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(no, bn), meta.shape[1]),   # columns fastest: a row tile's programs run together
        in_specs=[_whole(meta), _whole(lhs), _whole(w)], out_specs=pl.BlockSpec((m, no), lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, no), lhs.dtype), interpret=interpret,
        compiler_params=TritonCompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name="grouped_matmul_triton_dx" if trans_rhs else "grouped_matmul_triton",
    )(meta, lhs, w)


def dw_call(x, dy, group_sizes, tiles: TritonTiles, interpret: bool, out_dtype):
    """[G, K, N] per group x_g^T dy_g (rows past sum(group_sizes) in no group), fp32 sums in out_dtype."""
    (m, k), n, groups = x.shape, dy.shape[1], group_sizes.shape[0]
    if m == 0 or k == 0 or n == 0 or groups == 0:
        return jnp.zeros((groups, k, n), out_dtype)
    bm, bk, bn = fit(tiles.dw_block_m, m), fit(tiles.dw_block_k, k), fit(tiles.dw_block_n, n)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)])
    kernel = functools.partial(_dw_kernel, bm=bm, bk=bk, bn=bn, k=k, n=n)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(k, bk), pl.cdiv(n, bn), groups),   # one group's programs together: its rows shared
        in_specs=[_whole(offsets), _whole(x), _whole(dy)], out_specs=pl.BlockSpec((groups, k, n), lambda *_: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype), interpret=interpret,
        compiler_params=TritonCompilerParams(num_warps=tiles.dw_num_warps, num_stages=tiles.dw_num_stages),
        name="grouped_matmul_triton_dw",
    )(offsets, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x, w, group_sizes, tiles, interpret):
    return gmm_call(x, w, group_sizes, tiles, interpret)


def _gmm_fwd(x, w, group_sizes, tiles, interpret):
    return gmm_call(x, w, group_sizes, tiles, interpret), (x, w, group_sizes)


def _gmm_bwd(tiles, interpret, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = gmm_call(dy, w, group_sizes, tiles, interpret, trans_rhs=True)     # [M, K]: padding rows 0
    dw = dw_call(x, dy, group_sizes, tiles, interpret, w.dtype)             # [G, K, N]
    return dx, dw, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_matmul_triton(x, w, group_sizes, *, tiles: TritonTiles | None = None, interpret: bool = False):
    """x [M, K], w [G, K, N] (x's dtype), group_sizes [G] int -> [M, N] in x's dtype; rows past
    sum(group_sizes) are zero. Differentiable in x and w. tiles: TritonTiles.default(x.dtype) when None."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul_triton: x {x.shape} [M, K], w {w.shape} [G, K, N] and group_sizes "
                         f"{group_sizes.shape} [G] do not fit together")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"grouped_matmul_triton: {x.dtype=} must be one of bfloat16, float16, float32 and "
                         f"{w.dtype=} the same")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul_triton: {group_sizes.dtype=} must be an integer type")
    tiles = tiles or TritonTiles.default(x.dtype)
    tiles.validate()
    return _gmm(x, w, group_sizes.astype(jnp.int32), tiles, bool(interpret))
