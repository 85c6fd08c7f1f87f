"""Backward kernels of the Mosaic GPU FlashAttention (flash_attention_mgpu.py): dQ, dK/dV, and both in one.

- `dq_call` (FlashAttention-2 split): the forward's CTA shape, two warpgroups own query rows while
  K/V stream in; it also writes delta = rowsum(dO * O) for the dK/dV kernel.
- `dkv_call`: two warpgroups own kv rows (K, V resident in shared memory); the producer streams Q,
  dO, lse and delta tiles over every query head of the GQA group, so the group's dK/dV sum stays in
  registers. It works kv-major (S^T = K Q^T, dP^T = V dO^T), so P^T and dS^T are register operands.
- `dqkv_call` (fused, FlashAttention-3's): dK/dV as above, plus dS^T to shared memory and each
  warpgroup's piece of dQ = dS K reduce-added into an fp32 dQ in global memory by TMA. Head dim 64
  only (`flash_attention_mgpu_tiles.dq_split`); its dQ is not bitwise repeatable (unordered adds).
Layout: q/do/o [b, s, h, d], k/v [b, s, kv_h, d], lse (base 2) and delta [b, h, s] fp32.
Speed of each variant: docs/benchmarks.md#attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compat import mgpu_load
from pallas_kernels.flash_attention_mgpu_common import (REGS_COMPUTE, REGS_FUSED, REGS_PRODUCER, MgpuConfig, bcast,
                                                        cdiv, div, index_grid, kv_producer, launch, mma, q_tile_index,
                                                        ring_producer, tile_transforms, zeros)
from pallas_kernels.flash_attention_mgpu_tiles import COMPUTE_WGS, dq_split
from pallas_kernels.flash_common import LOG2E

# ----------------------------------------------------------------------------------------------
# backward: dQ


def dq_call(q, k, v, do, lse, out, cfg: MgpuConfig):
    """dQ, and delta = rowsum(dO * O) [b, h, s] fp32 for the dK/dV kernel: each compute warpgroup
    sums its rows from the dO tile it loads anyway and one O tile, which saves an XLA fusion over
    dO and O before the kernels (the fused backward still takes delta from XLA)."""
    bs = cfg.bs
    b_, s_, h_, d_ = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim
    dtype = q.dtype
    rows = bs.block_q_dq // COMPUTE_WGS
    bkv = bs.block_kv_dq
    n_tiles = s_ // bs.block_q_dq
    stages = min(bs.num_stages_bwd, s_ // bkv)
    c = cfg.sm_scale * LOG2E
    causal, group = cfg.causal, cfg.group

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, dq_ref, delta_ref,
               q_smem, do_smem, o_smem, lse_smem, delta_smem, k_smem, v_smem,
               q_ready, do_ready, lse_ready, o_ready, k_ready, v_ready, k_free, v_free):
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        cta_q0 = q_tile_index(n_tiles, causal) * bs.block_q_dq
        n_cta = cdiv(cta_q0 + bs.block_q_dq, bkv) if causal else s_ // bkv

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(REGS_COMPUTE, action="increase")
            q0 = cta_q0 + wg * rows
            qs, dos = q_smem.at[wg], do_smem.at[wg]
            rows_src = (b, pl.ds(q0, rows), h)
            plgpu.copy_gmem_to_smem(q_ref.at[rows_src], qs, q_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[rows_src], dos, do_ready.at[wg])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(q0, rows)], lse_smem.at[wg], lse_ready.at[wg])
            plgpu.copy_gmem_to_smem(o_ref.at[rows_src], o_smem.at[wg], o_ready.at[wg])
            for bar in (q_ready, do_ready, lse_ready, o_ready):
                plgpu.barrier_wait(bar.at[wg])
            lse_r = mgpu_load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            do_r = mgpu_load(dos, layout=plgpu.Layout.WGMMA).astype(jnp.float32)       # [rows, d]
            o_r = mgpu_load(o_smem.at[wg], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            delta_r = jnp.sum(do_r * o_r, axis=1)                                            # [rows]
            delta_smem.at[wg][...] = delta_r
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(delta_smem.at[wg], delta_ref.at[b, h, pl.ds(q0, rows)])

            def step(t, dq, masked):
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])

                def sdp(s_ref, dp_ref):  # both matmuls in flight before the first wait
                    plgpu.wgmma(s_ref, qs, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, dos, v_smem.at[slot].transpose((1, 0)))
                    return s_ref[...], dp_ref[...]
                s, dp = pl.run_scoped(sdp, plgpu.ACC((rows, bkv), jnp.float32), plgpu.ACC((rows, bkv), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                p = jnp.exp2(s * c - bcast(lse_r, s.shape, 0))
                if masked:
                    q_row, kv_col = index_grid(p.shape, q0 - t * bkv)
                    p = jnp.where(q_row >= kv_col, p, 0.0)
                ds = p * (dp - bcast(delta_r, dp.shape, 0))
                dq = mma(dq, ds.astype(dtype), k_smem.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            def idle_step(t, carry):
                slot = lax.rem(t, jnp.int32(stages))
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                return carry

            dq = zeros((rows, d_))
            if causal:
                n_full = lax.div(q0, jnp.int32(bkv))
                n_wg = cdiv(q0 + rows, bkv)
                dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), dq)
                dq = lax.fori_loop(n_full, n_wg, functools.partial(step, masked=True), dq)
                lax.fori_loop(n_wg, n_cta, idle_step, 0)
            else:
                dq = lax.fori_loop(0, n_cta, functools.partial(step, masked=False), dq)
            qs[...] = (dq * cfg.sm_scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qs, dq_ref.at[rows_src])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            kv_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free,
                         b=b, kvh=lax.div(h, jnp.int32(group)), bkv=bkv, n_steps=n_cta, num_stages=stages)

    tr = tile_transforms()
    scratch = [
        *[plgpu.SMEM((COMPUTE_WGS, rows, d_), dtype, transforms=tr)] * 3,   # Q, dO, O
        plgpu.SMEM((COMPUTE_WGS, rows), jnp.float32),
        plgpu.SMEM((COMPUTE_WGS, rows), jnp.float32),
        plgpu.SMEM((stages, bkv, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bkv, d_), dtype, transforms=tr),
        *[plgpu.Barrier(num_barriers=COMPUTE_WGS)] * 4,
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
    ]
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b_, h_, s_), jnp.float32))  # dQ, delta
    return launch(kernel, out_type, scratch, (h_, n_tiles, b_), q, k, v, do, lse, out, name="mgpu_flash_dq")


# ----------------------------------------------------------------------------------------------
# backward: dK, dV


def _q_producer(grefs, smems, readies, free, *, b, kvh, group, bq, qs_cta, n_per_head, stages, regs=REGS_PRODUCER):
    """The dK/dV kernels' producer warpgroup: per step, one [bq]-row tile of Q, lse, dO and delta of
    query head kvh * group + g (g-major over the GQA group, q tiles from qs_cta) into a ring slot."""
    def loads(t, slot):
        g = div(t, n_per_head)
        qi = qs_cta + (t - g * n_per_head)
        h = kvh * group + g
        for gref, smem, ready, seq_major in zip(grefs, smems, readies, (True, False, True, False)):
            rows = pl.ds(qi * bq, bq)
            src = gref.at[b, rows, h] if seq_major else gref.at[b, h, rows]   # Q, dO [b, s, h, d]; lse, delta [b, h, s]
            plgpu.copy_gmem_to_smem(src, smem.at[slot], ready.at[slot])
    ring_producer(group * n_per_head, stages, loads, (free,), regs)


def _pt_dst(ks, vs, ring, ready, slot, *, qi, k0, bq, c, masked):
    """The dK/dV kernels' step up to dS^T, kv-major: S^T = K Q^T and dP^T = V dO^T in flight together
    (shared-memory operands, one wait), P^T = exp2(S^T c - lse) (zero above the diagonal when
    `masked`), dS^T = P^T (dP^T - delta). Returns (P^T, dS^T) in fp32, the register operands of the
    dV += P^T dO and dK += dS^T Q wgmmas that follow. Register pressure decides this shape: issuing
    dV with dP^T would hold the fp32 P^T across a wgmma, and two [rows, bq] int32 iotas for the
    causal mask spilled past the compute warpgroups' 232 registers (ptxas reports; the mask is built
    from a row and a column index vector instead, index_grid). Both choices measured faster on the
    H200 (docs/benchmarks.md#attention). ring/ready: the (Q, lse, dO, delta) slots and their barriers."""
    (q_smem, lse_smem, do_smem, delta_smem), (q_ready, lse_ready, do_ready, delta_ready) = ring, ready
    rows = ks.shape[0]
    for bar in (q_ready, do_ready):
        plgpu.barrier_wait(bar.at[slot])

    def st_dpt(st_ref, dpt_ref):
        plgpu.wgmma(st_ref, ks, q_smem.at[slot].transpose((1, 0)))
        plgpu.wgmma(dpt_ref, vs, do_smem.at[slot].transpose((1, 0)))
        return st_ref[...], dpt_ref[...]
    st, dpt = pl.run_scoped(st_dpt, plgpu.ACC((rows, bq), jnp.float32), plgpu.ACC((rows, bq), jnp.float32))
    plgpu.barrier_wait(lse_ready.at[slot])
    lse_c = mgpu_load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    pt = jnp.exp2(st * c - bcast(lse_c, st.shape, 1))
    if masked:
        kv_row, q_col = index_grid(st.shape, k0 - qi * bq)
        pt = jnp.where(q_col >= kv_row, pt, 0.0)
    plgpu.barrier_wait(delta_ready.at[slot])
    delta_c = mgpu_load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    return pt, pt * (dpt - bcast(delta_c, dpt.shape, 1))


def _over_group(head, group, carry):
    """head(g, carry) over the query heads g of a GQA group: their dK/dV sum in the carry."""
    return head(0, carry) if group == 1 else lax.fori_loop(0, group, head, carry)


def _store_dkv(dk, dv, ks, vs, dk_dst, dv_dst):
    """dK, dV (fp32 registers) through the K/V shared-memory tiles to global memory."""
    ks[...] = dk.astype(ks.dtype)
    vs[...] = dv.astype(vs.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ks, dk_dst, commit_group=False)
    plgpu.copy_smem_to_gmem(vs, dv_dst, commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


def dkv_call(q, k, v, do, lse, delta, cfg: MgpuConfig):
    bs = cfg.bs
    b_, s_, kvh_, d_ = cfg.batch, cfg.seq, cfg.kv_heads, cfg.head_dim
    dtype = q.dtype
    rows = bs.block_kv_dkv // COMPUTE_WGS  # kv rows per compute warpgroup
    bq = bs.block_q_dkv
    n_tiles = s_ // bs.block_kv_dkv
    nq = s_ // bq
    c = cfg.sm_scale * LOG2E
    causal, group = cfg.causal, cfg.group
    stages = bs.num_stages_bwd if causal else min(bs.num_stages_bwd, group * nq)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
               k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
               k_ready, v_ready, q_ready, do_ready, lse_ready, delta_ready, free):
        b = lax.axis_index("batch")
        kvh = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        cta_k0 = q_tile_index(n_tiles, causal) * bs.block_kv_dkv
        qs_cta = lax.div(cta_k0, jnp.int32(bq)) if causal else 0  # first q tile any of the CTA's kv rows sees
        n_per_head = nq - qs_cta
        ring, ready = (q_smem, lse_smem, do_smem, delta_smem), (q_ready, lse_ready, do_ready, delta_ready)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(REGS_COMPUTE, action="increase")
            k0 = cta_k0 + wg * rows
            ks, vs = k_smem.at[wg], v_smem.at[wg]
            src = (b, pl.ds(k0, rows), kvh)
            plgpu.copy_gmem_to_smem(k_ref.at[src], ks, k_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[src], vs, v_ready.at[wg])
            plgpu.barrier_wait(k_ready.at[wg])
            plgpu.barrier_wait(v_ready.at[wg])

            def step(qi, carry, g, masked):
                dk, dv = carry
                t = g * n_per_head + (qi - qs_cta)
                slot = lax.rem(t, jnp.int32(stages))
                pt, dst = _pt_dst(ks, vs, ring, ready, slot, qi=qi, k0=k0, bq=bq, c=c, masked=masked)

                def dv_dk(refs):  # dV += P^T dO and dK += dS^T Q, one wait for both
                    dv_ref, dk_ref = refs
                    plgpu.wgmma(dv_ref, pt.astype(dtype), do_smem.at[slot])
                    plgpu.wgmma(dk_ref, dst.astype(dtype), q_smem.at[slot])
                dv, dk = pl.run_state(dv_dk)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            def idle_step(qi, carry, g):  # q tiles wholly above this warpgroup's kv rows
                t = g * n_per_head + (qi - qs_cta)
                slot = lax.rem(t, jnp.int32(stages))
                for bar in (q_ready, lse_ready, do_ready, delta_ready):
                    plgpu.barrier_wait(bar.at[slot])
                plgpu.barrier_arrive(free.at[slot])
                return carry

            def head(g, carry):
                if causal:
                    qi_first = lax.div(k0, jnp.int32(bq))
                    qi_unmasked = cdiv(k0 + rows, bq)
                    lax.fori_loop(qs_cta, qi_first, functools.partial(idle_step, g=g), 0)
                    carry = lax.fori_loop(qi_first, qi_unmasked, functools.partial(step, g=g, masked=True), carry)
                    return lax.fori_loop(qi_unmasked, nq, functools.partial(step, g=g, masked=False), carry)
                return lax.fori_loop(0, nq, functools.partial(step, g=g, masked=False), carry)

            dk, dv = _over_group(head, group, (zeros((rows, d_)), zeros((rows, d_))))
            _store_dkv(dk * cfg.sm_scale, dv, ks, vs, dk_ref.at[src], dv_ref.at[src])

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            _q_producer((q_ref, lse_ref, do_ref, delta_ref), ring, ready, free, b=b, kvh=kvh, group=group,
                        bq=bq, qs_cta=qs_cta, n_per_head=n_per_head, stages=stages)

    tr = tile_transforms()
    scratch = [
        plgpu.SMEM((COMPUTE_WGS, rows, d_), dtype, transforms=tr),
        plgpu.SMEM((COMPUTE_WGS, rows, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bq, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bq, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        *[plgpu.Barrier(num_barriers=stages)] * 4,
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
    ]
    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    return launch(kernel, (kv_type, kv_type), scratch, (kvh_, n_tiles, b_), q, k, v, do, lse, delta,
                   name="mgpu_flash_dkv")


# ----------------------------------------------------------------------------------------------
# backward: dQ, dK, dV in one kernel (dQ by TMA reduce-add)


def dqkv_call(q, k, v, do, lse, delta, cfg: MgpuConfig):
    """dK, dV as dkv_call, plus dQ: each step's dS^T tiles of both warpgroups go to shared memory, each
    warpgroup multiplies its half of dS (transposed in the wgmma descriptor) by the CTA's whole K and
    reduce-adds that piece into an fp32 dQ in global memory with one TMA (cp.reduce.async.bulk). This
    drops the dQ kernel's recompute of S and dP (7 tile matmuls per step -> 5) for fp32 reduce traffic
    of block_q_dkv * d * 4 bytes per CTA step, summed in L2 (FlashAttention-3's dQ accumulation).
    The sum order of the atomic adds is not fixed: dQ is not bitwise deterministic run to run."""
    bs = cfg.bs
    b_, s_, kvh_, d_ = cfg.batch, cfg.seq, cfg.kv_heads, cfg.head_dim
    dtype = q.dtype
    bkv = bs.block_kv_dkv
    rows = bkv // COMPUTE_WGS
    bq = bs.block_q_dkv
    n_tiles = s_ // bkv
    nq = s_ // bq
    c = cfg.sm_scale * LOG2E
    causal, group = cfg.causal, cfg.group
    stages = bs.num_stages_bwd if causal else min(bs.num_stages_bwd, group * nq)
    dq_m, dq_n = dq_split(bq, d_)   # each warpgroup: dq_m rows of the q tile, all dq_n = d columns

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref,
               k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
               k_ready, v_ready, q_ready, do_ready, lse_ready, delta_ready, free, ds_ready):
        b = lax.axis_index("batch")
        kvh = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        cta_k0 = q_tile_index(n_tiles, causal) * bkv
        qs_cta = lax.div(cta_k0, jnp.int32(bq)) if causal else 0
        n_per_head = nq - qs_cta
        ring, ready = (q_smem, lse_smem, do_smem, delta_smem), (q_ready, lse_ready, do_ready, delta_ready)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(REGS_FUSED[0], action="increase")
            k0 = cta_k0 + wg * rows
            ks, vs = k_smem.at[pl.ds(wg * rows, rows)], v_smem.at[pl.ds(wg * rows, rows)]
            src = (b, pl.ds(k0, rows), kvh)
            plgpu.copy_gmem_to_smem(k_ref.at[src], ks, k_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[src], vs, v_ready.at[wg])
            plgpu.barrier_wait(k_ready.at[wg])
            plgpu.barrier_wait(v_ready.at[wg])
            # this warpgroup's piece of dQ = dS K: dS^T rows of the whole CTA, K of the whole CTA
            dq_rhs = k_smem
            dq_stage = dq_smem.at[wg]

            def step(qi, carry, g, masked):
                dk, dv = carry
                t = g * n_per_head + (qi - qs_cta)
                slot = lax.rem(t, jnp.int32(stages))
                buf = lax.rem(t, jnp.int32(2))
                pt, dst = _pt_dst(ks, vs, ring, ready, slot, qi=qi, k0=k0, bq=bq, c=c, masked=masked)
                dst = dst.astype(dtype)
                # buffers alternate: a warpgroup rewrites buf only after both passed ds_ready of the
                # step in between, by which time the other's dQ wgmma on it has completed
                ds_smem.at[buf, pl.ds(wg * rows, rows)][...] = dst
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[buf])
                # dQ rows [wg * dq_m, +dq_m) of the q tile: columns of dS^T
                dq_lhs = ds_smem.at[buf, :, pl.ds(wg * dq_m, dq_m)].transpose((1, 0))

                def dkv_dq(refs):  # dV, dK from registers while the other warpgroup's dS^T lands
                    dv_ref, dk_ref, dq_acc = refs
                    plgpu.wgmma(dv_ref, pt.astype(dtype), do_smem.at[slot])
                    plgpu.wgmma(dk_ref, dst, q_smem.at[slot])
                    plgpu.barrier_wait(ds_ready.at[buf])
                    plgpu.wgmma(dq_acc, dq_lhs, dq_rhs)
                dv, dk, dq = pl.run_state(dkv_dq)(
                    (plgpu.ACC.init(dv), plgpu.ACC.init(dk), plgpu.ACC.init(zeros((dq_m, dq_n)))))
                plgpu.barrier_arrive(free.at[slot])
                h = kvh * group + g
                dst_rows = (b, pl.ds(qi * bq + wg * dq_m, dq_m), h)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last reduce has read the stage
                dq_stage[...] = dq
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dq_stage, dq_ref.at[dst_rows], reduction_op="add")
                return dk, dv

            def head(g, carry):
                if causal:   # the tiles above a warpgroup's rows run masked (all zero): the two
                    qi_unmasked = cdiv(k0 + rows, bq)   # warpgroups meet at ds_ready every step
                    carry = lax.fori_loop(qs_cta, qi_unmasked, functools.partial(step, g=g, masked=True), carry)
                    return lax.fori_loop(qi_unmasked, nq, functools.partial(step, g=g, masked=False), carry)
                return lax.fori_loop(0, nq, functools.partial(step, g=g, masked=False), carry)

            dk, dv = _over_group(head, group, (zeros((rows, d_)), zeros((rows, d_))))
            _store_dkv(dk * cfg.sm_scale, dv, ks, vs, dk_ref.at[src], dv_ref.at[src])

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            _q_producer((q_ref, lse_ref, do_ref, delta_ref), ring, ready, free, b=b, kvh=kvh, group=group,
                        bq=bq, qs_cta=qs_cta, n_per_head=n_per_head, stages=stages, regs=REGS_FUSED[1])

    tr = tile_transforms()
    scratch = [
        plgpu.SMEM((bkv, d_), dtype, transforms=tr),
        plgpu.SMEM((bkv, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bq, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bq, d_), dtype, transforms=tr),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((2, bkv, bq), dtype, transforms=tr),
        plgpu.SMEM((COMPUTE_WGS, dq_m, dq_n), jnp.float32,
                   transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        *[plgpu.Barrier(num_barriers=stages)] * 4,
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2),
    ]
    dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))   # aliased in and out of the kernel
    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    dk, dv = launch(kernel, (kv_type, kv_type), scratch, (kvh_, n_tiles, b_), q, k, v, do, lse, delta, dq_acc,
                     name="mgpu_flash_dqkv", refs=True)
    return (dq_acc[...] * cfg.sm_scale).astype(dtype), dk, dv
