"""Decode benchmark (llama3_1b shape, bf16, random weights), sized for one GPU call.

    PYTHONPATH=$PWD python3 scripts/bench_decode.py [--budget-s 440] [--jobs base,pallas] [--quick] [--cpu-smoke]

The parent never touches the GPU. It runs each job below as a child process of this script
(`--job NAME`) because XLA reads XLA_FLAGS once per process; each child prints `ROW {json}` lines
as it measures, so one killed at its time limit still hands back its rows. Jobs run most
important first; each is promised `reserve` seconds and gets the slack earlier jobs left, so
the whole call ends inside --budget-s. Children share a compilation and autotune cache.

  copy_torch    the copy bandwidth measured by torch (CUDA events; no JAX in that process)
  base          the copy bandwidth in JAX (1 GiB, 4 GiB, donated); batch-1 decode at ctx 2048
                with the layers split (per-layer buffers) / fused (split + concatenated q|k|v and
                gate|up weights), each with the HLO traffic and a kernel profile; fused over a
                contiguous cache (no page gather); batch 64 fused
  sweep         fused, paged XLA attention, batch 1..256 at ctx 2048 (TPOT vs batch 1)
  sweep_pallas  the same with the paged Pallas decode kernel (XLA's RoPE and cache scatter around it)
  sweep_fused   the same with RoPE and the cache write inside the kernel
  scan          the old stacked-weight paths (scan, unroll) at batch 1, for the record
  cmdbuf_while  XLA command buffers (CUDA graphs) that also capture while loops
  dsfusion      XLA dynamic-slice fusion (a GEMM reads a stacked weight's slice in place)
  no_cmdbuf     command buffers off: what CUDA graphs buy at batch 1
  pallas        fp32 correctness gate (contiguous, paged xla, paged Pallas) on the GPU, then
                decode with the paged Pallas kernel, and the kernel against its peers
  fusedk        the paged kernel with RoPE + cache write folded in (layers=fused) against the same
                kernel behind XLA's RoPE and scatter (impl pallas_unfused), batch 1 (profiled) and 64
  kernels       fp32 gate with layers=kernels (every decode matmul a Pallas kernel with its norm /
                residual / SwiGLU), then kernels vs fused at batch 1 (both profiled), 4 and 16
  matmul        the four decode matmuls (decode_gemv) in a BlockSizes sweep against XLA, batch 1 and 4
                (--quick: 1); a later engine_gemv job runs each op's fastest tile
  profile1      batch-1 fused pallas decode only, profiled, with its HLO (the quick look after a change)
  cublas        batch-1 fused pallas decode with XLA's Triton GEMMs off (cuBLAS for every dot)
  engine        the fp32 gate (cached greedy == uncached argmax) for the engine's programs, then
                batch-1 decode at ctx 2048 through Engine against the roofline, TTFT (call to first
                token, median of 5) of a 2k prompt with 2,032 tokens cached and of one met before
                (all cached) against uncached, then profiles: the batch-1 token (device us per
                token by kernel, wall and host time per token, decode calls chained or not) and
                the cached prompt's first token (with its program's dispatch, buffer on host or
                device; tables printed and written to bench_decode.md);
                TTFT for 512..8k prompts (--quick: 512, 2048), batch 1, 16, 64 through one
                Engine, then the first engine through HTTP (decode vs roofline, TTFT)
  first_token   the prefix-cache TTFT alone (~1 min): a 2k prompt with 2,032 tokens cached, and one
                met before, against uncached (median of 5), then the first token's profile
                (meshlab/bench/first_token.py: the call's timeline before dispatch / dispatch /
                device wait / read-back; the packed program's dispatch and call as jit, AOT, AOT
                without command buffers, input via pinned host memory; device_put alone; dispatch
                with ~100 argument leaves against 1; device time per kernel)
                and of a prompt met before (all cached: its last token in a one-step decode call), and
                the first token's host time (first_token.host_rows)
  first_token_host  the first token's host time alone, 2k prompts on any model (--cpu-smoke: the tiny
                one, a 2k prompt still: what the host does per request does not depend on the model)
  engine_ab, engine_pdl, engine_lock, engine_concurrent, engine_va, engine_pdl_lock, engine_ab2
                the engine's batch-1 decode and prefix-cache TTFT rows (engine_ab_job) under XLA runtime
                flags, one process each: programmatic dependent launch (a kernel's launch overlaps
                the tail of the one before), the exclusive-lock executable (less per-call resource
                bookkeeping), command buffers scheduled as a DAG, command buffers that remap buffer
                addresses instead of updating the graph; as shipped first and last (the noise)
  sweep_ab      batch 64 through engines with and without kept hidden states (Engine reuse_hidden),
                alternated twice in one process
  engine_gemv   fp32 gate with layers=kernels (pallas_kernels/decode_gemv.py), then the same rows
                through engines with layers=fused and =kernels (the shipped tiles), then kernels with
                each op's fastest tile in the matmul job ("tuned", when that job ran earlier in the
                call) and with the attention tiles of _attn_tiles(), and a profile of the fastest
                kernels variant's batch-1 token (MESHLAB_BENCH_GEMV_SHORT=1: fused, kernels and
                "tuned", no profile)
  first_token_ab  (MESHLAB_BENCH_PACKED_XLA=triton_any,no_triton,cublaslt: as shipped, then engines whose packed
                programs compile with those XLA options (first_token.PACKED_OPTIONS), each with its
                TTFT rows and its short tail's profile; else:)
                the same TTFT rows through an Engine as shipped, then one that feeds a prompt met before its
                last token again instead of sampling from its kept hidden state (tagged [last token fed
                again]), then one whose first-token decode calls are compiled
                without command buffers (tagged [first-token decode call no cmdbuf]), then one whose packed
                programs are (tagged [packed no cmdbuf]), then through one whose packed input
                goes through pinned host memory (tagged [pinned input]), then through one that feeds a
                prompt's one token left in a 16-wide packed row instead of a one-step decode call (tagged
                [one token left: packed row]); ~1.5 min more
  prefill_ab    the prefix-cache TTFT rows through engines whose prompt rows take other paged_prefill tiles
                (MESHLAB_BENCH_PREFILL: names of layer_chain.attention_variants, default the shipped; xla_merge:
                the splits merged by XLA), alternated twice (first_token.prefill_tiles_ab)

The roofline's bandwidth is the highest copy rate any copy job measured in the call.
Writes bench_decode.json / bench_decode.md, child logs and the decode HLO (gzip) to $OUT (or
/tmp/bench_decode); on a GPU also appends dated rows to docs/archive/benchmarks-diary.md and writes that block
to $OUT/benchmarks_append.md (the device machine's checkout does not come back).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: (XLA_FLAGS, reserve seconds, tag added to settings)
JOBS = {
    "copy_torch": ("", 30, ""),
    "base": ("", 120, ""),
    "sweep": ("", 90, ""),
    "sweep_pallas": ("", 90, ""),
    "sweep_fused": ("", 90, ""),
    "scan": ("", 40, ""),
    "cmdbuf_while": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", 45, " [cmdbuf+while]"),
    "dsfusion": ("--xla_gpu_enable_dynamic_slice_fusion=true", 40, " [ds-fusion]"),
    "no_cmdbuf": ("--xla_gpu_enable_command_buffer=", 30, " [no cmdbuf]"),
    "pallas": ("", 95, ""),
    "fusedk": ("", 90, ""),
    "cublas": ("--xla_gpu_enable_triton_gemm=false", 40, " [cublas]"),
    "profile1": ("", 60, ""),
    "kernels": ("", 120, ""),
    "matmul": ("", 120, ""),
    "engine": ("", 150, ""),
    "sweep_ab": ("", 150, ""),
    "first_token": ("", 110, ""),
    "first_token_ab": ("", 130, ""),
    "first_token_host": ("", 40, ""),
    "prefill_ab": ("", 150, ""),
    # the same engine rows under XLA runtime flags (ENGINE_AB), each in its own process
    "engine_ab": ("", 75, " [ab: as shipped]"),
    "engine_pdl": ("--xla_gpu_enable_pdl=true", 75, " [pdl]"),
    "engine_lock": ("--xla_gpu_require_exclusive_lock=true", 75, " [exclusive lock]"),
    "engine_concurrent": ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", 75, " [cmdbuf concurrent]"),
    "engine_va": ("--xla_gpu_enable_command_buffer_va_remapping=true", 75, " [va remapping]"),
    "engine_pdl_lock": ("--xla_gpu_enable_pdl=true --xla_gpu_require_exclusive_lock=true", 75, " [pdl + lock]"),
    "engine_ab2": ("", 75, " [ab: as shipped, again]"),
    "engine_gemv": ("", 300, ""),
}
ENGINE_AB = [name for name in JOBS if name.startswith("engine_") and name != "engine_gemv"]
# decode_gemv tiles tried through the engine (layers="kernels"): name -> (n, k, swiglu) -> BlockSizes
def _gemv_tuned_tiles():
    """decode_gemv tiles (n, k, swiglu) -> BlockSizes: each op's fastest in the matmul job when it ran
    earlier in the call (MESHLAB_BENCH_GEMV_TUNED), else None."""
    from pallas_kernels.decode_gemv import BlockSizes as B
    tuned = json.loads(os.environ.get("MESHLAB_BENCH_GEMV_TUNED", "{}"))   # {"n,k,swiglu": config label}
    if not tuned:
        return None
    configs = {label: c[0] if isinstance(c, tuple) else c for label, c in _matmul_configs().items()}
    return lambda n, k, sw: configs.get(tuned.get(f"{n},{k},{int(sw)}"), B())


SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENGINE_MAX_LEN = 8192 + 256          # the engines' context on the GPU (TTFT up to 8k)
ENGINE_MAX_PAGES = ENGINE_MAX_LEN // 16


def _matmul_configs(quick=False):
    """decode_gemv tiles for the matmul job (kernel alone against XLA): label -> BlockSizes, or
    (BlockSizes, the op names it is timed on). Labels: n<block_n> w<warps, 4 if absent>
    t<tiles_per_program> p<prefetch> k<block_k, 2048 if absent>."""
    from pallas_kernels.decode_gemv import BlockSizes as B
    if quick:
        return {"n4": B(block_n=4)}
    qkv, wo, gate_up, down = "qkv+norm", "wo+residual", "gate_up+norm+swiglu", "down+residual"
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


def _attn_tiles():
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


def _variant(name: str, shipped_attn=None):
    """"[tuned][ a:<attention tile>]" -> (decode_gemv default_block_sizes, paged_tiles decode_block_sizes);
    without "tuned" the shipped per-shape GEMV tiles, without "a:" the shipped attention tiles
    (shipped_attn: paged_tiles.decode_block_sizes as the module defines it, for a caller that has
    swapped it since)."""
    from pallas_kernels.decode_gemv import shape_block_sizes
    from pallas_kernels import paged_tiles
    tile, _, attn = name.partition("a:")
    attn_tiles = _attn_tiles()[attn] if attn else (shipped_attn or paged_tiles.decode_block_sizes)()
    return (_gemv_tuned_tiles() if tile.strip() == "tuned" else shape_block_sizes), lambda: attn_tiles


def _gemv_tuned(rows) -> dict:
    """{MESHLAB_BENCH_GEMV_TUNED: json {"n,k,swiglu": label}}: the matmul job's fastest decode_gemv tile
    per op at batch 1 (rows that passed its check), for _gemv_tuned_tiles()."""
    import re
    best: dict = {}
    for r in rows:
        m = re.fullmatch(r"\S+ ours\[(\S+)\] b=1", r.get("setting", ""))
        if r.get("job") == "matmul" and m and r["value"] == r["value"] and r["value"] > 0:
            if r["value"] < best.get(r["gemv_key"], (float("inf"), ""))[0]:
                best[r["gemv_key"]] = (r["value"], m.group(1))
    if not best:
        return {}
    tuned = {key: label for key, (_, label) in best.items()}
    print(f"[matmul] fastest tiles per op: {tuned}", flush=True)
    return {"MESHLAB_BENCH_GEMV_TUNED": json.dumps(tuned)}


def _sweep_configs():
    """The paged kernel's named configs plus grid-size and warp variants of the default (GPU only)."""
    from pallas_kernels.paged_tiles import CONFIGS
    variant = functools.partial(dataclasses.replace, CONFIGS["dot8"])
    return {**CONFIGS, "dot8_p132": variant(min_programs=132), "dot8_p528": variant(min_programs=528),
            "dot8_w2": variant(num_warps=2), "dot8_s1": variant(num_stages=1)}


# -- child side -------------------------------------------------------------------------------
def setup(args):
    import jax
    import models
    from meshlab.bench import decode as bench
    from meshlab.infer.loading import random_params
    from models import model_def
    bench.emit({"section": "meta", "setting": args.job, "value": 0.0, "unit": "", "backend": jax.default_backend(),
                "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "note": ""})
    name, dtype = ("tiny", "float32") if args.cpu_smoke else ("llama3_1b", "bfloat16")
    cfg = dataclasses.replace(models.preset(name), dtype=dtype)
    sizes = dict(ctx=64, big=2, n=8, lengths=[32, 64], max_len=256, chunk=32, tpot_n=32) if args.cpu_smoke else \
        dict(ctx=2048, big=64, n=32, lengths=[512, 2048] if args.quick else [512, 1024, 2048, 4096, 8192],
             max_len=ENGINE_MAX_LEN, chunk=512, tpot_n=256)
    bw = args.bw
    # base always measures (its rows are the JAX copy peers); first_token needs no roofline
    if args.job == "base" or not bw and not args.job.startswith("first_token"):
        gib = 1 << 24 if args.cpu_smoke else 1 << 30
        for setting, nbytes, donate in (("1 GiB", gib, False), ("4 GiB", 4 * gib, False), ("1 GiB donated", gib, True)):
            rate = bench.copy_bandwidth(nbytes, donate=donate)
            bw = max(bw, rate)
            if args.job == "base":
                bench.emit({"section": "copy", "setting": f"jax elementwise {setting}, read + write",
                            "value": rate / 1e9, "unit": "GB/s", "note": ""})
    return cfg, model_def(cfg), random_params(cfg), bw, sizes


def run_torch_copy(args):
    from meshlab.bench import decode as bench      # imports jax, but torch alone touches the GPU here
    if args.cpu_smoke:
        return
    for name, rate in bench.torch_copy_bandwidth().items():
        bench.emit({"section": "copy", "setting": f"torch {name} 1 GiB bf16, read + write", "value": rate / 1e9,
                    "unit": "GB/s", "note": "CUDA events"})


def run_child(args):
    if args.job == "copy_torch":
        return run_torch_copy(args)
    from meshlab.bench import decode as bench
    cfg, md, params, bw, sz = setup(args)
    out, tag = Path(args.out_dir), JOBS[args.job][2]

    def decode(batch, layers, impl="xla", detail=False, profile=False, layout="paged", variant=""):
        label = f"{layers}{variant}{tag}"
        try:
            slug = f"{args.job}_{layers}{variant}_{layout}_{impl}_b{batch}"
            bench.emit(bench.measure_decode(
                md, params, bw, batch, sz["ctx"], impl=impl, layers=layers, n=sz["n"], label=label,
                hlo_file=out / "hlo" / f"{slug}.hlo.txt.gz" if detail else None,
                profile_dir=Path("/tmp/bench_decode_traces") / slug if profile else None, layout=layout))
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            bench.fail_row("decode", f"{label} {layout} {impl} b={batch}", e)

    def layers_gate(layers):
        """The fp32 greedy gate of the Pallas paged path with these serving layers; emits and returns it."""
        gate = bench.correctness_gate(impls=("pallas",), layers=layers, preset="tiny" if args.cpu_smoke else "llama3_1b")
        for path, result in gate.items():
            bench.emit({"section": "gate", "setting": f"{path} (layers={layers})", "value": float(result == "ok"),
                        "unit": "ok", "note": result})
        return gate

    if args.job == "base":
        for layers in ("fused", "split"):
            decode(1, layers, detail=layers == "fused", profile=True)
        decode(1, "fused", layout="contiguous", profile=True)
        decode(sz["big"], "fused", detail=True)
    elif args.job in ("sweep", "sweep_pallas", "sweep_fused"):
        impl = {"sweep": "xla", "sweep_pallas": "pallas_unfused", "sweep_fused": "pallas"}[args.job]
        for batch in (SWEEP[:3] if args.cpu_smoke else SWEEP):
            decode(batch, "fused", impl=impl)
    elif args.job == "scan":
        for layers in ("scan", "unroll"):
            decode(1, layers)
    elif args.job == "cmdbuf_while":
        decode(1, "fused", detail=True)
        decode(1, "scan")
    elif args.job == "dsfusion":
        decode(1, "scan", detail=True)
        decode(1, "unroll")
    elif args.job == "no_cmdbuf":
        decode(1, "fused")
    elif args.job == "pallas":
        gate = bench.correctness_gate(preset="tiny" if args.cpu_smoke else "llama3_1b")
        for path, result in gate.items():
            bench.emit({"section": "gate", "setting": path, "value": float(result == "ok"), "unit": "ok",
                        "note": result})
        for batch in (1, sz["big"]):
            if gate.get("paged-pallas") == "ok":
                decode(batch, "fused", impl="pallas", detail=batch == 1, profile=batch == 1)
            try:
                bench.kernel_peers(cfg, bw, batch, sz["ctx"], configs=None if args.cpu_smoke else _sweep_configs())
            except Exception as e:  # noqa: BLE001
                bench.fail_row("kernel", f"peers b={batch}", e)
    elif args.job == "fusedk":
        layers_gate("fused")
        decode(1, "fused", impl="pallas", detail=True, profile=True)
        decode(1, "fused", impl="pallas_unfused")
        decode(sz["big"], "fused", impl="pallas")
        decode(sz["big"], "fused", impl="pallas_unfused")
        decode(1, "fused", impl="pallas")
        decode(1, "fused", impl="pallas_unfused")
    elif args.job == "kernels":
        if layers_gate("kernels").get("paged-pallas") == "ok":
            for i, (batch, layers) in enumerate(((1, "kernels"), (1, "fused"), (16, "kernels"), (16, "fused"),
                                                 (4, "kernels"), (1, "kernels"), (1, "fused"))):
                decode(batch, layers, impl="pallas", detail=i == 0, profile=batch == 1)
    elif args.job == "matmul":
        from meshlab.bench.matmul import matmul_peers
        for batch in (1,) if args.quick else (1, 4):
            matmul_peers(cfg, bw, batch, _matmul_configs(quick=args.cpu_smoke))
    elif args.job == "profile1":
        decode(1, "fused", impl="pallas", detail=True, profile=True)
    elif args.job == "cublas":
        decode(1, "fused", impl="pallas", profile=True)
    elif args.job == "engine":
        from meshlab.bench import first_token
        from meshlab.bench import serve as bs
        from meshlab.infer.engine import Engine
        # the layers measured: fused, or engine_gemv's faster choice (_engine_choice) in one call with it
        layers, tile = os.environ.get("MESHLAB_BENCH_LAYERS", "auto"), os.environ.get("MESHLAB_BENCH_GEMV", "")
        layers = shipped_layers(md) if layers == "auto" else layers
        if tile:
            from pallas_kernels import decode_gemv as dg, paged_tiles as pt
            dg.default_block_sizes, pt.decode_block_sizes = _variant(tile)
        bench.emit({"section": "config", "setting": "engine layers", "value": 0.0, "unit": "", "note": f"{layers} {tile}"})
        layers_gate(layers)                # fp32: packed steps (paged prompt kernel on GPU) and decode vs uncached
        try:
            eng = Engine(md, params, max_len=sz["max_len"], max_seqs=1, page_size=16, chunk=sz["chunk"],
                         steps_per_call=16, layers=layers)
            eng.warmup()
        except Exception as e:  # noqa: BLE001 - the paged prompt kernel failing to build must not lose the rest
            bench.fail_row("compile", "engine prefill=auto, falling back to prefill=flash", e)
            eng = Engine(md, params, max_len=sz["max_len"], max_seqs=1, page_size=16, chunk=sz["chunk"],
                         steps_per_call=16, layers=layers, prefill="flash")
            eng.warmup()
        ctx, n = sz["ctx"], sz["tpot_n"]

        def sweep(with_layers=layers, batches=(1, 16, 64), tag=""):
            big = Engine(md, params, max_len=ctx + 128, max_seqs=sz["big"], page_size=16, chunk=sz["chunk"],
                         steps_per_call=16, layers=with_layers, prefill=eng.prefill)
            bs.engine_sweep(big, bw, [b for b in batches if b <= sz["big"]], ctx=ctx, n=min(128, n), tag=tag)
        # most wanted first: a job stopped at its time limit keeps the rows before
        for section, fn in (("decode", lambda: bs.engine_tpot(eng, bw, ctx=ctx, n=n)),
                            ("ttft", lambda: bs.prefix_ttft(eng, n=min(2048, sz["lengths"][-1]))),
                            ("profile", lambda: bench.emit(bench.engine_profile(
                                eng, Path("/tmp/bench_decode_traces") / "engine_b1", ctx=ctx, n=min(128, n)))),
                            ("profile", lambda: bench.emit(first_token.engine_tail_profile(
                                eng, Path("/tmp/bench_decode_traces") / "engine_tail", n=min(2048, sz["lengths"][-1])))),
                            ("ttft", lambda: bs.ttft(eng, sz["lengths"])),
                            ("sweep", sweep),
                            ("http", lambda: bs.server_rows(eng, bw, ttft_len=min(2048, sz["lengths"][-1]), n=n,
                                                            ctx=ctx)),
                            # the shipped fused layers at the sweep's larger batches, when another was measured
                            ("sweep", lambda: layers != "fused" and sweep("fused", (16, 64), " [fused]"))):
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                bench.fail_row(section, "engine", e)
    elif args.job in ENGINE_AB:
        layers_gate(shipped_layers(md))    # fp32: a runtime flag must not change what is computed
        engine_ab_job(md, params, sz, bw, tag, layers=shipped_layers(md))
    elif args.job == "engine_gemv":
        engine_gemv_job(md, params, sz, bw, layers_gate)
    elif args.job in ("first_token", "first_token_ab"):
        first_token_job(md, params, sz, ab=args.job == "first_token_ab")
    elif args.job == "sweep_ab":         # batch 64 with and without kept hidden states, alternated
        from meshlab.bench import serve as bs
        from meshlab.infer.engine import Engine
        engines = {tag: Engine(md, params, max_len=sz["ctx"] + 128, max_seqs=sz["big"], page_size=16,
                               chunk=sz["chunk"], steps_per_call=16, layers=shipped_layers(md), reuse_hidden=on)
                   for tag, on in ((" [reuse_hidden]", True), (" [no reuse_hidden]", False))}
        for _ in range(2):
            for tag, eng in engines.items():
                bs.engine_sweep(eng, bw, [sz["big"]], ctx=sz["ctx"], n=min(128, sz["n"] * 4), tag=tag)
    elif args.job == "prefill_ab":
        from meshlab.bench import first_token
        from meshlab.infer.engine import Engine
        names = [v for v in os.environ.get("MESHLAB_BENCH_PREFILL", "default,xla_merge,st1,st1_ppb4_vfirst").split(",")
                 if v]
        first_token.prefill_tiles_ab(functools.partial(
            Engine, md, params, max_len=sz["max_len"], max_seqs=1, page_size=16, chunk=sz["chunk"], steps_per_call=16,
            layers=shipped_layers(md)), n=min(2048, sz["lengths"][-1]), names=names)
    elif args.job == "first_token_host":
        from meshlab.bench import first_token
        from meshlab.infer.engine import Engine
        eng = Engine(md, params, max_len=max(sz["max_len"], 2048 + 256), max_seqs=1, page_size=16, chunk=sz["chunk"],
                     steps_per_call=16, layers=shipped_layers(md))
        for row in first_token.host_rows(eng, n=2048):
            bench.emit(row)


def engine_gemv_job(md, params, sz, bw, layers_gate):
    """engine_gemv (the job list says what): fused against kernels with the shipped tiles, then each
    op's fastest tile in the matmul job (when it ran) and the attention tiles of _attn_tiles(), and a
    profile of the fastest kernels variant. MESHLAB_BENCH_ATTN set: no fused engine (the A/B is
    between attention tiles)."""
    from meshlab.bench import decode as bench
    from meshlab.infer.engine import Engine
    from pallas_kernels import decode_gemv as dg, paged_tiles as pt
    if layers_gate("kernels").get("paged-pallas") != "ok":
        return
    if "MESHLAB_BENCH_ATTN" not in os.environ:
        engine_ab_job(md, params, sz, bw, " [fused]", layers="fused")
    rates = {"": engine_ab_job(md, params, sz, bw, " [kernels]", layers="kernels")}
    default, attn, short = dg.default_block_sizes, pt.decode_block_sizes, os.environ.get("MESHLAB_BENCH_GEMV_SHORT") == "1"
    tile = "tuned" if _gemv_tuned_tiles() else ""
    names = ([tile] if tile else []) + ([] if short else [f"{tile} a:{a}".strip() for a in _attn_tiles()])

    def use(name):
        dg.default_block_sizes, pt.decode_block_sizes = _variant(name, shipped_attn=attn)
    for name in names:
        use(name)
        rates[name] = engine_ab_job(md, params, sz, bw, f" [kernels {name}]", layers="kernels")
    if not short:
        best = max(rates, key=lambda k: rates[k])
        use(best)
        try:
            eng = Engine(md, params, max_len=sz["max_len"], max_seqs=1, page_size=16, chunk=sz["chunk"],
                         steps_per_call=16, layers="kernels")
            row = bench.engine_profile(eng, Path("/tmp/bench_decode_traces") / "engine_kernels", ctx=sz["ctx"],
                                       n=min(128, sz["tpot_n"]))
            bench.emit(dict(row, setting=row["setting"] + f" [kernels {best}]".replace(" ]", "]")))
        except Exception as e:  # noqa: BLE001
            bench.fail_row("profile", "engine kernels", e)
    dg.default_block_sizes, pt.decode_block_sizes = default, attn


def shipped_layers(md) -> str:
    """The layers Engine(layers="auto") picks on this machine (kernels on one GPU, with the Pallas kernels)."""
    from meshlab.infer.engine import default_impl, default_layers
    return default_layers(md, default_impl())


def engine_ab_job(md, params, sz, bw, tag: str, layers: str = "fused"):
    """The engine job's batch-1 decode (TPOT vs the roofline) and prefix-cache TTFT rows, tagged, plus
    the greedy tokens of one bf16 prompt (the parent's table compares them across the variants)."""
    from meshlab.bench import decode as bench
    from meshlab.bench import serve as bs
    from meshlab.infer.engine import Engine
    from meshlab.infer.sampler import SamplingParams
    eng = Engine(md, params, max_len=sz["max_len"], max_seqs=1, page_size=16, chunk=sz["chunk"], steps_per_call=16,
                 layers=layers)
    n, rates = min(2048, sz["lengths"][-1]), []
    for section, fn in (("decode", lambda: bs.engine_tpot(eng, bw, ctx=sz["ctx"], n=sz["tpot_n"], tag=tag)),
                        ("ttft", lambda: bs.prefix_ttft(eng, n=n, tag=tag)),
                        ("decode", lambda: bs.engine_tpot(eng, bw, ctx=sz["ctx"], n=sz["tpot_n"], tag=tag + " again"))):
        try:
            row = fn()
            if section == "decode":
                rates.append(row["value"])
        except Exception as e:  # noqa: BLE001
            bench.fail_row(section, "engine" + tag, e)
    toks = eng.generate([list(range(7, 7 + n // 4))], SamplingParams(max_tokens=24))[0].output
    bench.emit({"section": "tokens", "setting": "greedy bf16" + tag, "value": float(sum(toks) % 100003), "unit": "sum",
                "note": " ".join(map(str, toks))})
    return sum(rates) / len(rates) if rates else 0.0


def first_token_job(md, params, sz, ab: bool):
    """The prefix-cache TTFT and its profile on one max_seqs=1 engine (the engine job's), no warmup:
    each program compiles at its first (untimed) use. ab: the TTFT through engines built otherwise
    instead (packed programs without command buffers; packed input in pinned host memory)."""
    from meshlab.bench import decode as bench
    from meshlab.bench import first_token
    from meshlab.bench import serve as bs
    from meshlab.infer.engine import Engine
    n = min(2048, sz["lengths"][-1])
    make = functools.partial(Engine, md, params, max_len=sz["max_len"], max_seqs=1, page_size=16, chunk=sz["chunk"],
                             steps_per_call=16, layers=shipped_layers(md))

    def tagged_ttft(tag, **kw):
        bs.prefix_ttft(make(**kw), n=n, tag=tag)

    def packed_options(name):            # TTFT and the short tail's profile with XLA options on packed programs
        eng = make(compiler_options={"packed": first_token.PACKED_OPTIONS[name]})
        bs.prefix_ttft(eng, n=n, tag=f" [packed {name}]")
        row = first_token.engine_tail_profile(eng, Path("/tmp/bench_decode_traces") / name, n=n)
        bench.emit(dict(row, setting=row["setting"] + f" [packed {name}]"))
    named = [v for v in os.environ.get("MESHLAB_BENCH_PACKED_XLA", "").split(",") if v]
    if ab and named:
        sections = [("ttft", lambda: tagged_ttft(" [as shipped]"))]
        sections += [("ttft", functools.partial(packed_options, name)) for name in named]
    elif ab:
        sections = (("ttft", lambda: tagged_ttft(" [as shipped]")),
                    ("ttft", lambda: tagged_ttft(" [last token fed again]", reuse_hidden=False)),
                    ("ttft", lambda: tagged_ttft(" [first-token decode call no cmdbuf]",
                                                 compiler_options={"first": first_token.NO_CMDBUF})),
                    ("ttft", lambda: tagged_ttft(" [packed no cmdbuf]", compiler_options={"packed": first_token.NO_CMDBUF})),
                    ("ttft", lambda: tagged_ttft(" [pinned input]", pinned_inputs=True)),
                    ("ttft", lambda: tagged_ttft(" [one token left: packed row]", first_token_decode=False)))
    else:
        eng = make()
        trace = Path("/tmp/bench_decode_traces")
        sections = (("ttft", lambda: bs.prefix_ttft(eng, n=n)),
                    ("profile", lambda: bench.emit(first_token.engine_tail_profile(eng, trace / "first_token", n=n))),
                    ("profile", lambda: bench.emit(first_token.engine_tail_profile(eng, trace / "first_token_all", n=n,
                                                                                   tail=0))),
                    ("host", lambda: [bench.emit(r) for r in first_token.host_rows(eng, n=n)]))
    for section, fn in sections:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            bench.fail_row(section, "first_token", e)


# -- parent side ------------------------------------------------------------------------------
def _engine_choice(rows) -> dict:
    """{MESHLAB_BENCH_LAYERS, MESHLAB_BENCH_GEMV}: the engine_gemv variant with the most batch-1 decode
    tokens/s (mean of its two measures): fused, or kernels under one of its variants (_variant)."""
    import re
    rates: dict = {}
    for r in rows:
        m = re.fullmatch(r"engine b=1 ctx=\d+ \[(fused|kernels)( [^\]]+)?\]( again)?", r.get("setting", ""))
        if r.get("job") == "engine_gemv" and r["section"] == "decode" and m and r["value"] > 0:
            rates.setdefault((m.group(1), (m.group(2) or "").strip()), []).append(r["value"])
    if not rates:
        return {}
    (layers, tile), _ = max(rates.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
    print(f"[engine] measures layers={layers} {tile or 'default tiles'} (the fastest of engine_gemv)", flush=True)
    return {"MESHLAB_BENCH_LAYERS": layers, "MESHLAB_BENCH_GEMV": tile}


def run_job(name, args, deadline, out: Path, bw):
    """Run one job as a child until it ends or `deadline`; returns its rows (those printed so far)."""
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), JOBS[name][0]) if f)
    cache = Path("/tmp/bench_decode_cache")
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))   # keep carried packages
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=path, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, __file__, "--job", name, "--out-dir", str(out)] + (["--bw", str(bw)] if bw else []) \
        + (["--quick"] if args.quick else []) + (["--cpu-smoke"] if args.cpu_smoke else [])
    rows_path, log_path = out / "logs" / f"{name}.rows", out / "logs" / f"{name}.log"
    with open(rows_path, "w") as rows_fh, open(log_path, "w") as log_fh:
        proc = subprocess.Popen(cmd, env=env, stdout=rows_fh, stderr=log_fh, start_new_session=True)
        rows, done = [], 0
        while True:
            finished = proc.poll() is not None
            lines = rows_path.read_text().splitlines(keepends=True)
            for line in lines[done:]:
                if not line.endswith("\n") and not finished:
                    break                                   # a line still being written
                done += 1
                if line.startswith("ROW "):
                    row = dict(json.loads(line[4:]), job=name)
                    rows.append(row)
                    if row["section"] != "meta":
                        print(f"[{name}] {row['section']:7} {row['setting']:36} {row['value']:10.1f} "
                              f"{row['unit']:5} {row.get('note', '')}"[:230], flush=True)
            if finished:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rows.append({"section": name, "setting": "TIMEOUT", "value": float("nan"), "unit": "", "job": name,
                             "note": "job stopped at its time limit; rows before this are complete"})
                print(f"[{name}] stopped at its time limit", flush=True)
                break
            time.sleep(0.5)
    if proc.returncode not in (0, -signal.SIGKILL):
        tail = log_path.read_text().splitlines()[-12:]
        rows.append({"section": name, "setting": "FAILED", "value": float("nan"), "unit": "", "job": name,
                     "note": f"exit {proc.returncode}: " + " | ".join(tail)[-300:]})
        print(f"[{name}] exit {proc.returncode}; log tail:\n  " + "\n  ".join(tail), flush=True)
    return rows


def markdown(rows, meta) -> str:
    day = datetime.date.today().isoformat()
    dev, jv = meta.get("device", "?"), meta.get("jax", "?")
    lines = ["| date | device | jax | section | setting | value | unit | note |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["section"] != "meta":
            lines.append(f"| {day} | {dev} | {jv} | {r['section']} | {r['setting']} | {r['value']:.1f} | {r['unit']} | "
                         f"{str(r.get('note', '')).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def profile_table(r) -> str:
    """An engine profile row (meshlab.bench.decode.engine_profile / first_token.engine_tail_profile) as a per-kernel
    table: us per decode token, or per request for the cached prompt's first token."""
    per = "token" if r["unit"] == "us/token" else "request"
    lines = [f"\n## {r['setting']}: where the time goes\n", r["note"] + "\n",
             f"| class | us/{per} |", "| --- | --- |"]
    lines += [f"| {c} | {t * 1e3:.1f} |" for c, t in r["classes"]]
    lines += ["", f"| kernel | us/{per} | launches/{per} |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {t:.1f} | {c:g} |" for k, t, c in r["kernels"]]
    return "\n".join(lines) + "\n"


def details(rows) -> str:
    """The batch sweep's TPOT against batch 1, then HLO traffic and kernel profiles per decode
    variant (the evidence behind the numbers), and whether its greedy tokens equal the paged fused
    XLA path's (bf16: a different fusion may round differently)."""
    out = []
    for job in ("sweep", "sweep_pallas", "sweep_fused"):
        sweep = {r["batch"]: r for r in rows if r["job"] == job and r["section"] == "decode" and "tpot_ms" in r}
        if sweep:
            one = sweep.get(1, {}).get("tpot_ms")
            out += [f"\n## {job}: TPOT against batch 1 (ctx 2048)\n", "| batch | tok/s | TPOT ms | x b=1 | % copy bw |",
                    "| --- | --- | --- | --- | --- |"]
            out += [f"| {b} | {r['value']:.0f} | {r['tpot_ms']:.2f} | {r['tpot_ms'] / one if one else float('nan'):.2f} | "
                    f"{r['frac_copy_bw']:.0%} |" for b, r in sorted(sweep.items())]
    for r in rows:
        if r["section"] == "profile" and "kernels" in r:
            out.append(profile_table(r))
    out.append("\n## HLO traffic and profiles per decode variant\n")
    ref = {r["batch"]: r["tokens"] for r in rows if r["section"] == "decode" and r.get("layers") == "fused"
           and r.get("impl") == "xla" and r.get("layout") == "paged" and r["job"] == "base" and "tokens" in r}
    for r in rows:
        if r["section"] == "decode" and ("hlo" in r or "profile" in r):
            same = {True: "same greedy tokens as paged fused xla", False: "greedy tokens differ from paged fused xla"}.get(
                r["tokens"] == ref[r["batch"]] if r["batch"] in ref else None, "")
            out.append(f"### {r['setting']}: {r['value']:.0f} tok/s, compile {r.get('compile_s')} s; {same}\n")
            out.append("```\n" + json.dumps(r["hlo"], indent=1) + "\n```")
            if "profile" in r:
                out.append("profile: ```" + json.dumps(r["profile"]) + "```\n")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=440, help="the whole call ends within this")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, in order; of {','.join(JOBS)}")
    ap.add_argument("--quick", action="store_true", help="fewer prompt lengths")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the mechanics only")
    ap.add_argument("--docs", default=str(ROOT / "docs" / "archive" / "benchmarks-diary.md"))
    ap.add_argument("--job", choices=list(JOBS), help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--bw", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return run_child(args)
    t0 = time.perf_counter()
    out = Path(os.environ.get("OUT") or "/tmp/bench_decode")
    for sub in ("logs", "hlo"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    jobs = [j for j in args.jobs.split(",") if j]
    rows, bw = [], 0.0
    for i, name in enumerate(jobs):
        later = sum(JOBS[j][1] for j in jobs[i + 1:])
        deadline = t0 + args.budget_s - 5 - later            # later jobs keep their reserve; slack goes here
        if name == "copy_torch":                             # every roofline of the call stands on it
            deadline = max(deadline, time.perf_counter() + JOBS[name][1])
        if deadline - time.perf_counter() < 20:
            rows.append({"section": name, "setting": "SKIPPED", "value": float("nan"), "unit": "", "job": name,
                         "note": "no time left in the budget"})
            print(f"[{name}] skipped: no time left", flush=True)
            continue
        rows += run_job(name, args, deadline, out, bw)
        if name == "matmul":
            os.environ.update(_gemv_tuned(rows))       # engine_gemv then also runs each op's fastest tile
        if name == "engine_gemv":
            os.environ.update(_engine_choice(rows))    # the engine job then measures the faster layers
        bw = max([bw] + [r["value"] * 1e9 for r in rows if r["section"] == "copy" and r["value"] == r["value"]])
    meta = next((r for r in rows if r["section"] == "meta"), {})
    table = markdown(rows, meta)
    (out / "bench_decode.json").write_text(json.dumps(rows, indent=1, default=float))
    (out / "bench_decode.md").write_text(table + details(rows))
    print("\n" + table)
    for r in rows:
        if r["section"] == "profile" and "kernels" in r:
            print(profile_table(r))
    if meta.get("backend") == "gpu":                        # real measurements only
        block = ("\n### bench_decode.py, one call (" + f"{time.perf_counter() - t0:.0f} s; jobs {','.join(jobs)})\n\n"
                 + table)
        (out / "benchmarks_append.md").write_text(block)
        with open(args.docs, "a") as fh:
            fh.write(block)
        print(f"appended {table.count(chr(10)) - 2} rows to {args.docs} and {out / 'benchmarks_append.md'}")
    print(f"total {time.perf_counter() - t0:.0f} s; files in {out}")


if __name__ == "__main__":
    main()
