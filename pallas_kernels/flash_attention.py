"""FlashAttention for GPU in Pallas: tiled online-softmax forward, tiled dQ and dK/dV backward.

Backend: the Triton lowering (`pl.pallas_call` + Triton `CompilerParams`). Why: it runs unchanged on
jax 0.10.2 (CPU, `interpret=True`) and 0.11.2 (H200), and one code path carries every feature here
(GQA, segment ids, ragged lengths, causal offsets, fwd and bwd); JAX's Mosaic kernel
(`attention_mgpu`) needs fp16 and has no causal backward in 0.11.2, and a wgmma/TMA kernel with a
backward did not fit this issue's budget. Measured on the H200 (2026-11-29, bf16, B*S=16k, H*D=2048,
D=128, TFLOP/s fwd / fwd+bwd, details and every variant in docs/benchmarks.md "Attention"):
causal S=8192: ours 286-308 / 244-247, cuDNN 408 / 452, Pallas `mha` 321 / 141, XLA 47 / 70,
`attention_mgpu` fp16 fwd 387; causal S=4096: ours 251-255 / 220-225, cuDNN 322 / 397, `mha` 237 / 131.
So in fwd+bwd: 1.7x `mha`, 3.5x XLA, about 0.55x cuDNN (causal); the fwd gap to cuDNN and to the Mosaic
kernel (wgmma, TMA, warp specialisation) is what a Mosaic GPU port would have to close.

Layout is `jax.nn.dot_product_attention`'s: q [b, q_len, h, d], k/v [b, kv_len, kv_h, d].
Causal masking aligns queries to the end of the keys (query i sees keys j <= i + kv_len - q_len),
as chunked prefill needs. Rows that see no key at all (only possible with segment ids) give 0 and
lse = -inf. Softmax runs in base 2 (exp2 with the scale folded into one multiply-add), in fp32.

Ring attention uses the block pieces: `flash_attention_block_fwd` gives (out, lse) of one query
block against one kv block under a static causal offset; `flash_attention_block_bwd` takes the
*global* lse and delta = rowsum(dO * O) so the per-block gradients simply add up.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels._compat import TritonCompilerParams as _TritonParams



def _dot(a, b, trans_a=False, trans_b=False):
    """2-D matmul with fp32 accumulation; transposes are folded into the contraction so the
    Triton lowering picks the operand layout instead of materialising a transpose."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The forward's residuals carry these checkpoint names, so a remat policy can keep them and skip
# the forward's recomputation in the backward (models/llama.py remat="save_dots_attn").
ATTENTION_OUT, ATTENTION_LSE = "attention_out", "attention_lse"
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and Triton launch settings. Powers of two >= 16; larger tiles cut K/V re-reads
    but cost registers (the fp32 accumulators live there) and shared memory (num_stages copies).
    Defaults are the variant measured fastest on the H200 (docs/benchmarks.md, "C"): at d=128,
    64x64 tiles with 4 warps beat 128-row tiles with 8 warps by 1.2-1.4x in fwd+bwd."""
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_q_dq: int = 64
    block_k_dq: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    num_warps_bwd: int = 4
    num_stages_bwd: int = 3

    @classmethod
    def default(cls, head_dim: int) -> "BlockSizes":
        if head_dim <= 64:  # small rows: a 128-row query tile still fits 4 warps' registers
            return cls(block_q=128)
        if head_dim <= 128:
            return cls()
        # d=256: fp32 accumulators of 64 rows would spill; halve the kv tiles
        return cls(block_k=32, num_stages=2, block_k_dq=32, block_q_dkv=32, block_k_dkv=32, num_stages_bwd=2)


def _params(num_warps, num_stages):
    return _TritonParams(num_warps=num_warps, num_stages=num_stages)


def _is_pow2(x):
    return x >= 16 and (x & (x - 1)) == 0


def _round_up(x, m):
    return (x + m - 1) // m * m


def _fit(block, length):
    """Never use a tile longer than the (power-of-two rounded) sequence: short inputs pad less."""
    return min(block, max(16, 1 << (max(length, 1) - 1).bit_length()))


# ----------------------------------------------------------------------------- shared kernel pieces
@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Everything static a kernel needs; hashable so it can be a custom_vjp nondiff arg."""
    sm_scale: float
    offset: int | None          # causal: row i sees cols j <= i + offset; None = no causal mask
    q_len: int
    kv_len: int
    q_pad: int
    kv_pad: int
    groups: int                 # q heads per kv head
    has_seg: bool
    blocks: BlockSizes
    interpret: bool


def _mask(cfg, rows, cols, q_seg, kv_seg):
    """Boolean [rows, cols] visibility; built only in blocks that need it (the masked loop)."""
    mask = None
    if cfg.offset is not None:
        mask = rows[:, None] + cfg.offset >= cols[None, :]
    if cfg.kv_pad != cfg.kv_len:
        pad = jnp.broadcast_to(cols[None, :] < cfg.kv_len, (rows.shape[0], cols.shape[0]))
        mask = pad if mask is None else mask & pad
    if cfg.has_seg:
        seg = q_seg[:, None] == kv_seg[None, :]
        mask = seg if mask is None else mask & seg
    return mask


def _kv_bounds(cfg, q_start, block_q, block_k):
    """For a query tile: kv tiles [0, n_full) need no mask, [n_full, hi) need one, the rest are
    skipped entirely (causal) -- the skipped tiles are where the causal 2x comes from."""
    nk = cfg.kv_pad // block_k
    n_full_static = 0 if cfg.has_seg else cfg.kv_len // block_k
    if cfg.offset is None:
        return n_full_static, nk
    last = jnp.maximum(q_start + block_q + cfg.offset, 0)          # one past the last visible col
    hi = jnp.minimum(lax.div(last + block_k - 1, jnp.int32(block_k)), nk)
    full = lax.div(jnp.maximum(q_start + 1 + cfg.offset, 0), jnp.int32(block_k))
    n_full = jnp.minimum(jnp.minimum(full, hi), n_full_static)
    return n_full, hi


def _q_bounds(cfg, k_start, block_q, block_k):
    """For a kv tile: q tiles [lo, mid) need a mask, [mid, nq) need none, [0, lo) see none of it."""
    nq = cfg.q_pad // block_q
    if cfg.offset is None:
        return 0, (nq if cfg.has_seg else 0), nq
    lo = lax.div(jnp.maximum(k_start - cfg.offset, 0), jnp.int32(block_q))
    lo = jnp.minimum(lo, nq)
    mid = lax.div(jnp.maximum(k_start + block_k - 1 - cfg.offset, 0) + block_q - 1, jnp.int32(block_q))
    mid = jnp.clip(mid, lo, nq)
    if cfg.has_seg:
        mid = jnp.int32(nq) + 0 * mid
    return lo, mid, nq


def _loop(lo, hi, body, carry):
    """fori_loop that vanishes when both bounds are static and the range is empty (e.g. the masked
    loop of a full, block-aligned problem), so no dead loop reaches the Triton compiler."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


# ----------------------------------------------------------------------------- forward kernel
def _fwd_kernel(*refs, cfg: _Cfg, block_q: int, block_k: int):
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
        s = _dot(q, k, trans_b=True)                          # fp32 [bq, bk]
        if masked:
            cols = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            kv_seg = kseg_ref[pl.ds(k_start, block_k)] if cfg.has_seg else None
            mask = _mask(cfg, rows, cols, q_seg, kv_seg)
            s = s if mask is None else jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        if masked:  # a row with nothing visible yet keeps m = -inf; exp2(-inf - -inf) would be NaN
            m_new_c = jnp.where(m_new == NEG_INF, 0.0, m_new * c)
        else:
            m_new_c = m_new * c
        p = jnp.exp2(s * c - m_new_c[:, None])                  # one FMA + exp2 per score
        alpha = jnp.exp2(m * c - m_new_c)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    d = q.shape[-1]
    carry = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), NEG_INF, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    n_full, hi = _kv_bounds(cfg, q_start, block_q, block_k)
    carry = _loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m, l = _loop(n_full, hi, functools.partial(body, masked=True), carry)
    empty = l == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, l)
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, NEG_INF, m * c + jnp.log2(jnp.where(empty, 1.0, l)))


def _fwd_call(q, k, v, q_seg, kv_seg, cfg: _Cfg, out_dtype):
    """Padded inputs in, (out [b, q_pad, h, d], lse2 [b, h, q_pad] in base-2 units) out."""
    b, _, h, d = q.shape
    bs = cfg.blocks
    bq, bk = _fit(bs.block_q, cfg.q_len), _fit(bs.block_k, cfg.kv_len)
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
        compiler_params=_params(bs.num_warps, bs.num_stages),
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
        if not _is_pow2(blk):
            raise ValueError(f"{name}={blk} must be a power of two >= 16")
    q_pad = _round_up(q_len, max(_fit(x, q_len) for x in (bs.block_q, bs.block_q_dq, bs.block_q_dkv)))
    kv_pad = _round_up(kv_len, max(_fit(x, kv_len) for x in (bs.block_k, bs.block_k_dq, bs.block_k_dkv)))
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
    cfg = _Cfg(sm_scale=scale, offset=causal_offset, q_len=q_len, kv_len=kv_len, q_pad=q_pad,
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


def output_grad_rowsum(out, do):
    """delta = rowsum(dO * O) in fp32, [b, h, q] from out/dO [b, q, h, d]: the backward's
    softmax-Jacobian term (dS = P (dP - delta)), shared by every flash backward here."""
    return jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))


def named_residuals(out, lse):
    """A forward kernel's (out, lse) named for remat="save_dots_attn", behind an optimization barrier.
    Why the barrier: when the layer scan stacks these residuals, XLA:GPU's dynamic-slice fusion
    (on by default in jax 0.11.2) fuses the kernel's custom call with the stacking update-slice and
    keeps a clone of the call for the layer's own use of `out`, so the kernel ran twice per layer
    (llama3_1b on an H200: 32 forward launches per 16-layer step, 2026-12-01). Behind the barrier
    the update-slice no longer reads the call's result directly, and the kernel runs once."""
    out, lse = lax.optimization_barrier((out, lse))
    return checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)


def attention_with_saved_forward(fwd, bwd, inputs, n_diff, n_ret=None):
    """fwd(*inputs) -> outs; returns outs[:n_ret] (all by default), differentiable in inputs[:n_diff]
    through bwd(inputs, outs, cotangents of the returned outs) -> the inputs' cotangents.

    The forward kernel runs outside the custom_vjp, on stop_gradient inputs, and its outs (named
    ATTENTION_OUT / ATTENTION_LSE by fwd, through named_residuals) become the custom_vjp's inputs.
    So its residuals are plain values a remat policy can keep (remat="save_dots_attn"), not values
    made inside a fwd rule, which jax.checkpoint on jax 0.11.2 re-ran whatever the policy
    (docs/jax-notes.md). Without remat it runs the same kernels, the same number of times, as a
    plain custom_vjp."""
    stopped = [lax.stop_gradient(x) if i < n_diff else x for i, x in enumerate(inputs)]
    outs = tuple(fwd(*stopped))
    return _saved(bwd, len(inputs), len(outs) if n_ret is None else n_ret, *inputs, *outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _saved(bwd, n_in, n_ret, *args):
    return tuple(args[n_in:n_in + n_ret])


def _saved_fwd(bwd, n_in, n_ret, *args):
    return tuple(args[n_in:n_in + n_ret]), args


def _saved_bwd(bwd, n_in, n_ret, res, cts):
    ins, outs = res[:n_in], res[n_in:]
    grads = tuple(bwd(ins, outs, cts))
    # no cotangent for the non-differentiable inputs nor for outs (computed from stopped inputs)
    return grads + (None,) * (n_in - len(grads) + len(outs))


_saved.defvjp(_saved_fwd, _saved_bwd)


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg):
    qp, kp, vp = _pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad)
    out, lse2 = _fwd_call(qp, kp, vp, q_seg, kv_seg, cfg, q.dtype)
    out, lse2 = out[:, :cfg.q_len], lse2[:, :, :cfg.q_len]
    return named_residuals(out, lse2)


def _flash_bwd(cfg, inputs, outs, cts):
    from pallas_kernels import flash_attention_bwd as _bwd
    q, k, v, q_seg, kv_seg = inputs
    out, lse2 = outs
    do, dlse2 = cts
    # delta = rowsum(dO*O); an lse cotangent enters the same place (d lse / d s = p), so fold it in
    delta = output_grad_rowsum(out, do) - dlse2.astype(jnp.float32) * (1.0 / LN2)  # lse2 = lse / ln2
    pad_q = ((0, 0), (0, 0), (0, cfg.q_pad - cfg.q_len))
    lse_p = jnp.pad(_bwd_lse(lse2), pad_q, constant_values=jnp.inf)
    delta_p = jnp.pad(delta, pad_q)
    dq, dk, dv = _bwd.bwd_call(_pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad),
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
    from pallas_kernels import flash_attention_bwd as _bwd
    cfg, q_seg, kv_seg = _check_and_config(q, k, v, segment_ids, causal_offset, sm_scale, block_sizes,
                                           interpret)
    pad_q = ((0, 0), (0, 0), (0, cfg.q_pad - cfg.q_len))
    lse_p = jnp.pad(_bwd_lse(lse.astype(jnp.float32) * LOG2E), pad_q, constant_values=jnp.inf)
    delta_p = jnp.pad(delta.astype(jnp.float32), pad_q)
    dq, dk, dv = _bwd.bwd_call(_pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad),
                               _pad_seq(do.astype(q.dtype), cfg.q_pad), lse_p, delta_p, q_seg, kv_seg,
                               cfg, (grad_dtype,) * 3)
    return dq[:, :cfg.q_len], dk[:, :cfg.kv_len], dv[:, :cfg.kv_len]


TILE_SKIPPED, TILE_MASKED, TILE_FULL = 0, 1, 2


def forward_tile_plan(q_len: int, kv_len: int, *, causal: bool = True, head_dim: int = 64,
                      block_sizes: BlockSizes | None = None) -> np.ndarray:
    """What the forward kernel does with each (query tile, kv tile): int8 [q tiles, kv tiles] of
    TILE_SKIPPED (the causal mask hides the whole tile: never loaded), TILE_MASKED (computed with the
    mask) or TILE_FULL (computed without one). Read from the loop bounds the kernel itself uses
    (`_kv_bounds`, same tiles and padding), so a picture of it shows what runs."""
    shape = lambda n: jax.ShapeDtypeStruct((1, n, 1, head_dim), jnp.float32)  # noqa: E731
    cfg, _, _ = _check_and_config(shape(q_len), shape(kv_len), shape(kv_len), None,
                                  (kv_len - q_len) if causal else None, None, block_sizes, True)
    bq, bk = _fit(cfg.blocks.block_q, q_len), _fit(cfg.blocks.block_k, kv_len)
    plan = np.full((cfg.q_pad // bq, cfg.kv_pad // bk), TILE_SKIPPED, np.int8)
    for i in range(plan.shape[0]):
        n_full, hi = (int(x) for x in _kv_bounds(cfg, i * bq, bq, bk))
        plan[i, :n_full] = TILE_FULL
        plan[i, n_full:hi] = TILE_MASKED
    return plan


def flash_attention_reference(q, k, v, *, causal=False, segment_ids=None, sm_scale=None,
                              causal_offset=None, return_lse=False):
    """Pure-jnp float32 attention with the same semantics (rows with no visible key give 0)."""
    b, q_len, h, d = q.shape
    kv_len, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    scale = sm_scale if sm_scale is not None else d ** -0.5
    qf = q.astype(jnp.float32).reshape(b, q_len, kvh, g, d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qf, k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale
    mask = jnp.ones((1, q_len, kv_len), bool)
    if causal_offset is None and causal:
        causal_offset = kv_len - q_len
    if causal_offset is not None:
        mask = mask & (jnp.arange(q_len)[:, None] + causal_offset >= jnp.arange(kv_len)[None, :])[None]
    if segment_ids is not None:
        qi, ki = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        mask = mask & (qi[:, :, None] == ki[:, None, :])
    mask = mask[:, None, None]
    s = jnp.where(mask, s, NEG_INF)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    o = o.reshape(b, q_len, h, d)
    return (o, lse.reshape(b, h, q_len)) if return_lse else o
