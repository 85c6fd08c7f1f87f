"""The all-reduce variants of scripts/bench_collectives.py (--variants): the same all-reduce re-timed in
fresh processes, one change each (NCCL protocol/algorithm, XLA user/symmetric buffers, XLA's one-shot
all-reduce kernel, one process per GPU, combining, in place). Flags checked to parse in jax 0.10.2; the
GPU's jax may differ: an unknown one is an error row. The children re-enter through the script's
command line (ENTRY), so each reads its settings at start-up.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from meshlab.bench.collectives import _input, parse_bytes, _timed, profile, report, wire_bytes

ENTRY = Path(__file__).resolve().parents[2] / "scripts" / "bench_collectives.py"

# Why is JAX's psum slower than torch's NCCL all-reduce at 1 GiB (253 vs 323 GB/s on 2 H200s)? Each
# variant runs the same all-reduce in a fresh process with one change: XLA flags and NCCL settings are
# read once at start-up, and an unknown XLA flag aborts the process, so a failure is a row, not the end.
_X = "XLA_FLAGS"
VARIANTS = {
    "base": {"NCCL_DEBUG": "VERSION"},                     # NCCL's version line comes back with it
    "multiprocess": {"_processes": "2"},                   # one process per GPU, as torch runs
    "nccl_proto_simple": {"NCCL_PROTO": "Simple"},
    "nccl_algo_ring": {"NCCL_ALGO": "Ring"},
    "xla_user_buffers": {_X: "--xla_gpu_enable_nccl_user_buffers=true"},
    "xla_one_shot_kernel": {_X: "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"},   # XLA's own kernel
    "xla_symmetric_buffers": {_X: "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true"},
    "nccl_min_channels_32": {"NCCL_MIN_NCHANNELS": "32"},
    "nccl_algo_tree": {"NCCL_ALGO": "Tree"},
    "nccl_proto_ll128": {"NCCL_PROTO": "LL128"},
    "xla_sync_all_reduce": {_X: "--xla_gpu_disable_async_collectives=ALLREDUCE"},
    # gradient-like: 64 buffers psum'd in one program, combined by XLA up to a threshold
    "combine_default": {"_op": "combine"},
    "combine_off": {"_op": "combine", _X: "--xla_gpu_all_reduce_combine_threshold_bytes=0"},
    "combine_1GiB": {"_op": "combine", _X: "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824"},
}
MODES = ("call", "pipelined", "loop", "donated")


def _hlo_summary(compiled) -> dict:
    """Counts of the instructions that tell where time goes: collectives, copies, custom kernels."""
    import re
    text = compiled.as_text()
    ops = re.findall(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", text)
    keep = ("all-reduce", "all-reduce-start", "all-reduce-done", "copy", "copy-start", "custom-call", "fusion",
            "while", "reduce-scatter", "all-gather")
    return {k: ops.count(k) for k in keep if ops.count(k)}


def variant_rows(name: str, mesh_spec: str, sizes: list[int], reps: int, k: int, op: str = "all-reduce") -> list[dict]:
    """The all-reduce in four ways (MODES): `call`/`pipelined` as in the sweep; `loop`: k psums chained in
    one program (a while loop: no host in between); `donated`: the input buffer given up each call, so
    XLA may reduce in place. `combine`: 64 buffers of size/64 psum'd in one program."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P
    from meshlab.mesh import make_mesh
    mesh = make_mesh(mesh_spec)
    axis = next((a for a, s in mesh.shape.items() if s > 1), "data")
    p = mesh.shape[axis]
    spec = P(axis)
    sm = lambda f, i=spec, o=spec: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o,  # noqa: E731
                                                 axis_names={axis}, check_vma=False)
    rows = []
    for n in sizes:
        elems = max(n // 4 // p * p, p)
        nb = elems * 4
        wire = wire_bytes("all-reduce", nb, p)
        base = {"variant": name, "op": op, "p": p, "bytes": nb}
        if op == "combine":
            parts = 64
            xs = [_input(mesh, axis, max(elems // parts, 1)) for _ in range(parts)]
            f = jax.jit(sm(lambda *a: [lax.psum(v, axis) for v in a], tuple([spec] * parts), [spec] * parts))
            g = lambda xs: f(*xs)  # noqa: E731
            t, t_call = _timed(g, xs, reps, k)
            rows.append({**base, "mode": "pipelined", "time_s": t, "call_s": t_call, "busbw_GBps": wire / t / 1e9,
                         "hlo": _hlo_summary(f.lower(*xs).compile())})
            del xs
            continue
        x = _input(mesh, axis, elems)
        f = jax.jit(sm(lambda v: lax.psum(v, axis)))
        t, t_call = _timed(f, x, reps, k)
        hlo = _hlo_summary(f.lower(x).compile())
        rows.append({**base, "mode": "pipelined", "time_s": t, "busbw_GBps": wire / t / 1e9, "hlo": hlo})
        rows.append({**base, "mode": "call", "time_s": t_call, "busbw_GBps": wire / t_call / 1e9})
        loop = jax.jit(sm(lambda v: lax.fori_loop(0, k, lambda i, y: lax.psum(y, axis), v)))
        lt, _ = _timed(loop, x, 1, 2)
        rows.append({**base, "mode": "loop", "time_s": lt / k, "busbw_GBps": wire * k / lt / 1e9,
                     "hlo": _hlo_summary(loop.lower(x).compile())})
        donated = jax.jit(sm(lambda v: lax.psum(v, axis)), donate_argnums=0)
        y = donated(jnp.copy(x))
        jax.block_until_ready(y)
        t0 = time.perf_counter()
        for _ in range(k):
            y = donated(y)
        jax.block_until_ready(y)
        dt = (time.perf_counter() - t0) / k
        rows.append({**base, "mode": "donated", "time_s": dt, "busbw_GBps": wire / dt / 1e9})
        del x, y
    return rows


def _child_cmd(a, name: str, extra=()) -> list[str]:
    cmd = [sys.executable, str(ENTRY), "--child-variant", name, "--mesh", a.mesh,
           "--variant-sizes", a.variant_sizes, "--reps", str(a.reps)]
    if a.cpu_devices:
        cmd += ["--cpu-devices", str(a.cpu_devices)]
    return cmd + list(extra)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variants(a, names: list[str], budget_s: float, per_variant_s: float) -> list[dict]:
    """Each variant in its own process(es) with its settings; stdout rows `VARIANT_ROW {json}`."""
    import re
    import subprocess
    rows, start = [], time.time()
    for name in names:
        spec = VARIANTS.get(name)
        if "@" in name:   # ad hoc: name@KEY=VALUE@KEY=VALUE (XLA_FLAGS values are appended to the current ones)
            label, *pairs = name.split("@")
            spec = dict(kv.split("=", 1) for kv in pairs if "=" in kv)
        if spec is None:
            rows.append({"variant": name, "error": f"unknown variant; one of {', '.join(VARIANTS)} or NAME@KEY=VALUE"})
            continue
        left = budget_s - (time.time() - start)
        if left < 5:
            rows.append({"variant": name, "error": "not run: past the variants' budget"})
            continue
        env = dict(os.environ)
        for key, val in spec.items():
            if key == _X:
                env[_X] = f"{env.get(_X, '')} {val}".strip()
            elif not key.startswith("_"):
                env[key] = val
        extra = ["--variant-op", spec.get("_op", "all-reduce")]
        nproc = int(spec.get("_processes", "1"))
        port = _free_port()
        procs = []
        for i in range(nproc):
            more = extra + (["--mp-rank", str(i), "--mp-size", str(nproc), "--mp-port", str(port)] if nproc > 1 else [])
            procs.append(subprocess.Popen(_child_cmd(a, name, more), env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        timeout = min(per_variant_s, left)
        deadline = time.time() + timeout
        outs, why = [], None
        for pr in procs:
            try:
                outs.append(pr.communicate(timeout=max(deadline - time.time(), 0.1))[0])
            except subprocess.TimeoutExpired:
                why = f"timeout after {timeout:.0f} s"
                for q in procs:
                    q.kill()
                outs.append(pr.communicate()[0])
        text = "\n".join(o or "" for o in outs)
        got = [json.loads(m) for m in re.findall(r"^VARIANT_ROW (.*)$", text, re.M)]
        nccl = re.search(r"NCCL version (\S+)", text)
        for r in got:
            if nccl:
                r["nccl"] = nccl.group(1)
            rows.append(r)
            print(f"variant {name:<26} {r.get('op', ''):<10} {r['bytes']:>11} {r['mode']:<9} "
                  f"{r['time_s'] * 1e6:>9.1f} us {r['busbw_GBps']:>8.2f} GB/s", flush=True)
        codes = [pr.returncode for pr in procs]
        if why or any(codes) or not got:
            tail = [ln for ln in text.strip().splitlines() if ln and not ln.startswith("VARIANT_ROW")][-3:]
            rows.append({"variant": name, "error": (why or f"exit codes {codes}") + ": " + " | ".join(tail)[-300:]})
            print(f"variant {name}: {rows[-1]['error']}", flush=True)
    return rows


def child_variant(a) -> int:
    """Runs inside a variant's own process (its settings are already in the environment)."""
    if a.mp_size > 1:
        import jax
        if a.cpu_devices:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.mp_port}", num_processes=a.mp_size,
                                   process_id=a.mp_rank, local_device_ids=[a.mp_rank] if not a.cpu_devices else None)
    sizes = [parse_bytes(s) for s in a.variant_sizes.split(",")]
    rows = variant_rows(a.child_variant, a.mesh, sizes, a.reps, 10, a.variant_op)
    if a.mp_rank == 0:
        for r in rows:
            print("VARIANT_ROW " + json.dumps(r), flush=True)
    return 0



def sweep_then_variants(a, argv: list[str], names: list[str]) -> int:
    """The sweep in a child process (rows streamed to a file, so a timeout keeps what was measured),
    then the variants; this process never starts a JAX backend of its own on the GPUs."""
    import subprocess
    import tempfile
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp()) / "sweep.jsonl"
    cmd = [sys.executable, str(ENTRY), *argv, "--sweep-json", str(tmp), "--out", str(tmp) + ".prof",
           "--markdown", str(tmp) + ".md"]
    note = ""
    try:
        done = subprocess.run(cmd, timeout=a.sweep_timeout_s)
        if done.returncode:
            note = f"sweep exited {done.returncode}"
    except subprocess.TimeoutExpired:
        note = f"sweep stopped after {a.sweep_timeout_s:.0f} s; the rows measured before are kept"
    lines = [json.loads(ln) for ln in tmp.read_text().splitlines() if ln.strip()] if tmp.exists() else []
    meta = next((ln["_meta"] for ln in lines if "_meta" in ln), {"device": "?", "jax": "?"})
    rows = [ln for ln in lines if "_meta" not in ln]
    if note:
        print(f"bench_collectives.py: {note}", flush=True)
    budget = a.variants_budget_s if not a.total_s else a.total_s - (time.time() - t_start) - 6
    variants = run_variants(a, names, budget, a.variant_timeout_s)
    prof = profile(rows, meta, a.copy_axes)
    prof["variants"], prof["note"] = variants, note
    report(rows, prof, a)
    return 0 if rows else 1

