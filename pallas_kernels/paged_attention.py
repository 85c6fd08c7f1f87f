"""Decode attention over a paged KV cache: one query token per sequence, pages read through a table.

Layout: q [b, h, d]; k_pages/v_pages [num_pages, page_size, kv_heads, d] (one layer of the cache),
or the whole stacked cache [layers, num_pages, page_size, kv_heads, d] with `layer` (a traced
scalar): then the kernel reads the layer in place, where slicing it out first would copy the
whole layer's cache every decode step (a custom call needs its operand materialised);
page_table [b, max_pages] int32 (logical page i of sequence b lives in page_table[b, i]);
lengths [b] int32 (tokens cached, the query's own included; 0 = inactive row -> zeros).

Grid (batch, kv_heads, splits): each program owns one KV head's group of query heads (GQA: the
group shares every K/V load, which is the point of decode being bandwidth-bound) and one slice
of the sequence's pages (flash-decoding: a long context is split so that batch-1 decode still
fills the GPU). Each program keeps an online softmax over its pages and writes an unnormalised
partial (acc, running max m, running sum l); the splits are merged outside the kernel with a
log-sum-exp rescale. Only pages below the sequence length are read; the last page may be part
filled (masked by position).

Scores use an elementwise product and sum instead of a matrix unit op: the group size is small
(4 for Llama-3 8B/1B), below the 16-row minimum of a tensor-core dot, and the kernel is limited
by the bytes of K/V it reads, not by FLOPs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._compat import TritonCompilerParams as _CompilerParams

NEG = -1e30       # a finite "minus infinity": exp(NEG - NEG) stays finite for empty splits


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    pages_per_split: int = 16       # 16 pages of 16 tokens: 256 tokens per program
    num_warps: int = 4
    num_stages: int = 2


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, page_size,
            pages_per_split, sm_scale):
    b, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    length = lengths_ref[b]
    q = q_ref[...].astype(jnp.float32) * sm_scale                                 # [g, d]
    first = s * pages_per_split
    n_pages = jnp.clip((length + page_size - 1) // page_size - first, 0, pages_per_split)

    def body(p, carry):
        m, l, acc = carry
        page = table_ref[b, first + p]
        k = k_ref[layer, page, :, kh, :].astype(jnp.float32)                      # [ps, d]
        v = v_ref[layer, page, :, kh, :].astype(jnp.float32)                      # [ps, d]
        scores = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1)                  # [g, ps]
        pos = (first + p) * page_size + jnp.arange(page_size)
        scores = jnp.where(pos[None, :] < length, scores, NEG)                   # part-filled last page
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        alpha = jnp.exp(m - m_new)
        probs = jnp.exp(scores - m_new[:, None])                                  # [g, ps]
        l = l * alpha + jnp.sum(probs, axis=-1)
        acc = acc * alpha[:, None] + jnp.sum(probs[:, :, None] * v[None, :, :], axis=1)
        return m_new, l, acc

    g, d = q.shape
    init = (jnp.full((g,), NEG, jnp.float32), jnp.zeros((g,), jnp.float32), jnp.zeros((g, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_pages, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def merge_splits(acc, m, l, dtype):
    """Combine per-split partials: acc [b, kvh, S, g, d], m/l [b, kvh, S, g] -> [b, kvh*g, d]."""
    big = jnp.max(m, axis=2, keepdims=True)                                       # [b, kvh, 1, g]
    w = jnp.exp(m - big)                                                          # empty splits -> 0
    num = jnp.sum(acc * w[..., None], axis=2)                                     # [b, kvh, g, d]
    den = jnp.sum(l * w, axis=2)                                                  # [b, kvh, g]
    out = num / jnp.where(den > 0, den, 1.0)[..., None]                           # inactive rows -> 0
    b, kvh, g, d = out.shape
    return out.reshape(b, kvh * g, d).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "sm_scale", "interpret"))
def paged_attention(q, k_pages, v_pages, page_table, lengths, layer=None, *,
                    block_sizes: BlockSizes = BlockSizes(), sm_scale: float | None = None, interpret: bool = False):
    """q [b, h, d] -> [b, h, d], attending to the first lengths[b] cached tokens of each sequence."""
    if k_pages.ndim == 4:                      # one layer: view it as a stack of one (free reshape)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    elif layer is None:
        raise ValueError("paged_attention: stacked k/v pages [layers, ...] need `layer`")
    b, h, d = q.shape
    k_pages_4d_shape = k_pages.shape[1:]
    num_pages, page_size, kvh, d_k = k_pages_4d_shape
    if h % kvh or d_k != d or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged_attention: q {q.shape} does not match k/v pages {k_pages.shape}/{v_pages.shape}")
    g, max_pages = h // kvh, page_table.shape[1]
    pps = min(block_sizes.pages_per_split, max_pages)
    splits = -(-max_pages // pps)
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, splits * pps - max_pages)))   # whole splits
    scale = sm_scale if sm_scale is not None else d ** -0.5
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_split=pps, sm_scale=scale)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[whole((1,)), whole((b,)), whole(table.shape), pl.BlockSpec((None, None, g, d), lambda i, j, s: (i, j, 0, 0)),
                  whole(k_pages.shape), whole(v_pages.shape)],
        out_specs=[pl.BlockSpec((None, None, None, g, d), lambda i, j, s: (i, j, s, 0, 0)),
                   pl.BlockSpec((None, None, None, g), lambda i, j, s: (i, j, s, 0)),
                   pl.BlockSpec((None, None, None, g), lambda i, j, s: (i, j, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits, g, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, g), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, g), jnp.float32)],
        interpret=interpret,
        # Triton params pick the Triton backend: jax's GPU default is Mosaic GPU, which would stage
        # every whole-array block (the entire KV cache) in shared memory and fails to lower.
        compiler_params=_CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        name="paged_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), table, q.reshape(b, kvh, g, d),
      k_pages, v_pages)
    return merge_splits(acc, m, l, q.dtype)


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
