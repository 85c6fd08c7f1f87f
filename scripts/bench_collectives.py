"""Collectives over each mesh axis, timed through shard_map; alpha and BW fitted per axis.

    PYTHONPATH=$PWD python3 scripts/bench_collectives.py --mesh data=-1 --out profiles/h200.json
    python scripts/bench_collectives.py --cpu-devices 8 --mesh data=2,tensor=4 --max-bytes 1MiB
    # 2 GPUs, issue 9: the four NCCL collectives 1 MiB .. 4 GiB, then why psum trails torch
    ... --ops all-reduce,all-gather,reduce-scatter,all-to-all,ppermute --min-bytes 1MiB --max-bytes 4GiB --variants all

Every collective of the source material's table (broadcast, reduce, all-reduce, scatter, gather,
all-gather, reduce-scatter, all-to-all) and ppermute, 4 KiB .. 1 GiB per device (smaller on CPU).
Broadcast/reduce/scatter/gather have no lax primitive: they are written here from ppermute
(binomial trees, direct sends), as are the teaching rings: all-gather in p-1 ppermute steps and
all-reduce as ring reduce-scatter then ring all-gather. Each result is checked against the
library collective before its time counts (up to --check-max-bytes). On one GPU every axis has
size 1: only the single-device overheads (dispatch, copy) are measured, and the profile says so.

Times: `time` is k calls issued back to back over k (device time, as nccl-tests counts it); `call`
is the median single call waited for. The profile's alpha/BW per axis are fitted with the planner's
own formulas on all-reduce/all-gather/reduce-scatter (ppermute when those were not run).
--variants re-times the all-reduce in fresh processes, one change each (NCCL protocol/algorithm,
XLA user/symmetric buffers, XLA's one-shot all-reduce kernel, one process per GPU, combining, in
place). Flags checked to parse in jax 0.10.2; the GPU's jax may differ: an unknown one is an error row.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ("broadcast", "reduce", "all-reduce", "scatter", "gather", "all-gather", "reduce-scatter", "all-to-all",
       "ppermute", "ring all-gather", "ring all-reduce")


def _parse_bytes(s: str) -> int:
    units = {"kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "b": 1}
    low = s.strip().lower()
    for u, m in units.items():
        if low.endswith(u):
            return int(float(low[: -len(u)]) * m)
    return int(low)


def make_ops(axis: str, p: int):
    """name -> (ours(x), reference(x) or None); x is this device's [n] float32 block, inside shard_map."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def idx():
        return lax.axis_index(axis)

    def ring_all_gather(x):          # p-1 steps; each passes the block it last received to the right
        right = [(i, (i + 1) % p) for i in range(p)]
        me = idx()
        blocks = jnp.zeros((p,) + x.shape, x.dtype).at[me].set(x)
        cur = x
        for step in range(1, p):
            cur = lax.ppermute(cur, axis, right)
            blocks = blocks.at[(me - step) % p].set(cur)
        return blocks.reshape(-1)

    def ring_reduce_scatter(x):      # p-1 steps; chunk (me - step - 1) travels right, summed on the way
        right = [(i, (i + 1) % p) for i in range(p)]
        chunks = x.reshape(p, -1)
        me = idx()
        acc = chunks[(me - 1) % p]
        for step in range(1, p):
            acc = lax.ppermute(acc, axis, right) + chunks[(me - step - 1) % p]
        return acc                    # device i ends with the full sum of chunk i

    def ring_all_reduce(x):
        return ring_all_gather(ring_reduce_scatter(x))

    def tree_broadcast(x):           # binomial tree from device 0: log2(p) rounds
        me, have = idx(), x
        r = 1
        while r < p:
            pairs = [(i, i + r) for i in range(r) if i + r < p]
            got = lax.ppermute(have, axis, pairs)
            have = jnp.where((me >= r) & (me < 2 * r), got, have)
            r *= 2
        return have

    def tree_reduce(x):              # mirror of the broadcast: partial sums flow down to device 0
        me, acc = idx(), x
        r = 1
        while r < p:
            r *= 2
        r //= 2
        while r >= 1:
            pairs = [(i + r, i) for i in range(r) if i + r < p]
            got = lax.ppermute(acc, axis, pairs)
            acc = jnp.where(me < r, acc + got, acc)
            r //= 2
        return jnp.where(me == 0, acc, 0.0)

    def direct_scatter(x):           # device 0 sends block j to device j: p-1 messages
        blocks = x.reshape(p, -1)
        me = idx()
        out = blocks[0]
        for j in range(1, p):
            got = lax.ppermute(blocks[j], axis, [(0, j)])
            out = jnp.where(me == j, got, out)
        return out

    def direct_gather(x):            # every device sends its block to device 0
        me = idx()
        out = jnp.zeros((p,) + x.shape, x.dtype).at[0].set(x)
        for j in range(1, p):
            out = out.at[j].set(lax.ppermute(x, axis, [(j, 0)]))
        return jnp.where(me == 0, out.reshape(-1), 0.0)

    ag = lambda x: lax.all_gather(x, axis, tiled=True)  # noqa: E731
    at_root = lambda y: jnp.where(idx() == 0, y, 0.0)   # noqa: E731
    return {
        "broadcast": (tree_broadcast, lambda x: ag(x)[: x.shape[0]]),
        "reduce": (tree_reduce, lambda x: at_root(lax.psum(x, axis))),
        "all-reduce": (lambda x: lax.psum(x, axis), None),
        "scatter": (direct_scatter, lambda x: ag(x)[: x.shape[0]].reshape(p, -1)[idx()]),
        "gather": (direct_gather, lambda x: at_root(ag(x))),
        "all-gather": (ag, None),
        "reduce-scatter": (lambda x: lax.psum_scatter(x, axis, tiled=True), None),
        "all-to-all": (lambda x: lax.all_to_all(x.reshape(p, -1), axis, 0, 0, tiled=True).reshape(-1), None),
        "ppermute": (lambda x: lax.ppermute(x, axis, [(i, (i + 1) % p) for i in range(p)]), None),
        "ring all-gather": (ring_all_gather, ag),
        "ring all-reduce": (ring_all_reduce, lambda x: lax.psum(x, axis)),
    }, jax


def wire_bytes(op: str, n: int, p: int) -> float:
    """Bytes one device sends (n = its input block), the algorithm's count (nccl-tests' bus bytes)."""
    if p <= 1:
        return float(n)
    f = (p - 1) / p
    return {"all-reduce": 2 * f * n, "ring all-reduce": 2 * f * n, "reduce-scatter": f * n, "all-to-all": f * n,
            "all-gather": (p - 1) * n, "ring all-gather": (p - 1) * n, "ppermute": n, "broadcast": n, "reduce": n,
            "scatter": f * n, "gather": n}[op]


def _input(mesh, axis: str, elems: int):
    """This device's [elems] float32 block, made on the devices (a host array of p x 4 GiB would not do)."""
    return _input_fn(mesh, axis, elems)()


@functools.lru_cache(maxsize=None)
def _input_fn(mesh, axis: str, elems: int):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def gen():
        i = lax.axis_index(axis)
        return ((lax.iota(jnp.int32, elems) + i * 7) % 251).astype(jnp.float32) / 251
    return jax.jit(jax.shard_map(gen, mesh=mesh, in_specs=(), out_specs=P(axis), axis_names={axis}, check_vma=False))


def _timed(f, x, reps: int, k: int = 10) -> tuple[float, float]:
    """(pipelined, call) seconds: `k` calls issued back to back and waited for once, over k (device
    time, as nccl-tests counts it), and the median of `reps` calls each waited for (adds the host
    dispatch and the skew between the devices' launches)."""
    import jax
    import numpy as np
    jax.block_until_ready(f(x))
    calls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        calls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(k):
        y = f(x)
    jax.block_until_ready(y)
    return (time.perf_counter() - t0) / k, float(np.median(calls))


def run(mesh_spec: str, sizes: list[int], reps: int = 5, ops=OPS, check_only: bool = False,
        check_max_bytes: int = 64 * 2**20, emit=None) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    sys.path.insert(0, str(ROOT))
    from meshlab.mesh import make_mesh
    mesh = make_mesh(mesh_spec)
    rows = []
    axes = [a for a, s in mesh.shape.items() if s > 1] or ["data"]   # one device: measure overheads on `data`
    for axis in axes:
        p = mesh.shape[axis]
        table, _ = make_ops(axis, p)
        for n in sizes:                      # one input per size, shared by every op
            elems = max(n // 4 // p * p, p)
            x = _input(mesh, axis, elems)
            for op in ops:
                ours, ref = table[op]
                spec = P(axis)
                wrap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec,  # noqa: E731
                                                       axis_names={axis}, check_vma=False))
                f = wrap(ours)
                checked = ref is not None and elems * 4 <= check_max_bytes
                if checked:
                    got, want = f(x), wrap(ref)(x)
                    if not np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5):
                        raise AssertionError(f"{op} over {axis} (p={p}, {n} B): result differs from the library collective")
                    del got, want
                if check_only:
                    rows.append({"axis": axis, "p": p, "op": op, "bytes": elems * 4, "checked": checked})
                    continue
                t, t_call = _timed(f, x, reps)
                nb = elems * 4
                rows.append({"axis": axis, "p": p, "op": op, "bytes": nb, "time_s": t, "call_s": t_call,
                             "checked": checked, "algbw_GBps": nb / t / 1e9, "busbw_GBps": wire_bytes(op, nb, p) / t / 1e9})
                if emit:
                    emit(rows[-1])
                del f
            del x
    order = {op: i for i, op in enumerate(ops)}
    return sorted(rows, key=lambda r: (axes.index(r["axis"]), order[r["op"]], r["bytes"]))


# The planner's cost of one call over p devices, T = c alpha + wire / BW (meshlab/plan/comm.py, ring).
_ALPHA_COUNT = {"all-reduce": lambda p: 2 * (p - 1), "all-gather": lambda p: p - 1, "reduce-scatter": lambda p: p - 1,
                "all-to-all": lambda p: p - 1, "ppermute": lambda p: 1}


def _fit_line(pts) -> tuple[float, float] | None:
    """(alpha, BW) of T = c alpha + w / BW from (c, w, T) points, least squares on relative error
    (so the small messages that set alpha count as much as the large ones that set BW)."""
    import numpy as np
    if len(pts) < 2:
        return None
    c, w, t = np.array(pts, dtype=float).T
    a = np.stack([c / t, w / t], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if inv_bw <= 0:          # noisy timings (CPU): the best observed rate bounds BW
        inv_bw = float(np.min(t / w))
    alpha = max(float(np.median((t - w * inv_bw) / c)), 0.0) if alpha < 0 else float(alpha)
    return alpha, float(1.0 / inv_bw)


def fit(rows: list[dict]) -> dict:
    """alpha and BW per axis. From all-reduce/all-gather/reduce-scatter when measured (the collectives the
    planner prices most, in its own formulas), else from ppermute (T = alpha + n/BW); each op's own fit beside."""
    out = {}
    for axis in sorted({r["axis"] for r in rows}):
        mine = [r for r in rows if r["axis"] == axis and "time_s" in r]
        if not mine:
            continue
        p = mine[0]["p"]
        per_op = {}
        for op in _ALPHA_COUNT:
            pts = [(_ALPHA_COUNT[op](p), wire_bytes(op, r["bytes"], p), r["time_s"]) for r in mine if r["op"] == op]
            got = _fit_line(pts)
            if got:
                per_op[op] = {"alpha_s": got[0], "bw_Bps": got[1], "points": len(pts)}
        coll = [(_ALPHA_COUNT[r["op"]](p), wire_bytes(r["op"], r["bytes"], p), r["time_s"]) for r in mine
                if r["op"] in ("all-reduce", "all-gather", "reduce-scatter")]
        best = _fit_line(coll)
        source = "all-reduce/all-gather/reduce-scatter"
        if best is None and "ppermute" in per_op:
            best, source = (per_op["ppermute"]["alpha_s"], per_op["ppermute"]["bw_Bps"]), "ppermute"
        if best is None:
            continue
        out[axis] = {"alpha_s": best[0], "bw_Bps": best[1], "p": p, "fitted_on": source, "per_op": per_op,
                     "points": len(coll) if source != "ppermute" else per_op["ppermute"]["points"],
                     "note": "" if p > 1 else "single device: overheads only, not a link"}
    return out


def append_markdown(rows: list[dict], prof: dict, path: Path):
    """Dated rows under `## Collectives` in docs/benchmarks.md; only ever appends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    add = "" if text else "# Benchmarks\n"
    headings = [ln for ln in text.splitlines() if ln.startswith("## ")]
    if not headings or headings[-1].strip() != "## Collectives":
        add += ("\n## Collectives\n\n| date | device | jax | axis | p | op | bytes | time (us) | algbw GB/s | busbw GB/s |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    day = datetime.date.today().isoformat()
    head = f"| {day} | {prof['device']} | {prof['jax']} |"
    big = {}
    for r in rows:   # per axis and op: the smallest message, 1 GiB, and the largest
        big.setdefault((r["axis"], r["op"]), []).append(r)
    for key, rs in big.items():
        pick = {id(r): r for r in (min(rs, key=lambda r: r["bytes"]), *[r for r in rs if r["bytes"] == 2**30],
                                   max(rs, key=lambda r: r["bytes"]))}
        for r in pick.values():
            add += (f"{head} {r['axis']} | {r['p']} | {r['op']} | {r['bytes']} | "
                    f"{r['time_s'] * 1e6:.1f} | {r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} |\n")
    for axis, v in prof["axes"].items():
        for op, f in ({} if v["note"].startswith("copied") else v.get("per_op", {})).items():
            add += (f"{head} {axis} | {v['p']} | fit ({op}) | | alpha {f['alpha_s'] * 1e6:.1f} | BW {f['bw_Bps'] / 1e9:.2f} | |\n")
        add += (f"{head} {axis} | {v['p']} | profile (fitted on {v.get('fitted_on', 'ppermute')}) | | "
                f"alpha {v['alpha_s'] * 1e6:.1f} | BW {v['bw_Bps'] / 1e9:.2f} | {v['note']} |\n")
    for r in prof.get("variants", []):
        what = (f"error: {r['error'][:80]}" if "error" in r else
                f"{r['mode']} {r['busbw_GBps']:.2f} GB/s ({r['time_s'] * 1e6:.0f} us)")
        add += f"{head} variant {r['variant']} | {r.get('p', '')} | {r.get('op', 'all-reduce')} | {r.get('bytes', '')} | {what} | | |\n"
    with path.open("a") as fh:
        fh.write(add)


# ---------------------------------------------------------------------------------------------- variants
# Why is JAX's psum slower than torch's NCCL all-reduce at 1 GiB (issue 9: 253 vs 323 GB/s)? Each
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
    sys.path.insert(0, str(ROOT))
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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-variant", name, "--mesh", a.mesh,
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
    sizes = [_parse_bytes(s) for s in a.variant_sizes.split(",")]
    rows = variant_rows(a.child_variant, a.mesh, sizes, a.reps, 10, a.variant_op)
    if a.mp_rank == 0:
        for r in rows:
            print("VARIANT_ROW " + json.dumps(r), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="data=-1")
    ap.add_argument("--min-bytes", default="4KiB")
    ap.add_argument("--max-bytes", default="", help="default 1GiB on GPU, 1MiB on CPU")
    ap.add_argument("--ops", default="", help=f"comma list from {', '.join(OPS)} (default: all)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check-max-bytes", default="64MiB", help="check hand-written ops against lax up to this size")
    ap.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
    ap.add_argument("--out", default=str(ROOT / "profiles" / "collectives.json"))
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--variants", default="", help=f"'all' or a comma list of {', '.join(VARIANTS)}, or ad hoc "
                    "NAME@KEY=VALUE[@KEY=VALUE] (environment; XLA_FLAGS appended): each in its own process after the "
                    "sweep (which then also runs in its own process, so no process holds the GPUs twice)")
    ap.add_argument("--variant-sizes", default="256MiB,1GiB")
    ap.add_argument("--variants-budget-s", type=float, default=60)
    ap.add_argument("--variant-timeout-s", type=float, default=30)
    ap.add_argument("--total-s", type=float, default=0, help="with --variants: the variants get what the sweep left "
                    "of this (replaces --variants-budget-s)")
    ap.add_argument("--sweep-timeout-s", type=float, default=120)
    ap.add_argument("--copy-axes", default="", help="mesh axes that share the measured axis's devices and link "
                    "(e.g. fsdp,tensor,context on one host): the profile gives them the same fit")
    ap.add_argument("--child-variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--variant-op", default="all-reduce", help=argparse.SUPPRESS)
    ap.add_argument("--mp-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--mp-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sweep-json", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu_devices:   # each process of a multi-process variant gets its share; jax.distributed joins them
        import re
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(a.cpu_devices // a.mp_size, 1)}".strip()
    try:
        lo, hi = _parse_bytes(a.min_bytes), _parse_bytes(a.max_bytes) if a.max_bytes else None
        check_max = _parse_bytes(a.check_max_bytes)
        [_parse_bytes(s) for s in a.variant_sizes.split(",")]
    except ValueError:
        print(f"bench_collectives.py: sizes must look like 4KiB, 64MiB, 1GiB (got {a.min_bytes!r}, {a.max_bytes!r}, "
              f"{a.variant_sizes!r})", file=sys.stderr)
        return 2
    ops = tuple(o for o in a.ops.split(",") if o) or OPS
    bad = [o for o in ops if o not in OPS]
    if bad:
        print(f"bench_collectives.py: unknown op(s) {bad}; choose from {', '.join(OPS)}", file=sys.stderr)
        return 2
    if a.child_variant:
        return child_variant(a)
    names = [] if not a.variants else list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    if names and not a.sweep_json:
        return sweep_then_variants(a, argv if argv is not None else sys.argv[1:], names)
    import jax
    hi = hi or _parse_bytes("1GiB" if jax.default_backend() == "gpu" else "1MiB")
    sizes = []
    n = lo
    while n <= hi:
        sizes.append(n)
        n *= 4
    meta = device_meta(jax)
    sink = open(a.sweep_json, "w") if a.sweep_json else None
    emit = (lambda r: (sink.write(json.dumps(r) + "\n"), sink.flush())) if sink else None  # noqa: E731
    if emit:
        emit({"_meta": meta})
    rows = run(a.mesh, sizes, a.reps, ops, check_max_bytes=check_max, emit=emit)
    prof = profile(rows, meta, a.copy_axes)
    report(rows, prof, a)
    return 0


def device_meta(jax) -> dict:
    dev = jax.devices()[0]
    meta = {"device": f"{jax.device_count()}x {getattr(dev, 'device_kind', dev.platform)}", "platform": dev.platform,
            "jax": jax.__version__}
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        meta["memory_bytes"] = int(stats["bytes_limit"])
    return meta


def profile(rows, meta: dict, copy_axes: str = "") -> dict:
    """`copy_axes`: other mesh axes laid over the same devices (one host, one link kind) get the first
    measured axis's fit, so the planner prices fsdp/tensor/context collectives on the measured link too."""
    axes = fit(rows)
    if axes and copy_axes:
        src = next(iter(axes))
        for name in copy_axes.split(","):
            if name and name not in axes:
                axes[name] = {**axes[src], "note": f"copied from {src} (same devices)"}
    return {**meta, "date": datetime.datetime.now().isoformat(timespec="seconds"), "axes": axes, "rows": rows}


def report(rows, prof, a):
    print(f"{'axis':<8} {'p':>2} {'op':<16} {'bytes':>11} {'time us':>10} {'call us':>10} {'busbw GB/s':>11}")
    for r in rows:
        print(f"{r['axis']:<8} {r['p']:>2} {r['op']:<16} {r['bytes']:>11} {r['time_s'] * 1e6:>10.1f} "
              f"{r.get('call_s', r['time_s']) * 1e6:>10.1f} {r['busbw_GBps']:>11.2f}")
    for axis, v in prof["axes"].items():
        print(f"fit {axis} ({v.get('fitted_on')}): alpha {v['alpha_s'] * 1e6:.1f} us, BW {v['bw_Bps'] / 1e9:.2f} GB/s "
              f"{v['note']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(prof, indent=1))
    append_markdown(rows, prof, Path(a.markdown))
    print(f"wrote {a.out}; appended to {a.markdown}")


def sweep_then_variants(a, argv: list[str], names: list[str]) -> int:
    """The sweep in a child process (rows streamed to a file, so a timeout keeps what was measured),
    then the variants; this process never starts a JAX backend of its own on the GPUs."""
    import subprocess
    import tempfile
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp()) / "sweep.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--sweep-json", str(tmp), "--out", str(tmp) + ".prof",
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


if __name__ == "__main__":
    sys.exit(main())
