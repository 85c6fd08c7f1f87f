"""Backward kernels of the Triton-lowered FlashAttention (FlashAttention-2 split).

One kernel owns a query tile and accumulates dQ over kv tiles; another owns a kv tile and
accumulates dK, dV over query tiles (and over the q heads of its GQA group, so the group's dK/dV
sum happens in registers, not in HBM). Both recompute probabilities from the forward's saved lse
(base 2), so no S x S matrix is stored. Layout: q/do [b, q_pad, h, d], k/v [b, kv_pad, kv_h, d],
lse2/delta [b, h, q_pad], padded to tile multiples by the wrapper in flash_attention.py, which
calls `bwd_call`. Tiles and loop bounds: flash_attention_tiles.py. Speed: docs/benchmarks.md#attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention_tiles import (FlashConfig, compiler_params, dot, fit, kv_bounds, q_bounds, tile_loop,
                                                  visible_mask)
from pallas_kernels.flash_common import LOG2E


def _dq_kernel(*refs, cfg: FlashConfig, block_q: int, block_k: int):
    if cfg.has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dq_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref), qseg_ref, kseg_ref = refs, None, None
    q_start = pl.program_id(0) * block_q
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg = qseg_ref[...] if cfg.has_seg else None
    rows = q_start + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    c = cfg.sm_scale * LOG2E

    def body(j, dq, masked):
        k_start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        p = jnp.exp2(dot(q, k, trans_b=True) * c - lse[:, None])
        if masked:
            cols = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            kv_seg = kseg_ref[pl.ds(k_start, block_k)] if cfg.has_seg else None
            mask = visible_mask(cfg, rows, cols, q_seg, kv_seg)
            p = p if mask is None else jnp.where(mask, p, 0.0)
        ds = p * (dot(do, v, trans_b=True) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, jnp.float32)
    n_full, hi = kv_bounds(cfg, q_start, block_q, block_k)
    dq = tile_loop(0, n_full, functools.partial(body, masked=False), dq)
    dq = tile_loop(n_full, hi, functools.partial(body, masked=True), dq)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: FlashConfig, block_q: int, block_k: int):
    g = cfg.groups
    k_ref, v_ref = refs[0], refs[1]
    q_refs, do_refs, lse_refs, delta_refs = (refs[2 + i * g: 2 + (i + 1) * g] for i in range(4))
    rest = refs[2 + 4 * g:]
    if cfg.has_seg:
        qseg_ref, kseg_ref, dk_ref, dv_ref = rest
    else:
        (dk_ref, dv_ref), qseg_ref, kseg_ref = rest, None, None
    k_start = pl.program_id(0) * block_k
    k, v = k_ref[...], v_ref[...]
    kv_seg = kseg_ref[...] if cfg.has_seg else None
    cols = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    c = cfg.sm_scale * LOG2E

    def body(i, carry, hg, masked):
        dk, dv = carry
        q_start = pl.multiple_of(i * block_q, block_q)
        q = q_refs[hg][pl.ds(q_start, block_q), :]
        do = do_refs[hg][pl.ds(q_start, block_q), :]
        lse = lse_refs[hg][pl.ds(q_start, block_q)]
        delta = delta_refs[hg][pl.ds(q_start, block_q)]
        p = jnp.exp2(dot(q, k, trans_b=True) * c - lse[:, None])       # [bq, bk]
        if masked:
            rows = q_start + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
            q_seg = qseg_ref[pl.ds(q_start, block_q)] if cfg.has_seg else None
            mask = visible_mask(cfg, rows, cols, q_seg, kv_seg)
            p = p if mask is None else jnp.where(mask, p, 0.0)
        dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (dot(do, v, trans_b=True) - delta[:, None])
        dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    d = k.shape[-1]
    carry = (jnp.zeros((block_k, d), jnp.float32), jnp.zeros((block_k, d), jnp.float32))
    lo, mid, nq = q_bounds(cfg, k_start, block_q, block_k)
    # static loop over the group's q heads: each is a separate operand (same buffer), so every ref
    # stays a plain 2-D tile and the kernel needs no strided head indexing
    for hg in range(g):
        carry = tile_loop(lo, mid, functools.partial(body, hg=hg, masked=True), carry)
        carry = tile_loop(mid, nq, functools.partial(body, hg=hg, masked=False), carry)
    dk, dv = carry
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def bwd_call(q, k, v, do, lse2, delta, q_seg, kv_seg, cfg: FlashConfig, dtypes):
    """Padded q/k/v/do, lse2 (base 2, +inf for empty rows) and delta [b, h, q_pad] -> dq, dk, dv."""
    b, _, h, d = q.shape
    kvh = k.shape[2]
    g = cfg.groups
    bs = cfg.blocks
    params = compiler_params(bs.num_warps_bwd, bs.num_stages_bwd)

    bq, bk = fit(bs.block_q_dq, cfg.q_len), fit(bs.block_k_dq, cfg.kv_len)
    q_tile = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    kv_all = pl.BlockSpec((None, cfg.kv_pad, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0))
    row = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))
    in_specs, args = [q_tile, kv_all, kv_all, q_tile, row, row], [q, k, v, do, lse2, delta]
    if cfg.has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i)),
                     pl.BlockSpec((None, cfg.kv_pad), lambda i, bi, hi: (bi, 0))]
        args += [q_seg, kv_seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, block_q=bq, block_k=bk),
        grid=(cfg.q_pad // bq, b, h),
        in_specs=in_specs,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, dtypes[0]),
        compiler_params=params, interpret=cfg.interpret, name="flash_attention_dq",
    )(*args)

    bq, bk = fit(bs.block_q_dkv, cfg.q_len), fit(bs.block_k_dkv, cfg.kv_len)
    kv_tile = pl.BlockSpec((None, bk, None, d), lambda j, bi, hk: (bi, j, hk, 0))
    q_all = [pl.BlockSpec((None, cfg.q_pad, None, d), lambda j, bi, hk, hg=hg: (bi, 0, hk * g + hg, 0))
             for hg in range(g)]
    row_all = [pl.BlockSpec((None, None, cfg.q_pad), lambda j, bi, hk, hg=hg: (bi, hk * g + hg, 0))
               for hg in range(g)]
    in_specs = [kv_tile, kv_tile] + q_all + q_all + row_all + row_all
    args = [k, v] + [q] * g + [do] * g + [lse2] * g + [delta] * g
    if cfg.has_seg:
        in_specs += [pl.BlockSpec((None, cfg.q_pad), lambda j, bi, hk: (bi, 0)),
                     pl.BlockSpec((None, bk), lambda j, bi, hk: (bi, j))]
        args += [q_seg, kv_seg]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, block_q=bq, block_k=bk),
        grid=(cfg.kv_pad // bk, b, kvh),
        in_specs=in_specs,
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, dtypes[1]), jax.ShapeDtypeStruct(v.shape, dtypes[2])],
        compiler_params=params, interpret=cfg.interpret, name="flash_attention_dkv",
    )(*args)
    return dq, dk, dv
