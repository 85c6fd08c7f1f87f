"""What the paged attention kernels share: the tuning dataclass and its named sweep configs, the
static tiling (`plan`), the run-time split of a sequence's pages over programs (`split_range`) and
the online-softmax loop over gathered page blocks (`page_loop`). The kernels: decode (one query
token per sequence) in `paged_attention`, prompt rows (many causal queries) in `paged_prefill`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = -1e30       # a finite "minus infinity": exp(NEG - NEG) stays finite for empty splits
MIN_DOT = 16      # smallest M, N and K of a Triton tensor-core dot


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # Pages per program at the table's full width (flash-decoding split): it sets the number of
    # splits, max_pages / pages_per_split; at run time a sequence's pages are dealt evenly over them
    # (split_range). None: derived from max_pages, batch and kv heads so that batch * kv_heads *
    # splits >= min_programs. Rounded up to whole page blocks.
    pages_per_split: int | None = None
    # Pages gathered per loop iteration (a power of two): 8 pages of 16 tokens = a [128, d] K
    # tile (16 KiB of bf16 K+V at d=64 per iteration, vs 4 KiB for one page). Larger tiles mean
    # more bytes in flight per program and fewer serial iterations; the cost is registers.
    pages_per_block: int = 8
    # Target grid size for the automatic split: 2x the 132 SMs of an H200, so every SM has two
    # programs' loads in flight even at batch 1 (8 kv heads -> 33 splits wanted).
    min_programs: int = 264
    # "dot": tensor-core q @ K^T and p @ V on the group padded to 16 rows (p cast to the dots'
    # dtype, bf16 for a bf16 or fp8 cache, as flash attention does). "vpu": elementwise products in fp32.
    # "dot" needs pages_per_block * page_size >= 16 and d >= 16; else "vpu" is used.
    score: str = "dot"
    num_warps: int = 4
    num_stages: int = 2
    # Load a block's V together with its K, before the scores (latency) rather than after (registers).
    v_first: bool = False
    # How the splits' partials are combined: "kernel" (one Pallas launch, merge_splits_kernel) or
    # "xla" (merge_splits: XLA's exp, reduce and normalise kernels; the benchmark's A/B).
    merge: str = "kernel"
    # Prompt rows only (paged_prefill): query tokens per program (a power of two, grown until the
    # tile has MIN_DOT rows). The block's tokens x the GQA group share each K/V load, so a row of a
    # 512-token chunk reads its pages 512 / block_q times; wider blocks cost registers.
    block_q: int = 16
    # Prompt rows only: the page blocks wholly before the query block's first position (all but the
    # last few of a long context's) run in a loop without the causal mask's compares and selects; a
    # second loop masks the rest, and padding query rows are cleared at the end.
    mask_tail: bool = False


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


def decode_block_sizes(batch: int = 1, fused: bool = True) -> BlockSizes:
    """The tiles of the serving step's decode attention at `batch` rows: the fused RoPE + write +
    attention kernel (meshlab/infer/kv_cache.py, batch <= 16), or with fused=False the plain kernel
    (larger batches, and a packed step's decode rows). Module-level so that a benchmark can swap it
    before building an engine. No software pipelining at any batch: with gathered page loads,
    Triton's staging through shared memory (num_stages 2) only adds a wait.
    - batch 1: a program runs one or two page blocks, and V's load is one memory latency less beside
      K's: [64, d] tiles, no pipelining, V first took the batch-1 decode layer from 52.2 to 49.0 us in
      the layer chain and the engine from 1,113 to 1,149 tokens/s (H200, docs/benchmarks.md).
    - fused, batch > 1: [128, d] tiles over 528 programs wanted: at batch 4 / 16, 16 layers at ctx 2k
      took 22.5 / 47.5 us a layer against 35.6 / 58.2 with the batch-1 tiles (H200).
    - unfused: [128, d] tiles with the automatic split: at batch 32 / 64 / 128, 65.6 / 105.0 / 179.5 us
      a layer against 82.3 / 131.9 / 246.8 with the kernel's defaults (H200)."""
    if fused and batch == 1:
        return BlockSizes(pages_per_block=4, num_stages=1, v_first=True)
    if fused:
        return BlockSizes(num_stages=1, min_programs=528)
    return BlockSizes(num_stages=1)


def prefill_block_sizes(chunk: int = 16) -> BlockSizes:
    """The tiles the serving step's prompt rows of `chunk` tokens get (paged_prefill via
    meshlab/infer/kv_cache.py); module-level, as decode_block_sizes, so that a benchmark can swap it
    before building an engine. Page blocks wholly before a query block skip the causal mask; chunks
    that 32 divides take 32-token query blocks (H100, llama3_1b, the step ending at 8k: 587 us a layer
    against 857 with 16 and the mask on every block), others 16 (a chunk of 48 keeps the paged path)."""
    return BlockSizes(block_q=32 if chunk % 32 == 0 else 16, mask_tail=True)


def to_cache(x, dtype):
    """x rounded to the cache's dtype; a float8 cache saturates at its largest finite value first
    (float8_e4m3fn has no infinity: a value past 448 would become NaN)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def widened(q_dtype, cache_dtype):
    """The dtype attention's products run in over a cache: an fp8 cache's is q's (JAX promotes no
    float8 implicitly), else the wider of the two."""
    return jnp.dtype(q_dtype) if jnp.dtype(cache_dtype).itemsize == 1 else jnp.promote_types(q_dtype, cache_dtype)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def page_loop(table_ref, k_ref, v_ref, qparts, *, b, kh, layer, first, n_blocks, visible, page_size, ppb,
               sm_scale, use_dot, per_row=False, v_first=False, clear_before=None):
    """Online softmax of the query rows over page blocks [first, first + n_blocks) of one sequence's
    kv head: (m [rows], l [rows], acc [rows, d]) unnormalised. Positions >= `visible` are masked.
    qparts: (q,) [rows, d], or the two rotate-half halves of a RoPE'd q, ([rows, d/2],) * 2,
    against which K is loaded in the same column halves (Triton has no concatenate).
    per_row: `visible` is [rows] (causal prompt rows: a row may see none of a block that others
    see, so its probabilities are masked too, not only its scores).
    clear_before (per_row): every row with visible > 0 sees all positions below it; the blocks
    ending there run unmasked, and rows with visible == 0 come back empty (m NEG, l 0, acc 0)."""
    rows, max_pages, tile = qparts[0].shape[0], table_ref.shape[1], ppb * page_size
    d = sum(qp.shape[1] for qp in qparts)
    col = [pl.ds(sum(qp.shape[1] for qp in qparts[:i]), qp.shape[1]) for i, qp in enumerate(qparts)]
    # The dots run in the wider of q's and the cache's dtypes: an fp8 cache's tiles are widened after
    # their load (its bytes are what decode pays for), never q narrowed to fp8. fp32: full-precision
    # dots (Triton's default for fp32 operands would be tf32).
    wide = widened(qparts[0].dtype, k_ref.dtype)
    precision = jax.lax.Precision.HIGHEST if wide == jnp.float32 else None
    if use_dot:
        qparts = tuple(qp.astype(wide) for qp in qparts)
    else:
        qparts = tuple(qp.astype(jnp.float32) * sm_scale for qp in qparts)

    def body(i, carry, masked=True):
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
                scores = scores + jax.lax.dot_general(qp, k.astype(wide), (((1,), (1,)), ((), ())), precision=precision,
                                                      preferred_element_type=jnp.float32)  # [rows, tile]
            else:
                scores = scores + jnp.sum(qp[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)
        if use_dot:
            scores = scores * sm_scale
        if v is None:
            v = v_ref[layer, ids, :, kh, :].reshape(tile, -1)
        if masked:
            pos = start * page_size + jnp.arange(tile)
            seen = pos[None, :] < (visible[:, None] if per_row else visible)      # [rows or 1, tile]
            scores = jnp.where(seen, scores, NEG)                                 # past the length
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        alpha = jnp.exp(m - m_new)
        probs = jnp.exp(scores - m_new[:, None])                                  # [rows, tile]
        if per_row and masked:                     # a row with nothing visible yet has m_new = NEG
            probs = jnp.where(seen, probs, 0.0)
        l = l * alpha + jnp.sum(probs, axis=-1)
        if use_dot:
            pv = jax.lax.dot_general(probs.astype(wide), v.astype(wide), (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)          # [rows, d]
        else:
            pv = jnp.sum(probs[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        return m_new, l, acc

    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, d), jnp.float32))
    if clear_before is None:
        return jax.lax.fori_loop(0, n_blocks, body, init)
    n_clear = jnp.clip(clear_before // tile - first // ppb, 0, n_blocks)         # first is whole blocks
    carry = jax.lax.fori_loop(0, n_clear, lambda i, c: body(i, c, masked=False), init)
    m, l, acc = jax.lax.fori_loop(n_clear, n_blocks, body, carry)
    real = visible > 0                                                            # padding rows: empty
    return jnp.where(real, m, NEG), jnp.where(real, l, 0.0), jnp.where(real[:, None], acc, 0.0)


def split_range(length, s, *, splits, page_size, ppb):
    """(first page, page blocks) of split s: the blocks holding a sequence's first `length` tokens
    are dealt evenly over the `splits` programs at run time. A split size fixed by the table's width
    would leave a short sequence in a wide table (an engine sized for 8k serving 2k) on a few
    programs of several serial iterations each while the others idle."""
    blocks = (length + ppb * page_size - 1) // (ppb * page_size)
    per = (blocks + splits - 1) // splits
    return s * per * ppb, jnp.clip(blocks - s * per, 0, per)


def active_splits(length, *, splits, page_size, ppb):
    """How many of the `splits` programs split_range gives page blocks to (the rest hold empty partials)."""
    blocks = (length + ppb * page_size - 1) // (ppb * page_size)
    per = jnp.maximum((blocks + splits - 1) // splits, 1)
    return (blocks + per - 1) // per


def split_blocks(n_blocks: int, want: int) -> int:
    """Page blocks per split, so that the table's n_blocks fill at least `want` splits (the grid
    BlockSizes.min_programs asks for). Rounded down: rounding up halves the splits where n_blocks is
    just over `want` (36 blocks, 33 wanted: 18 splits of two). On the H200 the two roundings decoded
    level through the engine (batch 1 in 2,304- and 4,096-token tables, batch 16 / 32: `bench_decode.py
    --jobs splits_ab`); down keeps the grid the dataclass promises. Module-level, so that a benchmark
    can swap it."""
    return max(1, n_blocks // want)


def plan(block_sizes: BlockSizes, batch: int, kv_heads: int, max_pages: int, page_size: int, group: int,
         head_dim: int) -> dict:
    """The static tiling a call uses: pages per block and per split, splits, padded group rows."""
    bs = block_sizes
    if bs.score not in ("dot", "vpu"):
        raise ValueError(f"paged_attention: BlockSizes.score must be 'dot' or 'vpu', not {bs.score!r}")
    if bs.merge not in ("kernel", "xla"):
        raise ValueError(f"paged_attention: BlockSizes.merge must be 'kernel' or 'xla', not {bs.merge!r}")
    if bs.pages_per_block < 1 or bs.pages_per_block & (bs.pages_per_block - 1):
        raise ValueError(f"paged_attention: pages_per_block must be a power of two, not {bs.pages_per_block}")
    ppb = min(bs.pages_per_block, pow2_at_least(max_pages))                     # short contexts: smaller tile
    if bs.pages_per_split is not None:
        ppb = min(ppb, pow2_at_most(bs.pages_per_split))
        blocks_per_split = -(-bs.pages_per_split // ppb)
    else:
        n_blocks = -(-max_pages // ppb)
        want = min(max(1, -(-bs.min_programs // (batch * kv_heads))), n_blocks)
        blocks_per_split = split_blocks(n_blocks, want)
    pps = blocks_per_split * ppb
    splits = -(-max_pages // pps)
    use_dot = bs.score == "dot" and ppb * page_size >= MIN_DOT and head_dim >= MIN_DOT
    rows = pow2_at_least(max(group, MIN_DOT) if use_dot else group)             # Triton tiles are powers of 2
    # The partials keep the group's rows padded to a power of two only (a group of 3: 4 rows, not the
    # dots' 16): the merge loads [splits, out_rows, d] fp32 per program, and at 16 rows of d = 128 its
    # registers spilled (llama3_3b's merge took 88 us a layer on the H100, its attention 8).
    return dict(pages_per_block=ppb, pages_per_split=pps, splits=splits, use_dot=use_dot, rows=rows,
                out_rows=pow2_at_least(group))


def whole(shape):
    """The whole array as one block, whatever the grid (the kernel indexes it itself)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


# Pallas Triton indexes a buffer of at most 2**32 bytes with 32-bit signed element offsets, which a
# 1-byte dtype overflows past 2**31 elements: an fp8 cache of 2-4 GiB per K or V would be read and
# written at wrapped addresses (outside the buffer). Below 2 GiB, or above 4 GiB (64-bit offsets), it is exact.
WRAPPING_BYTES = (2 ** 31, 2 ** 32)


def cache_bytes_wrap(nbytes: int, itemsize: int) -> bool:
    """Whether a cache buffer of nbytes with itemsize-byte entries meets WRAPPING_BYTES' overflow."""
    return itemsize == 1 and WRAPPING_BYTES[0] < nbytes <= WRAPPING_BYTES[1]


def stacked(k_pages, v_pages, layer, interpret: bool = False):
    nbytes = k_pages.size * k_pages.dtype.itemsize
    if not interpret and cache_bytes_wrap(nbytes, k_pages.dtype.itemsize):
        raise ValueError(f"paged attention: a {k_pages.dtype} cache of {nbytes} bytes per K/V lies in (2 GiB, 4 GiB], "
                         f"where Pallas Triton's 32-bit offsets wrap; use fewer or more pages (Engine adds pages)")
    if k_pages.ndim == 4:                      # one layer: view it as a stack of one (free reshape)
        return k_pages[None], v_pages[None], 0
    if layer is None:
        raise ValueError("paged_attention: stacked k/v pages [layers, ...] need `layer`")
    return k_pages, v_pages, layer
