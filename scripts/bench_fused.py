"""Benchmark the fused ops against XLA's fusion of their jnp references (and, for the
cross-entropy, against the chunked jnp version): same shapes, one process, correctness checked
against the fp32-accumulated reference before any time is reported.

    PYTHONPATH=$PWD python3 scripts/bench_fused.py [--ops slab,ce,swiglu,rmsnorm,rope,embed] [--out DIR]
    PYTHONPATH=$PWD python3 scripts/bench_fused.py --small --interpret   # CPU smoke test of this script

Times: jit, 2 warm-up calls, then the median of --reps synchronised calls. Memory: the compiled
program's memory_analysis (temp = scratch XLA allocates besides arguments and outputs).
Writes table.md, rows.md (dated rows for docs/archive/benchmarks-diary.md) and results.json to --out.
"""
import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.bench import diary  # noqa: E402
from meshlab.bench.timing import median_time  # noqa: E402
from pallas_kernels import cross_entropy_onepass as onepass
from pallas_kernels import fused_cross_entropy as ce
from pallas_kernels import fused_rmsnorm as rn
from pallas_kernels import rope
from pallas_kernels import swiglu as sg

GB = 1e9


def timeit(f, args, reps):
    return median_time(f, *args, warmup=2, reps=reps) * 1e3


def mem(f, args):
    m = f.lower(*args).compile().memory_analysis()
    if m is None:
        return float("nan"), float("nan")
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return m.temp_size_in_bytes / GB, total / GB


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def train_fn(loss):
    """value and grads of sum(loss(args) * cot) w.r.t. the float inputs, as one jitted program."""
    def f(*args):
        flo = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

        def scalar(*fl):
            full = list(args)
            for i, v in zip(flo, fl):
                full[i] = v
            out = loss(*full)
            return sum(jnp.sum(o.astype(jnp.float32) ** 2) * 0.5 for o in jax.tree.leaves(out))
        return jax.value_and_grad(scalar, tuple(range(len(flo))))(*[args[i] for i in flo])
    return jax.jit(f)


def case(rows, op, shape, name, fn, args, ref_out, reps, tol, flops=None):
    """Check fn against ref_out, then time it and read its compiled memory; append a row."""
    jf = jax.jit(fn) if not hasattr(fn, "lower") else fn
    try:
        out = jf(*args)
        err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out)))
        if not err < tol:
            rows.append(dict(op=op, shape=shape, impl=name, ms=None, err=err, note=f"WRONG (>{tol}), not timed"))
            print(f"{op:10s} {name:28s} WRONG err={err:.3g}", flush=True)
            return out
        ms = timeit(jf, args, reps)
        temp, total = mem(jf, args)
        row = dict(op=op, shape=shape, impl=name, ms=ms, err=err, temp_gb=temp, total_gb=total)
        if flops:
            row["tflops"] = flops / ms / 1e9
        rows.append(row)
        print(f"{op:10s} {name:28s} {ms:9.3f} ms  err {err:.2e}  temp {temp:7.3f} GB  total {total:7.3f} GB"
              + (f"  {row['tflops']:.0f} TFLOP/s" if flops else ""), flush=True)
        return out
    except Exception as e:  # one failing variant must not hide the others' numbers
        rows.append(dict(op=op, shape=shape, impl=name, ms=None, err=None, note=f"failed: {type(e).__name__}: {e}"[:300]))
        print(f"{op:10s} {name:28s} FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
        return None


def _model_dense_ce(h, w, y):
    from models.vjp_ops import mm_f32_out
    logits = mm_f32_out("td,dv->tv", h, w)                                        # [T, V] fp32
    lse = jax.nn.logsumexp(logits, axis=-1)
    label = jnp.take_along_axis(logits, jnp.clip(y, 0, w.shape[1] - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(y >= 0, lse - label, 0.0)                                     # [T], as the reference


def bench_ce(rows, a):
    t, d, v = (16384, 2048, 128256) if not a.small else (256, 64, 1000)
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (t, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, v), jnp.float32) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (t,), 0, v).at[::50].set(-1)
    shape = f"T={t} d={d} V={v} bf16"
    flops = 6 * t * d * v  # fwd 2TdV + bwd 4TdV (the useful work, not our recomputation)
    f_ref = train_fn(lambda h, w, y: ce.cross_entropy_reference(h, w, y))
    ref = case(rows, "ce", shape, "xla_reference", f_ref, (h, w, y), f_ref(h, w, y), a.reps, 1e-6, flops)
    # The model's dense loss: fp32 logits out, but a bf16 backward (models.vjp_ops.mm_f32_out); the
    # reference above transposes with fp32 cotangents, i.e. fp32 GEMMs, so it flatters the kernel.
    case(rows, "ce", shape, "xla_model_dense(bf16 bwd)", train_fn(_model_dense_ce), (h, w, y), ref, a.reps, 2e-2, flops)
    for cs in ((4096, 2048) if not a.small else (64,)):
        case(rows, "ce", shape, f"chunked_jnp(chunk={cs})",
             train_fn(lambda h, w, y, cs=cs: ce.chunked_cross_entropy(h, w, y, chunk_size=cs)),
             (h, w, y), ref, a.reps, 2e-2, flops)
    # run 1 (docs/archive/benchmarks-diary.md) swept 128/128, 256/256 and 64/256 tiles; 256/256 was best (220 ms)
    configs = [ce.BlockSizes(),  # the defaults (slab backward); run 2's rows below chose them
               ce.BlockSizes(fwd_v=256, bwd_v=256, bwd_chunk=0),
               ce.BlockSizes(fwd_v=256, bwd_v=256, dw_t=256, dw_v=128, bwd_chunk=0),
               ce.BlockSizes(fwd_v=128, bwd_v=128, bwd_chunk=4096),
               ce.BlockSizes(fwd_v=128, bwd_chunk=2048)]
    for bs in configs if not a.small else configs[:1]:
        tag = (f"pallas(t{bs.fwd_t}/{bs.bwd_t} v{bs.fwd_v}/{bs.bwd_v} s{bs.fwd_splits} w{bs.num_warps}"
               + (f" dw{bs.dw_t}/{bs.dw_v}" if bs.dw_t else "") + (f" slab{bs.bwd_chunk}" if bs.bwd_chunk else "") + ")")
        case(rows, "ce", shape, tag,
             train_fn(lambda h, w, y, bs=bs: ce.fused_cross_entropy(h, w, y, block_sizes=bs, interpret=a.interpret)),
             (h, w, y), ref, a.reps, 2e-2, flops)
    # One pass: gradients of the loss *sum* (its only output), made in the forward. The same GEMM
    # work as the rows above (whose per-token cotangent costs nothing extra), so its time compares
    # with them; its values are checked against the reference's sum and its gradients.
    sum_grads = lambda loss: jax.jit(lambda h, w, y: jax.value_and_grad(loss, (0, 1))(h, w, y))  # noqa: E731
    ref_sum = sum_grads(lambda h, w, y: jnp.sum(ce.cross_entropy_reference(h, w, y)))(h, w, y)
    for cs in ((2048, 4096) if not a.small else (64, 100)):
        case(rows, "ce", shape, f"onepass(chunk={cs})",
             sum_grads(lambda h, w, y, cs=cs: onepass.onepass_cross_entropy_sum(h, w, y, chunk_size=cs)),
             (h, w, y), ref_sum, a.reps, 2e-2, flops)
    del ref_sum
    # forward only (inference / eval loss)
    f_ref = jax.jit(lambda h, w, y: ce.cross_entropy_reference(h, w, y))
    ref = case(rows, "ce_fwd", shape, "xla_reference", f_ref, (h, w, y), f_ref(h, w, y), a.reps, 1e-6)
    case(rows, "ce_fwd", shape, "onepass(chunk=2048) sum, primal",
         lambda h, w, y: onepass.onepass_cross_entropy_sum(h, w, y, chunk_size=2048), (h, w, y), jnp.sum(ref),
         a.reps, 2e-2)
    case(rows, "ce_fwd", shape, "chunked_jnp(chunk=4096)",
         lambda h, w, y: ce.chunked_cross_entropy(h, w, y, chunk_size=4096), (h, w, y), ref, a.reps, 2e-2)
    for fv in (128, 256):
        case(rows, "ce_fwd", shape, f"pallas(fwd_v={fv})",
             lambda h, w, y, fv=fv: ce.fused_cross_entropy(h, w, y, block_sizes=ce.BlockSizes(fwd_v=fv),
                                                           interpret=a.interpret), (h, w, y), ref, a.reps, 2e-2)


def bench_slab(rows, a):
    """The onepass loss's passes over one [8192, V] logits slab, what runs between its head GEMM and its
    gradient GEMMs: XLA's fusions of the jnp passes (onepass.slab_passes) against softmax_rows'
    kernels, fp32 and bf16 slabs; the statistics and dlogits (bf16) timed apart, then both. GB/s
    over the least traffic: one read for the statistics, one read + one bf16 write for dlogits."""
    from pallas_kernels import softmax_rows as sr
    n, v = (8192, 128256) if not a.small else (64, 1000)
    k = jax.random.split(jax.random.key(3), 2)
    y = jax.random.randint(k[1], (n,), 0, v).at[::50].set(-1)
    cp = cy = (y >= 0).astype(jnp.float32)
    stats_tiles = [(1, 4096, 8, 2), (1, 8192, 8, 2), (2, 4096, 8, 2), (4, 2048, 8, 2), (8, 1024, 4, 2)]
    grad_tiles = [(16, 512, 8, 2), (32, 256, 4, 2), (8, 1024, 4, 2)]
    for dt in (jnp.float32, jnp.bfloat16):
        x = (jax.random.normal(k[0], (n, v), jnp.float32) * 3).astype(dt)
        isz = jnp.dtype(dt).itemsize
        shape = f"n={n} V={v} {jnp.dtype(dt).name} slab"
        name = jnp.dtype(dt).name
        both = lambda sm: jax.jit(lambda x, y: onepass.slab_passes(x, y, -1, 0.0, True, jnp.bfloat16, sm,  # noqa: E731
                                                                   a.interpret))
        op = f"slab_{name}"
        ref = case(rows, op, shape, "xla_reference", both("xla"), (x, y), both("xla")(x, y), a.reps, 1e-6)
        _gbps(rows, (2 * n * v * isz + n * v * 2) / GB)
        case(rows, op, shape, "pallas (defaults)", both("pallas"), (x, y), ref, a.reps, 1e-2)
        _gbps(rows, (2 * n * v * isz + n * v * 2) / GB)
        op = f"stats_{name}"
        xla_stats = jax.jit(lambda x, y: sr.softmax_stats_reference(x, y))
        ref = case(rows, op, shape, "xla_reference", xla_stats, (x, y), xla_stats(x, y), a.reps, 1e-6)
        _gbps(rows, n * v * isz / GB)
        for r_, c_, w_, s_ in stats_tiles if not a.small else stats_tiles[:1]:
            bs = sr.RowBlocks(stats_rows=r_, stats_cols=c_, num_warps=w_, num_stages=s_)
            f = jax.jit(lambda x, y, bs=bs: sr.softmax_stats(x, y, blocks=bs, interpret=a.interpret))
            case(rows, op, shape, f"pallas({r_}x{c_} w{w_} s{s_})", f, (x, y), ref, a.reps, 1e-5)
            _gbps(rows, n * v * isz / GB)
        op = f"grad_{name}"
        lse = ref[0]
        xla_grad = jax.jit(lambda x, lse, y: sr.softmax_grad_reference(x, lse, y, cp, cy, jnp.bfloat16))
        ref = case(rows, op, shape, "xla_reference", xla_grad, (x, lse, y), xla_grad(x, lse, y), a.reps, 1e-6)
        _gbps(rows, (n * v * isz + n * v * 2) / GB)
        for r_, c_, w_, s_ in grad_tiles if not a.small else grad_tiles[:1]:
            bs = sr.RowBlocks(grad_rows=r_, grad_cols=c_, num_warps=w_, num_stages=s_)
            f = jax.jit(lambda x, lse, y, bs=bs: sr.softmax_grad(x, lse, y, cp, cy, out_dtype=jnp.bfloat16, blocks=bs,
                                                                 interpret=a.interpret))
            case(rows, op, shape, f"pallas({r_}x{c_} w{w_} s{s_})", f, (x, lse, y), ref, a.reps, 1e-2)
            _gbps(rows, (n * v * isz + n * v * 2) / GB)


def _gbps(rows, gb):
    if rows and rows[-1].get("ms"):
        rows[-1]["gbps"] = gb / rows[-1]["ms"] * 1e3
        print(f"{'':10s} {rows[-1]['gbps']:,.0f} GB/s", flush=True)


def bench_pair(rows, a, op, shape, ours, ref_fn, args, tol, flops=None):
    """ours: one function, or {variant name: function}."""
    ours = ours if isinstance(ours, dict) else {"pallas": ours}
    for mode, wrap in (("fwd", jax.jit), ("fwd+bwd", train_fn)):
        r = wrap(ref_fn)
        fl = flops and (flops if mode == "fwd" else 3 * flops)
        ref = case(rows, f"{op}_{mode}", shape, "xla_reference", r, args, r(*args), a.reps, 1e-6, fl)
        for name, fn in ours.items():
            case(rows, f"{op}_{mode}", shape, name, wrap(fn), args, ref, a.reps, tol, fl)


def bench_embed(rows, a):
    """The embedding lookup's gradient, b*s rows scatter-added into [V, d], on byte text (a few hundred
    ids, the frequent ones thousands of times) and on random ids: embed_lookup (fp32 sums, rounded once)
    against autodiff of a bf16 take (bf16 adds: no hardware atomic, and rounded at every add). Both are
    timed whatever their error, which the row reports against the fp32 lookup's gradient."""
    from flax import nnx
    from meshlab.bench.train import sample_tokens
    from models.llama import embed_lookup
    v, d, n = (128256, 2048, 16384) if not a.small else (1000, 64, 512)
    w = jax.random.normal(jax.random.key(2), (v, d), jnp.float32)
    variants = {"embed_lookup (fp32 sums)": lambda w, t: embed_lookup(nnx.Param(w, logical=("vocab", "embed")),
                                                                         t, jnp.bfloat16),
                "bf16 take, autodiff": lambda w, t: jnp.take(w.astype(jnp.bfloat16), t, axis=0)}
    ref_fn = train_fn(lambda w, t: jnp.take(w, t, axis=0))
    for kind in ("text", "random"):
        tokens = jnp.asarray(sample_tokens(kind, v, (n,)))
        ref = ref_fn(w, tokens)
        op, shape = f"embed_{kind}_fwd+bwd", f"T={n} V={v} d={d}"
        case(rows, op, shape, "xla_reference", ref_fn, (w, tokens), ref, a.reps, 1e-6)   # fp32 take
        for name, fn in variants.items():
            case(rows, op, shape, name, train_fn(fn), (w, tokens), ref, a.reps, float("inf"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="ce,swiglu,rmsnorm,rope", help="any of slab,ce,swiglu,rmsnorm,rope,embed")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--out", help="where its files go (default: $OUT, else a temporary directory)")
    a = p.parse_args()
    a.out = str(diary.out_dir("bench_fused", a.out))
    rows = []
    ops = a.ops.split(",")
    k = jax.random.split(jax.random.key(1), 6)
    bf = jnp.bfloat16
    if "slab" in ops:
        bench_slab(rows, a)
    if "ce" in ops:  # first: the op that matters most, in case the run is cut short
        bench_ce(rows, a)
    if "embed" in ops:
        bench_embed(rows, a)
    if "swiglu" in ops:
        t, d, f = (16384, 2048, 8192) if not a.small else (100, 64, 128)
        x = jax.random.normal(k[0], (t, d)).astype(bf)
        wg, wu = (jax.random.normal(kk, (d, f)) * 0.02 for kk in k[1:3])
        args = (x, wg.astype(bf), wu.astype(bf))
        bench_pair(rows, a, "swiglu", f"T={t} d={d} f={f} bf16",
                   lambda x, g, u: sg.swiglu(x, g, u, interpret=a.interpret), sg.swiglu_reference, args, 2e-2,
                   flops=4 * t * d * f)
    if "rmsnorm" in ops:
        t, d = (16384, 2048) if not a.small else (100, 64)
        args = (jax.random.normal(k[3], (t, d)).astype(bf), jax.random.normal(k[4], (t, d)).astype(bf),
                (1 + 0.1 * jax.random.normal(k[5], (d,))).astype(bf))
        bench_pair(rows, a, "rmsnorm+res", f"T={t} d={d} bf16",
                   lambda x, r, w: rn.rms_norm(x, w, eps=1e-5, residual=r, interpret=a.interpret),
                   lambda x, r, w: rn.rms_norm_reference(x, w, eps=1e-5, residual=r), args, 1e-2)
    if "rope" in ops:
        b, s, h, kvh, hd = (4, 4096, 32, 8, 64) if not a.small else (1, 64, 4, 2, 16)
        q = jax.random.normal(k[0], (b, s, h, hd)).astype(bf)
        kk = jax.random.normal(k[1], (b, s, kvh, hd)).astype(bf)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        sc = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        variants = {f"pallas(rows={br} w{nw})": (lambda q, k_, p, bs=rope.BlockSizes(br, nw): rope.apply_rope(
            q, k_, p, theta=5e5, scaling=sc, interpret=a.interpret, block_sizes=bs)) for br, nw in ((16, 4), (64, 8))}
        bench_pair(rows, a, "rope", f"b={b} s={s} h={h}/{kvh} d={hd} bf16", variants,
                   lambda q, k_, p: rope.apply_rope_reference(q, k_, p, theta=5e5, scaling=sc), (q, kk, pos), 1e-2)

    dev = jax.devices()[0]
    stamp = datetime.date.today().isoformat()
    head = "| date | device | jax | op | shapes | impl | ms | vs XLA | rel err | temp GB | total GB |"
    lines = [head, "|" + " --- |" * 11]
    ref_ms = {r["op"]: r["ms"] for r in rows if r["impl"] == "xla_reference" and r["ms"]}
    for r in rows:
        ratio = (f"{ref_ms[r['op']] / r['ms']:.2f}x" if r["ms"] and r["op"] in ref_ms else "-")
        ms = f"{r['ms']:.3f}" if r["ms"] else r.get("note", "-")
        err = f"{r['err']:.1e}" if r.get("err") is not None else "-"
        lines.append(f"| {stamp} | {dev.device_kind} | {jax.__version__} | {r['op']} | {r['shape']} | {r['impl']}"
                     + (f" {r['gbps']:,.0f} GB/s" if r.get("gbps") else "") + " | "
                     f"{ms} | {ratio} | {err} | {r.get('temp_gb', float('nan')):.2f} | "
                     f"{r.get('total_gb', float('nan')):.2f} |")
    table = "\n".join(lines)
    for name, text in (("table.md", table), ("rows.md", "\n".join(lines[2:]))):
        with open(os.path.join(a.out, name), "w") as fh:
            fh.write(text + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, date=stamp, rows=rows), fh, indent=1)
    print("\n" + table)


if __name__ == "__main__":
    main()
