"""Mosaic GPU helpers shared by the FlashAttention kernels of flash_attention_mgpu.py (forward)
and flash_attention_mgpu_bwd.py (dQ, dK/dV, fused backward).

- `MgpuConfig`: the static facts of one call (shapes, dtype, causal, scale, tiles).
- The CTA layout every kernel shares (`launch`): grid (heads, q or kv tiles, batch), COMPUTE_WGS
  compute warpgroups plus one producer warpgroup that streams tiles through a shared-memory ring
  (`ring_producer`, `kv_producer`) guarded by mbarriers; register budgets per warpgroup.
- Register-level pieces: the wgmma accumulate (`mma`), WGMMA-layout zeros and row vectors, the
  causal index grid, the longest-first tile order of causal CTAs.
Hopper (sm_90) only; lowering also runs on CPU for tests. Design and limits: flash_attention_mgpu.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention_mgpu_tiles import COMPUTE_WGS, MgpuBlockSizes

REGS_COMPUTE, REGS_PRODUCER = 232, 40  # 2*128*232 + 128*40 <= 64K registers per SM
# FlashAttention-3's split (compute, producer), for the fused backward only: there 240 registers
# spill less than 232 and the kernel ran faster (docs/benchmarks.md#attention); elsewhere it changed
# nothing measurable.
REGS_FUSED = (240, 24)


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Static facts of one call (hashable: a custom_vjp nondiff argument); tiles already resolved."""
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    sm_scale: float
    bs: MgpuBlockSizes

    @property
    def group(self):
        return self.heads // self.kv_heads


def tile_transforms():
    # 64 elements of 16 bits = one 128-byte swizzle row: the wgmma-friendly shared-memory layout
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def compiler_params():
    return plgpu.CompilerParams(approx_math=True)


def cdiv(x, m):
    return lax.div(x + (m - 1), jnp.int32(m))


def bcast(vec, shape, dim):
    return lax.broadcast_in_dim(vec, shape, [dim])


def index_grid(shape, row_offset):
    """(row + row_offset, col) as int32 [rows, cols] broadcasts of two index vectors in the WGMMA
    layout: 2 + cols/4 values per thread where two 2D iotas hold 2 * rows * cols / 128 (the dK/dV
    kernel's 2D iotas were most of its register spill). One mask helper for all three kernels."""
    rows, cols = shape
    r = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=plgpu.Layout.WGMMA.reduce(1)) + row_offset
    col = plgpu.broadcasted_iota(jnp.int32, (cols,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
    return bcast(r, shape, 0), bcast(col, shape, 1)


def mma(acc, a, b):
    """acc + a @ b on the tensor cores, accumulating in the wgmma registers."""
    def body(ref):
        plgpu.wgmma(ref, a, b)
    return pl.run_state(body)(plgpu.ACC.init(acc))


def zeros(shape, layout=None):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout or plgpu.Layout.WGMMA)


def row_vec(n, value):
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def q_tile_index(n_tiles, causal):
    """Causal CTAs run longest-first, so the short ones fill the tail of the launch."""
    i = lax.axis_index("q_seq")
    return (n_tiles - 1 - i) if causal else i


def div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def ring_producer(n_steps, num_stages, loads, frees, regs=REGS_PRODUCER):
    """The producer warpgroup: `loads(step, slot)` issues the TMA copies of one streamed step into a
    ring slot; before reusing a slot it waits until both compute warpgroups released it."""
    plgpu.set_max_registers(regs, action="decrease")
    for i in range(num_stages):
        if isinstance(n_steps, int):
            if i < n_steps:
                loads(i, i)
        else:
            pl.when(i < n_steps)(functools.partial(loads, i, i))

    def body(t, carry):
        slot = lax.rem(t, jnp.int32(num_stages))
        for free in frees:
            plgpu.barrier_wait(free.at[slot])
        loads(t, slot)
        return carry

    if not isinstance(n_steps, int) or n_steps > num_stages:
        lax.fori_loop(num_stages, n_steps, body, 0)


def kv_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free, *, b, kvh, bkv, n_steps,
                 num_stages):
    """ring_producer streaming [bkv] rows of K and V (kv head `kvh`) per step: the forward's and
    the dQ kernel's producer warpgroup."""
    def loads(t, slot):
        src = (b, pl.ds(t * bkv, bkv), kvh)
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_ready.at[slot])
    ring_producer(n_steps, num_stages, loads, (k_free, v_free))


def launch(kernel, out_type, scratch, grid, *args, name, refs=False):
    """plgpu.kernel with the layout every kernel here shares: grid (heads, q or kv tiles, batch),
    two compute warpgroups plus the producer. `name` names the kernel in profiles (Pallas takes the
    body's name), where fwd, dQ and dK/dV would otherwise all be "kernel". refs=True: some args are
    jax Refs, aliased in and out of the kernel (the fused backward's fp32 dQ); plgpu.kernel's vmap
    wrapper cannot carry their effects, so this calls pl.kernel on a plgpu.Mesh directly."""
    kernel.__name__ = kernel.__qualname__ = name
    mesh_kw = dict(grid=grid, grid_names=("heads", "q_seq", "batch"), num_threads=COMPUTE_WGS + 1, thread_name="wg")
    if not refs:
        return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, compiler_params=compiler_params(),
                            **mesh_kw)(*args)

    def body(*arg_refs):
        pl.run_scoped(lambda *scratch_refs: kernel(*arg_refs, *scratch_refs), *scratch, collective_axes="wg")
    return pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(**mesh_kw), compiler_params=compiler_params(),
                     name=name)(*args)
