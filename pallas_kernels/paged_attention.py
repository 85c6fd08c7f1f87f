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
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams

NEG = -1e30       # a finite "minus infinity": exp(NEG - NEG) stays finite for empty splits
MIN_DOT = 16      # smallest M, N and K of a Triton tensor-core dot


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # Pages per program at the table's full width (flash-decoding split): it sets the number of
    # splits, max_pages / pages_per_split; at run time a sequence's pages are dealt evenly over them
    # (_split_range). None: derived from max_pages, batch and kv heads so that batch * kv_heads *
    # splits >= min_programs. Rounded up to whole page blocks.
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
    # Load a block's V together with its K, before the scores (latency) rather than after (registers).
    v_first: bool = False


# Named configurations for the GPU sweep (bench.kernel_peers times each; the tests check each in
# interpret mode). At llama3_1b shapes (8 kv heads, 128 pages of 16 at ctx 2048):
#   dot8      the default: [128, 64] tiles; b=1: 16 splits x 8 = 128 programs of one iteration;
#             b=8: 4 splits (256 programs); b=64: 1 split, 16 iterations (512 programs)
#   dot4      [64, 64] tiles, twice the splits at b=1 (256 programs): more, smaller programs
#   dot16_w8  [256, 64] tiles on 8 warps: most bytes in flight per program, fewest iterations
#   vpu2      elementwise fp32 scores on [32, 64] tiles (no tensor cores, small register tiles)
#   old       the previous kernel: 16 pages per split, one page per iteration, elementwise
#   dot8_vfirst  dot8 with V loaded alongside K (BlockSizes.v_first)
CONFIGS = {
    "dot8": BlockSizes(),
    "dot4": BlockSizes(pages_per_block=4),
    "dot16_w8": BlockSizes(pages_per_block=16, num_warps=8),
    "vpu2": BlockSizes(pages_per_block=2, score="vpu"),
    "old": BlockSizes(pages_per_split=16, pages_per_block=1, score="vpu"),
    "dot8_vfirst": BlockSizes(v_first=True),
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


def _page_loop(table_ref, k_ref, v_ref, qparts, *, b, kh, layer, first, n_blocks, visible, page_size, ppb,
               sm_scale, use_dot, per_row=False, v_first=False):
    """Online softmax of the query rows over page blocks [first, first + n_blocks) of one sequence's
    kv head: (m [rows], l [rows], acc [rows, d]) unnormalised. Positions >= `visible` are masked.
    qparts: (q,) [rows, d], or the two rotate-half halves of a RoPE'd q, ([rows, d/2],) * 2,
    against which K is loaded in the same column halves (Triton has no concatenate).
    per_row: `visible` is [rows] (causal prompt rows: a row may see none of a block that others
    see, so its probabilities are masked too, not only its scores)."""
    rows, max_pages, tile = qparts[0].shape[0], table_ref.shape[1], ppb * page_size
    d = sum(qp.shape[1] for qp in qparts)
    col = [pl.ds(sum(qp.shape[1] for qp in qparts[:i]), qp.shape[1]) for i, qp in enumerate(qparts)]
    # fp32 caches: full-precision dots (Triton's default for fp32 operands would be tf32)
    precision = jax.lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None
    if use_dot:
        qparts = tuple(qp.astype(k_ref.dtype) for qp in qparts)
    else:
        qparts = tuple(qp.astype(jnp.float32) * sm_scale for qp in qparts)

    def body(i, carry):
        m, l, acc = carry
        start = first + i * ppb
        # [ppb] page ids; a block running past the table's end repeats its last entry (those
        # positions are >= max_pages * page_size >= length, so masked), where padding the
        # table outside would cost one more XLA kernel per call
        ids = table_ref[b, jnp.minimum(start + jnp.arange(ppb), max_pages - 1)]
        ks = [k_ref[layer, ids, :, kh, c].reshape(tile, -1) for c in col]         # gather: [tile, d or d/2]
        # v_first: V's load issued before any math (at batch 1 a program runs one or two iterations,
        # so the chain K load -> scores -> V load is its latency), at the cost of both tiles' registers
        v = v_ref[layer, ids, :, kh, :].reshape(tile, -1) if v_first else None     # [tile, d]
        scores = 0.0
        for qp, k in zip(qparts, ks):
            if use_dot:
                scores = scores + jax.lax.dot_general(qp, k, (((1,), (1,)), ((), ())), precision=precision,
                                                      preferred_element_type=jnp.float32)  # [rows, tile]
            else:
                scores = scores + jnp.sum(qp[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)
        if use_dot:
            scores = scores * sm_scale
        if v is None:
            v = v_ref[layer, ids, :, kh, :].reshape(tile, -1)
        pos = start * page_size + jnp.arange(tile)
        seen = pos[None, :] < (visible[:, None] if per_row else visible)          # [rows or 1, tile]
        scores = jnp.where(seen, scores, NEG)                                     # past the length
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        alpha = jnp.exp(m - m_new)
        probs = jnp.exp(scores - m_new[:, None])                                  # [rows, tile]
        if per_row:                                # a row with nothing visible yet has m_new = NEG
            probs = jnp.where(seen, probs, 0.0)
        l = l * alpha + jnp.sum(probs, axis=-1)
        if use_dot:
            pv = jax.lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)          # [rows, d]
        else:
            pv = jnp.sum(probs[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        return m_new, l, acc

    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, d), jnp.float32))
    return jax.lax.fori_loop(0, n_blocks, body, init)


def _split_range(length, s, *, splits, page_size, ppb):
    """(first page, page blocks) of split s: the blocks holding a sequence's first `length` tokens
    are dealt evenly over the `splits` programs at run time. A split size fixed by the table's width
    would leave a short sequence in a wide table (an engine sized for 8k serving 2k) on a few
    programs of several serial iterations each while the others idle."""
    blocks = (length + ppb * page_size - 1) // (ppb * page_size)
    per = (blocks + splits - 1) // splits
    return s * per * ppb, jnp.clip(blocks - s * per, 0, per)


def _write_partials(outs, m, l, acc):
    """(acc, m, l) refs <- the first out_rows rows; or, with one output ref, the normalised result."""
    out_rows = outs[0].shape[0]                                                   # g, or rows when g does not divide it
    if len(outs) == 1:                                                            # one split: finish here
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]                               # inactive rows -> 0
        outs[0][...] = _first_rows(o, out_rows).astype(outs[0].dtype)
        return
    for ref, x in zip(outs, (acc, m, l)):
        ref[...] = _first_rows(x, out_rows)


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, v_ref, *outs, page_size, splits,
            pages_per_block, rows, sm_scale, use_dot, v_first):
    b, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    first, n_blocks = _split_range(length, s, splits=splits, page_size=page_size, ppb=pages_per_block)
    # The group padded to `rows` (a power of two, 16 for the dots) by repeating its last head: a
    # gather load, where padding q outside would cost one more XLA kernel per call.
    q = q_ref[jnp.minimum(jnp.arange(rows), q_ref.shape[0] - 1), :]               # [rows, d]
    m, l, acc = _page_loop(table_ref, k_ref, v_ref, (q,), b=b, kh=kh, layer=layer_ref[0], first=first,
                           n_blocks=n_blocks, visible=length, page_size=page_size, ppb=pages_per_block, sm_scale=sm_scale,
                           use_dot=use_dot, v_first=v_first)
    _write_partials(outs, m, l, acc)


def _fused_kernel(layer_ref, lengths_ref, table_ref, qkv_ref, cs_ref, k_ref, v_ref, *outs, page_size,
                  splits, pages_per_block, rows, sm_scale, use_dot, group, n_heads, v_first):
    """_kernel for one decode step with RoPE and the cache write folded in (paged_decode_attention).

    The new token (position length - 1) is not read back from the cache: every program masks it,
    and the program whose split holds it adds it to the online softmax from registers and writes
    its rotated k and its v into the cache slot. No program reads that slot, so there is no race."""
    *outs, k_out, v_out = outs
    b, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, layer = lengths_ref[b], layer_ref[0]
    new = length - 1                                                              # the new token's position
    first, n_blocks = _split_range(length, s, splits=splits, page_size=page_size, ppb=pages_per_block)
    d = qkv_ref.shape[-1]
    half = d // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    cos, sin = cs_ref[b, 0, :], cs_ref[b, 1, :]                                   # [d/2] fp32

    def rotate(x1, x2):  # rotate-half RoPE in fp32, rounded to the cache dtype as the model rounds it
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return ((x1 * cos - x2 * sin).astype(k_ref.dtype), (x2 * cos + x1 * sin).astype(k_ref.dtype))

    heads = kh * group + jnp.minimum(jnp.arange(rows), group - 1)                # the group padded to `rows`
    q1, q2 = rotate(qkv_ref[b, heads, lo], qkv_ref[b, heads, hi])                 # [rows, d/2] x2
    k1, k2 = rotate(qkv_ref[b, n_heads + kh, lo], qkv_ref[b, n_heads + kh, hi])   # [d/2] x2
    v_new = qkv_ref[b, n_heads + v_ref.shape[3] + kh, :]                         # [d]
    m, l, acc = _page_loop(table_ref, k_ref, v_ref, (q1, q2), b=b, kh=kh, layer=layer, first=first,
                           n_blocks=n_blocks, visible=new, page_size=page_size, ppb=pages_per_block, sm_scale=sm_scale,
                           use_dot=use_dot, v_first=v_first)
    mine = (length > 0) & (new // page_size >= first) & (new // page_size < first + n_blocks * pages_per_block)
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
        v_out[layer, page, slot, kh, :] = v_new.astype(v_out.dtype)


def merge_splits(acc, m, l, dtype):
    """Combine per-split partials: acc [b, kvh, S, g, d], m/l [b, kvh, S, g] -> [b, kvh*g, d]."""
    big = jnp.max(m, axis=2, keepdims=True)                                       # [b, kvh, 1, g]
    w = jnp.exp(m - big)                                                          # empty splits -> 0
    num = jnp.sum(acc * w[..., None], axis=2)                                     # [b, kvh, g, d]
    den = jnp.sum(l * w, axis=2)                                                  # [b, kvh, g]
    out = num / jnp.where(den > 0, den, 1.0)[..., None]                           # inactive rows -> 0
    b, kvh, g, d = out.shape
    return out.reshape(b, kvh * g, d).astype(dtype)


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, b, g, splits, s_pad):
    """merge_splits for one (row, kv head): o[i, kh*g:(kh+1)*g] <- the splits' rescaled sum; rows >= b
    (the caller's padding) get zeros."""
    i, kh = pl.program_id(0), pl.program_id(1)
    src, rows = jnp.minimum(i, b - 1), acc_ref.shape[3]
    live = jnp.arange(s_pad) < splits                                             # [S] the split padding
    m = plgpu.load(m_ref.at[src, kh, pl.ds(0, s_pad), :], mask=live[:, None], other=NEG)                  # [S, rows]
    l = plgpu.load(l_ref.at[src, kh, pl.ds(0, s_pad), :], mask=live[:, None], other=0.0)                  # [S, rows]
    acc = plgpu.load(acc_ref.at[src, kh, pl.ds(0, s_pad), :, :], mask=live[:, None, None], other=0.0)      # [S, rows, d]
    w = jnp.exp(m - jnp.max(m, axis=0)[None, :])                                  # [S, rows]; empty splits -> 0
    den = jnp.sum(l * w, axis=0)                                                  # [rows]
    o = jnp.sum(acc * w[:, :, None], axis=0) / jnp.where(den > 0, den, 1.0)[:, None]   # [rows, d]; inactive -> 0
    o = jnp.where(i < b, o, 0.0)
    plgpu.store(o_ref.at[i, pl.ds(kh * g, rows), :], o.astype(o_ref.dtype), mask=(jnp.arange(rows) < g)[:, None])


def merge_splits_kernel(acc, m, l, dtype, *, g: int, rows_out: int, interpret: bool = False):
    """merge_splits as one Pallas launch, writing o [rows_out, kvh*g, d] with rows >= b zero: XLA runs
    the merge as a reduce and a normalise-and-pad kernel (4.4 us per layer at batch 1 on the H200,
    about as long as the attention itself; docs/benchmarks.md), and the zero row is the one the
    model's one-token GEMM needs (models/llama.py _mm_decode), so no pad follows."""
    b, kvh, splits, rows, d = acc.shape
    s_pad = _pow2_at_least(splits)
    kernel = functools.partial(_merge_kernel, b=b, g=g, splits=splits, s_pad=s_pad)
    return pl.pallas_call(
        kernel, grid=(rows_out, kvh), in_specs=[_whole(a.shape) for a in (acc, m, l)],
        out_specs=_whole((rows_out, kvh * g, d)), out_shape=jax.ShapeDtypeStruct((rows_out, kvh * g, d), dtype),
        interpret=interpret, compiler_params=_CompilerParams(num_warps=4, num_stages=1), name="paged_attention_merge",
    )(acc, m, l)


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


def _whole(shape):
    """The whole array as one block, whatever the grid (the kernel indexes it itself)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


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
        out_specs += [_whole(c.shape) for c in caches]
        out_shape += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]
    return pl.pallas_call(
        kernel, grid=(b, kvh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=interpret,
        # Triton params pick the Triton backend: jax's GPU default is Mosaic GPU, which would stage
        # every whole-array block (the entire KV cache) in shared memory and fails to lower.
        compiler_params=_CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        name="paged_attention",
    )(*args)


def _finish(outs, p, g, b, dtype, rows_out=None, interpret=False):
    """The kernel's outputs -> [rows_out (default b), kvh * g, d]: reshaped (one split) or merged
    (several, in one Pallas launch); rows past b are zeros."""
    rows_out = rows_out or b
    if p["splits"] == 1:
        o = outs[0][:, :, :g] if p["out_rows"] > g else outs[0]                   # [b, kvh, g, d]
        o = o.reshape(b, -1, o.shape[-1])
        return jnp.pad(o, ((0, rows_out - b), (0, 0), (0, 0))) if rows_out > b else o
    return merge_splits_kernel(*outs[:3], dtype, g=g, rows_out=rows_out, interpret=interpret)


def _stacked(k_pages, v_pages, layer):
    if k_pages.ndim == 4:                      # one layer: view it as a stack of one (free reshape)
        return k_pages[None], v_pages[None], 0
    if layer is None:
        raise ValueError("paged_attention: stacked k/v pages [layers, ...] need `layer`")
    return k_pages, v_pages, layer


@functools.partial(jax.jit, static_argnames=("block_sizes", "sm_scale", "interpret"))
def paged_attention(q, k_pages, v_pages, page_table, lengths, layer=None, *,
                    block_sizes: BlockSizes = BlockSizes(), sm_scale: float | None = None, interpret: bool = False):
    """q [b, h, d] -> [b, h, d], attending to the first lengths[b] cached tokens of each sequence."""
    k_pages, v_pages, layer = _stacked(k_pages, v_pages, layer)
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
    in_specs = [_whole((1,)), _whole((b,)), _whole(page_table.shape),
                pl.BlockSpec((None, None, g, d), lambda i, j, s: (i, j, 0, 0)),
                _whole(k_pages.shape), _whole(v_pages.shape)]
    args = (jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), page_table.astype(jnp.int32),
            q.reshape(b, kvh, g, d), k_pages, v_pages)
    outs = _launch(kernel, args, in_specs, b=b, kvh=kvh, p=p, d=d, dtype=q.dtype, block_sizes=block_sizes,
                   interpret=interpret)
    return _finish(outs, p, g, b, q.dtype, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("n_heads", "block_sizes", "sm_scale", "interpret"))
def paged_decode_attention(qkv, cos_sin, k_pages, v_pages, page_table, lengths, layer=None, *, n_heads: int,
                           block_sizes: BlockSizes = BlockSizes(), sm_scale: float | None = None,
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
    donates the cache (the serving step does; aliased outputs), else into a copy. Against RoPE + scatter +
    paged_attention it saves four XLA launches per layer
    (a select for the dropped writes, q's RoPE, the k and v scatters), which cost more than the
    attention itself at batch 1 (H200 profile, docs/benchmarks.md)."""
    one_layer = k_pages.ndim == 4
    k_pages, v_pages, layer = _stacked(k_pages, v_pages, layer)
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
    in_specs = [_whole((1,)), _whole((b,)), _whole(page_table.shape), _whole(qkv.shape), _whole(cos_sin.shape),
                _whole(k_pages.shape), _whole(v_pages.shape)]
    args = (jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), page_table.astype(jnp.int32),
            qkv, cos_sin.astype(jnp.float32), k_pages, v_pages)
    *outs, k_pages, v_pages = _launch(kernel, args, in_specs, b=b, kvh=kvh, p=p, d=d, dtype=qkv.dtype,
                                      block_sizes=block_sizes, interpret=interpret, caches=(k_pages, v_pages))
    if one_layer:
        k_pages, v_pages = k_pages[0], v_pages[0]
    return _finish(outs, p, g, b, qkv.dtype, rows_out, interpret), k_pages, v_pages


# -- prompt rows: many causal queries per sequence ------------------------------------------------
PREFILL_BLOCK_Q = 16     # query tokens per program: with a GQA group of 4, [64, d] query tiles for the dots


def prefill_plan(block_sizes: BlockSizes, rows: int, chunk: int, kv_heads: int, max_pages: int, page_size: int,
                 group: int, head_dim: int) -> dict:
    """The static tiling of paged_prefill_attention, or a ValueError naming what the GPU tiles cannot
    take (the caller then uses another path): query tokens per program, splits, page blocks."""
    bq = min(PREFILL_BLOCK_Q, chunk)
    while bq * group < MIN_DOT and bq < chunk:
        bq *= 2
    p = plan(block_sizes, rows * (chunk // bq), kv_heads, max_pages, page_size, 1, head_dim)
    tile = bq * group
    if chunk % bq or tile & (tile - 1) or group & (group - 1) or (p["use_dot"] and tile < MIN_DOT):
        raise ValueError(f"paged_prefill_attention: chunk {chunk} and GQA group {group} need power-of-two "
                         f"query tiles of >= {MIN_DOT} rows (got {bq} tokens x {group} heads)")
    return dict(p, block_q=bq, q_blocks=chunk // bq)


def _prefill_kernel(layer_ref, starts_ref, ends_ref, table_ref, q_ref, k_ref, v_ref, *outs, page_size, splits,
                    pages_per_block, q_blocks, block_q, group, sm_scale, use_dot, v_first):
    """One (row, query block, kv head, split): block_q query tokens x the kv head's group of query
    heads against the pages up to the block's last real query; each query row sees its own position."""
    i, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row, qb = i // q_blocks, i % q_blocks
    lo = starts_ref[row] + qb * block_q                                           # the block's first position
    hi = jnp.minimum(lo + block_q, ends_ref[row])                                 # real queries: [lo, hi)
    first, n_blocks = _split_range(jnp.where(hi > lo, hi, 0), s, splits=splits, page_size=page_size,
                                   ppb=pages_per_block)
    qpos = lo + jnp.arange(block_q * group) // group                              # [rows] query row -> position
    q = q_ref[...].reshape(block_q * group, -1)                                   # [rows, d]
    m, l, acc = _page_loop(table_ref, k_ref, v_ref, (q,), b=row, kh=kh, layer=layer_ref[0], first=first,
                           n_blocks=n_blocks, visible=jnp.where(qpos < hi, qpos + 1, 0), page_size=page_size,
                           ppb=pages_per_block, sm_scale=sm_scale, use_dot=use_dot, per_row=True, v_first=v_first)
    d = acc.shape[-1]
    if len(outs) == 1:                                                            # one split: finish here
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]                               # padding queries -> 0
        outs[0][...] = o.reshape(block_q, group, d).astype(outs[0].dtype)
        return
    outs[0][...] = acc.reshape(block_q, group, d)
    outs[1][...] = m.reshape(block_q, group)
    outs[2][...] = l.reshape(block_q, group)


@functools.partial(jax.jit, static_argnames=("block_sizes", "sm_scale", "interpret"))
def paged_prefill_attention(q, k_pages, v_pages, page_table, starts, ends, layer=None, *,
                            block_sizes: BlockSizes = BlockSizes(), sm_scale: float | None = None,
                            interpret: bool = False):
    """Prompt-chunk rows over the paged cache, pages read in place through the table (no window gather).

    q [k, c, h, d]: row i's query t sits at position starts[i] + t and is real while that is below
    ends[i] (padding after); it sees the cached keys at positions <= its own, this chunk's included
    (written before the call). page_table [k, max_pages]. Returns [k, c, h, d], zeros for padding.
    Grid (rows x query blocks, kv heads, splits): a program takes block_q tokens x the group's heads
    as one [block_q * g, d] tile (GQA: the group shares each K/V load) and visits only the page
    blocks below its block's last real query, dealt over the splits at run time: a chunk whose
    prefix is long, or a short cached tail, reads what it attends to and nothing past it."""
    k_pages, v_pages, layer = _stacked(k_pages, v_pages, layer)
    rows, c, h, d = q.shape
    num_pages, page_size, kvh, d_k = k_pages.shape[1:]
    if h % kvh or d_k != d or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged_prefill_attention: q {q.shape} does not match k/v pages {k_pages.shape}")
    g = h // kvh
    p = prefill_plan(block_sizes, rows, c, kvh, page_table.shape[1], page_size, g, d)
    bq, nqb, splits = p["block_q"], p["q_blocks"], p["splits"]
    kernel = functools.partial(_prefill_kernel, page_size=page_size, splits=splits, pages_per_block=p["pages_per_block"],
                               q_blocks=nqb, block_q=bq, group=g, sm_scale=sm_scale if sm_scale is not None else d ** -0.5,
                               use_dot=p["use_dot"], v_first=block_sizes.v_first)
    tok = lambda i: (i // nqb, i % nqb)  # noqa: E731 - grid row -> (sequence row, query block)
    in_specs = [_whole((1,)), _whole((rows,)), _whole((rows,)), _whole(page_table.shape),
                pl.BlockSpec((None, bq, None, g, d), lambda i, j, s: (*tok(i), j, 0, 0)),
                _whole(k_pages.shape), _whole(v_pages.shape)]
    if splits == 1:
        out_specs = [pl.BlockSpec((None, bq, None, g, d), lambda i, j, s: (*tok(i), j, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((rows, c, kvh, g, d), q.dtype)]
    else:
        out_specs = [pl.BlockSpec((None, bq, None, None, g, d), lambda i, j, s: (*tok(i), j, s, 0, 0)),
                     pl.BlockSpec((None, bq, None, None, g), lambda i, j, s: (*tok(i), j, s, 0)),
                     pl.BlockSpec((None, bq, None, None, g), lambda i, j, s: (*tok(i), j, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((rows, c, kvh, splits, g, d), jnp.float32),
                     jax.ShapeDtypeStruct((rows, c, kvh, splits, g), jnp.float32),
                     jax.ShapeDtypeStruct((rows, c, kvh, splits, g), jnp.float32)]
    outs = pl.pallas_call(
        kernel, grid=(rows * nqb, kvh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name="paged_prefill_attention",
        compiler_params=_CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
    )(jnp.asarray(layer, jnp.int32).reshape(1), starts.astype(jnp.int32), ends.astype(jnp.int32),
      page_table.astype(jnp.int32), q.reshape(rows, c, kvh, g, d), k_pages, v_pages)
    if splits == 1:
        return outs[0].reshape(rows, c, h, d)
    acc, m, l = outs                                                              # merge the splits (axis 3)
    w = jnp.exp(m - jnp.max(m, axis=3, keepdims=True))                            # empty splits -> 0
    den = jnp.sum(l * w, axis=3)                                                  # [k, c, kvh, g]
    o = jnp.sum(acc * w[..., None], axis=3) / jnp.where(den > 0, den, 1.0)[..., None]
    return o.reshape(rows, c, h, d).astype(q.dtype)


def paged_prefill_reference(q, k_pages, v_pages, page_table, starts, ends, sm_scale: float | None = None):
    """Pure jnp paged_prefill_attention (one layer's pages): gather, causal mask by position, fp32."""
    rows, c, h, d = q.shape
    kvh = k_pages.shape[2]
    k = k_pages[page_table].reshape(rows, -1, kvh, d).astype(jnp.float32)       # [k, s, kvh, d]
    v = v_pages[page_table].reshape(rows, -1, kvh, d).astype(jnp.float32)
    qg = q.reshape(rows, c, kvh, h // kvh, d).astype(jnp.float32)
    scale = sm_scale if sm_scale is not None else d ** -0.5
    scores = jnp.einsum("bckgd,bskd->bkgcs", qg, k) * scale                      # [k, kvh, g, c, s]
    qpos = starts[:, None] + jnp.arange(c)[None, :]                               # [k, c]
    real = qpos < ends[:, None]
    seen = (jnp.arange(k.shape[1])[None, None, :] <= qpos[:, :, None]) & real[:, :, None]   # [k, c, s]
    scores = jnp.where(seen[:, None, None], scores, NEG)
    p = jax.nn.softmax(scores, axis=-1) * seen[:, None, None]
    o = jnp.einsum("bkgcs,bskd->bckgd", p, v)                                     # [k, c, kvh, g, d]
    return o.reshape(rows, c, h, d).astype(q.dtype)


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
