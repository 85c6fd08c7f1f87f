"""Attention speed on one GPU: ours (Pallas FlashAttention, block-size variants) vs cuDNN and XLA
through jax.nn.dot_product_attention, JAX's Pallas `mha`, and JAX's Mosaic `attention_mgpu` (fwd, fp16).

B*S = 16k tokens, H*D = 2048, bf16. Every result is first checked against a float32 reference on the
last 256 query rows of batch 0 (forward, and dq/dk/dv with dO zero outside those rows, which makes
the sliced reference exact); over the threshold it is a FAIL, not a time. Shapes run in priority
order under a time budget, so a cut-short run still has the headline shapes.
Usage: PYTHONPATH=$PWD python3 scripts/bench_attention.py --plan first --budget-s 300 --out $OUT
       [--append-docs docs/archive/benchmarks-diary.md]   (--smoke: tiny interpret-mode run to check the script on CPU)
"""
import argparse
import dataclasses
import datetime
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.bench import diary, ptxas
from meshlab.bench.timing import median_time  # noqa: E402
from pallas_kernels.flash_attention import BlockSizes, flash_attention, flash_attention_reference

VARIANTS = {  # every variant tried is recorded; "def" is BlockSizes.default (C at d=128 since run 2)
    "def": None,
    "A": lambda d: BlockSizes(block_q=128, block_k=64, num_warps=4 if d <= 64 else 8, num_stages=3, block_q_dq=128,
                              block_k_dq=64, block_q_dkv=64, block_k_dkv=64, num_warps_bwd=4 if d <= 64 else 8,
                              num_stages_bwd=2),
    "B": lambda d: BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=2, block_q_dq=64, block_k_dq=64,
                              block_q_dkv=64, block_k_dkv=128, num_warps_bwd=8, num_stages_bwd=2),
    "C": lambda d: BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=3, block_q_dq=64, block_k_dq=64,
                              block_q_dkv=64, block_k_dkv=64, num_warps_bwd=4, num_stages_bwd=3),
    "E": lambda d: BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=4, block_q_dq=64, block_k_dq=64,
                              block_q_dkv=64, block_k_dkv=64, num_warps_bwd=4, num_stages_bwd=4),
    "F": lambda d: BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3, block_q_dq=128, block_k_dq=32,
                              block_q_dkv=32, block_k_dkv=128, num_warps_bwd=8, num_stages_bwd=3),
}
CHECK_ROWS, FWD_TOL, BWD_TOL = 256, 2e-2, 5e-2
TOKENS, HD, INTERPRET = 16384, 2048, False  # --smoke shrinks these to check the script on CPU
KV_GROUP = 1  # --kv-group: query heads per KV head (llama3_1b: 4), the model's GQA shape


# Mosaic GPU tile variants (--plan tiles), timed beside cuDNN at the model's shapes. "def" is
# MgpuBlockSizes() (at d=64 no longer the default: default_block_sizes); each other changes one knob of the forward
# (block_q, block_kv, stages, ping-pong) or of the backward (dQ's kv tile, dK/dV's q tile and kv rows, stages).
MGPU_VARIANTS = {
    "def": {}, "kv64": dict(block_kv=64), "st3": dict(num_stages=3), "nopp": dict(pingpong=False),
    "q256": dict(block_q=256), "q256kv64": dict(block_q=256, block_kv=64), "dq128": dict(block_kv_dq=128),
    "dkvq128": dict(block_q_dkv=128), "dkv256": dict(block_kv_dkv=256), "bst3": dict(num_stages_bwd=3),
    "dkvq128_dq128": dict(block_q_dkv=128, block_kv_dq=128), "dkvq128_bst3": dict(block_q_dkv=128, num_stages_bwd=3),
}


def impls(d):
    from jax.experimental.pallas.ops.gpu import attention as jmha
    out = {f"ours{v}": (lambda q, k, v, c, bs=VARIANTS[v]: flash_attention(q, k, v, causal=c, block_sizes=bs and bs(d),
                                                                                        interpret=INTERPRET))
           for v in VARIANTS}
    out["cudnn"] = lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn")
    from pallas_kernels.flash_attention_mgpu import flash_attention_mgpu  # Mosaic GPU (wgmma/TMA), sm_90 only
    out["ours_mgpu"] = lambda q, k, v, c: flash_attention_mgpu(q, k, v, causal=c)
    from pallas_kernels.flash_attention_mgpu import MgpuBlockSizes
    for name, over in MGPU_VARIANTS.items():
        out[f"mgpu_{name}"] = (lambda q, k, v, c, over=over:
                               flash_attention_mgpu(q, k, v, causal=c, block_sizes=MgpuBlockSizes(**over)))
    for name, bs in bwd_variants(d).items():   # backward variants (BWD_VARIANTS) at the default forward
        out[f"mgpu_bwd_{name}"] = lambda q, k, v, c, bs=bs: flash_attention_mgpu(q, k, v, causal=c, block_sizes=bs)
    out["xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla")
    out["pallas_mha"] = lambda q, k, v, c: jmha.mha(q, k, v, None, sm_scale=d ** -0.5, causal=c)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mg

        def mgpu(q, k, v, c):
            cfg = mg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=c)
            # attention_mgpu applies no softmax scale: fold ours into q (one fp16 rounding of q)
            qs = (q.astype(jnp.float32) * d ** -0.5).astype(jnp.float16)
            return mg.attention(qs, k.astype(jnp.float16), v.astype(jnp.float16), cfg)
        out["mgpu_fp16_fwd"] = mgpu
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print("attention_mgpu unavailable:", repr(e)[:200])
    return out


BWD_VARIANTS = {   # changes to default_block_sizes(d): the backward kernels compared by --bwd-alone
    "split": dict(fused_bwd=False), "fused": dict(fused_bwd=True),   # fused: dQ by TMA reduce-add
    "dq64": dict(fused_bwd=False, block_kv_dq=64),   # d=64: the dQ kernel's earlier 64-row K/V tile (d=128's default)
}


def bwd_variants(d):
    """BWD_VARIANTS at head dim d, the ones a user can reach: the fused backward takes d=64 only
    (FUSED_BWD_HEAD_DIMS; elsewhere the argument check refuses it)."""
    from pallas_kernels.flash_attention_mgpu import default_block_sizes
    from pallas_kernels.flash_attention_mgpu_tiles import FUSED_BWD_HEAD_DIMS
    return {name: dataclasses.replace(default_block_sizes(d), **over) for name, over in BWD_VARIANTS.items()
            if not over.get("fused_bwd") or d in FUSED_BWD_HEAD_DIMS}


def bench_bwd_alone(s, d, causal, names, tracker=None):
    """The backward alone on a saved (out, lse), ms per call (delta = rowsum(dO * O) included), for
    each variant of bwd_variants; for the split kernels also dQ and dK/dV apart. The gradients of
    every variant are checked against the first one's. tracker (ptxas.Tracker): each row also lists
    the registers and spills of the Mosaic kernels it compiled."""
    from pallas_kernels import flash_attention_mgpu as fm, flash_attention_mgpu_bwd as fb
    from pallas_kernels.flash_attention import output_grad_rowsum
    b, h = TOKENS // s, HD // d
    q, k, v, do = random_inputs(7 * s + d + causal, b, s, h, d)
    rows, want = [], None
    for name in names:
        row = dict(kind="bwd_alone", impl=name, S=s, D=d, B=b, H=h, KVH=h // KV_GROUP, causal=causal)
        rows.append(row)
        try:
            if name not in bwd_variants(d):
                raise ValueError(f"{name} is not a backward this head dim takes ({d=})")
            cfg = fm.make_config(q, k, v, causal, None, bwd_variants(d)[name], False)
            out, lse = jax.jit(lambda q, k, v, cfg=cfg: fm.forward_call(q, k, v, cfg))(q, k, v)
            bwd = jax.jit(lambda q, k, v, out, lse, do, cfg=cfg: fm.backward(cfg, (q, k, v), (out, lse), (do,)))
            got = bwd(q, k, v, out, lse, do)
            want = want or got
            row["err_vs_first"] = err = max(rel(g, w) for g, w in zip(got, want))
            if not err < 1e-2:
                row["error"] = f"gradients differ from {names[0]}'s by {err:.3g}"
                continue
            row["bwd_ms"] = timeit(bwd, q, k, v, out, lse, do) * 1e3
            if not cfg.bs.fused_bwd:
                row["dq_ms"] = timeit(jax.jit(lambda *a, cfg=cfg: fb.dq_call(*a, cfg)), q, k, v, do, lse, out) * 1e3
                row["dkv_ms"] = timeit(jax.jit(lambda *a, cfg=cfg: fb.dkv_call(*a, cfg)),
                                       q, k, v, do, lse, output_grad_rowsum(out, do)) * 1e3
        except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported, not fatal
            row["error"] = describe(e)
        if tracker:
            row["ptxas"] = [dataclasses.asdict(r) for r in tracker.new()]
    return rows


def random_inputs(seed, b, s, h, d):
    """Fresh bf16 q, k, v, dO: q and dO [b, s, h, d], k and v [b, s, h / KV_GROUP, d] (never zeros)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(kk, (b, s, h // (KV_GROUP if i in (1, 2) else 1), d), jnp.float32)
                 .astype(jnp.bfloat16) for i, kk in enumerate(ks))


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def timeit(f, *args, warmup=10, reps=10):
    # 5 calls per sample: the 2026-12-01 tiles run (1 call per sample, 2 warm-up) timed one
    # kernel's forward at 0.91-1.41 ms across variants that do not change it
    return median_time(f, *args, warmup=warmup, reps=reps, inner=5)


def unavailable(name, backend):
    """Why impl `name` cannot run on `backend` ("gpu", "cpu", ...), or None: cuDNN and the Mosaic GPU
    kernels have no CPU or interpret-mode path."""
    if backend == "gpu":
        return None
    if name == "cudnn":
        return f"cuDNN attention needs an NVIDIA GPU, not on {backend}"
    if "mgpu" in name:
        return f"a Mosaic GPU kernel: needs a Hopper (sm_90) GPU, not on {backend}"
    return None


def describe(e):
    """An exception as one line; one without a message (a bare assert) names where it was raised."""
    msg = str(e).splitlines()[0][:160] if str(e).strip() else ""
    if not msg and e.__traceback__ is not None:
        last = traceback.extract_tb(e.__traceback__)[-1]
        msg = f"no message, raised at {os.path.basename(last.filename)}:{last.lineno}"
    return f"{type(e).__name__}: {msg}"


def bench_shape(name, fn, s, d, causal, fwd_only, ref_cache):
    b, h = TOKENS // s, HD // d
    if h % KV_GROUP:
        return dict(impl=name, S=s, D=d, B=b, H=h, causal=causal, error=f"{h} heads: not a multiple of --kv-group")
    why = unavailable(name, jax.default_backend())
    if why:
        return dict(impl=name, S=s, D=d, B=b, H=h, causal=causal, error=why)
    q, k, v, do = random_inputs(s + d + causal, b, s, h, d)
    # checking: only the checked rows carry a cotangent; timing uses the full random dO (never zeros)
    do_chk = do.at[:, : s - CHECK_ROWS].set(0)

    def fb(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
        return vjp(do.astype(o.dtype))
    key = (s, d, causal)
    if key not in ref_cache:
        f32 = lambda x: x[:1].astype(jnp.float32)  # noqa: E731
        (ro, vjp) = jax.vjp(lambda q, k, v: flash_attention_reference(q, k, v, causal=causal),
                            f32(q)[:, -CHECK_ROWS:], f32(k), f32(v))
        ref_cache.clear()
        ref_cache[key] = (ro, vjp(f32(do_chk)[:, -CHECK_ROWS:]))
    ro, (rdq, rdk, rdv) = ref_cache[key]
    row = dict(impl=name, S=s, D=d, B=b, H=h, KVH=h // KV_GROUP, causal=causal)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    try:
        fwd = jax.jit(lambda q, k, v: fn(q, k, v, causal))
        err = rel(first_call(row, "fwd", fwd, q, k, v)[:1, -CHECK_ROWS:], ro)
        row["fwd_err"] = err
        if not err < FWD_TOL:
            row["fwd"] = "FAIL"
        else:
            t = timeit(fwd, q, k, v)
            row.update(fwd_ms=t * 1e3, fwd_tflops=flops / t / 1e12)
        if not fwd_only:
            fwdbwd = jax.jit(fb)
            dq, dk, dv = first_call(row, "fwdbwd", fwdbwd, q, k, v, do_chk)
            err = max(rel(dq[:1, -CHECK_ROWS:], rdq), rel(dk[:1], rdk), rel(dv[:1], rdv))
            row["bwd_err"] = err
            if not err < BWD_TOL:
                row["fwdbwd"] = "FAIL"
            else:
                t = timeit(fwdbwd, q, k, v, do)
                row.update(fwdbwd_ms=t * 1e3, fwdbwd_tflops=3.5 * flops / t / 1e12)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is reported
        row["error"] = describe(e)
    return row


def first_call(row, what, jitted, *args):
    """jitted(*args), announced before it starts and its seconds (compile + one run) kept in
    row[f"{what}_first_s"]: a compile that stalls names its row in the log."""
    print(f"compiling {row['impl']} {what} S={row['S']} D={row['D']} causal={row['causal']} ...", flush=True)
    t = time.perf_counter()
    out = jax.block_until_ready(jitted(*args))
    row[f"{what}_first_s"] = round(time.perf_counter() - t, 1)
    return out


def plan(which):
    """(S, D, causal, impl names) in priority order: the issue's headline shapes first."""
    peers = ["cudnn", "xla", "pallas_mha", "mgpu_fp16_fwd"]
    if which == "first":  # run 1: variants A, B, C at the headline shapes
        first = [(s, 128, c) for c in (True, False) for s in (4096, 8192)]
        second = [(s, 64, c) for c in (True, False) for s in (4096, 8192)]
        rest = [(s, d, c) for s in (2048, 1024, 16384) for d in (128, 64) for c in (True, False)]
        out = [(s, d, c, ["oursA", "oursB", "oursC"] + peers) for s, d, c in first]
        out += [(s, d, c, ["oursA", "oursB"] + peers) for s, d, c in second]
        return out + [(s, d, c, ["oursA"] + peers) for s, d, c in rest]
    if which.startswith("full"):  # every shape of the issue with every peer; "full64"/"full128": one head dim
        dims = {"full": (64, 128), "full64": (64,), "full128": (128,)}[which]
        return [(s, d, c, ["ours_mgpu", "cudnn", "pallas_mha", "xla", "mgpu_fp16_fwd"])
                for s in (2048, 4096, 8192, 16384, 1024) for d in dims for c in (True, False)]
    if which == "mgpu":
        # The Mosaic GPU kernel (ours_mgpu: flash_attention_mgpu's defaults, default_block_sizes(d), and
        # the backward use_fused_bwd picks: fused at d=64 causal S >= 4096, split dQ + dK/dV elsewhere,
        # so the split kernels at every d=128 shape) beside the Triton kernel and cuDNN
        shapes = [(2048, 64, True), (8192, 64, True), (2048, 128, True), (8192, 128, True), (8192, 128, False)]
        return [(s, d, c, ["ours_mgpu", "oursdef", "cudnn"]) for s, d, c in shapes]
    if which == "fused":  # the one-kernel backward against the split one and cuDNN, each twice (drift)
        names = ["cudnn", "ours_mgpu", "mgpu_bwd_fused"] * 2
        # d=64 only: at d=128 the fused backward is refused (flash_attention_mgpu_tiles.check_fused_bwd)
        return [(s, d, c, names) for s, d, c in ((4096, 64, True), (2048, 64, True), (8192, 64, True),
                                                 (4096, 64, False))]
    if which == "bwd":  # the backward variants (BWD_VARIANTS) against cuDNN at the model's shapes
        names = ["cudnn", "mgpu_bwd_split", "mgpu_bwd_dq64"] * 2
        return [(s, d, True, names) for s, d in ((4096, 64), (4096, 128), (2048, 64), (8192, 64))]
    if which == "tiles2":  # the second tiles run: the D=64 winners of the first, each twice
        names = ["cudnn", "ours_mgpu", "mgpu_def", "mgpu_dkvq128_dq128", "mgpu_dkvq128_bst3", "mgpu_bst3"]
        return [(s, 64, True, names + names) for s in (4096, 2048, 8192)]
    if which == "tiles":  # the model's shapes (llama3_1b: D=64, causal; use --kv-group 4)
        names = ["cudnn"] + [f"mgpu_{v}" for v in MGPU_VARIANTS] + ["cudnn"]   # cuDNN twice: the drift
        return [(s, 64, True, names) for s in (4096, 2048, 8192)] + [(4096, 128, True, names)]
    if which == "third":  # run 3: the tiles runs 1-2 left untimed, then every shape not yet measured
        return [(8192, 128, True, ["oursE", "oursF", "oursdef", "cudnn"])] + [
            (s, d, c, ["oursdef", "cudnn", "pallas_mha", "xla"]) for s, d, c in _UNMEASURED]
    # run 2: the mgpu peer with its scale fixed, two more variants, then the shapes run 1 missed
    # first: the default (C tiles) with the kv-major dK/dV kernel, against run 1's oursC
    out = [(s, 128, True, ["oursdef"]) for s in (8192, 4096)]
    out += [(s, 128, c, ["mgpu_fp16_fwd"]) for c in (True, False) for s in (4096, 8192)]
    out += [(8192, 128, True, ["oursE", "oursF"])]
    return out + [(s, d, c, ["oursdef", "cudnn", "pallas_mha", "xla"]) for s, d, c in _UNMEASURED]


_UNMEASURED = [(2048, 128, True), (16384, 128, True), (8192, 64, True), (1024, 128, True), (2048, 64, True),
               (16384, 64, True), (2048, 128, False), (16384, 128, False), (4096, 64, False), (8192, 64, False),
               (1024, 64, True), (1024, 128, False), (2048, 64, False), (16384, 64, False), (1024, 64, False)]


def parse_shape(spec):
    """S:D:causal|full -> (S, D, causal), one clear error otherwise."""
    try:
        s, d, mask = spec.split(":")
        if mask not in ("causal", "full"):
            raise ValueError
        return int(s), int(d), mask == "causal"
    except ValueError:
        raise SystemExit(f"error: --shapes entry {spec!r} must be S:D:causal or S:D:full, e.g. 8192:128:causal")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--out", help="where the rows go (default: $OUT, else a temporary directory)")
    ap.add_argument("--plan", default="second", choices=("first", "second", "third", "mgpu", "tiles", "tiles2",
                                                       "fused", "bwd", "full", "full64", "full128"))
    ap.add_argument("--bwd-alone", default=None, help="S,D,causal[;...]: first time the backward kernels alone "
                    "(--bwd-variants, twice each), e.g. '4096,64,1;4096,128,1'")
    ap.add_argument("--bwd-variants", default="split,fused", help=f"names from {sorted(BWD_VARIANTS)}")
    ap.add_argument("--shapes", default=None, help="comma-separated S:D:causal|full: only these shapes of the plan "
                    "run (e.g. 8192:128:causal)")
    ap.add_argument("--impls", default=None, help="comma-separated impl names: only these run (e.g. ours_mgpu,cudnn)")
    ap.add_argument("--kv-group", type=int, default=1, help="query heads per KV head (GQA); 4 is llama3_1b's")
    ap.add_argument("--append-docs", default=None, help="also append the table to this file (docs/archive/benchmarks-diary.md)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode: CPU check of the script")
    ap.add_argument("--ptxas", nargs="?", const="/tmp/meshlab_ptxas", default=None, metavar="DUMP_DIR",
                    help="record each Mosaic kernel's registers and spills (ptxas -v) in its rows and in "
                         "OUT/ptxas.md; the raw reports go to DUMP_DIR (default /tmp/meshlab_ptxas)")
    args = ap.parse_args()
    args.out = str(diary.out_dir("bench_attention", args.out))
    tracker = ptxas.Tracker(ptxas.enable(args.ptxas)) if args.ptxas else None   # before any compile
    global TOKENS, HD, INTERPRET, CHECK_ROWS, KV_GROUP
    KV_GROUP = args.kv_group
    if args.smoke:
        TOKENS, HD, INTERPRET, CHECK_ROWS = 512, 256, True, 32
    t0 = time.time()
    dev = jax.devices()[0].device_kind
    rows, ref_cache = [], {}
    jsonl = open(os.path.join(args.out, "bench_attention.jsonl"), "w")
    for spec in (args.bwd_alone.split(";") if args.bwd_alone else []):
        if time.time() - t0 > args.budget_s:
            break
        s, d, causal = (int(x) for x in spec.split(","))
        for row in bench_bwd_alone(min(s, TOKENS // 2), d, bool(causal), args.bwd_variants.split(",") * 2, tracker):
            row.update(device=dev, jax=jax.__version__)
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            print(json.dumps(row), flush=True)
    only = {parse_shape(x) for x in args.shapes.split(",")} if args.shapes else None
    for s, d, causal, names in plan(args.plan):
        if only is not None and (s, d, causal) not in only:
            continue
        if s > TOKENS:
            s = TOKENS // 2
        table = impls(d)
        for name in names:
            if time.time() - t0 > args.budget_s:
                break
            if name not in table or (args.impls and name not in args.impls.split(",")):
                continue
            row = bench_shape(name, table[name], s, d, causal, name == "mgpu_fp16_fwd", ref_cache)
            row.update(device=dev, jax=jax.__version__)
            if tracker:
                row["ptxas"] = [dataclasses.asdict(r) for r in tracker.new()]
            rows.append(row)
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            print(json.dumps(row), flush=True)
    write_md(rows, os.path.join(args.out, "attention_rows.md"), dev)
    if args.append_docs:  # off on the lent GPU, whose copy of the repo does not come back
        diary.append("\n" + open(os.path.join(args.out, "attention_rows.md")).read(), path=args.append_docs,
                     backend=jax.default_backend())
    print(open(os.path.join(args.out, "attention_rows.md")).read())
    if tracker:
        table = ptxas.markdown(ptxas.read(tracker.dir))
        open(os.path.join(args.out, "ptxas.md"), "w").write(table)
        print(table)
    print(f"bench wall {time.time() - t0:.0f}s, {len(rows)} measurements")


def _cell(r, k):
    if r.get("error"):
        return "ERR"
    if r.get(k) == "FAIL":
        return "FAIL"
    return tflops_text(r.get(f"{k}_tflops"))


def tflops_text(v):
    """A rate with enough digits to tell CPU-sized rates apart (0.00123, not 0)."""
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def write_md(rows, path, dev):
    """One dated line per (shape): TFLOP/s fwd / fwd+bwd for each impl, and ours/cuDNN ratios."""
    today = datetime.date.today().isoformat()
    shapes = sorted({(r["S"], r["D"], r["causal"]) for r in rows}, key=lambda x: (x[1], x[2], x[0]))
    names = list(dict.fromkeys(r["impl"] for r in rows))
    head = "| date | device | jax | B x S x H x D | causal | " + " | ".join(names)
    lines = [head + " | ours/cudnn fwd | ours/cudnn f+b |",
             "| --- " * (len(names) + 7) + "|"]
    for s, d, c in shapes:
        by = {r["impl"]: r for r in rows if (r["S"], r["D"], r["causal"]) == (s, d, c)}
        cells = [f"{_cell(by[n], 'fwd')} / {_cell(by[n], 'fwdbwd')}" if n in by else "" for n in names]
        a, cu = by.get("ours_mgpu", by.get("oursdef", by.get("oursC", by.get("oursA", {})))), by.get("cudnn", {})
        ratio = lambda k: (f"{a[k] / cu[k]:.2f}" if a.get(k) and cu.get(k) else "-")  # noqa: E731
        heads = f"{HD // d}" if KV_GROUP == 1 else f"{HD // d}/{HD // d // KV_GROUP}kv"
        lines.append(f"| {today} | {dev} | {jax.__version__} | {TOKENS // s}x{s}x{heads}x{d} | {c} | "
                     + " | ".join(cells) + f" | {ratio('fwd_tflops')} | {ratio('fwdbwd_tflops')} |")
    errors = dict.fromkeys(f"ERR {r['impl']}: {r['error']}" for r in rows if r.get("error"))
    lines += ["", *errors] if errors else []
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
