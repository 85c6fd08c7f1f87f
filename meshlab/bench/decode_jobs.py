"""The child side of scripts/bench_decode.py: one job per process, since XLA reads XLA_FLAGS once per
process. Each job prints `ROW {json}` lines as it measures (meshlab.bench.decode.emit), so one killed
at its time limit still hands back its rows. What each job measures: the script's docstring.

Imports of JAX and the models stay inside the functions: the parent reads JOBS without touching a
device.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import os
from pathlib import Path

from meshlab.bench.decode_tiles import (ENGINE_MAX_LEN, attention_tiles, gemv_tuned_tiles, matmul_configs,
                                        sweep_configs, tile_variant)

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
    "read_rate": ("", 60, ""),
    "engine": ("", 150, ""),
    "sweep_ab": ("", 240, ""),
    "sweep_engine": ("", 240, ""),
    "buckets_ab": ("", 300, ""),
    "splits_ab": ("", 300, ""),
    "rows_ab": ("", 200, ""),
    "expert_rows_ab": ("", 240, ""),
    "gmm_tiles_ab": ("", 420, ""),
    "attn_tiles": ("", 300, ""),
    "first_token": ("", 110, ""),
    "first_token_ab": ("", 130, ""),
    "first_token_host": ("", 40, ""),
    "prefill_ab": ("", 150, ""),
    "prompt_tiles": ("", 200, ""),
    "prompt_tiles_ab": ("", 300, ""),
    "ttft_profile": ("", 150, ""),
    # the same engine rows under XLA runtime flags (ENGINE_AB), each in its own process
    "engine_ab": ("", 75, " [ab: as shipped]"),
    "engine_pdl": ("--xla_gpu_enable_pdl=true", 75, " [pdl]"),
    "engine_lock": ("--xla_gpu_require_exclusive_lock=true", 75, " [exclusive lock]"),
    "engine_concurrent": ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", 75, " [cmdbuf concurrent]"),
    "engine_va": ("--xla_gpu_enable_command_buffer_va_remapping=true", 75, " [va remapping]"),
    "engine_pdl_lock": ("--xla_gpu_enable_pdl=true --xla_gpu_require_exclusive_lock=true", 75, " [pdl + lock]"),
    "engine_pdl_launch": ("--xla_gpu_enable_pdl_launch=true", 75, " [pdl launch]"),
    "engine_pdl_both": ("--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true", 75, " [pdl + pdl launch]"),
    "engine_ab2": ("", 75, " [ab: as shipped, again]"),
    "engine_gemv": ("", 300, ""),
    "layers_ab": ("", 300, ""),
    "gmm_rows": ("", 200, ""),
    "fp8": ("", 420, ""),
    "kv_fp8": ("", 300, ""),
}
ENGINE_AB = [name for name in JOBS if name.startswith("engine_") and name != "engine_gemv"]

TRACES = Path("/tmp/bench_decode_traces")


# -- the jobs ----------------------------------------------------------------------
@dataclasses.dataclass
class Child:
    """What every job of one child process works with."""
    args: object
    cfg: object
    md: object
    params: object
    bw: float                 # the roofline's bandwidth (bytes/s): the parent's best copy rate, or this job's
    sz: dict                  # sizes: ctx, big (batch), n, lengths, max_len, chunk, tpot_n
    out: Path
    tag: str                  # appended to settings (the job's XLA flags)

    @property
    def smoke(self) -> bool:
        return self.args.cpu_smoke

    def decode(self, batch, layers, impl="xla", detail=False, profile=False, layout="paged", variant=""):
        """One measure_decode row (HLO traffic with detail, a kernel profile with profile); a failure is a row."""
        from meshlab.bench import decode as bench
        label = f"{layers}{variant}{self.tag}"
        try:
            slug = f"{self.args.job}_{layers}{variant}_{layout}_{impl}_b{batch}"
            bench.emit(bench.measure_decode(
                self.md, self.params, self.bw, batch, self.sz["ctx"], impl=impl, layers=layers, n=self.sz["n"],
                label=label, hlo_file=self.out / "hlo" / f"{slug}.hlo.txt.gz" if detail else None,
                profile_dir=TRACES / slug if profile else None, layout=layout))
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            bench.fail_row("decode", f"{label} {layout} {impl} b={batch}", e)

    def gate(self, impls=None, layers=None) -> dict:
        """The fp32 greedy gate (paths -> "ok" or why not), emitted; impls/layers None: the gate's defaults."""
        from meshlab.bench import decode as bench
        kw = {k: v for k, v in (("impls", impls), ("layers", layers)) if v is not None}
        result = bench.correctness_gate(preset="tiny" if self.smoke else self.cfg.name, **kw)
        for path, ok in result.items():
            bench.emit({"section": "gate", "setting": path + (f" (layers={layers})" if layers else ""),
                        "value": float(ok == "ok"), "unit": "ok", "note": ok})
        return result

    def layers_gate(self, layers) -> dict:
        """The fp32 greedy gate of the Pallas paged path with these serving layers."""
        return self.gate(impls=("pallas",), layers=layers)

    def engine(self, **kw):
        """An engine as every job builds one: pages of 16, 16 decode steps a call, the job's chunk; by
        default one row of max_len tokens on the shipped layers (kw: overrides and Engine's other arguments)."""
        from meshlab.infer.engine import Engine
        kw = {"layers": shipped_layers(self.md), **kw}
        return Engine(self.md, self.params, max_len=kw.pop("max_len", self.sz["max_len"]), max_seqs=kw.pop("max_seqs", 1),
                      page_size=16, chunk=self.sz["chunk"], steps_per_call=16, **kw)


def setup(args) -> "Child":
    """The job's model, params, roofline bandwidth and sizes (the tiny model with --cpu-smoke)."""
    import jax
    import models
    from meshlab.bench import decode as bench
    from meshlab.infer.loading import random_params
    from models import model_def
    bench.emit({"section": "meta", "setting": args.job, "value": 0.0, "unit": "", "backend": jax.default_backend(),
                "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "note": ""})
    name, dtype = ("tiny", "float32") if args.cpu_smoke else (args.preset, "bfloat16")
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
    return Child(args, cfg, model_def(cfg), random_params(cfg), bw, sizes, Path(args.out_dir), JOBS[args.job][2])


def run_torch_copy(args):
    from meshlab.bench import decode as bench      # imports jax, but torch alone touches the GPU here
    if args.cpu_smoke:
        return
    for name, rate in bench.torch_copy_bandwidth().items():
        bench.emit({"section": "copy", "setting": f"torch {name} 1 GiB bf16, read + write", "value": rate / 1e9,
                    "unit": "GB/s", "note": "CUDA events"})


def shipped_layers(md) -> str:
    """The layers Engine(layers="auto") picks on this machine (kernels on one GPU, with the Pallas kernels)."""
    from meshlab.infer.engine import default_impl, default_layers
    return default_layers(md, default_impl())


def job_engine_gemv(c: Child):
    """engine_gemv (the script's job list says what): fused against kernels with the shipped tiles,
    then each op's fastest tile in the matmul job (when it ran) and the attention tiles of
    attention_tiles(), and a profile of the fastest kernels variant. MESHLAB_BENCH_ATTN set: no fused
    engine (the A/B is between attention tiles)."""
    from meshlab.bench import decode as bench
    from pallas_kernels import decode_gemv as dg, paged_tiles as pt
    if c.layers_gate("kernels").get("paged-pallas") != "ok":
        return
    if os.environ.get("MESHLAB_BENCH_GEMV_SHORT") == "1" and gemv_tuned_tiles():
        return _gemv_alternated(c)
    if "MESHLAB_BENCH_ATTN" not in os.environ:
        engine_ab_job(c, " [fused]", layers="fused")
    rates = {"": engine_ab_job(c, " [kernels]", layers="kernels")}
    default, attn, short = dg.default_block_sizes, pt.decode_block_sizes, os.environ.get("MESHLAB_BENCH_GEMV_SHORT") == "1"
    tile = "tuned" if gemv_tuned_tiles() else ""
    names = ([tile] if tile else []) + ([] if short else [f"{tile} a:{a}".strip() for a in attention_tiles()])

    def use(name):
        dg.default_block_sizes, pt.decode_block_sizes = tile_variant(name, shipped_attn=attn)
    for name in names:
        use(name)
        rates[name] = engine_ab_job(c, f" [kernels {name}]", layers="kernels")
    if not short:
        best = max(rates, key=lambda k: rates[k])
        use(best)
        try:
            row = bench.engine_profile(c.engine(layers="kernels"), TRACES / "engine_kernels", ctx=c.sz["ctx"],
                                       n=min(128, c.sz["tpot_n"]))
            bench.emit(dict(row, setting=row["setting"] + f" [kernels {best}]".replace(" ]", "]")))
        except Exception as e:  # noqa: BLE001
            bench.fail_row("profile", "engine kernels", e)
    dg.default_block_sizes, pt.decode_block_sizes = default, attn


def _gemv_alternated(c: Child, rounds: int = 2):
    """engine_gemv's short form (MESHLAB_BENCH_GEMV_SHORT=1 after a matmul job): batch-1 decode through two
    kernels-layer engines, the shipped tiles and each op's fastest, alternated `rounds` times, nothing else
    (a wide model's engines take minutes each to build and run the full job)."""
    from meshlab.bench import serve as bs
    from pallas_kernels import decode_gemv as dg, paged_tiles as pt
    default, attn = dg.default_block_sizes, pt.decode_block_sizes
    engines = {}
    try:
        for r in range(rounds):
            for name in ("", "tuned"):
                # the tiles are read when a program is traced: the first round compiles each engine under its own
                dg.default_block_sizes, pt.decode_block_sizes = tile_variant(name, shipped_attn=attn)
                if name not in engines:
                    engines[name] = c.engine(layers="kernels")
                eng = engines[name]
                tag = f" [kernels {name}]".replace(" ]", "]") + (" again" if r else "")
                bs.engine_tpot(eng, c.bw, ctx=c.sz["ctx"], n=c.sz["tpot_n"], tag=tag)
    finally:
        dg.default_block_sizes, pt.decode_block_sizes = default, attn


def engine_ab_job(c: Child, tag: str, layers: str = "fused", **engine_kw):
    """The engine job's batch-1 decode (TPOT vs the roofline) and prefix-cache TTFT rows, tagged, plus
    the greedy tokens of one bf16 prompt (the parent's table compares them across the variants)."""
    from meshlab.bench import decode as bench
    from meshlab.bench import serve as bs
    from meshlab.infer.sampler import SamplingParams
    eng, sz, bw = c.engine(layers=layers, **engine_kw), c.sz, c.bw
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


def first_token_job(c: Child, ab: bool):
    """The prefix-cache TTFT and its profile on one max_seqs=1 engine (the engine job's), no warmup:
    each program compiles at its first (untimed) use. ab: the TTFT through engines built otherwise
    instead (packed programs without command buffers; packed input in pinned host memory)."""
    from meshlab.bench import decode as bench
    from meshlab.bench import first_token
    from meshlab.bench import serve as bs
    n, make = min(2048, c.sz["lengths"][-1]), c.engine

    def tagged_ttft(tag, **kw):
        bs.prefix_ttft(make(**kw), n=n, tag=tag)

    def packed_options(name):            # TTFT and the short tail's profile with XLA options on packed programs
        eng = make(compiler_options={"packed": first_token.PACKED_OPTIONS[name]})
        bs.prefix_ttft(eng, n=n, tag=f" [packed {name}]")
        row = first_token.engine_tail_profile(eng, TRACES / name, n=n)
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
        sections = (("ttft", lambda: bs.prefix_ttft(eng, n=n)),
                    ("profile", lambda: bench.emit(first_token.engine_tail_profile(eng, TRACES / "first_token", n=n))),
                    ("profile", lambda: bench.emit(first_token.engine_tail_profile(eng, TRACES / "first_token_all", n=n,
                                                                                   tail=0))),
                    ("host", lambda: [bench.emit(r) for r in first_token.host_rows(eng, n=n)]))
    for section, fn in sections:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            bench.fail_row(section, "first_token", e)


def job_base(c: Child):
    for layers in ("fused", "split"):
        c.decode(1, layers, detail=layers == "fused", profile=True)
    c.decode(1, "fused", layout="contiguous", profile=True)
    c.decode(c.sz["big"], "fused", detail=True)


def _batched(name: str, module: str = "batched_decode"):
    """A job of meshlab/bench/<module>.py (batched_decode, fp8_jobs, prompt_attention), imported when it runs (the parent
    imports no JAX)."""
    def job(c: Child):
        import importlib
        return getattr(importlib.import_module(f"meshlab.bench.{module}"), name)(c)
    return job


def job_sweep(c: Child):
    from meshlab.bench.batched_decode import SWEEP
    impl = {"sweep": "xla", "sweep_pallas": "pallas_unfused", "sweep_fused": "pallas"}[c.args.job]
    for batch in (SWEEP[:3] if c.smoke else SWEEP):
        c.decode(batch, "fused", impl=impl)


def job_pallas(c: Child):
    from meshlab.bench import decode as bench
    gate = c.gate()
    for batch in (1, c.sz["big"]):
        if gate.get("paged-pallas") == "ok":
            c.decode(batch, "fused", impl="pallas", detail=batch == 1, profile=batch == 1)
        try:
            bench.kernel_peers(c.cfg, c.bw, batch, c.sz["ctx"], configs=None if c.smoke else sweep_configs())
        except Exception as e:  # noqa: BLE001
            bench.fail_row("kernel", f"peers b={batch}", e)


def job_fusedk(c: Child):
    c.layers_gate("fused")
    c.decode(1, "fused", impl="pallas", detail=True, profile=True)
    big = c.sz["big"]
    for batch, impl in ((1, "pallas_unfused"), (big, "pallas"), (big, "pallas_unfused"), (1, "pallas"),
                        (1, "pallas_unfused")):
        c.decode(batch, "fused", impl=impl)


def job_kernels(c: Child):
    if c.layers_gate("kernels").get("paged-pallas") == "ok":
        for i, (batch, layers) in enumerate(((1, "kernels"), (1, "fused"), (16, "kernels"), (16, "fused"),
                                             (4, "kernels"), (1, "kernels"), (1, "fused"))):
            c.decode(batch, layers, impl="pallas", detail=i == 0, profile=batch == 1)


def job_matmul(c: Child):
    from meshlab.bench.matmul import matmul_peers
    for batch in (1,) if c.args.quick else (1, 4):
        matmul_peers(c.cfg, c.bw, batch, matmul_configs(quick=c.smoke, wide=c.cfg.d_model >= 4096, rows=batch))


def job_read_rate(c: Child):
    from meshlab.bench.matmul import read_rates
    read_rates(c.bw, smoke=c.smoke)


def job_engine(c: Child):
    """The engine job (the script's job list): the layers measured are the shipped ones (Engine's
    layers="auto"), or engine_gemv's faster choice when it ran earlier in the call
    (MESHLAB_BENCH_LAYERS / MESHLAB_BENCH_GEMV)."""
    from meshlab.bench import decode as bench
    from meshlab.bench import first_token
    from meshlab.bench import serve as bs
    layers, tile = os.environ.get("MESHLAB_BENCH_LAYERS", "auto"), os.environ.get("MESHLAB_BENCH_GEMV", "")
    layers = shipped_layers(c.md) if layers == "auto" else layers
    if tile:
        from pallas_kernels import decode_gemv as dg, paged_tiles as pt
        dg.default_block_sizes, pt.decode_block_sizes = tile_variant(tile)
    bench.emit({"section": "config", "setting": "engine layers", "value": 0.0, "unit": "", "note": f"{layers} {tile}"})
    c.layers_gate(layers)                # fp32: packed steps (paged prompt kernel on GPU) and decode vs uncached
    try:
        eng = c.engine(layers=layers)
        eng.warmup()
    except Exception as e:  # noqa: BLE001 - the paged prompt kernel failing to build must not lose the rest
        bench.fail_row("compile", "engine prefill=auto, falling back to prefill=flash", e)
        eng = c.engine(layers=layers, prefill="flash")
        eng.warmup()
    ctx, n, ttft_len = c.sz["ctx"], c.sz["tpot_n"], min(2048, c.sz["lengths"][-1])
    held, prefill = {"eng": eng}, eng.prefill
    del eng      # held["eng"] alone keeps it: the sweep frees it (a wide model's two engines overflow an 80 GB card)

    def sweep(with_layers=layers, batches=(1, 16, 64), tag=""):
        held.clear()
        gc.collect()       # the first engine, or the sweep before's
        big = c.engine(max_len=ctx + 128, max_seqs=c.sz["big"], layers=with_layers, prefill=prefill)
        bs.engine_sweep(big, c.bw, [b for b in batches if b <= c.sz["big"]], ctx=ctx, n=min(128, n), tag=tag)
    # most wanted first: a job stopped at its time limit keeps the rows before; the sweeps last, they free `eng`
    for section, fn in (("decode", lambda: bs.engine_tpot(held["eng"], c.bw, ctx=ctx, n=n)),
                        ("ttft", lambda: bs.prefix_ttft(held["eng"], n=ttft_len)),
                        ("profile", lambda: bench.emit(bench.engine_profile(held["eng"], TRACES / "engine_b1", ctx=ctx,
                                                                            n=min(128, n)))),
                        ("profile", lambda: bench.emit(first_token.engine_tail_profile(held["eng"], TRACES / "engine_tail",
                                                                                       n=ttft_len))),
                        ("ttft", lambda: bs.ttft(held["eng"], c.sz["lengths"])),
                        ("http", lambda: bs.server_rows(held["eng"], c.bw, ttft_len=ttft_len, n=n, ctx=ctx)),
                        ("sweep", sweep),
                        # the shipped fused layers at the sweep's larger batches, when another was measured
                        ("sweep", lambda: layers != "fused" and sweep("fused", (16, 64), " [fused]"))):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            bench.fail_row(section, "engine", e)


def job_layers_ab(c: Child):
    """Batch-1 decode at ctx 2k through engines with each layers mode, one at a time, the shipped one
    first, alternated twice."""
    from meshlab.bench import serve as bs
    shipped = shipped_layers(c.md)
    modes = [shipped] + [m for m in ("split", "fused", "kernels") if m != shipped]
    for again in ("", " again"):
        for layers in modes:
            eng = c.engine(layers=layers)
            bs.engine_tpot(eng, c.bw, ctx=c.sz["ctx"], n=c.sz["tpot_n"], tag=f" [{layers}]{again}")
            del eng
            gc.collect()


def job_gmm_rows(c: Child):
    from meshlab.bench import decode as bench
    from meshlab.bench.expert_rows import gmm_rows
    import models
    cfg = models.preset("moe_tiny") if c.smoke else c.cfg
    if not getattr(cfg, "n_experts", 0):
        raise SystemExit(f"gmm_rows: {cfg.name} has no experts; pass --preset moe_1b_8e (or another mixture of experts)")
    for row in gmm_rows(cfg, c.smoke):
        bench.emit(row)


def job_engine_ab(c: Child):
    c.layers_gate(shipped_layers(c.md))    # fp32: a runtime flag must not change what is computed
    engine_ab_job(c, c.tag, layers=shipped_layers(c.md))


def job_prefill_ab(c: Child):
    from meshlab.bench import first_token
    names = [v for v in os.environ.get("MESHLAB_BENCH_PREFILL", "served,default,xla_merge,st1").split(",") if v]
    first_token.prefill_tiles_ab(c.engine, n=min(2048, c.sz["lengths"][-1]), names=names)


def job_first_token_host(c: Child):
    from meshlab.bench import decode as bench
    from meshlab.bench import first_token
    for row in first_token.host_rows(c.engine(max_len=max(c.sz["max_len"], 2048 + 256)), n=2048):
        bench.emit(row)


CHILD_JOBS = {
    "base": job_base, "sweep": job_sweep, "sweep_pallas": job_sweep, "sweep_fused": job_sweep,
    "scan": lambda c: [c.decode(1, layers) for layers in ("scan", "unroll")],
    "cmdbuf_while": lambda c: (c.decode(1, "fused", detail=True), c.decode(1, "scan")),
    "dsfusion": lambda c: (c.decode(1, "scan", detail=True), c.decode(1, "unroll")),
    "no_cmdbuf": lambda c: c.decode(1, "fused"),
    "pallas": job_pallas, "fusedk": job_fusedk, "kernels": job_kernels, "matmul": job_matmul,
    "read_rate": job_read_rate,
    "profile1": lambda c: c.decode(1, "fused", impl="pallas", detail=True, profile=True),
    "cublas": lambda c: c.decode(1, "fused", impl="pallas", profile=True),
    "engine": job_engine, "engine_gemv": job_engine_gemv, "prefill_ab": job_prefill_ab, "layers_ab": job_layers_ab,
    "gmm_rows": job_gmm_rows,
    **{name: _batched(f"job_{name}") for name in ("sweep_ab", "rows_ab", "expert_rows_ab", "gmm_tiles_ab", "sweep_engine",
                                                   "buckets_ab", "attn_tiles", "splits_ab")},
    "first_token": lambda c: first_token_job(c, ab=False),
    "first_token_ab": lambda c: first_token_job(c, ab=True),
    "first_token_host": job_first_token_host, **{name: _batched(f"job_{name}", "fp8_jobs") for name in ("fp8", "kv_fp8")},
    **{name: _batched(f"job_{name}", "prompt_attention") for name in ("prompt_tiles", "prompt_tiles_ab", "ttft_profile")},
    **{name: job_engine_ab for name in ENGINE_AB},
}


def run_child(args) -> None:
    """Run the job args.job (a child process of the script's parent)."""
    if args.job == "copy_torch":
        return run_torch_copy(args)
    CHILD_JOBS[args.job](setup(args))
