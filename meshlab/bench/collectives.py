"""Collectives over each mesh axis, timed through shard_map; alpha and BW fitted per axis (the logic of
scripts/bench_collectives.py; the all-reduce variants, each in its own process, are collectives_variants.py).

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
JAX is imported inside the functions: use_cpu_devices must set the platform before it loads.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import re
import time
from pathlib import Path

from meshlab.bench import diary

OPS = ("broadcast", "reduce", "all-reduce", "scatter", "gather", "all-gather", "reduce-scatter", "all-to-all",
       "ppermute", "ring all-gather", "ring all-reduce")


def parse_bytes(s: str) -> int:
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
    """Dated rows under `## Collectives` in docs/archive/benchmarks-diary.md; only ever appends."""
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


def use_cpu_devices(n: int, mp_size: int = 1):
    """Simulate `n` CPU devices; each process of a multi-process variant gets its share (jax.distributed
    joins them). Before JAX is imported."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(n // mp_size, 1)}".strip()


def sweep(a, lo: int, hi: int | None, ops, check_max: int) -> int:
    """The sweep in this process: sizes lo, 4 lo, .. hi; with a.sweep_json (the child of sweep_then_variants)
    every row is streamed there as it is measured."""
    import jax
    hi = hi or parse_bytes("1GiB" if jax.default_backend() == "gpu" else "1MiB")
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
    print(f"wrote {a.out} (the planner reads it: scripts/plan.py --hardware {a.out})")
    if diary.records(prof["platform"], a.markdown):
        append_markdown(rows, prof, Path(a.markdown))
        print(f"appended to {a.markdown}")
    else:
        print(f"not appended to {a.markdown}: only a GPU run is recorded")

