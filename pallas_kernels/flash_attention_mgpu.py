"""FlashAttention forward and backward for Hopper (sm_90) through Pallas' Mosaic GPU backend.

Why a second kernel: the Triton-lowered `flash_attention.py` has no control over wgmma or TMA and
its backward reaches about 0.45-0.75x cuDNN (docs/benchmarks.md, "Attention"). Here every matmul is
an explicit `plgpu.wgmma` on shared-memory tiles fed by TMA copies, in the FlashAttention-3 shape:

- Forward: one CTA owns `block_q` query rows, split between two compute warpgroups (block_q/2 rows
  each, one wgmma M-tile of 64); a third, producer warpgroup streams K and V tiles of `block_kv`
  rows into a ring of `num_stages` shared-memory slots (TMA, mbarriers: `*_ready` per slot, and
  `*_free` with one arrival per compute warpgroup). Softmax is online, in fp32 and base 2 (the
  scale folded into one multiply-add before exp2). Optional ping-pong: the two compute warpgroups
  meet at a 2-arrival barrier twice per kv step so that one runs its softmax while the other's
  matmuls occupy the tensor cores. Causal: kv tiles wholly above the diagonal are never loaded
  (per CTA) nor computed (per warpgroup; the warpgroup whose rows end earlier only waits on and
  releases the CTA's last tiles); only diagonal tiles are masked. Causal CTAs run longest-first.
  Writes O and lse (base 2, [batch, heads, seq], fp32) for the backward.
- Backward (FlashAttention-2 split): a dQ kernel of the same shape as the forward (two warpgroups
  own query rows, K/V streamed) that also writes delta = rowsum(dO * O), and a dK/dV kernel where two
  warpgroups own `block_kv_dkv/2` kv rows each (K, V resident in shared memory) and the producer
  streams Q, dO, lse and delta tiles over every query head of the GQA group, so the group's dK/dV
  sum happens in registers and K/V are never repeated in memory. The dK/dV kernel works kv-major
  (S^T = K Q^T, dP^T = V dO^T) so that P^T and dS^T are register operands of wgmma with dO, Q in
  shared memory as the other operand.
- Fused backward (`fused_bwd`; FlashAttention-3's): the dK/dV kernel also writes each step's dS^T
  to shared memory, and each compute warpgroup multiplies half of dS by the CTA's K and adds that
  piece to an fp32 dQ in global memory with one TMA reduce-add. The fp32 dQ is a jax Ref, zeroed by
  XLA and aliased in and out of the kernel; XLA scales and casts it afterwards. Five tile matmuls
  per step instead of the split's seven, for the reduce traffic and a memset and convert per call.
  By default (`use_fused_bwd`) it runs where it measured faster: d=64, full attention or causal
  S >= 4096. Its compute warpgroups take 240 registers (FlashAttention-3's split), the others 232.
  Its dQ is not bitwise repeatable (the adds have no fixed order); XLA_FLAGS with
  --xla_gpu_deterministic_ops=true selects the split kernels instead (tiles.deterministic_requested).

The backward kernels live in flash_attention_mgpu_bwd.py, the tiles (MgpuBlockSizes), their
defaults and the fused-or-split choice in flash_attention_mgpu_tiles.py; this file has the forward,
the shared helpers, the custom_vjp wrapper and the argument checks.

Measured on an H200 (jax 0.11.2, bf16, B*S = 16k, H*D = 2048, 2026-11-30, docs/benchmarks.md):
forward 145-608 TFLOP/s (608 at 1x16384x16x128 full). In one run over the issue's 20 shapes,
fwd+bwd was 0.85-1.09x cuDNN at 19 of them. The exception was 8x2048x16x128 causal at 0.77x,
which another call measured at 1.32x and a later three-round call at 1.08x (three rounds, alternating). The Triton kernel
was 0.45-0.87x. It is faster than JAX's
Pallas `mha` and XLA at every shape. So `attention: pallas` runs this kernel on Hopper for the
shapes it takes (pallas_kernels/attention.py), and the Triton kernel for everything else:
segment ids, q_len != kv_len, other GPUs, CPU interpret mode. In the llama3_1b training step
(causal 4x4096, GQA 32/8, d=64, fused backward) it was 1.001-1.014x cuDNN's tokens/s over six
alternating pairs (docs/benchmarks.md#attention). Tried there and slower: FA3's intra-warpgroup
pipelined forward (S_t with P_{t-1} V_{t-1}), 10-55% slower at that shape, with or without ping-pong.

Layout is `jax.nn.dot_product_attention`'s: q [b, s, h, d], k/v [b, s, kv_h, d], q_len == kv_len,
h a multiple of kv_h, d in {64, 128}, bf16 or fp16, s a multiple of every block size.
Causal masking is the plain lower triangle (query i sees keys j <= i).

CPU status: the Mosaic GPU lowering runs without a GPU (`jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))`), which tests/test_flash_attention_mgpu.py uses as a CPU check. The
Mosaic GPU interpreter (jax 0.10.2) cannot run these kernels: its wgmma takes both operands from
shared memory without transposes, and it has no rule for `pl.run_state` (the accumulate-into
wgmma); so `interpret=True` raises and numerical tests are GPU-only.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention import attention_with_saved_forward, named_residuals, output_grad_rowsum
from pallas_kernels.flash_attention import flash_attention_reference  # noqa: F401  (the jnp reference)
from pallas_kernels.flash_attention_mgpu_tiles import (  # noqa: F401  (re-exported: the tuning API)
    _COMPUTE_WGS, MgpuBlockSizes, default_block_sizes, resolve_block_sizes)

LOG2E = math.log2(math.e)
_REGS_COMPUTE, _REGS_PRODUCER = 232, 40  # 2*128*232 + 128*40 <= 64K registers per SM
# FlashAttention-3's split, for the fused backward only: there ptxas spilled 244 bytes per thread at
# 232 and 192 at 240, and the kernel ran 4-5% faster (causal 4x4096x32/8x64: 1.90-1.92 vs 2.00-2.01
# ms, H200, same process). Elsewhere 240 changed nothing measurable (the split dK/dV
# kernel spills 24 -> 20 bytes) or was within noise (d=128).
_REGS_FUSED = (240, 24)


@dataclasses.dataclass(frozen=True)
class _Cfg:
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


def _tile_transforms():
    # 64 elements of 16 bits = one 128-byte swizzle row: the wgmma-friendly shared-memory layout
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _params():
    return plgpu.CompilerParams(approx_math=True)


def _cdiv(x, m):
    return lax.div(x + (m - 1), jnp.int32(m))


def _bcast(vec, shape, dim):
    return lax.broadcast_in_dim(vec, shape, [dim])


def _index_grid(shape, row_offset):
    """(row + row_offset, col) as int32 [rows, cols] broadcasts of two index vectors in the WGMMA
    layout: 2 + cols/4 values per thread where two 2D iotas hold 2 * rows * cols / 128 (measured:
    the dK/dV kernel's iotas were most of its register spill). The forward and dQ kernels did not
    spill either way; there it measured even and keeps one mask for all three kernels."""
    rows, cols = shape
    r = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=plgpu.Layout.WGMMA.reduce(1)) + row_offset
    col = plgpu.broadcasted_iota(jnp.int32, (cols,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
    return _bcast(r, shape, 0), _bcast(col, shape, 1)


def _mma(acc, a, b):
    """acc + a @ b on the tensor cores, accumulating in the wgmma registers."""
    def body(ref):
        plgpu.wgmma(ref, a, b)
    return pl.run_state(body)(plgpu.ACC.init(acc))


def _zeros(shape, layout=None):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout or plgpu.Layout.WGMMA)


def _row_vec(n, value):
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def _q_tile_index(n_tiles, causal):
    """Causal CTAs run longest-first, so the short ones fill the tail of the launch."""
    i = lax.axis_index("q_seq")
    return (n_tiles - 1 - i) if causal else i


def _div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _ring_producer(n_steps, num_stages, loads, frees, regs=_REGS_PRODUCER):
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


def _kv_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free, *, b, kvh, bkv, n_steps,
                 num_stages):
    """_ring_producer streaming [bkv] rows of K and V (kv head `kvh`) per step: the forward's and
    the dQ kernel's producer warpgroup."""
    def loads(t, slot):
        src = (b, pl.ds(t * bkv, bkv), kvh)
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_ready.at[slot])
    _ring_producer(n_steps, num_stages, loads, (k_free, v_free))


def _launch(kernel, out_type, scratch, grid, *args, name, refs=False):
    """plgpu.kernel with the layout every kernel here shares: grid (heads, q or kv tiles, batch),
    two compute warpgroups plus the producer. `name` names the kernel in profiles (Pallas takes the
    body's name), where fwd, dQ and dK/dV would otherwise all be "kernel". refs=True: some args are
    jax Refs, aliased in and out of the kernel (the fused backward's fp32 dQ); plgpu.kernel's vmap
    wrapper cannot carry their effects, so this calls pl.kernel on a plgpu.Mesh directly."""
    kernel.__name__ = kernel.__qualname__ = name
    mesh_kw = dict(grid=grid, grid_names=("heads", "q_seq", "batch"), num_threads=_COMPUTE_WGS + 1, thread_name="wg")
    if not refs:
        return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, compiler_params=_params(),
                            **mesh_kw)(*args)

    def body(*arg_refs):
        pl.run_scoped(lambda *scratch_refs: kernel(*arg_refs, *scratch_refs), *scratch, collective_axes="wg")
    return pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(**mesh_kw), compiler_params=_params(),
                     name=name)(*args)


# ----------------------------------------------------------------------------------------------
# forward


def _fwd_call(q, k, v, cfg: _Cfg):
    bs = cfg.bs
    b_, s_, h_, d_ = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim
    dtype = q.dtype
    rows = bs.block_q // _COMPUTE_WGS
    bkv = bs.block_kv
    n_tiles = s_ // bs.block_q
    stages = min(bs.num_stages, s_ // bkv)
    c = cfg.sm_scale * LOG2E
    causal, pingpong, group = cfg.causal, bs.pingpong, cfg.group

    def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem,
               q_ready, k_ready, v_ready, k_free, v_free, sched):
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        cta_q0 = _q_tile_index(n_tiles, causal) * bs.block_q
        n_cta = _cdiv(cta_q0 + bs.block_q, bkv) if causal else s_ // bkv

        def meet():  # both compute warpgroups at the same point (ping-pong scheduling)
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < _COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(_REGS_COMPUTE, action="increase")
            q0 = cta_q0 + wg * rows
            qs = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, rows), h], qs, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])

            def step(t, carry, masked):
                acc, m, l = carry
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(ref):
                    plgpu.wgmma(ref, qs, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    if pingpong:
                        meet()
                    return ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((rows, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    q_row, kv_col = _index_grid(s.shape, q0 - t * bkv)
                    s = jnp.where(q_row >= kv_col, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * c - _bcast(m_new, s.shape, 0))
                l = l * alpha + p.sum(axis=1)
                acc = acc * _bcast(alpha, acc.shape, 0)
                p = p.astype(dtype)
                if pingpong:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_ready.at[slot])
                if pingpong:
                    plgpu.barrier_wait(sched)
                acc = _mma(acc, p, v_smem.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            def idle_step(t, carry):  # a CTA tile past this warpgroup's diagonal: keep the ring moving
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(k_ready.at[slot])
                if pingpong:
                    meet()
                plgpu.barrier_arrive(k_free.at[slot])
                if pingpong:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_ready.at[slot])
                if pingpong:
                    plgpu.barrier_wait(sched)
                plgpu.barrier_arrive(v_free.at[slot])
                return carry

            carry = (_zeros((rows, d_)), _row_vec(rows, -jnp.inf), _row_vec(rows, 0.0))
            if pingpong:
                pl.when(wg == 1)(meet)
            if causal:
                n_full = lax.div(q0, jnp.int32(bkv))  # tiles wholly at or below the diagonal
                n_wg = _cdiv(q0 + rows, bkv)
                carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(n_full, n_wg, functools.partial(step, masked=True), carry)
                lax.fori_loop(n_wg, n_cta, idle_step, 0)
            else:
                carry = lax.fori_loop(0, n_cta, functools.partial(step, masked=False), carry)
            if pingpong:
                pl.when(wg == 0)(meet)
            acc, m, l = carry
            acc = acc * _bcast(1.0 / l, acc.shape, 0)
            qs[...] = acc.astype(dtype)
            lse_smem.at[wg][...] = m + jnp.log(l) * LOG2E
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qs, o_ref.at[b, pl.ds(q0, rows), h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q0, rows)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def _producer():
            _kv_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free,
                         b=b, kvh=lax.div(h, jnp.int32(group)), bkv=bkv, n_steps=n_cta, num_stages=stages)

    tr = _tile_transforms()
    scratch = [
        plgpu.SMEM((_COMPUTE_WGS, rows, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bkv, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bkv, d_), dtype, transforms=tr),
        plgpu.SMEM((_COMPUTE_WGS, rows), jnp.float32),
        plgpu.Barrier(num_barriers=_COMPUTE_WGS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    ]
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b_, h_, s_), jnp.float32))   # O, lse
    return _launch(kernel, out_type, scratch, (h_, n_tiles, b_), q, k, v, name="mgpu_flash_fwd")


# ----------------------------------------------------------------------------------------------
# public wrapper


def _attn_fwd(q, k, v, cfg):
    # named like the Triton kernel's, so remat="save_dots_attn" keeps them (no forward in the backward)
    return named_residuals(*_fwd_call(q, k, v, cfg))


def _attn_bwd(cfg, inputs, outs, cts):
    (q, k, v), (out, lse), (do,) = inputs, outs, cts   # only out is returned: lse has no cotangent
    do = do.astype(q.dtype)
    from pallas_kernels.flash_attention_mgpu_bwd import _dkv_call, _dq_call, _dqkv_call   # imports our helpers
    if cfg.bs.fused_bwd:
        return _dqkv_call(q, k, v, do, lse, output_grad_rowsum(out, do), cfg)
    dq, delta = _dq_call(q, k, v, do, lse, out, cfg)   # delta for the dK/dV kernel, which runs after
    dk, dv = _dkv_call(q, k, v, do, lse, delta, cfg)
    return dq, dk, dv


def _attn(q, k, v, cfg):
    return attention_with_saved_forward(functools.partial(_attn_fwd, cfg=cfg), functools.partial(_attn_bwd, cfg),
                                        (q, k, v), n_diff=3, n_ret=1)[0]


def _config(q, k, v, causal, sm_scale, block_sizes, interpret) -> _Cfg:
    if interpret:
        raise NotImplementedError(
            "flash_attention_mgpu has no interpret mode: the Mosaic GPU interpreter (jax 0.10/0.11) supports "
            "neither wgmma with a register or transposed operand nor pl.run_state; use "
            "pallas_kernels.flash_attention(..., interpret=True) on CPU")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim]; got {q.shape=}, {k.shape=}, {v.shape=}")
    batch, seq_len, heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape=}, {v.shape=}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v batch and head_dim must match q; got {q.shape=}, {k.shape=}")
    if k.shape[1] != seq_len:
        raise ValueError(f"q_len must equal kv_len; got q_len={seq_len}, kv_len={k.shape[1]}")
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if head_dim not in (64, 128):
        raise ValueError(f"{head_dim=} must be 64 or 128")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"q, k, v must all be bfloat16 or all float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    bs = resolve_block_sizes(block_sizes, head_dim, seq_len, bool(causal))
    sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
    return _Cfg(batch, seq_len, heads, kv_heads, head_dim, jnp.dtype(q.dtype).name, bool(causal), sm_scale, bs)


def flash_attention_mgpu(q, k, v, *, causal=False, sm_scale=None, block_sizes: MgpuBlockSizes | None = None,
                         interpret=False):
    """softmax(q k^T * sm_scale [+ causal mask]) v, differentiable; q [b, s, h, d], k/v [b, s, kv_h, d].

    Hopper only (wgmma, TMA). sm_scale defaults to 1/sqrt(d). See the module docstring."""
    cfg = _config(q, k, v, causal, sm_scale, block_sizes, interpret)
    return _attn(q, k, v, cfg)


def flash_attention_mgpu_fwd_lse(q, k, v, *, causal=False, sm_scale=None, block_sizes=None):
    """(out, lse) with lse in base 2, [batch, heads, seq], fp32 (what the backward consumes)."""
    cfg = _config(q, k, v, causal, sm_scale, block_sizes, False)
    return _fwd_call(q, k, v, cfg)
