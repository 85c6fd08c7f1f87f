"""FlashAttention for GPU in Pallas, Triton lowering: tiled online-softmax forward, tiled dQ and dK/dV backward.

One code path carries every feature: GQA, segment ids, ragged lengths, causal offsets, fwd and bwd,
on any CUDA GPU of sm_80+ and on CPU (`interpret=True`). On Hopper the Mosaic GPU kernel
(flash_attention_mgpu.py) is faster for the shapes it takes; pallas_kernels/attention.py picks.
Layout is `jax.nn.dot_product_attention`'s: q [b, q_len, h, d], k/v [b, kv_len, kv_h, d], d in
{16, 32, 64, 128, 256}. Causal masking aligns queries to the end of the keys (chunked prefill).
Rows that see no key (only with segment ids) give 0 and lse = -inf. Softmax in base 2, fp32.
Files: the forward and the wrapper here, the backward kernels in flash_attention_bwd.py, tiles and
shared kernel pieces in flash_attention_tiles.py, the custom_vjp plumbing in flash_residuals.py.
Ring attention uses the block pieces (`flash_attention_block_fwd` / `_bwd`: per-block gradients
from the global lse and delta simply add up). Speed: docs/benchmarks.md#attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import flash_attention_bwd
from pallas_kernels.flash_attention_tiles import (BlockSizes, FlashConfig, compiler_params, dot, fit, is_pow2,
                                                  kv_bounds, round_up, tile_loop, visible_mask)
from pallas_kernels.flash_common import (LN2, LOG2E, NEG_INF, flash_attention_reference,  # noqa: F401  (public API)
                                         output_grad_rowsum)
from pallas_kernels.flash_residuals import (ATTENTION_LSE, ATTENTION_OUT,  # noqa: F401  (public API, models/remat.py)
                                            attention_with_saved_forward, named_residuals)


# ----------------------------------------------------------------------------- forward kernel
def _fwd_kernel(*refs, cfg: FlashConfig, block_q: int, block_k: int):
    if cfg.has_seg:
        q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref), qseg_ref, kseg_ref = refs, None, None
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    q_seg = qseg_ref[...] if cfg.has_seg else None
    rows = q_start + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    c = cfg.sm_scale * LOG2E

    def body(j, carry, masked):
        acc, m, l = carry
        k_start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        s = dot(q, k, trans_b=True)                          # fp32 [bq, bk]
        if masked:
            cols = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            kv_seg = kseg_ref[pl.ds(k_start, block_k)] if cfg.has_seg else None
            mask = visible_mask(cfg, rows, cols, q_seg, kv_seg)
            s = s if mask is None else jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        if masked:  # a row with nothing visible yet keeps m = -inf; exp2(-inf - -inf) would be NaN
            m_new_c = jnp.where(m_new == NEG_INF, 0.0, m_new * c)
        else:
            m_new_c = m_new * c
        p = jnp.exp2(s * c - m_new_c[:, None])                  # one FMA + exp2 per score
        alpha = jnp.exp2(m * c - m_new_c)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return acc, m_new, l

    d = q.shape[-1]
    carry = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), NEG_INF, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    n_full, hi = kv_bounds(cfg, q_start, block_q, block_k)
    carry = tile_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m, l = tile_loop(n_full, hi, functools.partial(body, masked=True), carry)
    empty = l == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, l)
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, NEG_INF, m * c + jnp.log2(jnp.where(empty, 1.0, l)))


def _fwd_call(q, k, v, q_seg, kv_seg, cfg: FlashConfig, out_dtype):
    """Padded inputs in, (out [b, q_pad, h, d], lse2 [b, h, q_pad] in base-2 units) out."""
    b, _, h, d = q.shape
    bs = cfg.blocks
    bq, bk = fit(bs.block_q, cfg.q_len), fit(bs.block_k, cfg.kv_len)
    g = cfg.groups
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        # GQA: the kv head comes from the q head in the index map, so K/V are never repeated
        pl.BlockSpec((None, cfg.kv_pad, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, cfg.kv_pad, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
    ]
    args = [q, k, v]
    if cfg.has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i)),
                     pl.BlockSpec((None, cfg.kv_pad), lambda i, bi, hi: (bi, 0))]
        args += [q_seg, kv_seg]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, block_q=bq, block_k=bk),
        grid=(cfg.q_pad // bq, b, h),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct((b, cfg.q_pad, h, d), out_dtype),
                   jax.ShapeDtypeStruct((b, h, cfg.q_pad), jnp.float32)],
        compiler_params=compiler_params(bs.num_warps, bs.num_stages),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)


# ----------------------------------------------------------------------------- wrapper plumbing
def _check_and_config(q, k, v, segment_ids, causal_offset, sm_scale, block_sizes, interpret):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, len, heads, head_dim]; got {q.shape=} {k.shape=} {v.shape=}")
    b, q_len, h, d = q.shape
    _, kv_len, kvh, _ = k.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be [{b}, kv_len, kv_heads, {d}]; got {k.shape=} {v.shape=}")
    if h % kvh:
        raise ValueError(f"query heads {h=} must be a multiple of kv heads {kvh=}")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"{d=} (head_dim) must be one of 16, 32, 64, 128, 256; pad the head dim")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"q, k, v must share one dtype of bfloat16/float16/float32; got "
                         f"{q.dtype=} {k.dtype=} {v.dtype=}")
    if causal_offset is not None and causal_offset < 0:
        raise ValueError(f"causal with {q_len=} > {kv_len=} ({causal_offset=}) leaves the first queries "
                         "no key; causal needs q_len <= kv_len (offset >= 0)")
    scale = float(sm_scale) if sm_scale is not None else d ** -0.5
    if not scale > 0:
        raise ValueError(f"{sm_scale=} must be positive")
    bs = block_sizes or BlockSizes.default(d)
    for name in ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv"):
        blk = getattr(bs, name)
        if not is_pow2(blk):
            raise ValueError(f"{name}={blk} must be a power of two >= 16")
    q_pad = round_up(q_len, max(fit(x, q_len) for x in (bs.block_q, bs.block_q_dq, bs.block_q_dkv)))
    kv_pad = round_up(kv_len, max(fit(x, kv_len) for x in (bs.block_k, bs.block_k_dq, bs.block_k_dkv)))
    q_seg = kv_seg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            q_seg, kv_seg = segment_ids
        else:
            if q_len != kv_len:
                raise ValueError(f"one segment_ids array needs {q_len=} == {kv_len=}; pass (q_ids, kv_ids)")
            q_seg = kv_seg = segment_ids
        if q_seg.shape != (b, q_len) or kv_seg.shape != (b, kv_len):
            raise ValueError(f"segment ids must be [batch, len]: expected {(b, q_len)} and {(b, kv_len)}, "
                             f"got {q_seg.shape} and {kv_seg.shape}")
        # padded queries get an id no key has, so they see nothing (and give finite zeros)
        q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, q_pad - q_len)), constant_values=-1)
        kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, kv_pad - kv_len)), constant_values=-2)
    cfg = FlashConfig(sm_scale=scale, offset=causal_offset, q_len=q_len, kv_len=kv_len, q_pad=q_pad,
               kv_pad=kv_pad, groups=h // kvh, has_seg=segment_ids is not None, blocks=bs,
               interpret=bool(interpret))
    return cfg, q_seg, kv_seg


def _pad_seq(x, to):
    # a copy only when the length is ragged; block-multiple inputs pass straight through
    return x if x.shape[1] == to else jnp.pad(x, ((0, 0), (0, to - x.shape[1]), (0, 0), (0, 0)))


def _bwd_lse(lse2):
    # rows that saw no key (-inf, or a caller's large finite stand-in): +inf makes every recomputed
    # probability exp2(s - inf) = 0 instead of NaN/inf
    return jnp.where(lse2 < -1e20, jnp.inf, lse2)


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg):
    qp, kp, vp = _pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad)
    out, lse2 = _fwd_call(qp, kp, vp, q_seg, kv_seg, cfg, q.dtype)
    out, lse2 = out[:, :cfg.q_len], lse2[:, :, :cfg.q_len]
    return named_residuals(out, lse2)


def _flash_bwd(cfg, inputs, outs, cts):
    q, k, v, q_seg, kv_seg = inputs
    out, lse2 = outs
    do, dlse2 = cts
    # delta = rowsum(dO*O); an lse cotangent enters the same place (d lse / d s = p), so fold it in
    delta = output_grad_rowsum(out, do) - dlse2.astype(jnp.float32) * (1.0 / LN2)  # lse2 = lse / ln2
    pad_q = ((0, 0), (0, 0), (0, cfg.q_pad - cfg.q_len))
    lse_p = jnp.pad(_bwd_lse(lse2), pad_q, constant_values=jnp.inf)
    delta_p = jnp.pad(delta, pad_q)
    dq, dk, dv = flash_attention_bwd.bwd_call(_pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad),
                               _pad_seq(do, cfg.q_pad), lse_p, delta_p, q_seg, kv_seg, cfg,
                               (q.dtype, k.dtype, v.dtype))
    return dq[:, :cfg.q_len], dk[:, :cfg.kv_len], dv[:, :cfg.kv_len]


def _flash(q, k, v, q_seg, kv_seg, cfg):
    return attention_with_saved_forward(functools.partial(_flash_fwd, cfg=cfg), functools.partial(_flash_bwd, cfg),
                                        (q, k, v, q_seg, kv_seg), n_diff=3)


# ----------------------------------------------------------------------------- public API
@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "return_lse", "interpret"))
def flash_attention(q, k, v, *, causal=False, segment_ids=None, sm_scale=None, block_sizes=None,
                    return_lse=False, interpret=False):
    """softmax(q k^T * sm_scale + mask) v, tiled. Returns out [b, q_len, h, d] in q's dtype, and with
    `return_lse` also lse [b, h, q_len] (natural log, fp32). Differentiable in q, k, v (and lse)."""
    offset = (k.shape[1] - q.shape[1]) if causal else None
    cfg, q_seg, kv_seg = _check_and_config(q, k, v, segment_ids, offset, sm_scale, block_sizes, interpret)
    out, lse2 = _flash(q, k, v, q_seg, kv_seg, cfg)
    return (out, lse2 * LN2) if return_lse else out


@functools.partial(jax.jit, static_argnames=("causal_offset", "sm_scale", "block_sizes", "out_dtype",
                                             "interpret"))
def flash_attention_block_fwd(q, k, v, *, causal_offset=None, segment_ids=None, sm_scale=None,
                              block_sizes=None, out_dtype=None, interpret=False):
    """One query block against one kv block: (out normalised within this kv block, lse [b, h, q_len]).
    `causal_offset` (static int or None): row i sees col j iff j <= i + causal_offset -- for ring
    attention, (global start of q) - (global start of kv). Merge partial results with
    lse = logaddexp(lse1, lse2); out = exp(lse1 - lse) o1 + exp(lse2 - lse) o2."""
    cfg, q_seg, kv_seg = _check_and_config(q, k, v, segment_ids, causal_offset, sm_scale, block_sizes,
                                           interpret)
    out, lse2 = _fwd_call(_pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad),
                          q_seg, kv_seg, cfg, out_dtype or q.dtype)
    return out[:, :cfg.q_len], lse2[:, :, :cfg.q_len] * LN2


@functools.partial(jax.jit, static_argnames=("causal_offset", "sm_scale", "block_sizes", "grad_dtype",
                                             "interpret"))
def flash_attention_block_bwd(q, k, v, do, lse, delta, *, causal_offset=None, segment_ids=None,
                              sm_scale=None, block_sizes=None, grad_dtype=jnp.float32, interpret=False):
    """(dq, dk, dv) of one q block against one kv block, from the *global* lse [b, h, q_len] (natural
    log) and delta = rowsum(dO * O_global) [b, h, q_len]; summing over kv blocks (dq) and q blocks
    (dk, dv) gives the full gradient. Gradients come back in `grad_dtype` (fp32: they get summed)."""
    cfg, q_seg, kv_seg = _check_and_config(q, k, v, segment_ids, causal_offset, sm_scale, block_sizes,
                                           interpret)
    pad_q = ((0, 0), (0, 0), (0, cfg.q_pad - cfg.q_len))
    lse_p = jnp.pad(_bwd_lse(lse.astype(jnp.float32) * LOG2E), pad_q, constant_values=jnp.inf)
    delta_p = jnp.pad(delta.astype(jnp.float32), pad_q)
    dq, dk, dv = flash_attention_bwd.bwd_call(_pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad),
                               _pad_seq(do.astype(q.dtype), cfg.q_pad), lse_p, delta_p, q_seg, kv_seg,
                               cfg, (grad_dtype,) * 3)
    return dq[:, :cfg.q_len], dk[:, :cfg.kv_len], dv[:, :cfg.kv_len]


TILE_SKIPPED, TILE_MASKED, TILE_FULL = 0, 1, 2


def forward_tile_plan(q_len: int, kv_len: int, *, causal: bool = True, head_dim: int = 64,
                      block_sizes: BlockSizes | None = None) -> np.ndarray:
    """What the forward kernel does with each (query tile, kv tile): int8 [q tiles, kv tiles] of
    TILE_SKIPPED (the causal mask hides the whole tile: never loaded), TILE_MASKED (computed with the
    mask) or TILE_FULL (computed without one). Read from the loop bounds the kernel itself uses
    (`kv_bounds`, same tiles and padding), so a picture of it shows what runs."""
    shape = lambda n: jax.ShapeDtypeStruct((1, n, 1, head_dim), jnp.float32)  # noqa: E731
    cfg, _, _ = _check_and_config(shape(q_len), shape(kv_len), shape(kv_len), None,
                                  (kv_len - q_len) if causal else None, None, block_sizes, True)
    bq, bk = fit(cfg.blocks.block_q, q_len), fit(cfg.blocks.block_k, kv_len)
    plan = np.full((cfg.q_pad // bq, cfg.kv_pad // bk), TILE_SKIPPED, np.int8)
    for i in range(plan.shape[0]):
        n_full, hi = (int(x) for x in kv_bounds(cfg, i * bq, bq, bk))
        plan[i, :n_full] = TILE_FULL
        plan[i, n_full:hi] = TILE_MASKED
    return plan
