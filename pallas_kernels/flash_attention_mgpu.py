"""FlashAttention forward and backward for Hopper (sm_90) through Pallas' Mosaic GPU backend.

Every matmul is an explicit `plgpu.wgmma` on shared-memory tiles fed by TMA copies, in the
FlashAttention-3 shape: per CTA two compute warpgroups own the rows and a producer warpgroup
streams the other operand's tiles through a shared-memory ring (design: `forward_call` here, the
backward kernels in flash_attention_mgpu_bwd.py). Backward: split dQ and dK/dV kernels, or one
fused kernel (dQ by TMA reduce-add) at head_dim 64 where it measured faster (`use_fused_bwd`).
Layout is `jax.nn.dot_product_attention`'s: q [b, s, h, d], k/v [b, s, kv_h, d], q_len == kv_len,
h a multiple of kv_h, d in {64, 128}, bf16 or fp16, s a multiple of every block size; causal is the
plain lower triangle. No interpret mode: the Mosaic GPU interpreter cannot run wgmma with register
or transposed operands, so CPU tests lower the kernels for CUDA without running them.
Files: tiles and the fused-or-split rule in flash_attention_mgpu_tiles.py, shared Mosaic pieces in
flash_attention_mgpu_common.py. pallas_kernels/attention.py runs this kernel on Hopper for the shapes
it takes. Speed against cuDNN and the Triton kernel: docs/benchmarks.md#attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import flash_attention_mgpu_bwd
from pallas_kernels.flash_attention_mgpu_common import (REGS_COMPUTE, MgpuConfig, bcast, cdiv, index_grid, kv_producer,
                                                        launch, mma, q_tile_index, row_vec, tile_transforms, zeros)
from pallas_kernels.flash_attention_mgpu_tiles import (  # noqa: F401  (re-exported: the tuning API)
    COMPUTE_WGS, MgpuBlockSizes, default_block_sizes, resolve_block_sizes)
from pallas_kernels.flash_common import LOG2E, flash_attention_reference, output_grad_rowsum  # noqa: F401
from pallas_kernels.flash_residuals import attention_with_saved_forward, named_residuals


# ----------------------------------------------------------------------------------------------
# forward


def forward_call(q, k, v, cfg: MgpuConfig):
    """(O [b, s, h, d], lse [b, h, s] fp32 in base 2) of one call; the forward kernel.

    One CTA owns `block_q` query rows, split between two compute warpgroups (one wgmma M-tile of 64
    rows each); the producer warpgroup streams K and V tiles of `block_kv` rows into a ring of
    `num_stages` shared-memory slots (TMA; mbarriers `*_ready` per slot and `*_free` with one arrival
    per compute warpgroup). Softmax is online, in fp32 and base 2 (the scale folded into one
    multiply-add before exp2). Optional ping-pong: the compute warpgroups meet at a 2-arrival barrier
    twice per kv step so one runs its softmax while the other's matmuls hold the tensor cores.
    Causal: kv tiles wholly above the diagonal are never loaded (per CTA) nor computed (per
    warpgroup; the warpgroup whose rows end earlier only waits on and releases the CTA's last
    tiles); only diagonal tiles are masked; CTAs run longest-first."""
    bs = cfg.bs
    b_, s_, h_, d_ = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim
    dtype = q.dtype
    rows = bs.block_q // COMPUTE_WGS
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
        cta_q0 = q_tile_index(n_tiles, causal) * bs.block_q
        n_cta = cdiv(cta_q0 + bs.block_q, bkv) if causal else s_ // bkv

        def meet():  # both compute warpgroups at the same point (ping-pong scheduling)
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(REGS_COMPUTE, action="increase")
            q0 = cta_q0 + wg * rows
            qs = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, rows), h], qs, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])

            def step(t, carry, masked):
                acc, m, l = carry
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(ref):
                    plgpu.wgmma(ref, qs, k_smem.at[slot].transpose((1, 0)))
                    if pingpong:
                        meet()
                    return ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((rows, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    q_row, kv_col = index_grid(s.shape, q0 - t * bkv)
                    s = jnp.where(q_row >= kv_col, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * c - bcast(m_new, s.shape, 0))
                l = l * alpha + p.sum(axis=1)
                acc = acc * bcast(alpha, acc.shape, 0)
                p = p.astype(dtype)
                if pingpong:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_ready.at[slot])
                if pingpong:
                    plgpu.barrier_wait(sched)
                acc = mma(acc, p, v_smem.at[slot])
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

            carry = (zeros((rows, d_)), row_vec(rows, -jnp.inf), row_vec(rows, 0.0))
            if pingpong:
                pl.when(wg == 1)(meet)
            if causal:
                n_full = lax.div(q0, jnp.int32(bkv))  # tiles wholly at or below the diagonal
                n_wg = cdiv(q0 + rows, bkv)
                carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(n_full, n_wg, functools.partial(step, masked=True), carry)
                lax.fori_loop(n_wg, n_cta, idle_step, 0)
            else:
                carry = lax.fori_loop(0, n_cta, functools.partial(step, masked=False), carry)
            if pingpong:
                pl.when(wg == 0)(meet)
            acc, m, l = carry
            acc = acc * bcast(1.0 / l, acc.shape, 0)
            qs[...] = acc.astype(dtype)
            lse_smem.at[wg][...] = m + jnp.log(l) * LOG2E
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qs, o_ref.at[b, pl.ds(q0, rows), h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q0, rows)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            kv_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free,
                         b=b, kvh=lax.div(h, jnp.int32(group)), bkv=bkv, n_steps=n_cta, num_stages=stages)

    tr = tile_transforms()
    scratch = [
        plgpu.SMEM((COMPUTE_WGS, rows, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bkv, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bkv, d_), dtype, transforms=tr),
        plgpu.SMEM((COMPUTE_WGS, rows), jnp.float32),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    ]
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b_, h_, s_), jnp.float32))   # O, lse
    return launch(kernel, out_type, scratch, (h_, n_tiles, b_), q, k, v, name="mgpu_flash_fwd")


# ----------------------------------------------------------------------------------------------
# public wrapper


def _attn_fwd(q, k, v, cfg):
    # named like the Triton kernel's, so remat="save_dots_attn" keeps them (no forward in the backward)
    return named_residuals(*forward_call(q, k, v, cfg))


def backward(cfg, inputs, outs, cts):
    """(dq, dk, dv) from the saved (out, lse) and dO: the fused kernel when cfg.bs.fused_bwd, else the
    dQ kernel (which also writes delta) followed by the dK/dV kernel."""
    (q, k, v), (out, lse), (do,) = inputs, outs, cts   # only out is returned: lse has no cotangent
    do = do.astype(q.dtype)
    if cfg.bs.fused_bwd:
        return flash_attention_mgpu_bwd.dqkv_call(q, k, v, do, lse, output_grad_rowsum(out, do), cfg)
    dq, delta = flash_attention_mgpu_bwd.dq_call(q, k, v, do, lse, out, cfg)   # delta for the dK/dV kernel, which runs after
    dk, dv = flash_attention_mgpu_bwd.dkv_call(q, k, v, do, lse, delta, cfg)
    return dq, dk, dv


def _attn(q, k, v, cfg):
    return attention_with_saved_forward(functools.partial(_attn_fwd, cfg=cfg), functools.partial(backward, cfg),
                                        (q, k, v), n_diff=3, n_ret=1)[0]


def make_config(q, k, v, causal, sm_scale, block_sizes, interpret) -> MgpuConfig:
    """The checked, static config of one call: one clear error for anything the kernels do not take
    (shapes, dtypes, tiles that do not fit or divide, the fused backward where it is refused)."""
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
    return MgpuConfig(batch, seq_len, heads, kv_heads, head_dim, jnp.dtype(q.dtype).name, bool(causal), sm_scale, bs)


def flash_attention_mgpu(q, k, v, *, causal=False, sm_scale=None, block_sizes: MgpuBlockSizes | None = None,
                         interpret=False):
    """softmax(q k^T * sm_scale [+ causal mask]) v, differentiable; q [b, s, h, d], k/v [b, s, kv_h, d].

    Hopper only (wgmma, TMA). sm_scale defaults to 1/sqrt(d). See the module docstring."""
    cfg = make_config(q, k, v, causal, sm_scale, block_sizes, interpret)
    return _attn(q, k, v, cfg)


def flash_attention_mgpu_fwd_lse(q, k, v, *, causal=False, sm_scale=None, block_sizes=None):
    """(out, lse) with lse in base 2, [batch, heads, seq], fp32 (what the backward consumes)."""
    cfg = make_config(q, k, v, causal, sm_scale, block_sizes, False)
    return forward_call(q, k, v, cfg)
