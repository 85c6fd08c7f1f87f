"""Grouped (ragged) matmul for mixture-of-experts layers: rows sorted by group, one weight per group.

    out[m] = x[m] @ w[g(m)]        x [M, K], w [G, K, N], group_sizes [G] -> [M, N]

Rows 0..gs[0]-1 belong to group 0, the next gs[1] to group 1, and so on; rows past
sum(group_sizes) (a static buffer's padding) come out zero, as `jax.lax.ragged_dot` gives them.
Backends: mosaic, JAX's Mosaic GPU ragged-dot kernels for the forward, dX and dW (Hopper only);
triton, our Pallas Triton kernels (grouped_matmul_triton.py: any CUDA GPU, or the CPU with
interpret=True); xla, `jax.lax.ragged_dot` with its own autodiff (the numerical reference).
`auto` picks triton on any CUDA GPU, xla elsewhere. On Hopper the triton kernels beat Mosaic's in
the forward, the forward + backward and MoE training (docs/benchmarks.md#pipeline-and-moe); `mosaic`
stays for whoever asks, and is the Hopper path should jax drop Pallas Triton (deprecated in 0.11).
On GPU ragged_dot lowers to dense GEMMs over a zero-masked copy of the operand per group (G times
the bytes and FLOPs), while both kernel backends read each group's rows in place. Limits: mosaic
needs Hopper and has no interpret mode; `interpret=True` runs triton's kernels in the Pallas
interpreter when triton is asked for, and takes xla for auto and mosaic. Speed:
scripts/bench_moe.py.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

from pallas_kernels.attention import on_hopper
from pallas_kernels.grouped_matmul_triton import TritonTiles, gmm_call, grouped_matmul_triton

BACKENDS = ("auto", "mosaic", "triton", "xla")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Mosaic kernel tiles (rows x columns x contraction per wgmma tile) and pipeline depth.
    block_m/n 128 and block_k 64 with 4 stages fit the H200's 227 KiB of shared memory in bf16;
    grid_block_n orders the persistent grid so neighbouring SMs share weight columns."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 2
    # dW kernel (transposed ragged dot): its output tile is [block_m of K, block_n of N]
    t_block_m: int = 128
    t_block_n: int = 128
    t_block_k: int = 64
    t_max_concurrent_steps: int = 2
    t_grid_block_n: int = 1


def grouped_matmul_reference(x, w, group_sizes):
    """Pure-jnp reference: each row times its group's weight, rows past the total zero. O(M K N) memory."""
    ends = jnp.cumsum(group_sizes)                                           # [G]
    rows = jnp.arange(x.shape[0])
    gid = jnp.searchsorted(ends, rows, side="right")                         # [M], G for padding rows
    valid = gid < w.shape[0]
    wm = w[jnp.minimum(gid, w.shape[0] - 1)]                                 # [M, K, N]
    out = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), wm.astype(jnp.float32))
    return jnp.where(valid[:, None], out, 0.0).astype(x.dtype)


# interpret=True: triton runs its kernels in the Pallas interpreter; auto and mosaic take xla (the
# Mosaic GPU interpreter does not run wgmma with a shared-memory LHS, as flash_attention_mgpu found,
# and auto is the CPU's choice, xla, there). xla is never the GPU default: on the H200 image
# `lax.ragged_dot` lowers to dense cuBLAS GEMMs over zero-padded operands (a tenth of the Mosaic
# kernels' rate, GBs of temporaries).
def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_backend(backend: str = "auto", interpret: bool = False) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"grouped_matmul backend={backend!r} must be one of {BACKENDS}")
    if backend == "xla":
        return "xla"
    if backend == "triton":
        if not interpret and not _on_gpu():
            raise ValueError("grouped_matmul backend='triton' needs a CUDA GPU, or interpret=True (the Pallas "
                             "interpreter, slow: tests); on CPU use backend='xla' or 'auto'")
        return "triton"
    if interpret:
        return "xla"
    if backend == "mosaic":
        if not on_hopper():
            raise ValueError("grouped_matmul backend='mosaic' needs a Hopper GPU (H100/H200); on other devices use "
                             "backend='triton' (any CUDA GPU), 'xla' (jax.lax.ragged_dot) or 'auto'")
        return "mosaic"
    return "triton" if _on_gpu() else "xla"


def grouped_matmul(x, w, group_sizes, *, backend: str = "auto", tiles: Tiles = Tiles(),
                   triton_tiles: TritonTiles | None = None, interpret: bool = False, all_rows: bool = False):
    """x [M, K], w [G, K, N], group_sizes [G] int32 -> [M, N] in x's dtype (fp32 accumulation).
    tiles: the mosaic kernels'; triton_tiles: the triton kernels' (None: TritonTiles.default(x.dtype)).
    all_rows: sum(group_sizes) == M is guaranteed by the caller (no padding rows to mask; mosaic only,
    the triton kernels write every row themselves)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul: x {x.shape} [M, K], w {w.shape} [G, K, N] and group_sizes "
                         f"{group_sizes.shape} [G] do not fit together")
    group_sizes = group_sizes.astype(jnp.int32)
    resolved = resolve_backend(backend, interpret)
    if resolved == "xla":
        return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
    if resolved == "triton":
        return grouped_matmul_triton(x, w.astype(x.dtype), group_sizes, tiles=triton_tiles, interpret=interpret)
    m, pad = x.shape[0], -x.shape[0] % ROW_ALIGN
    if pad:   # zero rows past every group: unwritten by the kernels, sliced off (their gradient: zeros)
        x = jnp.pad(x, ((0, pad), (0, 0)))
    return _mosaic_gmm(x, w.astype(x.dtype), group_sizes, tiles, all_rows)[:m]


# -- the Mosaic GPU path --------------------------------------------------------------------------
# The kernels' TMA copies take x's rows in (8, 64) tiles: Mosaic GPU refuses a row count that is
# not a multiple of 8 (e.g. 683, a third of 2,048 rows), so grouped_matmul pads x for every caller.
ROW_ALIGN = 8
# jax.experimental.pallas.ops.gpu's Hopper kernels: `ragged_dot_mgpu` for the forward and dX (its
# transposed-RHS form), `transposed_ragged_dot_mgpu` for dW (per group x_g^T dy_g).
def _call(fn, *args, **kw):
    """Call a JAX example kernel with only the keyword arguments its installed version takes."""
    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kw.items() if k in params})


# A decode batch routes a few rows to each expert: the Hopper tile computes 128 rows for a group of a
# few. Through the engine on an H100 (moe_1b_8e, `bench_decode.py --jobs gmm_tiles_ab`), a 16-row tile
# with narrow columns over long contraction chunks decoded batch 8 / 16 (32 routed rows) 1.04x / 1.02x
# faster than the default; at batch 64 (128 rows) the candidate tied, so 128+ rows keep the default.
# Shared memory a stage: (16 x 256 + 256 x 64) x 2 B; 120 KiB at 3 stages: Hopper's, not sm_86/89's.
FEW_ROWS = 64
HOPPER_FEW_ROWS = TritonTiles(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3)


def nk_tiles(rows: int, dtype) -> TritonTiles:
    """grouped_matmul_nk's triton tiles for a static row count: HOPPER_FEW_ROWS for 2-byte inputs on
    Hopper up to FEW_ROWS rows (decode batches up to 32 tokens at top 2), TritonTiles.default past them."""
    if rows <= FEW_ROWS and jnp.dtype(dtype).itemsize == 2 and on_hopper():
        return HOPPER_FEW_ROWS
    return TritonTiles.default(dtype)


def grouped_matmul_nk(x, w_nk, group_sizes, *, backend: str = "auto", interpret: bool = False):
    """x [M, K] @ w_nk[g]^T, each group's matrix stored [N, K] (w_nk [G, N, K], the layout serving's
    expert kernels read) -> [M, N] in x's dtype; forward only (serving). The triton kernels
    read w_nk transposed in place, their dX path, with tiles by M (nk_tiles); xla and mosaic take a
    transposed copy (the CPU's tests, or whoever asks for mosaic)."""
    if x.ndim != 2 or w_nk.ndim != 3 or x.shape[1] != w_nk.shape[2] or group_sizes.shape != (w_nk.shape[0],):
        raise ValueError(f"grouped_matmul_nk: x {x.shape} [M, K], w_nk {w_nk.shape} [G, N, K] and group_sizes "
                         f"{group_sizes.shape} [G] do not fit together")
    group_sizes = group_sizes.astype(jnp.int32)
    if resolve_backend(backend, interpret) == "triton":
        return gmm_call(x, w_nk.astype(x.dtype), group_sizes, nk_tiles(x.shape[0], x.dtype), interpret, trans_rhs=True)
    return grouped_matmul(x, jnp.swapaxes(w_nk, 1, 2), group_sizes, backend=backend, interpret=interpret)


def _row_mask(out, group_sizes, all_rows=False):
    """The Mosaic kernels write only the rows of the groups, leaving rows past sum(group_sizes)
    unwritten: they are zeroed here (one select XLA fuses into the consumer; alone a pass over
    [M, N]). all_rows=True is the caller's promise that sum(group_sizes) == M (every row a real
    assignment, as in a single device's dropless dispatch): no mask."""
    if all_rows:
        return out
    valid = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)                  # [M]
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def _fwd_kernel(x, w, group_sizes, tiles: Tiles, transpose_rhs: bool, all_rows: bool):
    out = _call(ragged_dot_mgpu.ragged_dot, x, w, group_sizes=group_sizes, block_m=tiles.block_m,
                block_n=tiles.block_n, block_k=tiles.block_k, max_concurrent_steps=tiles.max_concurrent_steps,
                grid_block_n=tiles.grid_block_n, transpose_rhs=transpose_rhs)
    return _row_mask(out, group_sizes, all_rows)


def _dw_kernel(x, dy, group_sizes, tiles: Tiles):
    return _call(transposed_ragged_dot_mgpu.transposed_ragged_dot, x, dy, group_sizes=group_sizes,
                 block_m=tiles.t_block_m, block_n=tiles.t_block_n, block_k=tiles.t_block_k,
                 max_concurrent_steps=tiles.t_max_concurrent_steps, grid_block_n=tiles.t_grid_block_n)  # [G, K, N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _mosaic_gmm(x, w, group_sizes, tiles, all_rows):
    return _fwd_kernel(x, w, group_sizes, tiles, False, all_rows)


def _mosaic_fwd(x, w, group_sizes, tiles, all_rows):
    return _mosaic_gmm(x, w, group_sizes, tiles, all_rows), (x, w, group_sizes)


def _mosaic_bwd(tiles, all_rows, res, dy):
    x, w, group_sizes = res
    dy = _row_mask(dy.astype(x.dtype), group_sizes, all_rows)   # rows past the total: 0 (dW's edge blocks x 0)
    dx = _fwd_kernel(dy, w, group_sizes, tiles, True, all_rows)              # [M, K] = dy [M, N] . w_g^T
    dw = _dw_kernel(x, dy, group_sizes, tiles)                               # [G, K, N] = x_g^T dy_g
    return dx, dw.astype(w.dtype), None


_mosaic_gmm.defvjp(_mosaic_fwd, _mosaic_bwd)
