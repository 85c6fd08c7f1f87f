"""Which Mosaic GPU attention kernel fails at a shape: compile and run the forward, the dQ kernel, the
dK/dV kernel and the fused backward each in its own process, so that a crash in a custom call's
compile (an LLVM stack trace, a killed process) names its kernel instead of taking the caller down.

    PYTHONPATH=$PWD python3 scripts/diag_mgpu_shapes.py                      # the default shapes
    PYTHONPATH=$PWD python3 scripts/diag_mgpu_shapes.py --shapes 8192:128:causal:4 --kernels fwd,dq

A shape is S:D:causal|full:GROUP with bench_attention.py's sizes (B = 16384 / S rows, H = 2048 / D
query heads, H / GROUP kv heads). The kernels under test get their inputs (O, lse, delta) from the
float32 jnp reference, so each process compiles exactly one Mosaic kernel (`fwdbwd`: all three, as a
training step does). Each child prints a JSON line per phase (config, inputs, compiled, ran); the
table gives the last phase reached, the exit status (a negative one is the signal that killed it)
and the last lines of its stderr. A kernel the argument checks refuse (the fused backward at head
dim 128) is status `refused` with its error, not a failure. --meshlab-flags: the children import
meshlab first, so XLA_FLAGS are bench_attention.py's (it imports meshlab; this script otherwise does
not). Rows in $OUT/diag_mgpu.json.
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# fwdbwd: the public function's forward and default backward in one program, as bench_attention.py
# compiles them (if each kernel passes alone but this fails, the kernels' compiles interfere).
KERNELS = ("fwd", "dq", "dkv", "fused", "fwdbwd")
# The failing shape first (causal 8192 x 128, GQA 4), then what brackets it: the same at 2048 and
# 4096 (those ran), full attention at 8192, and GQA 1.
SHAPES = ("8192:128:causal:4", "4096:128:causal:4", "2048:128:causal:4", "8192:128:full:4", "8192:128:causal:1")


def parse_shape(spec: str):
    s, d, mask, group = spec.split(":")
    if mask not in ("causal", "full"):
        raise SystemExit(f"error: shape {spec!r}: the third field is causal or full")
    return int(s), int(d), mask == "causal", int(group)


def child(spec: str, kernel: str) -> None:
    """One kernel at one shape; prints {"phase": ...} lines as it gets past each step."""
    if os.environ.get("DIAG_MESHLAB_FLAGS") == "1":
        import meshlab  # noqa: F401  (sets XLA_FLAGS as bench_attention.py's process has them)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import flash_attention_mgpu as fm, flash_attention_mgpu_bwd as fb
    from pallas_kernels.flash_common import LOG2E, flash_attention_reference, output_grad_rowsum

    s, d, causal, group = parse_shape(spec)
    b, h = 16384 // s, 2048 // d
    say = lambda **kw: print(json.dumps(kw), flush=True)   # noqa: E731
    ks = jax.random.split(jax.random.key(s + d), 4)
    q, do = (jax.random.normal(k_, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for k_ in ks[:2])
    k, v = (jax.random.normal(k_, (b, s, h // group, d), jnp.float32).astype(jnp.bfloat16) for k_ in ks[2:])
    bs = fm.default_block_sizes(d)
    bs = bs if kernel == "fwdbwd" else dataclasses.replace(bs, fused_bwd=kernel == "fused")
    try:
        cfg = fm.make_config(q, k, v, causal, None, bs, False)
    except ValueError as e:   # a kernel the argument checks refuse (e.g. the fused backward at d=128)
        say(phase="refused", error=str(e))
        return
    say(phase="config", tiles=dataclasses.asdict(cfg.bs), batch=b, heads=h, kv_heads=h // group)
    # Row 0 of the batch: the reference's inputs for the kernel, and what it must produce.
    f32 = lambda x: x[:1].astype(jnp.float32)  # noqa: E731
    ref = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v, causal=causal, return_lse=True))
    out1, lse1 = ref(f32(q), f32(k), f32(v))
    _, vjp = jax.vjp(lambda q, k, v: flash_attention_reference(q, k, v, causal=causal), f32(q), f32(k), f32(v))
    want = dict(zip(("dq", "dk", "dv"), vjp(f32(do))), out=out1)
    # Every row's O and lse (base 2, as the forward writes it) from the reference, row by row.
    outs, lses = zip(*(ref(*(x[i:i + 1].astype(jnp.float32) for x in (q, k, v))) for i in range(b)))
    out = jnp.concatenate(outs).astype(jnp.bfloat16)
    lse = jnp.concatenate(lses) * LOG2E
    delta = output_grad_rowsum(out, do)
    say(phase="inputs")
    calls = {"fwd": (lambda q, k, v: fm.forward_call(q, k, v, cfg), (q, k, v), ("out", None)),
             "dq": (lambda *a: fb.dq_call(*a, cfg), (q, k, v, do, lse, out), ("dq", None)),
             "dkv": (lambda *a: fb.dkv_call(*a, cfg), (q, k, v, do, lse, delta), ("dk", "dv")),
             "fused": (lambda *a: fb.dqkv_call(*a, cfg), (q, k, v, do, lse, delta), ("dq", "dk", "dv")),
             "fwdbwd": (lambda q, k, v, do: _fwd_bwd(q, k, v, do, causal), (q, k, v, do), ("out", "dq", "dk", "dv"))}
    fn, args, names = calls[kernel]
    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    say(phase="compiled", compile_s=round(time.perf_counter() - t, 1))
    got = jax.block_until_ready(compiled(*args))
    t = time.perf_counter()
    for _ in range(5):
        res = compiled(*args)
    jax.block_until_ready(res)
    ms = (time.perf_counter() - t) / 5 * 1e3
    errs = {}
    for name, g in zip(names, got if isinstance(got, tuple) else (got,)):
        if name is None:
            continue
        g1, w = np.asarray(g[:1], np.float32), np.asarray(want[name], np.float32)
        errs[name] = float(np.linalg.norm(g1 - w) / np.linalg.norm(w)) if np.isfinite(g1).all() else float("nan")
    say(phase="ran", ms=round(ms, 3), rel_err=errs)


def _fwd_bwd(q, k, v, do, causal):
    import jax
    from pallas_kernels.flash_attention_mgpu import flash_attention_mgpu
    out, vjp = jax.vjp(lambda q, k, v: flash_attention_mgpu(q, k, v, causal=causal), q, k, v)
    return (out, *vjp(do))


def run_one(spec: str, kernel: str, timeout: float) -> dict:
    row = {"shape": spec, "kernel": kernel}
    t = time.perf_counter()
    try:
        # the parent (a pytest run, a notebook) may hold most of the GPU already: the child allocates
        # what it uses instead of claiming XLA's default 75% of the card at start
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        p = subprocess.run([sys.executable, __file__, "--child", spec, kernel], capture_output=True, text=True,
                           timeout=timeout, env=env)
        row["rc"] = p.returncode
        stdout, stderr = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        row["rc"] = "timeout"
        stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    row["wall_s"] = round(time.perf_counter() - t, 1)
    phases = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    for ph in phases:
        row.update({k: v for k, v in ph.items() if k != "phase"})
    row["last_phase"] = phases[-1]["phase"] if phases else "start"
    if row["last_phase"] == "refused":   # the argument checks' one clear error, at once
        row["status"] = "refused"
    elif row["rc"] != 0:
        noise = ("For simplicity, JAX has removed", "-----")
        tail = [x for x in stderr.splitlines() if x.strip() and not x.startswith(noise)]
        row["stderr_tail"] = tail[-12:]
        row["status"] = (f"killed by signal {-row['rc']}" if isinstance(row["rc"], int) and row["rc"] < 0
                         else "timeout" if row["rc"] == "timeout" else "error")
    else:
        row["status"] = "ok"
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated S:D:causal|full:GROUP")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"subset of {','.join(KERNELS)}")
    p.add_argument("--timeout", type=float, default=240, help="seconds per kernel process")
    p.add_argument("--budget-s", type=float, default=420, help="start no new process after this many seconds")
    p.add_argument("--meshlab-flags", action="store_true", help="children import meshlab first (its XLA_FLAGS)")
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "KERNEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    if args.meshlab_flags:
        os.environ["DIAG_MESHLAB_FLAGS"] = "1"
    kernels = args.kernels.split(",")
    if bad := [k for k in kernels if k not in KERNELS]:
        raise SystemExit(f"error: unknown kernels {bad}; choose from {KERNELS}")
    shapes = args.shapes.split(",")
    for spec in shapes:
        parse_shape(spec)
    rows, start = [], time.perf_counter()
    print(f"{'shape':<20} {'kernel':<6} {'status':<18} {'phase':<9} {'compile s':>9} {'ms':>9}  rel err")
    for spec in shapes:
        for kernel in kernels:
            if time.perf_counter() - start > args.budget_s:
                rows.append({"shape": spec, "kernel": kernel, "status": "not run (budget)"})
                continue
            r = run_one(spec, kernel, args.timeout)
            rows.append(r)
            errs = " ".join(f"{k} {v:.2g}" for k, v in (r.get("rel_err") or {}).items())
            print(f"{spec:<20} {kernel:<6} {r['status']:<18} {r['last_phase']:<9} {r.get('compile_s', ''):>9} "
                  f"{r.get('ms', ''):>9}  {errs}", flush=True)
            for line in r.get("stderr_tail", [])[-4:]:
                print(f"    | {line[:200]}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "diag_mgpu.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        if r["status"] == "refused":
            print(f"{r['shape']} {r['kernel']}: refused: {r['error']}")
    failed = [f"{r['shape']} {r['kernel']}: {r['status']} after {r.get('last_phase')}" for r in rows
              if r["status"] not in ("ok", "refused", "not run (budget)")]
    print("failed: " + ("; ".join(failed) if failed else "none"))


if __name__ == "__main__":
    main()
