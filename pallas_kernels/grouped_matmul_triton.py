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

FP8 operands (float8_e4m3fn, float8_e5m2, either type on either side; models/fp8.py's grouped op
quantizes and scales them): the same kernels with fp32 accumulation, the output in an explicit
dtype times a per-call fp32 scale (the product of the operands' inverse scales) before its store.
Every FP8 dot is "NT": both operands contraction-major in memory (lhs [M, kc], rhs [G, no, kc]; dW
from x^T [K, M] and dy^T [N, M]). Hopper's FP8 wgmma reads no transposed operand (only 16-bit types
may be transposed), and Triton meets a non-contraction-major FP8 operand by re-laying it out through
registers on its way to shared memory; Ada's FP8 mma.sync likewise takes both operands contraction-
major (row.col, no 8-bit ldmatrix transpose). The forward therefore
takes w^T [G, N, K], and dW the transposed copies, which the caller writes while it quantizes (one
extra 1-byte write and read of x, w and dy per step). A dot's contraction tile is >= 32 for FP8
(the k of an FP8 MMA instruction).
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
FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
FP8_MIN_K = 32           # an FP8 MMA's k (wgmma m64nNk32, mma.sync m16n8k32): the least contraction tile


@dataclasses.dataclass(frozen=True)
class TritonTiles:
    """Forward/dX tiles (rows x output columns x contraction chunk) and launch settings, and the dW
    kernel's (output [dw_block_k of K, dw_block_n of N], dw_block_m rows of x per step). Powers of
    two >= 16. bf16 defaults: (128x32 + 32x128) x 2 B x 4 stages = 64 KiB of shared memory, within
    every sm_80+ part's; `default(dtype)` halves the stages for 4-byte inputs, and on Hopper takes
    HOPPER_BF16 (144 KiB: past the 99 KiB of sm_86/89 parts). FP8 inputs (1 byte) take FP8_TILES /
    HOPPER_FP8: twice bf16's contraction chunk in the same shared memory."""
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
        if jnp.dtype(dtype) in FP8:
            return HOPPER_FP8 if on_hopper() else FP8_TILES
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
# FP8: 1-byte operands, so each contraction chunk doubles for the bf16 tiles' shared memory:
# (128 + 128) x 64 x 4 stages = 64 KiB, and the dW kernel's (128 + 128) x 64 rows x 4 = 64 KiB.
FP8_TILES = TritonTiles(block_k=64, dw_block_m=64)
# Hopper: 128-wide chunks, (128 + 128) x 128 x 4 stages = 128 KiB each kernel. The output tile stays
# 128 x 128 on 8 warps: a dot that promotes its sums to fp32 (dX, dW: precise accumulation) keeps a
# second fp32 accumulator of the tile in registers, 2 x 64 per thread here (a 128 x 256 tile would
# need 256 per thread at 8 warps, past the 255 a thread may hold).
HOPPER_FP8 = TritonTiles(block_k=128, num_warps=8, dw_block_m=128, dw_num_warps=8)


def fit(block: int, size: int, least: int = 16) -> int:
    """A tile no longer than the dimension rounded up to a power of two (and >= least: 16, Triton's
    smallest dot; FP8_MIN_K for an FP8 dot's contraction)."""
    return min(block, max(least, 1 << (max(size, 1) - 1).bit_length()))


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


def _mma(acc, a, b, trans_a=False, trans_b=False, fast=False):
    """acc + a . b, a 2-D matmul with fp32 accumulation, transposes folded into the contraction (no
    copy). fp32 operands are multiplied exactly (Triton's IEEE input precision, off the tensor cores):
    Pallas Triton's default precision would round them to TF32 (3e-4 relative error at K = 1000 on an
    H100). FP8 operands: `fp8_mma_nt` (a [m, k] . b [n, k]^T only); fast: its accumulation mode."""
    if a.dtype in FP8 or b.dtype in FP8:
        assert a.dtype in FP8 and b.dtype in FP8 and trans_b and not trans_a, (a.dtype, b.dtype, trans_a, trans_b)
        return fp8_mma_nt(acc, a, b, fast=fast)
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    exact = lax.Precision.HIGHEST if a.dtype == F32 else None
    return acc + lax.dot_general(a, b, dims, precision=exact, preferred_element_type=F32)


# -- the FP8 dot ------------------------------------------------------------------------------------
# Pallas Triton lowers `lax.dot_general` only for operands of one element type ("a and b must have the
# same element type", jax 0.10 and 0.11), while Triton's tt.dot takes any two 8-bit float types (an
# e5m2 x e4m3 MMA is one instruction on Ada and Hopper) and the backward's GEMMs are e5m2 x e4m3. So
# FP8 dots bind their own primitive, lowered straight to a tt.dot that adds into the loop's fp32
# accumulator. Its accumulation is explicit: Hopper's FP8 wgmma adds its products at reduced
# precision (DeepSeek-V3 measured about 14 bits of mantissa), and Triton adds a tt.dot whose
# `maxNumImpreciseAcc` is at most its contraction into the fp32 accumulator through a second,
# partial one, every maxNumImpreciseAcc products. fast=False sets it to the contraction tile: one
# promotion per 64-128 products (DeepSeek-V3 promotes every 128; 0 would promote after every k=32
# wgmma, an fp32 add per accumulator element per wgmma) at the cost of that second accumulator's
# registers and one add per element and tile. fast=True (2^30) accumulates
# the whole contraction natively, as cuBLASLt's fast-accumulation mode does. Ada's mma.sync
# accumulates FP8 in fp32 either way. (A tt.dot with a nonzero maxNumImpreciseAcc is not merged with
# a following add by Triton, hence the accumulator as an operand.) The cost of the primitive: Pallas
# Triton's private lowering registry (register_lowering) and the jaxlib Triton dialect's builders,
# unchanged between jax 0.10.2 and 0.11.
_FAST_ACCUM = 1 << 30                                     # more products than any contraction tile


def _fp8_mma_impl(acc, a, b, *, fast):
    """The interpreter's (and XLA's) rule: the exact FP8 values, multiplied and summed in fp32."""
    del fast
    return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=F32)


def _fp8_mma_abstract(acc, a, b, *, fast):
    del fast
    if (a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or a.dtype not in FP8 or b.dtype not in FP8
            or acc.shape != (a.shape[0], b.shape[0]) or acc.dtype != F32):
        raise ValueError(f"fp8_mma_nt: acc {acc.dtype}{list(acc.shape)} [m, n] fp32, a {a.dtype}{list(a.shape)} "
                         f"[m, k] and b {b.dtype}{list(b.shape)} [n, k], float8_e4m3fn or float8_e5m2")
    return jax.core.ShapedArray(acc.shape, F32)


def _fp8_mma_triton(ctx, acc, a, b, *, fast):
    from jax._src.lib.triton import dialect as tt
    k = ctx.avals_in[1].shape[1]
    return tt.dot(a, tt.trans(b, (1, 0)), acc, max_num_imprecise_acc=_FAST_ACCUM if fast else k)


def _register_fp8_mma():
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    p = Primitive("fp8_mma_nt")
    p.def_impl(_fp8_mma_impl)
    p.def_abstract_eval(_fp8_mma_abstract)
    mlir.register_lowering(p, mlir.lower_fun(_fp8_mma_impl, multiple_results=False))
    triton_lowering.register_lowering(p)(_fp8_mma_triton)
    return p


_fp8_mma_p = _register_fp8_mma()


def fp8_mma_nt(acc, a, b, *, fast: bool = False):
    """acc [m, n] fp32 + a [m, k] . b [n, k]^T, for float8_e4m3fn / float8_e5m2 a and b (either type
    each), inside a Pallas Triton kernel (or anywhere: XLA runs it on the exact values)."""
    return _fp8_mma_p.bind(acc, a, b, fast=bool(fast))


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
    """A tile load; masked-off elements read as 0 (they meet a 0 or are never stored). A float 0: Pallas
    Triton casts no integer to an FP8 type."""
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=jnp.broadcast_to(mask, shape), other=0.0)


def _gmm_kernel(meta_ref, lhs_ref, rhs_ref, *refs, bm, bn, bk, groups, m, kc, no, trans_rhs, fast):
    """One [bm, bn] output tile: rows of one group (or the padding), columns j*bn..; the contraction
    (kc: K forward, N for dX) in bk chunks, whole ones unmasked in a loop, a ragged last one after it.
    lhs [M, kc]; rhs [G, kc, no] or, trans_rhs, [G, no, kc]; refs: ([1, 1] fp32 scale,) out [M, no]."""
    *scale_ref, out_ref = refs
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
            return _mma(acc, a, b, trans_b=True, fast=fast)
        k_col = (k0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)) < kc if ragged else None   # [bk, 1]
        b = _load(rhs_ref.at[gw, pl.ds(k0, bk), pl.ds(c0, bn)], _mask(k_col, col_in), (bk, bn))
        return _mma(acc, a, b)

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
    if scale_ref:
        acc = acc * scale_ref[0][...]                    # [1, 1]: the operands' inverse scales, exact (2^k)
    store = _mask((rows >= lo) & (rows < hi), col_in)
    plgpu.store(out_ref.at[pl.ds(r0, bm), pl.ds(c0, bn)], acc.astype(out_ref.dtype),
                mask=jnp.broadcast_to(store, (bm, bn)))


def _dw_kernel(off_ref, x_ref, dy_ref, *refs, bm, bk, bn, k, n, transposed, fast):
    """dW[g][i*bk.., j*bn..] = sum over the group's rows, bm at a time, of x^T dy (rows masked to the
    group). x [M, K], dy [M, N]; transposed: x^T [K, M] and dy^T [N, M] (FP8: both contraction-major),
    whose row chunks start on multiples of bm (the first may reach into the previous group, masked) so
    that their loads along M are aligned. refs: ([1, 1] fp32 scale,) dW [G, K, N]."""
    *scale_ref, dw_ref = refs
    i, j, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = off_ref[g], off_ref[g + 1]
    k0, n0 = pl.multiple_of(i * bk, bk), pl.multiple_of(j * bn, bn)
    kr = (k0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)) < k if k % bk else None   # [bk, 1]

    if transposed:
        nr = (n0 + lax.broadcasted_iota(jnp.int32, (bn, 1), 0)) < n if n % bn else None
        start = lax.div(lo, jnp.int32(bm)) * bm

        def body(s, acc):
            r0 = pl.multiple_of(start + s * bm, bm)
            r = r0 + lax.broadcasted_iota(jnp.int32, (1, bm), 1)
            r_in = (r >= lo) & (r < hi)                                                   # [1, bm]
            a = _load(x_ref.at[pl.ds(k0, bk), pl.ds(r0, bm)], _mask(kr, r_in), (bk, bm))
            b = _load(dy_ref.at[pl.ds(n0, bn), pl.ds(r0, bm)], _mask(nr, r_in), (bn, bm))
            return _mma(acc, a, b, trans_b=True, fast=fast)

        steps = jnp.where(hi > lo, lax.div(hi - start + (bm - 1), jnp.int32(bm)), 0)
    else:
        k_in = (k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < k if k % bk else None
        n_in = (n0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n if n % bn else None

        def body(s, acc):
            r0 = lo + s * bm
            r_in = (r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < hi
            a = _load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], _mask(r_in, k_in), (bm, bk))
            b = _load(dy_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], _mask(r_in, n_in), (bm, bn))
            return _mma(acc, a, b, trans_a=True)

        steps = lax.div(jnp.maximum(hi - lo, 0) + (bm - 1), jnp.int32(bm))
    acc = lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), F32))
    if scale_ref:
        acc = acc * scale_ref[0][...]
    n_col = (n0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n if n % bn else None
    mask = _mask(kr, n_col)
    view = dw_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)]
    val = acc.astype(dw_ref.dtype)
    if mask is None:
        plgpu.store(view, val)
    else:
        plgpu.store(view, val, mask=jnp.broadcast_to(mask, (bk, bn)))


def _whole(a):
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)   # pointers: tiles are picked in the kernel


def _check_fp8(a, b, out_dtype, nt: bool, what: str):
    """Operands both FP8 or neither; FP8 needs the contraction-major ("NT") form and a 16/32-bit output."""
    fp8 = [jnp.dtype(t.dtype) in FP8 for t in (a, b)]
    if any(fp8) and not all(fp8):
        raise ValueError(f"grouped_matmul_triton {what}: {a.dtype} with {b.dtype}: FP8 operands go in pairs "
                         "(float8_e4m3fn / float8_e5m2, either type each)")
    if all(fp8):
        if not nt:
            raise ValueError(f"grouped_matmul_triton {what}: FP8 operands must be contraction-major (trans_rhs=True; "
                             "dW: transposed=True): Hopper's FP8 wgmma reads no transposed operand")
        if out_dtype is None or jnp.dtype(out_dtype) not in DTYPES:
            raise ValueError(f"grouped_matmul_triton {what}: FP8 operands need out_dtype bfloat16, float16 or "
                             f"float32 (got {out_dtype})")
    return all(fp8)


def _scale_operand(scale):
    return [] if scale is None else [jnp.asarray(scale, F32).reshape(1, 1)]


def gmm_call(lhs, w, group_sizes, tiles: TritonTiles, interpret: bool, trans_rhs: bool = False, *,
             out_dtype=None, scale=None, fast: bool = False, name: str | None = None):
    """lhs [M, kc] @ w[g] ([G, kc, no], or trans_rhs: [G, no, kc] read transposed) -> [M, no] in
    out_dtype (None: lhs's). scale (a scalar, fp32): multiplies the fp32 sums before the cast. FP8
    lhs and w: trans_rhs only, out_dtype given; fast: FP8's fast accumulation (Hopper). name: the
    kernel's (profiles), by default grouped_matmul_triton, _dx with trans_rhs."""
    fp8 = _check_fp8(lhs, w, out_dtype, trans_rhs, "gmm_call")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, kc = lhs.shape
    groups, no = w.shape[0], w.shape[1] if trans_rhs else w.shape[2]
    if m == 0 or no == 0 or kc == 0 or groups == 0:
        return jnp.zeros((m, no), out_dtype)
    bm, bn, bk = fit(tiles.block_m, m), fit(tiles.block_n, no), fit(tiles.block_k, kc, FP8_MIN_K if fp8 else 16)
    meta = row_tiles(group_sizes, m, bm)
    scale = _scale_operand(scale)
    kernel = functools.partial(_gmm_kernel, bm=bm, bn=bn, bk=bk, groups=groups, m=m, kc=kc, no=no,
                               trans_rhs=trans_rhs, fast=bool(fast))
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(no, bn), meta.shape[1]),   # columns fastest: a row tile's programs run together
        in_specs=[_whole(meta), _whole(lhs), _whole(w)] + [_whole(s) for s in scale],
        out_specs=pl.BlockSpec((m, no), lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, no), out_dtype), interpret=interpret,
        compiler_params=TritonCompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name=name or ("grouped_matmul_triton_dx" if trans_rhs else "grouped_matmul_triton"),
    )(meta, lhs, w, *scale)


def dw_call(x, dy, group_sizes, tiles: TritonTiles, interpret: bool, out_dtype, *, transposed: bool = False,
            scale=None, fast: bool = False, name: str = "grouped_matmul_triton_dw"):
    """[G, K, N] per group x_g^T dy_g (rows past sum(group_sizes) in no group), fp32 sums (times scale,
    if given) in out_dtype. x [M, K] and dy [M, N], or transposed: x^T [K, M] and dy^T [N, M] (the
    form FP8 operands need)."""
    fp8 = _check_fp8(x, dy, out_dtype, transposed, "dw_call")
    (k, m), n = (x.shape, dy.shape[0]) if transposed else (x.shape[::-1], dy.shape[1])
    groups = group_sizes.shape[0]
    if m == 0 or k == 0 or n == 0 or groups == 0:
        return jnp.zeros((groups, k, n), out_dtype)
    bm, bk, bn = fit(tiles.dw_block_m, m, FP8_MIN_K if fp8 else 16), fit(tiles.dw_block_k, k), fit(tiles.dw_block_n, n)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)])
    scale = _scale_operand(scale)
    kernel = functools.partial(_dw_kernel, bm=bm, bk=bk, bn=bn, k=k, n=n, transposed=transposed, fast=bool(fast))
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(k, bk), pl.cdiv(n, bn), groups),   # one group's programs together: its rows shared
        in_specs=[_whole(offsets), _whole(x), _whole(dy)] + [_whole(s) for s in scale],
        out_specs=pl.BlockSpec((groups, k, n), lambda *_: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype), interpret=interpret,
        compiler_params=TritonCompilerParams(num_warps=tiles.dw_num_warps, num_stages=tiles.dw_num_stages),
        name=name,
    )(offsets, x, dy, *scale)


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
