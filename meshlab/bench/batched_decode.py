"""Batched decode: the paged attention kernel's tiles by batch, and the Engine A/Bs behind the
batch-dependent choices (bench_decode.py's jobs attn_tiles, sweep_ab, rows_ab, expert_rows_ab, gmm_tiles_ab,
buckets_ab, splits_ab and the sweep 1..256, sweep_engine; each job takes the child's context, decode_jobs.Child).

`attention_tile_sweep` times the decode attention alone: `layers` layers of one stacked paged cache
in one jit (each layer's K/V read in place, 67 MB a layer at llama3_1b's batch 16 and ctx 2k, past
the L2 a single repeated layer would sit in), the plain kernel at the larger batches and the fused
RoPE + write + attention kernel at the small ones, under named tilings (`TILES`).
"""
from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.bench import serve as bs
from meshlab.bench.decode import emit
from meshlab.bench.timing import median_time
from models import serving
from pallas_kernels import paged_tiles as pt
from pallas_kernels.paged_attention import (paged_attention, paged_attention_reference, paged_decode_attention,
                                            rope_cos_sin)
from pallas_kernels.rope import rope_frequencies

SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_B = pt.BlockSizes
BATCH1 = pt.decode_block_sizes(1)   # the shipped batch-1 tiles (read once: the A/Bs swap the function)
# Named tilings of the sweep: the kernel's defaults, the batch-1 tiles, and unpipelined variants
# (st1): V beside K, warps, pages a block, programs wanted.
TILES = {"default": _B(), "batch1": BATCH1, "st1": _B(num_stages=1),
         "st1_vfirst": _B(num_stages=1, v_first=True), "st1_w8": _B(num_stages=1, num_warps=8),
         "st1_w2": _B(num_stages=1, num_warps=2), "st1_ppb4": _B(num_stages=1, pages_per_block=4),
         "st1_ppb16": _B(num_stages=1, pages_per_block=16), "st1_p132": _B(num_stages=1, min_programs=132),
         "st1_p528": _B(num_stages=1, min_programs=528), "st1_p1056": _B(num_stages=1, min_programs=1056)}


def _stacked_cache(layers, batch, ctx, kvh, d, page_size=16):
    """Random bf16 K/V [layers, pages, page_size, kvh, d] with each row's pages scattered, its table."""
    pages = ctx // page_size
    shape = (layers, batch * pages + 8, page_size, kvh, d)
    k = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(batch * pages).reshape(batch, pages), jnp.int32)
    return k, v, table, jnp.full((batch,), ctx - 3, jnp.int32)


def _plain(tiles, batch, ctx, cfg, layers):
    """(seconds per layer, max error of layer 1 against the fp32 reference) for the plain kernel."""
    k, v, table, lengths = _stacked_cache(layers, batch, ctx, cfg.n_kv_heads, cfg.head_dim)
    q = jax.random.normal(jax.random.key(2), (batch, cfg.n_heads, cfg.head_dim), jnp.bfloat16)
    interpret = jax.default_backend() != "gpu"
    f = jax.jit(lambda q, k, v, t, n: jnp.stack([paged_attention(q, k, v, t, n, jnp.int32(i), block_sizes=tiles,
                                                                 interpret=interpret) for i in range(layers)]))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = paged_attention_reference(f32(q), f32(k[1]), f32(v[1]), table, lengths)
    err = float(jnp.max(jnp.abs(f32(f(q, k, v, table, lengths)[1]) - want)))
    return median_time(lambda: f(q, k, v, table, lengths), warmup=1, reps=10) / layers, err


def _fused(tiles, batch, ctx, cfg, layers):
    """(seconds per layer, layer 1's output) for the fused kernel, its cache donated and carried."""
    k, v, table, lengths = _stacked_cache(layers, batch, ctx, cfg.n_kv_heads, cfg.head_dim)
    h, d = cfg.n_heads, cfg.head_dim
    qkv = jax.random.normal(jax.random.key(3), (batch, h + 2 * cfg.n_kv_heads, d), jnp.bfloat16)
    cs = rope_cos_sin(lengths - 1, rope_frequencies(d, 10000.0))
    interpret = jax.default_backend() != "gpu"

    def run(qkv, cs, k, v, t, n):
        outs = []
        for i in range(layers):
            o, k, v = paged_decode_attention(qkv, cs, k, v, t, n, jnp.int32(i), n_heads=h, block_sizes=tiles,
                                             interpret=interpret)
            outs.append(o)
        return jnp.stack(outs), k, v
    f, state = jax.jit(run, donate_argnums=(2, 3)), {"k": k, "v": v}

    def call():
        o, state["k"], state["v"] = f(qkv, cs, state["k"], state["v"], table, lengths)
        return o
    first = call()[1]
    return median_time(call, warmup=1, reps=10) / layers, first


def attention_tile_sweep(cfg, bw, plain=(16, 32, 64, 128), fused=(1, 4, 16), ctx=2048, layers=16, tiles=None):
    """Rows of us per layer for each tiling in `tiles` (default TILES) at each batch: the plain kernel
    checked against the fp32 reference, the fused one against the first tiling's output."""
    tiles = tiles or TILES
    kv_bytes = lambda b: 2 * b * ctx * cfg.n_kv_heads * cfg.head_dim * 2  # noqa: E731
    for kind, batches in (("plain", plain), ("fused", fused)):
        for b in batches:
            first = None
            for name, t in tiles.items():
                setting = f"{kind} attention [{name}] x{layers}L b={b} ctx={ctx}"
                try:
                    if kind == "plain":
                        sec, err = _plain(t, b, ctx, cfg, layers)
                    else:
                        sec, out = _fused(t, b, ctx, cfg, layers)
                        first = out if first is None else first
                        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - first.astype(jnp.float32))))
                    emit({"section": "kernel", "setting": setting, "value": sec * 1e6, "unit": "us", "batch": b,
                          "note": f"per layer, {layers} layers in one jit; {kv_bytes(b) / sec / bw:.0%} of copy bw; "
                                  f"max error {err:.1e}" + (" (vs the first tiling)" if kind == "fused" else "")})
                except Exception as e:  # noqa: BLE001 - a tiling that fails to build is a row
                    emit({"section": "kernel", "setting": setting, "value": float("nan"), "unit": "us",
                          "note": f"FAILED {type(e).__name__}: {str(e)[:200]}"})


def job_attn_tiles(c):
    """attention_tile_sweep at llama3_1b's heads (the tiny model's, two tilings, on the CPU smoke)."""
    if c.smoke:
        attention_tile_sweep(c.cfg, c.bw, plain=(2,), fused=(2,), ctx=64, layers=2,
                             tiles={k: TILES[k] for k in ("default", "st1_p528")})
    else:
        attention_tile_sweep(c.cfg, c.bw, ctx=c.sz["ctx"])


def before_batch_tiles(batch: int = 1, fused: bool = True):
    """The decode attention's tiles before they depended on the batch: the batch-1 tiles for the fused
    kernel at every batch, the kernel's defaults (pipelined, num_stages 2) for the plain one."""
    return BATCH1 if fused else _B()


def alternated(c, owner, attr: str, variants: dict, run, max_seqs: int = 1, max_len: int | None = None) -> None:
    """One engine of max_seqs rows (max_len: default the sweep's ctx + 128) per variant (row tag -> the
    value `owner.attr` takes), alternated twice, `run(engine, tag)` under each engine's own value. The
    value is read when a program traces, so each engine runs under its own, compiles included."""
    engines = {tag: c.engine(max_len=max_len or c.sz["ctx"] + 128, max_seqs=max_seqs) for tag in variants}
    for _ in range(2):
        for tag, eng in engines.items():
            with mock.patch.object(owner, attr, variants[tag]):
                run(eng, tag)


def _sweep(c, batches):
    """run for alternated: the batch sweep's TPOT rows at `batches`, ctx ~2k."""
    return lambda eng, tag: bs.engine_sweep(eng, c.bw, batches, ctx=c.sz["ctx"], n=min(128, c.sz["n"] * 4), tag=tag)


def job_sweep_ab(c):
    """The sweep's batches 4 / 16 / 64 through engines whose decode attention takes the shipped tiles
    (paged_tiles.decode_block_sizes, by batch) or before_batch_tiles, alternated twice."""
    variants = {" [attention tiles by batch]": pt.decode_block_sizes, " [attention tiles before]": before_batch_tiles}
    alternated(c, pt, "decode_block_sizes", variants, _sweep(c, sorted({min(b, c.sz["big"]) for b in (4, 16, 64)})),
               c.sz["big"])


def job_sweep_engine(c):
    """The batch sweep 1..256 through one Engine of 256 rows (every decode bucket, the shipped layers
    and tiles): TPOT and tokens/s per batch at ctx ~2k."""
    big = SWEEP[-1] if not c.smoke else c.sz["big"]
    eng = c.engine(max_len=c.sz["ctx"] + 128, max_seqs=big)
    bs.engine_sweep(eng, c.bw, [b for b in SWEEP if b <= big], ctx=c.sz["ctx"], n=min(128, c.sz["n"] * 4))


def job_rows_ab(c):
    """Batch 1 / 2 / 4 through engines whose decode steps take decode_step's kernels up to the shipped
    rows (models.serving.KERNEL_ROWS) or up to the kernel's limit (decode_gemv.MAX_ROWS); past it
    nk_step's XLA GEMMs; the engine pads 2 rows to its bucket of 4. Alternated twice."""
    from pallas_kernels.decode_gemv import MAX_ROWS
    variants = {f" [kernel rows {rows}]": rows for rows in sorted({serving.KERNEL_ROWS, MAX_ROWS})}
    alternated(c, serving, "KERNEL_ROWS", variants, _sweep(c, [1, 2, 4]), 4)


def job_expert_rows_ab(c):
    """A mixture of experts' batch 1 / 2 / 4 through engines whose decode rows past one take the expert
    kernels up to the shipped rows (models.serving.EXPERT_KERNEL_ROWS) or none of them (the grouped
    GEMM); the engine pads 2 rows to its bucket of 4, whose padding rows route nowhere. Alternated twice."""
    variants = {f" [expert kernel rows {rows}]": rows for rows in sorted({serving.EXPERT_KERNEL_ROWS, 1})}
    alternated(c, serving, "EXPERT_KERNEL_ROWS", variants, _sweep(c, [1, 2, 4]), 4)


def job_gmm_tiles_ab(c):
    """A mixture of experts' batch 8 / 16 / 64 (32 / 32 / 128 routed rows in their decode buckets at
    top 2), then TTFT of 512- and 2,048-token prompts, through engines whose grouped GEMM
    takes the tiles by rows (shipped, grouped_matmul.nk_tiles: the few-row tile on Hopper) or the
    defaults (TritonTiles.default). Alternated twice."""
    from pallas_kernels import grouped_matmul as gm
    from pallas_kernels.grouped_matmul_triton import TritonTiles
    variants = {" [grouped GEMM tiles by rows]": gm.nk_tiles,
                " [grouped GEMM default tiles]": lambda rows, dtype: TritonTiles.default(dtype)}
    big = min(64, c.sz["big"])
    lengths = sorted({min(n, c.sz["ctx"]) for n in (512, 2048)})
    sweep = _sweep(c, sorted({min(b, big) for b in (8, 16, 64)}))

    def run(eng, tag):
        sweep(eng, tag)
        bs.ttft(eng, lengths, tag=tag)
    alternated(c, gm, "nk_tiles", variants, run, big)


def job_buckets_ab(c):
    """Batch 8 / 32 / 128 through an Engine of 256 rows with its decode buckets in powers of 4 (8 runs
    the 16-row program, 32 the 64-row one, 128 the 256-row one, padding rows attending to nothing)
    and one with the shipped buckets (Engine.DECODE), alternated twice."""
    big = SWEEP[-1] if not c.smoke else c.sz["big"]
    engines = {tag: c.engine(max_len=c.sz["ctx"] + 128, max_seqs=big) for tag in ("powers of 4", "shipped")}
    engines["powers of 4"].DECODE = sorted({min(4 ** i, big) for i in range(big.bit_length() + 1)})
    batches = sorted({min(b, big) for b in (8, 32, 128)})
    for _ in range(2):
        for tag, eng in engines.items():
            bs.engine_sweep(eng, c.bw, batches, ctx=c.sz["ctx"], n=min(128, c.sz["n"] * 4),
                            tag=f" [decode buckets: {tag} {eng.DECODE}]")


def _blocks_rounded_up(n_blocks: int, want: int) -> int:
    """paged_tiles.split_blocks before: page blocks per split rounded up (at most `want` splits)."""
    return -(-n_blocks // want)


def job_splits_ab(c):
    """Decode through engines whose attention splits take page blocks per split rounded down (shipped,
    paged_tiles.split_blocks: at least the splits wanted) or up (before), alternated twice, where the
    two differ: batch 1 in a 2,304-token engine at ctx 2k (144 pages: 36 one-block splits against 18 of
    two) and in a 4,096-token one at ctx 2k and ~4k, batch 16 / 32 in a 2,176-token one of 32 rows. The
    split count is read when a program traces: each engine runs under its own, compiles included."""
    ctx, n = c.sz["ctx"], min(128, c.sz["n"] * 4)
    cases = [(ctx + 256, 1, [(1, ctx)]), (2 * ctx, 1, [(1, ctx), (1, 2 * ctx - n)]),
             (ctx + 128, min(32, c.sz["big"]), [(16, ctx), (32, ctx)])]
    variants = {"rounded down": pt.split_blocks, "rounded up": _blocks_rounded_up}
    engines = {(max_len, tag): c.engine(max_len=max_len, max_seqs=rows)
               for max_len, rows, _ in cases for tag in variants}
    for _ in range(2):
        for max_len, rows, runs in cases:
            for tag, fn in variants.items():
                with mock.patch.object(pt, "split_blocks", fn):
                    for b, at in runs:
                        bs.engine_sweep(engines[max_len, tag], c.bw, [min(b, rows)], ctx=at, n=n,
                                        tag=f" max_len={max_len} [splits {tag}]")
