"""Prompt-chunk attention over a paged KV cache: many causal queries per sequence, pages read in place.

The serving engine's token-packed step feeds prompt chunks as rows of `chunk` tokens, each row one
sequence's consecutive tokens (padding at the end; a long prompt's chunks may fill several rows).
Each query attends to the cached keys at positions up to its own, its own row's and earlier rows'
included (the step writes them all first). Gathering each row's window of the
table's full width for a dense or flash kernel costs what the engine's max_len costs, not what the
context does: a 16-token cached tail in an 8k engine attended over 8k positions. Here each program
reads its row's pages through the table, only those below its last real query.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
from pallas_kernels.paged_attention import merge_splits, merge_splits_kernel
from pallas_kernels.paged_tiles import (MIN_DOT, NEG, BlockSizes, page_loop, plan, pow2_at_least, split_range, stacked,
                                        whole)

def prefill_plan(block_sizes: BlockSizes, rows: int, chunk: int, kv_heads: int, max_pages: int, page_size: int,
                 group: int, head_dim: int) -> dict:
    """The static tiling of paged_prefill_attention, or a ValueError naming what the GPU tiles cannot
    take (the caller then uses another path): query tokens per program, splits, page blocks."""
    group_rows = pow2_at_least(group)          # a group of 3 (Llama-3.2-3B) runs as 4, its last head repeated
    bq = min(block_sizes.block_q, chunk)
    while bq * group_rows < MIN_DOT and bq < chunk:
        bq *= 2
    p = plan(block_sizes, rows * (chunk // bq), kv_heads, max_pages, page_size, 1, head_dim)
    tile = bq * group_rows
    if chunk % bq or tile & (tile - 1) or (p["use_dot"] and tile < MIN_DOT):
        raise ValueError(f"paged_prefill_attention: chunk {chunk} and GQA group {group} need power-of-two "
                         f"query tiles of >= {MIN_DOT} rows (got {bq} tokens x {group_rows} heads)")
    return dict(p, block_q=bq, q_blocks=chunk // bq, group_rows=group_rows)


def _prefill_kernel(layer_ref, starts_ref, ends_ref, table_ref, q_ref, k_ref, v_ref, *outs, page_size, splits,
                    pages_per_block, q_blocks, block_q, group, sm_scale, use_dot, v_first, mask_tail):
    """One (row, query block, kv head, split): block_q query tokens x the kv head's group of query
    heads against the pages up to the block's last real query; each query row sees its own position."""
    i, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row, qb = i // q_blocks, i % q_blocks
    lo = starts_ref[row] + qb * block_q                                           # the block's first position
    hi = jnp.minimum(lo + block_q, ends_ref[row])                                 # real queries: [lo, hi)
    first, n_blocks = split_range(jnp.where(hi > lo, hi, 0), s, splits=splits, page_size=page_size,
                                  ppb=pages_per_block)
    qpos = lo + jnp.arange(block_q * group) // group                              # [rows] query row -> position
    q = q_ref[...].reshape(block_q * group, -1)                                   # [rows, d]
    m, l, acc = page_loop(table_ref, k_ref, v_ref, (q,), b=row, kh=kh, layer=layer_ref[0], first=first,
                          n_blocks=n_blocks, visible=jnp.where(qpos < hi, qpos + 1, 0), page_size=page_size,
                          ppb=pages_per_block, sm_scale=sm_scale, use_dot=use_dot, per_row=True, v_first=v_first,
                          clear_before=lo if mask_tail else None)
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
    k_pages, v_pages, layer = stacked(k_pages, v_pages, layer, interpret)
    rows, c, h, d = q.shape
    num_pages, page_size, kvh, d_k = k_pages.shape[1:]
    if h % kvh or d_k != d or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged_prefill_attention: q {q.shape} does not match k/v pages {k_pages.shape}")
    g = h // kvh
    p = prefill_plan(block_sizes, rows, c, kvh, page_table.shape[1], page_size, g, d)
    bq, nqb, splits, gp = p["block_q"], p["q_blocks"], p["splits"], p["group_rows"]
    q = q.reshape(rows, c, kvh, g, d)                                             # [k, c, kvh, g, d]
    if gp > g:   # the group padded to a power of two by repeating its last head; the copies are dropped below
        q = jnp.concatenate([q, jnp.repeat(q[:, :, :, -1:], gp - g, axis=3)], axis=3)   # [k, c, kvh, gp, d]
    kernel = functools.partial(_prefill_kernel, page_size=page_size, splits=splits, pages_per_block=p["pages_per_block"],
                               q_blocks=nqb, block_q=bq, group=gp, sm_scale=sm_scale if sm_scale is not None else d ** -0.5,
                               use_dot=p["use_dot"], v_first=block_sizes.v_first, mask_tail=block_sizes.mask_tail)
    tok = lambda i: (i // nqb, i % nqb)  # noqa: E731 - grid row -> (sequence row, query block)
    in_specs = [whole((1,)), whole((rows,)), whole((rows,)), whole(page_table.shape),
                pl.BlockSpec((None, bq, None, gp, d), lambda i, j, s: (*tok(i), j, 0, 0)),
                whole(k_pages.shape), whole(v_pages.shape)]
    if splits == 1:
        out_specs = [pl.BlockSpec((None, bq, None, gp, d), lambda i, j, s: (*tok(i), j, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((rows, c, kvh, gp, d), q.dtype)]
    else:
        out_specs = [pl.BlockSpec((None, bq, None, None, gp, d), lambda i, j, s: (*tok(i), j, s, 0, 0)),
                     pl.BlockSpec((None, bq, None, None, gp), lambda i, j, s: (*tok(i), j, s, 0)),
                     pl.BlockSpec((None, bq, None, None, gp), lambda i, j, s: (*tok(i), j, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((rows, c, kvh, splits, gp, d), jnp.float32),
                     jax.ShapeDtypeStruct((rows, c, kvh, splits, gp), jnp.float32),
                     jax.ShapeDtypeStruct((rows, c, kvh, splits, gp), jnp.float32)]
    outs = pl.pallas_call(
        kernel, grid=(rows * nqb, kvh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name="paged_prefill_attention",
        compiler_params=_CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
    )(jnp.asarray(layer, jnp.int32).reshape(1), starts.astype(jnp.int32), ends.astype(jnp.int32),
      page_table.astype(jnp.int32), q, k_pages, v_pages)
    if splits == 1:
        return outs[0][:, :, :, :g].reshape(rows, c, h, d)
    # The splits merged per query token in one launch (XLA's merge is three: an exp, a reduce and a
    # normalise; the first two took 3.6 us a layer for a 16-token tail on the H200). [k, c, ...] ->
    # [k * c, ...] is free.
    acc, m, l = (x.reshape(rows * c, *x.shape[2:]) for x in outs)                 # [k c, kvh, S, g(, d)]
    if block_sizes.merge == "xla":
        o = merge_splits(*(x[:, :, :, :g] for x in (acc, m, l)), q.dtype)         # [k c, h, d]
    else:
        o = merge_splits_kernel(acc, m, l, q.dtype, g=g, rows_out=rows * c, interpret=interpret)
    return o.reshape(rows, c, h, d)


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
