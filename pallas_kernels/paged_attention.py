"""Decode attention over a paged KV cache: one query token per sequence, pages read through a table.

Layout: q [b, h, d]; k_pages/v_pages [num_pages, page_size, kv_heads, d] (one layer of the cache),
or the whole stacked cache [layers, num_pages, page_size, kv_heads, d] with `layer` (a traced
scalar): then the kernel reads the layer in place, where slicing it out first would copy the
whole layer's cache every decode step (a custom call needs its operand materialised);
page_table [b, max_pages] int32 (logical page i of sequence b lives in page_table[b, i]; entries
past a sequence's length may be any valid page: they are never read into the result);
lengths [b] int32 (tokens cached, the query's own included; 0 = inactive row -> zeros).

Grid (batch, kv_heads, splits): each program owns one KV head's group of query heads (GQA: the
group shares every K/V load, which is the point of decode being bandwidth-bound) and one slice
of the sequence's pages (flash-decoding: a long context is split so that batch-1 decode still
fills the GPU). Each program keeps an online softmax over its pages and writes an unnormalised
partial (acc, running max m, running sum l); the splits are merged outside the kernel with a
log-sum-exp rescale. Only page blocks below the sequence length are visited; positions at or
past the length (the part-filled last page, the rest of the last block) are masked.

Decode reads every cached byte once and does ~2 flops per byte, so the kernel is latency-bound
unless many large loads are in flight. Hence (each a BlockSizes knob, for the GPU sweep):
- a loop iteration gathers `pages_per_block` pages at once (one load whose row pointers come
  from a vector of page ids, the same gather JAX's own paged kernel does), so the K and V tiles
  are [pages_per_block * page_size, d] and the loop has few iterations;
- the number of splits is chosen so that the grid has at least `min_programs` programs (about
  2x the SM count) whatever the batch: batch 1 gets many short splits, batch 64 one split;
- scores can use the tensor cores (`score="dot"`): the GQA group (4 for Llama-3) is padded to
  16 query rows so that q @ K^T and p @ V are matrix-unit dots; the padded rows cost nothing
  that matters (flops are free here) and the dots keep the [rows, tokens, d] product out of
  the registers. `score="vpu"` is the elementwise product-and-sum (fp32 throughout), fine for
  small tiles.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._compat import TritonCompilerParams as _CompilerParams

NEG = -1e30       # a finite "minus infinity": exp(NEG - NEG) stays finite for empty splits
MIN_DOT = 16      # smallest M, N and K of a Triton tensor-core dot


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # Pages per program (flash-decoding split). None: derived from max_pages, batch and kv heads
    # so that batch * kv_heads * splits >= min_programs. Rounded up to whole page blocks.
    pages_per_split: int | None = None
    # Pages gathered per loop iteration (a power of two): 8 pages of 16 tokens = a [128, d] K
    # tile (16 KiB of bf16 K+V at d=64 per iteration, vs 4 KiB for one page). Larger tiles mean
    # more bytes in flight per program and fewer serial iterations; the cost is registers.
    pages_per_block: int = 8
    # Target grid size for the automatic split: 2x the 132 SMs of an H200, so every SM has two
    # programs' loads in flight even at batch 1 (8 kv heads -> 33 splits wanted).
    min_programs: int = 264
    # "dot": tensor-core q @ K^T and p @ V on the group padded to 16 rows (p cast to the cache
    # dtype for the second dot, as flash attention does). "vpu": elementwise products in fp32.
    # "dot" needs pages_per_block * page_size >= 16 and d >= 16; else "vpu" is used.
    score: str = "dot"
    num_warps: int = 4
    num_stages: int = 2


# Named configurations for the GPU sweep (bench.kernel_peers times each; the tests check each in
# interpret mode). At llama3_1b shapes (8 kv heads, 128 pages of 16 at ctx 2048):
#   dot8      the default: [128, 64] tiles; b=1: 16 splits x 8 = 128 programs of one iteration;
#             b=8: 4 splits (256 programs); b=64: 1 split, 16 iterations (512 programs)
#   dot4      [64, 64] tiles, twice the splits at b=1 (256 programs): more, smaller programs
#   dot16_w8  [256, 64] tiles on 8 warps: most bytes in flight per program, fewest iterations
#   vpu2      elementwise fp32 scores on [32, 64] tiles (no tensor cores, small register tiles)
#   old       the previous kernel: 16 pages per split, one page per iteration, elementwise
CONFIGS = {
    "dot8": BlockSizes(),
    "dot4": BlockSizes(pages_per_block=4),
    "dot16_w8": BlockSizes(pages_per_block=16, num_warps=8),
    "vpu2": BlockSizes(pages_per_block=2, score="vpu"),
    "old": BlockSizes(pages_per_split=16, pages_per_block=1, score="vpu"),
}


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _first_rows(x, rows: int):
    """x[:rows] for x [R, ...] with rows dividing R (Triton has no slice): reshape and select."""
    r = x.shape[0]
    if r == rows:
        return x
    y = x.reshape(r // rows, rows, *x.shape[1:])
    keep = (jnp.arange(r // rows) == 0).reshape(-1, *([1] * (y.ndim - 1)))
    return jnp.sum(jnp.where(keep, y, jnp.zeros_like(y)), axis=0)


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, page_size,
            pages_per_split, pages_per_block, rows, sm_scale, use_dot):
    b, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    length = lengths_ref[b]
    g, max_pages = q_ref.shape[0], table_ref.shape[1]
    first = s * pages_per_split                                                   # first page of the split
    ppb, tile = pages_per_block, pages_per_block * page_size
    n_pages = jnp.clip((length + page_size - 1) // page_size - first, 0, pages_per_split)
    n_blocks = (n_pages + ppb - 1) // ppb
    # The group padded to `rows` (a power of two, 16 for the dots) by repeating its last head: a
    # gather load, where padding q outside would cost one more XLA kernel per call.
    q = q_ref[jnp.minimum(jnp.arange(rows), g - 1), :]                            # [rows, d]
    if not use_dot:
        q = q.astype(jnp.float32) * sm_scale
    # fp32 caches: full-precision dots (Triton's default for fp32 operands would be tf32)
    precision = jax.lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None

    def body(i, carry):
        m, l, acc = carry
        start = first + i * ppb
        # [ppb] page ids; a block running past the table's end repeats its last entry (those
        # positions are >= max_pages * page_size >= length, so masked), where padding the
        # table outside would cost one more XLA kernel per call
        ids = table_ref[b, jnp.minimum(start + jnp.arange(ppb), max_pages - 1)]
        k = k_ref[layer, ids, :, kh, :].reshape(tile, -1)                         # gather: [tile, d]
        v = v_ref[layer, ids, :, kh, :].reshape(tile, -1)
        if use_dot:
            scores = jax.lax.dot_general(q.astype(k.dtype), k, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32) * sm_scale   # [rows, tile]
        else:
            scores = jnp.sum(q[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)
        pos = start * page_size + jnp.arange(tile)
        scores = jnp.where(pos[None, :] < length, scores, NEG)                   # past the length
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        alpha = jnp.exp(m - m_new)
        probs = jnp.exp(scores - m_new[:, None])                                  # [rows, tile]
        l = l * alpha + jnp.sum(probs, axis=-1)
        if use_dot:
            pv = jax.lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)          # [rows, d]
        else:
            pv = jnp.sum(probs[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        return m_new, l, acc

    d = q.shape[1]
    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out_rows = o_ref.shape[0]                                                     # g, or rows when g does not divide it
    o_ref[...] = _first_rows(acc, out_rows)
    m_ref[...] = _first_rows(m, out_rows)
    l_ref[...] = _first_rows(l, out_rows)


def merge_splits(acc, m, l, dtype):
    """Combine per-split partials: acc [b, kvh, S, g, d], m/l [b, kvh, S, g] -> [b, kvh*g, d]."""
    big = jnp.max(m, axis=2, keepdims=True)                                       # [b, kvh, 1, g]
    w = jnp.exp(m - big)                                                          # empty splits -> 0
    num = jnp.sum(acc * w[..., None], axis=2)                                     # [b, kvh, g, d]
    den = jnp.sum(l * w, axis=2)                                                  # [b, kvh, g]
    out = num / jnp.where(den > 0, den, 1.0)[..., None]                           # inactive rows -> 0
    b, kvh, g, d = out.shape
    return out.reshape(b, kvh * g, d).astype(dtype)


def plan(block_sizes: BlockSizes, batch: int, kv_heads: int, max_pages: int, page_size: int, group: int,
         head_dim: int) -> dict:
    """The static tiling a call uses: pages per block and per split, splits, padded group rows."""
    bs = block_sizes
    if bs.score not in ("dot", "vpu"):
        raise ValueError(f"paged_attention: BlockSizes.score must be 'dot' or 'vpu', not {bs.score!r}")
    if bs.pages_per_block < 1 or bs.pages_per_block & (bs.pages_per_block - 1):
        raise ValueError(f"paged_attention: pages_per_block must be a power of two, not {bs.pages_per_block}")
    ppb = min(bs.pages_per_block, _pow2_at_least(max_pages))                     # short contexts: smaller tile
    if bs.pages_per_split is not None:
        ppb = min(ppb, _pow2_at_most(bs.pages_per_split))
        blocks_per_split = -(-bs.pages_per_split // ppb)
    else:
        n_blocks = -(-max_pages // ppb)
        want = min(max(1, -(-bs.min_programs // (batch * kv_heads))), n_blocks)
        blocks_per_split = -(-n_blocks // want)
    pps = blocks_per_split * ppb
    splits = -(-max_pages // pps)
    use_dot = bs.score == "dot" and ppb * page_size >= MIN_DOT and head_dim >= MIN_DOT
    rows = _pow2_at_least(max(group, MIN_DOT) if use_dot else group)             # Triton tiles are powers of 2
    return dict(pages_per_block=ppb, pages_per_split=pps, splits=splits, use_dot=use_dot, rows=rows,
                out_rows=group if rows % group == 0 else rows)


@functools.partial(jax.jit, static_argnames=("block_sizes", "sm_scale", "interpret"))
def paged_attention(q, k_pages, v_pages, page_table, lengths, layer=None, *,
                    block_sizes: BlockSizes = BlockSizes(), sm_scale: float | None = None, interpret: bool = False):
    """q [b, h, d] -> [b, h, d], attending to the first lengths[b] cached tokens of each sequence."""
    if k_pages.ndim == 4:                      # one layer: view it as a stack of one (free reshape)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    elif layer is None:
        raise ValueError("paged_attention: stacked k/v pages [layers, ...] need `layer`")
    b, h, d = q.shape
    num_pages, page_size, kvh, d_k = k_pages.shape[1:]
    if h % kvh or d_k != d or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged_attention: q {q.shape} does not match k/v pages {k_pages.shape}/{v_pages.shape}")
    g, max_pages = h // kvh, page_table.shape[1]
    p = plan(block_sizes, b, kvh, max_pages, page_size, g, d)
    pps, splits, rows, out_rows = p["pages_per_split"], p["splits"], p["rows"], p["out_rows"]
    scale = sm_scale if sm_scale is not None else d ** -0.5
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_split=pps,
                               pages_per_block=p["pages_per_block"], rows=rows, sm_scale=scale,
                               use_dot=p["use_dot"])
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[whole((1,)), whole((b,)), whole(page_table.shape),
                  pl.BlockSpec((None, None, g, d), lambda i, j, s: (i, j, 0, 0)),
                  whole(k_pages.shape), whole(v_pages.shape)],
        out_specs=[pl.BlockSpec((None, None, None, out_rows, d), lambda i, j, s: (i, j, s, 0, 0)),
                   pl.BlockSpec((None, None, None, out_rows), lambda i, j, s: (i, j, s, 0)),
                   pl.BlockSpec((None, None, None, out_rows), lambda i, j, s: (i, j, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, splits, out_rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, out_rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, splits, out_rows), jnp.float32)],
        interpret=interpret,
        # Triton params pick the Triton backend: jax's GPU default is Mosaic GPU, which would stage
        # every whole-array block (the entire KV cache) in shared memory and fails to lower.
        compiler_params=_CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        name="paged_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), page_table.astype(jnp.int32),
      q.reshape(b, kvh, g, d), k_pages, v_pages)
    if out_rows > g:
        acc, m, l = acc[..., :g, :], m[..., :g], l[..., :g]
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
