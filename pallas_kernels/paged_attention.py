"""Decode attention over a paged KV cache: one query token per sequence, pages read through a table.

Layout: q [b, h, d]; k_pages/v_pages [num_pages, page_size, kv_heads, d] (one layer), or the whole
stacked cache [layers, num_pages, page_size, kv_heads, d] with a traced `layer`, read in place;
page_table [b, max_pages] int32 (logical page i of sequence b is page_table[b, i]; entries past a
sequence's length are never read into the result); lengths [b] int32 (tokens cached, the query's
own included; 0 = inactive row -> zeros). `paged_decode_attention` also rotates the new token's
q and k (RoPE) and writes its k/v into the cache in the same kernel. The pages may be float8_e4m3fn
(an fp8 KV cache: half the bytes): each tile is widened to q's dtype after its load.
Grid (batch, kv_heads, splits): a program per KV head's query group and slice of the pages
(flash-decoding), the slices merged by a log-sum-exp rescale; see the notes above `_kernel`.
Limits: one query token per sequence; the Triton backend (GPU) or interpret=True; tiles from
paged_tiles.BlockSizes. Speed: docs/benchmarks.md#decode-and-serving.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
from pallas_kernels.paged_tiles import (NEG, BlockSizes, active_splits, page_loop, plan, pow2_at_least, split_range,
                                        stacked, to_cache, whole)


def _first_rows(x, rows: int):
    """x[:rows] for x [R, ...] with rows dividing R (Triton has no slice): reshape and select."""
    r = x.shape[0]
    if r == rows:
        return x
    y = x.reshape(r // rows, rows, *x.shape[1:])
    keep = (jnp.arange(r // rows) == 0).reshape(-1, *([1] * (y.ndim - 1)))
    return jnp.sum(jnp.where(keep, y, jnp.zeros_like(y)), axis=0)


def _write_partials(outs, m, l, acc):
    """(acc, m, l) refs <- the first out_rows rows; or, with one output ref, the normalised result."""
    out_rows = outs[0].shape[0]                                                   # g padded to a power of two
    if len(outs) == 1:                                                            # one split: finish here
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]                               # inactive rows -> 0
        outs[0][...] = _first_rows(o, out_rows).astype(outs[0].dtype)
        return
    for ref, x in zip(outs, (acc, m, l)):
        ref[...] = _first_rows(x, out_rows)


# Each program owns one KV head's group of query heads (GQA: the group shares every K/V load, which
# is the point while decode is bandwidth-bound) and one slice of the sequence's pages
# (flash-decoding: a long context is split so that batch-1 decode still fills the GPU). It keeps an
# online softmax over its pages and writes an unnormalised partial (acc, running max m, running sum
# l); the splits are merged outside the kernel (merge_splits). Only page blocks below the sequence
# length are visited; positions at or past it (the part-filled last page) are masked.
# The stacked cache is read in place because a custom call needs its operand materialised: slicing
# the layer out first would copy that layer's whole cache every decode step.
# Decode reads every cached byte once at ~2 flops per byte, so the kernel is latency-bound unless
# many large loads are in flight. Hence the knobs of paged_tiles.BlockSizes (swept on the GPU):
# - a loop iteration gathers `pages_per_block` pages at once (one load whose row pointers come from
#   a vector of page ids, the gather JAX's own paged kernel does): K and V tiles are
#   [pages_per_block * page_size, d] and the loop has few iterations;
# - the number of splits gives the grid at least `min_programs` programs (about 2x the SM count)
#   whatever the batch: batch 1 gets many short splits, batch 64 one split;
# - score="dot": the GQA group (4 for Llama-3) is padded to 16 query rows so that q @ K^T and p @ V
#   are tensor-core dots; the padded rows' flops cost nothing that matters here, and the dots keep
#   the [rows, tokens, d] product out of the registers. score="vpu": the elementwise
#   product-and-sum (fp32 throughout), fine for small tiles.
def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, v_ref, *outs, page_size, splits,
            pages_per_block, rows, sm_scale, use_dot, v_first):
    b, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    first, n_blocks = split_range(length, s, splits=splits, page_size=page_size, ppb=pages_per_block)
    # The group padded to `rows` (a power of two, 16 for the dots) by repeating its last head: a
    # gather load, where padding q outside would cost one more XLA kernel per call.
    q = q_ref[jnp.minimum(jnp.arange(rows), q_ref.shape[0] - 1), :]               # [rows, d]
    m, l, acc = page_loop(table_ref, k_ref, v_ref, (q,), b=b, kh=kh, layer=layer_ref[0], first=first,
                          n_blocks=n_blocks, visible=length, page_size=page_size, ppb=pages_per_block, sm_scale=sm_scale,
                          use_dot=use_dot, v_first=v_first)
    _write_partials(outs, m, l, acc)


def _fused_kernel(layer_ref, lengths_ref, cached_ref, table_ref, qkv_ref, cs_ref, k_ref, v_ref, *outs, page_size,
                  splits, pages_per_block, rows, sm_scale, use_dot, group, n_heads, v_first):
    """_kernel for one decode step with RoPE and the cache write folded in (paged_decode_attention).

    The new token (position length - 1) is not read back from the cache: every program masks it,
    and the program whose split holds it adds it to the online softmax from registers and writes
    its rotated k and its v into the cache slot. No program reads that slot, so there is no race.
    A cached row (cached_ref[b] != 0: the token's K/V already lie in a shared prefix page) is read
    from the cache like every earlier token, and neither added from registers nor written."""
    *outs, k_out, v_out = outs
    b, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, layer, keep = lengths_ref[b], layer_ref[0], cached_ref[b] != 0
    new = length - 1                                                              # the new token's position
    first, n_blocks = split_range(length, s, splits=splits, page_size=page_size, ppb=pages_per_block)
    d = qkv_ref.shape[-1]
    half = d // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    cos, sin = cs_ref[b, 0, :], cs_ref[b, 1, :]                                   # [d/2] fp32

    def rotate(x1, x2):  # rotate-half RoPE in fp32, rounded to the model's dtype as the model rounds it
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return ((x1 * cos - x2 * sin).astype(qkv_ref.dtype), (x2 * cos + x1 * sin).astype(qkv_ref.dtype))

    heads = kh * group + jnp.minimum(jnp.arange(rows), group - 1)                # the group padded to `rows`
    q1, q2 = rotate(qkv_ref[b, heads, lo], qkv_ref[b, heads, hi])                 # [rows, d/2] x2
    # the new k and v as the cache will hold them (rounded to an fp8 cache's dtype: the token attends
    # to itself as every later step will read it)
    k1, k2 = (to_cache(x, k_ref.dtype) for x in rotate(qkv_ref[b, n_heads + kh, lo], qkv_ref[b, n_heads + kh, hi]))
    v_new = to_cache(qkv_ref[b, n_heads + v_ref.shape[3] + kh, :], v_ref.dtype)   # [d]
    m, l, acc = page_loop(table_ref, k_ref, v_ref, (q1, q2), b=b, kh=kh, layer=layer, first=first,
                          n_blocks=n_blocks, visible=jnp.where(keep, length, new), page_size=page_size,
                          ppb=pages_per_block, sm_scale=sm_scale, use_dot=use_dot, v_first=v_first)
    mine = (length > 0) & ~keep & (new // page_size >= first) & (new // page_size < first + n_blocks * pages_per_block)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    s_new = jnp.sum(f32(q1) * f32(k1)[None, :] + f32(q2) * f32(k2)[None, :], axis=-1) * sm_scale   # [rows]
    s_new = jnp.where(mine, s_new, NEG)
    m_new = jnp.maximum(m, s_new)
    alpha = jnp.exp(m - m_new)
    p_new = jnp.where(mine, jnp.exp(s_new - m_new), 0.0)
    l = l * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * f32(v_new)[None, :]
    _write_partials(outs, m_new, l, acc)

    @pl.when(mine)
    def _():
        page = table_ref[b, jnp.maximum(new, 0) // page_size]
        slot = jnp.maximum(new, 0) % page_size
        k_out[layer, page, slot, kh, lo] = k1
        k_out[layer, page, slot, kh, hi] = k2
        v_out[layer, page, slot, kh, :] = v_new


def merge_splits(acc, m, l, dtype):
    """Combine per-split partials: acc [b, kvh, S, g, d], m/l [b, kvh, S, g] -> [b, kvh*g, d]."""
    big = jnp.max(m, axis=2, keepdims=True)                                       # [b, kvh, 1, g]
    w = jnp.exp(m - big)                                                          # empty splits -> 0
    num = jnp.sum(acc * w[..., None], axis=2)                                     # [b, kvh, g, d]
    den = jnp.sum(l * w, axis=2)                                                  # [b, kvh, g]
    out = num / jnp.where(den > 0, den, 1.0)[..., None]                           # inactive rows -> 0
    b, kvh, g, d = out.shape
    return out.reshape(b, kvh * g, d).astype(dtype)


def _merge_kernel(lengths_ref, acc_ref, m_ref, l_ref, o_ref, *, b, g, splits, s_pad, page_size, ppb, all_live):
    """merge_splits for one (row, kv head): o[i, kh*g:(kh+1)*g] <- the splits' rescaled sum; rows >= b
    (the caller's padding) get zeros. Only the splits that split_range gave pages are read: a table
    sized for a longer context than the row's leaves the rest empty (with 8-page blocks at ctx 2k in
    an 8k table, 17 of 33 partials). all_live: every split is read (lengths_ref unused)."""
    i, kh = pl.program_id(0), pl.program_id(1)
    src, rows = jnp.minimum(i, b - 1), acc_ref.shape[3]
    if all_live:
        live = jnp.arange(s_pad) < splits                                          # [S]
    else:
        live = jnp.arange(s_pad) < active_splits(lengths_ref[src], splits=splits, page_size=page_size, ppb=ppb)
    m = plgpu.load(m_ref.at[src, kh, pl.ds(0, s_pad), :], mask=live[:, None], other=NEG)                  # [S, rows]
    l = plgpu.load(l_ref.at[src, kh, pl.ds(0, s_pad), :], mask=live[:, None], other=0.0)                  # [S, rows]
    acc = plgpu.load(acc_ref.at[src, kh, pl.ds(0, s_pad), :, :], mask=live[:, None, None], other=0.0)      # [S, rows, d]
    w = jnp.exp(m - jnp.max(m, axis=0)[None, :])                                  # [S, rows]; empty splits -> 0
    den = jnp.sum(l * w, axis=0)                                                  # [rows]
    o = jnp.sum(acc * w[:, :, None], axis=0) / jnp.where(den > 0, den, 1.0)[:, None]   # [rows, d]; inactive -> 0
    o = jnp.where(i < b, o, 0.0)
    plgpu.store(o_ref.at[i, pl.ds(kh * g, rows), :], o.astype(o_ref.dtype), mask=(jnp.arange(rows) < g)[:, None])


def merge_splits_kernel(acc, m, l, dtype, lengths=None, *, g: int, rows_out: int, page_size: int = 1,
                        pages_per_block: int = 1, interpret: bool = False):
    """merge_splits as one Pallas launch, writing o [rows_out, kvh*g, d] with rows >= b zero: XLA runs
    the merge as a reduce and a normalise-and-pad kernel (at batch 1 about as long as the attention
    itself; docs/benchmarks.md#decode-and-serving), and the zero row is the one the model's
    one-token GEMM needs (models/serving.py _mm_decode), so no pad follows. lengths [b]: the tokens
    each row attended, with the attention's page_size and pages_per_block: which splits hold data;
    None: every split's partial is read (empty ones hold m = NEG, l = 0 and weigh nothing)."""
    b, kvh, splits, rows, d = acc.shape
    s_pad = pow2_at_least(splits)
    kernel = functools.partial(_merge_kernel, b=b, g=g, splits=splits, s_pad=s_pad, page_size=page_size,
                               ppb=pages_per_block, all_live=lengths is None)
    if lengths is None:
        lengths = jnp.zeros((b,), jnp.int32)
    return pl.pallas_call(
        kernel, grid=(rows_out, kvh), in_specs=[whole(a.shape) for a in (lengths, acc, m, l)],
        out_specs=whole((rows_out, kvh * g, d)), out_shape=jax.ShapeDtypeStruct((rows_out, kvh * g, d), dtype),
        interpret=interpret, compiler_params=_CompilerParams(num_warps=4, num_stages=1), name="paged_attention_merge",
    )(lengths.astype(jnp.int32), acc, m, l)


def _launch(kernel, args, in_specs, *, b, kvh, p, d, dtype, block_sizes, interpret, caches=None):
    """pallas_call over (batch, kv_heads, splits). One split: the kernel normalises and writes
    o [b, kvh, out_rows, d] in `dtype` (no merge launch); else fp32 partials (acc, m, l) per split.
    caches: (k, v) operands updated in place (aliased to two extra whole-array outputs)."""
    splits, out_rows = p["splits"], p["out_rows"]
    if splits == 1:
        out_specs = [pl.BlockSpec((None, None, out_rows, d), lambda i, j, s: (i, j, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, out_rows, d), dtype)]
    else:
        out_specs = [pl.BlockSpec((None, None, None, out_rows, d), lambda i, j, s: (i, j, s, 0, 0)),
                     pl.BlockSpec((None, None, None, out_rows), lambda i, j, s: (i, j, s, 0)),
                     pl.BlockSpec((None, None, None, out_rows), lambda i, j, s: (i, j, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, splits, out_rows, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, kvh, splits, out_rows), jnp.float32),
                     jax.ShapeDtypeStruct((b, kvh, splits, out_rows), jnp.float32)]
    aliases = {}
    if caches is not None:
        first = len(args) - 2                                                     # the caches are the last two inputs
        aliases = {first + i: len(out_shape) + i for i in range(2)}
        out_specs += [whole(c.shape) for c in caches]
        out_shape += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]
    return pl.pallas_call(
        kernel, grid=(b, kvh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=interpret,
        # Triton params pick the Triton backend: jax's GPU default is Mosaic GPU, which would stage
        # every whole-array block (the entire KV cache) in shared memory and fails to lower.
        compiler_params=_CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        name="paged_attention",
    )(*args)


def _finish(outs, p, g, b, dtype, lengths, page_size, rows_out=None, interpret=False, merge="kernel"):
    """The kernel's outputs -> [rows_out (default b), kvh * g, d]: reshaped (one split) or merged
    (several: in one Pallas launch, or by XLA with merge="xla"); rows past b are zeros."""
    rows_out = rows_out or b
    if p["splits"] > 1 and merge == "kernel":
        return merge_splits_kernel(*outs[:3], dtype, lengths, g=g, rows_out=rows_out, page_size=page_size,
                                   pages_per_block=p["pages_per_block"], interpret=interpret)
    if p["splits"] > 1:
        acc, m, l = (x[:, :, :, :g] for x in outs[:3])                            # the group's rows
        o = merge_splits(acc, m, l, dtype)                                        # [b, kvh * g, d]
    else:
        o = outs[0][:, :, :g] if p["out_rows"] > g else outs[0]                   # [b, kvh, g, d]
        o = o.reshape(b, -1, o.shape[-1])
    return jnp.pad(o, ((0, rows_out - b), (0, 0), (0, 0))) if rows_out > b else o


@functools.partial(jax.jit, static_argnames=("block_sizes", "sm_scale", "interpret"))
def paged_attention(q, k_pages, v_pages, page_table, lengths, layer=None, *,
                    block_sizes: BlockSizes = BlockSizes(), sm_scale: float | None = None, interpret: bool = False):
    """q [b, h, d] -> [b, h, d], attending to the first lengths[b] cached tokens of each sequence."""
    k_pages, v_pages, layer = stacked(k_pages, v_pages, layer, interpret)
    b, h, d = q.shape
    num_pages, page_size, kvh, d_k = k_pages.shape[1:]
    if h % kvh or d_k != d or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged_attention: q {q.shape} does not match k/v pages {k_pages.shape}/{v_pages.shape}")
    g, max_pages = h // kvh, page_table.shape[1]
    p = plan(block_sizes, b, kvh, max_pages, page_size, g, d)
    scale = sm_scale if sm_scale is not None else d ** -0.5
    kernel = functools.partial(_kernel, page_size=page_size, splits=p["splits"],
                               pages_per_block=p["pages_per_block"], rows=p["rows"], sm_scale=scale,
                               use_dot=p["use_dot"], v_first=block_sizes.v_first)
    in_specs = [whole((1,)), whole((b,)), whole(page_table.shape),
                pl.BlockSpec((None, None, g, d), lambda i, j, s: (i, j, 0, 0)),
                whole(k_pages.shape), whole(v_pages.shape)]
    args = (jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), page_table.astype(jnp.int32),
            q.reshape(b, kvh, g, d), k_pages, v_pages)
    outs = _launch(kernel, args, in_specs, b=b, kvh=kvh, p=p, d=d, dtype=q.dtype, block_sizes=block_sizes,
                   interpret=interpret)
    return _finish(outs, p, g, b, q.dtype, lengths, page_size, interpret=interpret, merge=block_sizes.merge)


@functools.partial(jax.jit, static_argnames=("n_heads", "block_sizes", "sm_scale", "interpret"))
def paged_decode_attention(qkv, cos_sin, k_pages, v_pages, page_table, lengths, layer=None, cached=None, *,
                           n_heads: int, block_sizes: BlockSizes = BlockSizes(), sm_scale: float | None = None,
                           interpret: bool = False):
    """One decode step of attention with RoPE and the KV-cache write in the same kernel.

    qkv [b, n_heads + 2 kv_heads, d]: the new token's q | k | v projections, before RoPE (the fused
    projection's output, read in place: no slices); it may have rows past b = lengths.shape[0]
    (the zero row the model's one-token GEMM carries), which are not read and come back as zero
    rows of o. cos_sin [b, 2, d/2] fp32: cos and sin of the
    new position's angles (rotate-half convention, pallas_kernels/rope.py). lengths [b]: tokens
    including the new one, whose position is lengths - 1 (0: inactive row, nothing written, zeros).
    Returns (o [qkv rows, n_heads, d], k_pages, v_pages) with the new rotated k and v written at
    page_table[b, (length-1) // page_size], slot (length-1) % page_size: in place when the caller
    donates the cache (the serving step does; aliased outputs), else into a copy. cached [b] bool or
    None: rows whose new token already lies in a shared prefix page (a fully cached prompt's last
    token, fed again for its logits): attended from the cache, not written, so the shared page
    stays exactly as every other request reads it. Against RoPE + scatter +
    paged_attention it saves four XLA launches per layer
    (a select for the dropped writes, q's RoPE, the k and v scatters), which cost more than the
    attention itself at batch 1 (H200 profile, docs/benchmarks.md#decode-and-serving)."""
    one_layer = k_pages.ndim == 4
    k_pages, v_pages, layer = stacked(k_pages, v_pages, layer, interpret)
    (rows_out, heads, d), b = qkv.shape, lengths.shape[0]
    if rows_out < b:
        raise ValueError(f"paged_decode_attention: qkv {qkv.shape} has fewer rows than lengths {lengths.shape}")
    num_pages, page_size, kvh, d_k = k_pages.shape[1:]
    if heads != n_heads + 2 * kvh or n_heads % kvh or d_k != d or v_pages.shape != k_pages.shape or d % 2:
        raise ValueError(f"paged_decode_attention: qkv {qkv.shape} must be [b, {n_heads=} + 2 * {kvh} kv heads, d] "
                         f"with even d matching the k/v pages {k_pages.shape}/{v_pages.shape}")
    if cos_sin.shape != (b, 2, d // 2):
        raise ValueError(f"paged_decode_attention: cos_sin {cos_sin.shape} must be [b, 2, d/2] = {(b, 2, d // 2)}")
    g, max_pages = n_heads // kvh, page_table.shape[1]
    p = plan(block_sizes, b, kvh, max_pages, page_size, g, d // 2)   # the dots contract over d/2-wide halves
    scale = sm_scale if sm_scale is not None else d ** -0.5
    kernel = functools.partial(_fused_kernel, page_size=page_size, splits=p["splits"],
                               pages_per_block=p["pages_per_block"], rows=p["rows"], sm_scale=scale,
                               use_dot=p["use_dot"], group=g, n_heads=n_heads, v_first=block_sizes.v_first)
    if cached is None:
        cached = jnp.zeros((b,), jnp.int32)
    elif cached.shape != (b,):
        raise ValueError(f"paged_decode_attention: cached {cached.shape} must be [b] = {(b,)}")
    in_specs = [whole((1,)), whole((b,)), whole((b,)), whole(page_table.shape), whole(qkv.shape), whole(cos_sin.shape),
                whole(k_pages.shape), whole(v_pages.shape)]
    args = (jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), cached.astype(jnp.int32),
            page_table.astype(jnp.int32), qkv, cos_sin.astype(jnp.float32), k_pages, v_pages)
    *outs, k_pages, v_pages = _launch(kernel, args, in_specs, b=b, kvh=kvh, p=p, d=d, dtype=qkv.dtype,
                                      block_sizes=block_sizes, interpret=interpret, caches=(k_pages, v_pages))
    if one_layer:
        k_pages, v_pages = k_pages[0], v_pages[0]
    return (_finish(outs, p, g, b, qkv.dtype, lengths, page_size, rows_out, interpret, block_sizes.merge),
            k_pages, v_pages)


def rope_cos_sin(positions, inv_freq):
    """[b] positions, [d/2] inverse frequencies -> cos_sin [b, 2, d/2] fp32 for paged_decode_attention."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]             # [b, d/2]
    return jnp.stack([jnp.cos(ang), jnp.sin(ang)], axis=1)


def paged_attention_reference(q, k_pages, v_pages, page_table, lengths, sm_scale: float | None = None):
    """Pure jnp: gather each sequence's pages, mask positions >= length, softmax in fp32."""
    b, h, d = q.shape
    _, page_size, kvh, _ = k_pages.shape
    k = k_pages[page_table].reshape(b, -1, kvh, d).astype(jnp.float32)          # [b, s, kvh, d]
    v = v_pages[page_table].reshape(b, -1, kvh, d).astype(jnp.float32)
    qg = q.reshape(b, kvh, h // kvh, d).astype(jnp.float32)
    scale = sm_scale if sm_scale is not None else d ** -0.5
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k) * scale
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]                   # [b, s]
    scores = jnp.where(valid[:, None, None], scores, NEG)
    p = jax.nn.softmax(scores, axis=-1) * valid[:, None, None]                    # inactive rows -> 0
    return jnp.einsum("bkgs,bskd->bkgd", p, v).reshape(b, h, d).astype(q.dtype)
