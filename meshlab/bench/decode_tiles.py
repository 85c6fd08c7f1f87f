"""The decode tile variants bench_decode.py's jobs sweep: decode_gemv tiles for the matmul job, the
fused attention's tiles through the engine, and the "[tuned][ a:<tile>]" variants that swap them in
(meshlab/bench/decode_jobs.py). Imports of JAX and the kernels stay inside the functions.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

ENGINE_MAX_LEN = 8192 + 256          # the engines' context on the GPU (TTFT up to 8k)
ENGINE_MAX_PAGES = ENGINE_MAX_LEN // 16


def gemv_tuned_tiles():
    """decode_gemv tiles (n, k, swiglu) -> BlockSizes: each op's fastest in the matmul job when it ran
    earlier in the call (MESHLAB_BENCH_GEMV_TUNED), else None."""
    from pallas_kernels.decode_gemv import BlockSizes as B
    tuned = json.loads(os.environ.get("MESHLAB_BENCH_GEMV_TUNED", "{}"))   # {"n,k,swiglu": config label}
    if not tuned:
        return None
    configs = {label: c[0] if isinstance(c, tuple) else c for label, c in matmul_configs(wide=True).items()}
    return lambda n, k, sw: configs.get(tuned.get(f"{n},{k},{int(sw)}"), B())


def matmul_configs(quick=False, wide=False, rows=1):
    """decode_gemv tiles for the matmul job (kernel alone against XLA): label -> BlockSizes, or
    (BlockSizes, the op names it is timed on). Labels: n<block_n> w<warps, 4 if absent>
    t<tiles_per_program> p<prefetch> k<block_k, 2048 if absent> s<num_stages, 2 if absent>, r rolled.
    wide (d_model >= 4096, e.g. llama3_8b): also tiles that load k = 4096 in one chunk, and deeper
    pipelines for down's k = 14336 (seven chunks of 2048, the largest power of two dividing it).
    rows > 1: also tiles that stream k in short pipelined chunks (_rows_configs)."""
    from pallas_kernels.decode_gemv import BlockSizes as B
    if quick:
        return {"n4": B(block_n=4)}
    return {**_narrow_configs(B), **(_wide_configs(B) if wide else {}), **(_rows_configs(B) if rows > 1 else {})}


def _rows_configs(B):
    """Tiles for 2-4 rows: each row's product of a whole [block_n, 2048] tile is a register tile of its
    own, which the one-row tiles fill (the kernels lost to XLA's GEMMs at 2-4 rows through the engine:
    models.serving.KERNEL_ROWS); k in chunks of 256-1024 pipelined over 2-4 stages keeps them small."""
    return {"n4k512s3": B(block_k=512, num_stages=3), "n4k1024s2": B(block_k=1024),
            "n8k512s3w8": B(block_n=8, block_k=512, num_stages=3, num_warps=8), "n2k512s3": B(block_n=2, block_k=512, num_stages=3),
            "n4k256s4": B(block_k=256, num_stages=4), "n2k1024s3w2": B(block_n=2, block_k=1024, num_stages=3, num_warps=2),
            "n1k512s3w1": B(block_n=1, block_k=512, num_stages=3, num_warps=1)}


QKV, WO, GATE_UP, DOWN = "qkv+norm", "wo+residual", "gate_up+norm+swiglu", "down+residual"


def _wide_configs(B):
    qkv, wo, gate_up, down = QKV, WO, GATE_UP, DOWN
    return {"n4k4096": (B(block_k=4096), {qkv}), "n2k4096": (B(block_n=2, block_k=4096), {qkv, wo}),
            "n4k4096w8": (B(block_k=4096, num_warps=8), {qkv}),
            "n4k4096t4r": (B(block_k=4096, tiles_per_program=4, prefetch=1, rolled=True), {qkv}),
            "n1w1k4096": (B(block_n=1, num_warps=1, block_k=4096), {wo}),
            "n1w2k4096": (B(block_n=1, num_warps=2, block_k=4096), {wo}),
            "n2w2k4096": (B(block_n=2, num_warps=2, block_k=4096), {wo}),
            "n2t4p1k4096": (B(block_n=2, tiles_per_program=4, prefetch=1, block_k=4096), {gate_up}),
            "n1w2t4p1k4096": (B(block_n=1, num_warps=2, tiles_per_program=4, prefetch=1, block_k=4096), {gate_up}),
            "n1w2t8rk4096": (B(block_n=1, num_warps=2, tiles_per_program=8, prefetch=1, rolled=True, block_k=4096),
                             {gate_up}),
            "n2t4rk4096": (B(block_n=2, tiles_per_program=4, prefetch=1, rolled=True, block_k=4096), {gate_up}),
            "n2p2": (B(block_n=2, prefetch=2), {down}), "n2s3": (B(block_n=2, num_stages=3), {down}),
            "n4s3": (B(num_stages=3), {down}), "n1w2s4": (B(block_n=1, num_warps=2, num_stages=4), {down}),
            "n4w8p2": (B(num_warps=8, prefetch=2), {down})}


def _narrow_configs(B):
    qkv, wo, gate_up, down = QKV, WO, GATE_UP, DOWN
    return {"n4": B(), "n1w1": B(block_n=1, num_warps=1), "n2w2t4p1": B(block_n=2, num_warps=2, tiles_per_program=4,
                                                                       prefetch=1),
            "n2k8192p1": B(block_n=2, block_k=8192, prefetch=1),
            "n4w2": (B(num_warps=2), {qkv, wo}), "n4w8": (B(num_warps=8), {qkv}), "n8w8": (B(block_n=8, num_warps=8), {qkv}),
            "n2": (B(block_n=2), {qkv, wo}), "n1w2": (B(block_n=1, num_warps=2), {wo, down}),
            "n2w1": (B(block_n=2, num_warps=1), {wo}),
            "n2w2t2p1": (B(block_n=2, num_warps=2, tiles_per_program=2, prefetch=1), {gate_up}),
            "n2w2t8p1": (B(block_n=2, num_warps=2, tiles_per_program=8, prefetch=1), {gate_up}),
            "n1w1t4p1": (B(block_n=1, num_warps=1, tiles_per_program=4, prefetch=1), {gate_up}),
            "n2t4p1": (B(block_n=2, tiles_per_program=4, prefetch=1), {gate_up}),
            "n2w2t4p2": (B(block_n=2, num_warps=2, tiles_per_program=4, prefetch=2), {gate_up}),
            "n2k8192w8p1": (B(block_n=2, block_k=8192, num_warps=8, prefetch=1), {down}),
            "n1k8192w2": (B(block_n=1, block_k=8192, num_warps=2), {down}),
            "n4k8192w8p1": (B(block_n=4, block_k=8192, num_warps=8, prefetch=1), {down}),
            "n2k4096p1": (B(block_n=2, block_k=4096, prefetch=1), {down}),
            # rolled: the tiles in a loop carrying the next tile's weights
            "n4t4r": (B(tiles_per_program=4, prefetch=1, rolled=True), {qkv}),
            "n1w1t8r": (B(block_n=1, num_warps=1, tiles_per_program=8, prefetch=1, rolled=True), {wo, gate_up}),
            "n2w2t4r": (B(block_n=2, num_warps=2, tiles_per_program=4, prefetch=1, rolled=True), {gate_up}),
            "n2w2t16r": (B(block_n=2, num_warps=2, tiles_per_program=16, prefetch=1, rolled=True), {gate_up}),
            "n2k8192t4r": (B(block_n=2, block_k=8192, tiles_per_program=4, prefetch=1, rolled=True), {down}),
            "n1k8192w2t8r": (B(block_n=1, block_k=8192, num_warps=2, tiles_per_program=8, prefetch=1, rolled=True),
                             {down})}


def attention_tiles():
    """The fused decode attention's tiles tried through the engine: the names in MESHLAB_BENCH_ATTN
    (comma-separated, meshlab/bench/layer_chain.py attention_variants at the engine's table width),
    by default the kernel's default tiles and the runner-up of the H200 chain sweep."""
    from meshlab.bench.layer_chain import attention_variants
    variants = attention_variants(ENGINE_MAX_PAGES)
    names = [n for n in os.environ.get("MESHLAB_BENCH_ATTN", "default,st1_ppb4").split(",") if n]
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise SystemExit(f"MESHLAB_BENCH_ATTN: unknown attention tiles {unknown}; known: {', '.join(variants)}")
    return {n: variants[n] for n in names}


def tile_variant(name: str, shipped_attn=None):
    """"[tuned][ a:<attention tile>]" -> (decode_gemv default_block_sizes, paged_tiles decode_block_sizes);
    without "tuned" the shipped per-shape GEMV tiles, without "a:" the shipped attention tiles
    (shipped_attn: paged_tiles.decode_block_sizes as the module defines it, for a caller that has
    swapped it since). An "a:" tile replaces the fused kernel's at batch 1 only (the batch-1 chain
    these variants are about); other batches keep the shipped tiles."""
    from pallas_kernels.decode_gemv import shape_block_sizes
    from pallas_kernels import paged_tiles
    tile, _, attn = name.partition("a:")
    shipped = shipped_attn or paged_tiles.decode_block_sizes
    gemv = gemv_tuned_tiles() if tile.strip() == "tuned" else shape_block_sizes
    if not attn:
        return gemv, shipped
    one = attention_tiles()[attn]
    return gemv, lambda batch=1, fused=True: one if fused and batch == 1 else shipped(batch, fused)


def sweep_configs():
    """The paged kernel's named configs plus grid-size and warp variants of the default (GPU only)."""
    from pallas_kernels.paged_tiles import CONFIGS
    variant = functools.partial(dataclasses.replace, CONFIGS["dot8"])
    return {**CONFIGS, "dot8_p132": variant(min_programs=132), "dot8_p528": variant(min_programs=528),
            "dot8_w2": variant(num_warps=2), "dot8_s1": variant(num_stages=1)}
