"""Ring attention's overhead on one GPU: context size 1 with the ring code path forced on, against
the plain kernels (our Pallas FlashAttention, cuDNN), causal, S = 8k..32k, bf16, fwd and fwd+bwd.

Each result is first checked against a float32 reference on the last CHECK_ROWS query rows of
batch 0 (forward; and dq/dk/dv with dO zero outside those rows, which makes the sliced reference
exact); over the tolerance it is a FAIL, not a time. Prints a table, writes it to --out ($OUT or a temp dir), and
appends dated rows to docs/archive/benchmarks-diary.md under "## Context parallel".
Usage: PYTHONPATH=$PWD python3 scripts/bench_ring.py [--budget-s 400] [--out $OUT] [--smoke]
"""
import argparse
import datetime
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from meshlab.bench import diary  # noqa: E402
from meshlab.bench.timing import median_time  # noqa: E402
from meshlab.parallel.ring_attention import ring_attention  # noqa: E402
from pallas_kernels.attention import xla_attention  # noqa: E402

CHECK_ROWS, FWD_TOL, BWD_TOL = 256, 2e-2, 5e-2
SECTION = "## Context parallel"


def impls(mesh, interpret):
    out = {}
    try:
        from pallas_kernels.flash_attention import flash_attention
        out["flash(plain)"] = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=interpret)
        out["ring+pallas"] = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True, block_impl="pallas")
    except ImportError as e:
        print("pallas flash attention unavailable:", e)
    if jax.default_backend() == "gpu":
        out["cudnn(plain)"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                            implementation="cudnn")
    out["ring+jnp"] = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True, block_impl="jnp", block_k=512)
    return out


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.isfinite(a).all() else float("nan")


def timeit(f, *args, warmup=2, reps=5):
    return median_time(f, *args, warmup=warmup, reps=reps)


def reference(q, k, v, do_chk):
    """fp32 output and grads for the last CHECK_ROWS queries of batch 0 (causal aligns to the end)."""
    f32 = lambda x: x[:1].astype(jnp.float32)  # noqa: E731
    ro, vjp = jax.vjp(lambda q, k, v: xla_attention(q, k, v, causal=True), f32(q)[:, -CHECK_ROWS:], f32(k), f32(v))
    return ro, vjp(f32(do_chk)[:, -CHECK_ROWS:])


def bench(name, fn, q, k, v, do, do_chk, ref):
    b, s, h, d = q.shape
    row = dict(impl=name)
    fwd = jax.jit(fn)

    def fb(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return vjp(do.astype(o.dtype))
    fwdbwd = jax.jit(fb)
    ro, (rdq, rdk, rdv) = ref
    try:
        row["fwd_err"] = err = rel(fwd(q, k, v)[:1, -CHECK_ROWS:], ro)
        if err < FWD_TOL:
            row["fwd_ms"] = timeit(fwd, q, k, v) * 1e3
        dq, dk, dv = fwdbwd(q, k, v, do_chk)
        row["bwd_err"] = err = max(rel(dq[:1, -CHECK_ROWS:], rdq), rel(dk[:1], rdk), rel(dv[:1], rdv))
        if err < BWD_TOL:
            row["fb_ms"] = timeit(fwdbwd, q, k, v, do) * 1e3
    except Exception as e:  # noqa: BLE001 - an impl that cannot run this shape is reported
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    for key in ("fwd", "fb"):
        if f"{key}_ms" in row:
            row[f"{key}_ktok_s"] = b * s / row[f"{key}_ms"]  # tokens per ms = thousand tokens per s
    return row


def cell(r, key):
    if "error" in r:
        return "ERR"
    if f"{key}_ms" not in r:
        return "FAIL" if f"{'fwd' if key == 'fwd' else 'bwd'}_err" in r else "-"
    return f"{r[f'{key}_ktok_s']:.1f}k ({r[f'{key}_ms']:.1f} ms)"


def table(results, dev):
    today = datetime.date.today().isoformat()
    lines = ["| date | device | jax | B x S x H/KVH x D | impl | fwd tok/s | fwd+bwd tok/s | vs plain f+b | "
             "fwd err | bwd err |", "| --- " * 10 + "|"]
    for shape, rows in results:
        plain = next((r for r in rows if r["impl"] == "flash(plain)" and "fb_ms" in r), None)
        plain = plain or next((r for r in rows if "plain" in r["impl"] and "fb_ms" in r), None)
        for r in rows:
            ratio = f"{plain['fb_ms'] / r['fb_ms']:.2f}x" if plain and "fb_ms" in r else "-"
            lines.append(f"| {today} | {dev} | {jax.__version__} | {shape} | {r['impl']} | {cell(r, 'fwd')} | "
                         f"{cell(r, 'fb')} | {ratio} | {r.get('fwd_err', float('nan')):.1e} | "
                         f"{r.get('bwd_err', float('nan')):.1e} |")
    return "\n".join(lines) + "\n"


def append_docs(path, text):
    """Append under SECTION (created at the end if missing); nothing already there is changed."""
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write("# Benchmarks\n")
    lines = open(path).read().splitlines(keepends=True)
    intro = (f"\n{SECTION}\n\n`scripts/bench_ring.py`: ring attention at context size 1 (the ring code path "
             "forced on, so its overhead shows) against the plain kernels; causal, bf16, one process, fp32-checked "
             "before timing, median of 5 after 2 warm-ups. tok/s counts the query tokens of one call; "
             "'vs plain' > 1 means faster than our Pallas flash attention.\n\n")
    if not any(line.strip() == SECTION for line in lines):
        lines.append(intro)
        lines.append(text)
    else:
        start = next(i for i, line in enumerate(lines) if line.strip() == SECTION)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[end:end] = ["\n", text] + (["\n"] if end < len(lines) else [])
    with open(path, "w") as f:
        f.writelines(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--out", help="where bench_ring.md goes (default: $OUT, else a temporary directory)")
    ap.add_argument("--docs", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                   "docs", "archive", "benchmarks-diary.md"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    args = ap.parse_args()
    global CHECK_ROWS
    smoke = args.smoke or jax.default_backend() != "gpu"
    seqs, h, kvh, d = ((256, 512), 2, 1, 16) if smoke else ((8192, 16384, 32768), 16, 8, 128)
    if smoke:
        CHECK_ROWS = 32
    dev = jax.devices()[0].device_kind
    mesh = jax.make_mesh((1,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    results, t0 = [], time.time()
    for s in seqs:
        if time.time() - t0 > args.budget_s:
            print(f"budget reached; skipping S={s} and longer")
            break
        ks = jax.random.split(jax.random.key(s), 4)
        q = jax.random.normal(ks[0], (1, s, h, d), jnp.float32).astype(jnp.bfloat16)
        k, v = (jax.random.normal(kk, (1, s, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in ks[1:3])
        do = jax.random.normal(ks[3], q.shape, jnp.float32).astype(jnp.bfloat16)
        do_chk = do.at[:, : s - CHECK_ROWS].set(0)  # only checked rows carry a cotangent when checking
        ref = reference(q, k, v, do_chk)
        rows = []
        for name, fn in impls(mesh, interpret=smoke).items():
            r = bench(name, fn, q, k, v, do, do_chk, ref)
            print(s, r, flush=True)
            rows.append(r)
        results.append((f"1x{s}x{h}/{kvh}x{d}", rows))
    text = table(results, dev)
    print(text)
    with open(diary.out_dir("bench_ring", args.out) / "bench_ring.md", "w") as f:
        f.write(text)
    if not smoke and diary.records(jax.default_backend(), args.docs):
        append_docs(args.docs, text)
        print(f"appended to {args.docs}; wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
