"""Prompt-chunk attention over the paged cache at long contexts (bench_decode.py's jobs prompt_tiles,
prompt_tiles_ab and ttft_profile; each takes the child's context, decode_jobs.Child).

An uncached prompt is fed in steps of `rows` chunk rows of `chunk` tokens (the engine's 4 x 512), each
row attending to every earlier position of its sequence through the paged prompt kernel
(pallas_kernels/paged_prefill.py). `prompt_tile_sweep` times that kernel alone on the step that ends
at each context (16 layers of one stacked cache in one jit, so no layer's K/V sits in L2 from the
last), under named tilings, against the flash kernel over each row's gathered window (the path for
shapes the paged kernel refuses). FLOPs are causal: a query at position p costs 4 * (p + 1) * d per
head. `job_prompt_tiles_ab` then times TTFT through engines whose prompt rows take each tiling, and
`job_ttft_profile` says where an uncached prompt's device time goes, by kernel class.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.bench import serve as bs
from meshlab.bench.batched_decode import alternated
from meshlab.bench.decode import emit
from meshlab.bench.timing import median_time
from pallas_kernels import paged_tiles as pt
from pallas_kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference

_B = pt.BlockSizes
# Named tilings of the prompt kernel: the shipped one (prefill_block_sizes), the kernel's defaults
# (q16: 16-token query blocks, the causal mask on every block), then wider query blocks (fewer reads
# of each page per chunk) with fewer pages a block or more warps to hold the larger score tiles, and
# the causal mask kept to the blocks that need it (mask_tail).
PROMPT_TILES = {
    "shipped": None,
    "q16": _B(),
    "q16_st1": _B(num_stages=1),
    "q16_w8": _B(num_warps=8),
    "q32": _B(block_q=32),
    "q32_w8": _B(block_q=32, num_warps=8),
    "q32_ppb4": _B(block_q=32, pages_per_block=4),
    "q64_ppb4_w8": _B(block_q=64, pages_per_block=4, num_warps=8),
    "q64_w8": _B(block_q=64, num_warps=8),
    "q64_w8_st1": _B(block_q=64, num_warps=8, num_stages=1),
    "q128_ppb4_w8": _B(block_q=128, pages_per_block=4, num_warps=8),
    "q16_mask_tail": _B(mask_tail=True),
    "q32_mask_tail": _B(block_q=32, mask_tail=True),
    "q64_ppb4_w8_mask_tail": _B(block_q=64, pages_per_block=4, num_warps=8, mask_tail=True),
    "q32_st3_mask_tail": _B(block_q=32, num_stages=3, mask_tail=True),
    "q64_w8_mask_tail": _B(block_q=64, num_warps=8, mask_tail=True),
}


def tiles_named(name: str, chunk: int) -> pt.BlockSizes:
    return pt.prefill_block_sizes(chunk) if PROMPT_TILES[name] is None else PROMPT_TILES[name]


def _cache(cfg, width: int, rows: int, chunk: int, layers: int, page_size: int = 16):
    """A stacked cache of `layers` layers whose one sequence holds `width` positions in scattered pages,
    its table (the same for the step's rows, as the engine's rows of one prompt) and the rows' queries;
    (q, k, v, table). A step ending at ctx <= width reads only the pages below it."""
    pages = width // page_size
    shape = (layers, pages + 8, page_size, cfg.n_kv_heads, cfg.head_dim)
    k = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    table = jnp.asarray(np.broadcast_to(np.random.default_rng(0).permutation(pages), (rows, pages)), jnp.int32)
    q = jax.random.normal(jax.random.key(2), (rows, chunk, cfg.n_heads, cfg.head_dim), jnp.bfloat16)
    return q, k, v, table


def causal_flops(cfg, starts, chunk: int) -> float:
    """4 * (p + 1) * d per query head at each query position p of the rows."""
    p = np.asarray(starts)[:, None] + np.arange(chunk)[None, :]
    return float(4 * np.sum(p + 1) * cfg.head_dim * cfg.n_heads)


def prompt_tile_sweep(cfg, contexts=(2048, 4096, 8192), rows: int = 4, chunk: int = 512, layers: int = 16,
                      names=None, width: int | None = None) -> None:
    """Rows of us per layer and TFLOP/s for each named tiling (PROMPT_TILES) on the step that ends at
    each context (its rows at [ctx - rows * chunk, ctx)), with layer 1's max error against the fp32
    reference; the windowed flash kernel as the peer. The table is `width` positions wide (default
    the engines' 8k + 256) at every context, as an engine's is, so each tiling compiles once; the
    flash peer gathers that whole width, as the engine's flash path would."""
    from meshlab.bench.decode_tiles import ENGINE_MAX_LEN
    from meshlab.infer.kv_cache import windowed_flash_attention
    interpret = jax.default_backend() != "gpu"
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    q, k, v, table = _cache(cfg, width or ENGINE_MAX_LEN, rows, chunk, layers)
    steps = {}
    for ctx in contexts:
        starts = jnp.asarray([ctx - (rows - i) * chunk for i in range(rows)], jnp.int32)
        want = paged_prefill_reference(f32(q), f32(k[1]), f32(v[1]), table, starts, starts + chunk)
        steps[ctx] = (starts, want, causal_flops(cfg, starts, chunk))
    runs = {name: lambda q, k, v, t, s, e, tiles=tiles_named(name, chunk): jnp.stack([
        paged_prefill_attention(q, k, v, t, s, e, jnp.int32(i), block_sizes=tiles, interpret=interpret)
        for i in range(layers)]) for name in (names or PROMPT_TILES)}
    runs["flash window"] = lambda q, k, v, t, s, e: jnp.stack([
        windowed_flash_attention(q, {"k": k, "v": v}, i, t, s, interpret) for i in range(layers)])
    for name, run in runs.items():
        f = jax.jit(run)
        for ctx, (starts, want, flops) in steps.items():
            setting = f"prompt attention [{name}] x{layers}L {rows}x{chunk} ending at ctx={ctx}"
            try:
                args = (q, k, v, table, starts, starts + chunk)
                err = float(jnp.max(jnp.abs(f32(f(*args)[1]) - want)))
                sec = median_time(lambda: f(*args), warmup=1, reps=10) / layers
                emit({"section": "kernel", "setting": setting, "value": sec * 1e6, "unit": "us",
                      "note": f"per layer, {layers} layers in one jit; {flops / sec / 1e12:.0f} TFLOP/s causal; "
                              f"max error {err:.1e} against fp32"})
            except Exception as e:  # noqa: BLE001 - a tiling that fails to build is a row
                emit({"section": "kernel", "setting": setting, "value": float("nan"), "unit": "us",
                      "note": f"FAILED {type(e).__name__}: {str(e)[:200]}"})


def job_prompt_tiles(c):
    """prompt_tile_sweep at the preset's heads (the tiny model's, three tilings, on the CPU smoke);
    MESHLAB_BENCH_PROMPT_TILES=a,b names the tilings (default: all)."""
    import os
    names = [n for n in os.environ.get("MESHLAB_BENCH_PROMPT_TILES", "").split(",") if n] or None
    if c.smoke:
        prompt_tile_sweep(c.cfg, contexts=(64, 96), rows=2, chunk=32, layers=2, names=["shipped", "q32", "q64_w8"],
                          width=128)
    else:
        prompt_tile_sweep(c.cfg, names=names)


def job_prompt_tiles_ab(c):
    """TTFT of 2k / 4k / 8k prompts (median of 3 fresh prompts each) through engines whose prompt rows
    take the shipped tiles or each named one (MESHLAB_BENCH_PROMPT_AB, default q16),
    alternated twice; the tiles are read when a program traces: each engine runs under its own."""
    import os
    names = ["shipped"] + [n for n in os.environ.get("MESHLAB_BENCH_PROMPT_AB", "q16").split(",") if n]
    lengths = [64] if c.smoke else [2048, 4096, 8192]
    variants = {f" [prompt tiles {n}]": pt.prefill_block_sizes if PROMPT_TILES[n] is None
                else (lambda chunk=16, tiles=PROMPT_TILES[n]: tiles) for n in names}
    alternated(c, pt, "prefill_block_sizes", variants, lambda eng, tag: bs.ttft(eng, lengths, tag=tag, reps=3),
               max_len=max(lengths) + 256)


def ttft_profile(engine, trace_dir, n: int) -> dict:
    """TTFT of fresh n-token prompts (median of 3), then the device time by kernel class and by kernel
    of one more, traced (profiling runs the ops one by one: busy time, not wall time)."""
    from meshlab.bench.decode import _kernel_table
    from meshlab.infer.sampler import SamplingParams
    t = bs.ttft(engine, [n], reps=3)[0]["value"]
    prompt = np.random.default_rng(n).integers(0, engine.md.cfg.vocab_size, n).tolist()

    def traced():
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            engine.generate([prompt], SamplingParams(max_tokens=1))
        return 1
    row = {"section": "profile", "setting": f"engine prompt={n} uncached: device time by kernel", "unit": "ms",
           "value": t}
    s = _kernel_table(row, trace_dir, traced)
    top = ", ".join(f"{c} {ms:.2f}" for c, ms in row.get("classes", [])[:6])
    row["note"] = (f"TTFT {t:.1f} ms (median of 3); device busy {s['busy_ms_per_step']:.2f} ms: {top}" if s
                   else f"TTFT {t:.1f} ms; no profile: {row.get('error', '')}")
    return row


def job_ttft_profile(c):
    """ttft_profile at 2k and 8k (the CPU smoke: 64 tokens, no kernels to profile) through the
    engine every job builds, its max_len 8k + 256."""
    from meshlab.bench.decode_jobs import TRACES
    lengths = [64] if c.smoke else [2048, 8192]
    eng = c.engine(max_len=max(lengths) + 256)
    for n in lengths:
        emit(ttft_profile(eng, TRACES / f"ttft_{n}", n))
