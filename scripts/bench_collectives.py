"""Collectives over each mesh axis, timed through shard_map; alpha and BW fitted per axis.

    PYTHONPATH=$PWD python3 scripts/bench_collectives.py --mesh data=-1 --out profiles/h200.json
    python scripts/bench_collectives.py --cpu-devices 8 --mesh data=2,tensor=4 --max-bytes 1MiB

Every collective of the source material's table (broadcast, reduce, all-reduce, scatter, gather,
all-gather, reduce-scatter, all-to-all) and ppermute, 4 KiB .. 1 GiB per device (smaller on CPU).
Broadcast/reduce/scatter/gather have no lax primitive: they are written here from ppermute
(binomial trees, direct sends), as are the teaching rings: all-gather in p-1 ppermute steps and
all-reduce as ring reduce-scatter then ring all-gather. Each result is checked against the
library collective before its time counts. On one GPU every axis has size 1: only the
single-device overheads (dispatch, copy) are measured, and the profile says so.
"""
from __future__ import annotations

import argparse
import datetime
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


def run(mesh_spec: str, sizes: list[int], reps: int = 5, ops=OPS, check_only: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, str(ROOT))
    from meshlab.mesh import make_mesh
    mesh = make_mesh(mesh_spec)
    rows = []
    axes = [a for a, s in mesh.shape.items() if s > 1] or ["data"]   # one device: measure overheads on `data`
    for axis in axes:
        p = mesh.shape[axis]
        table, _ = make_ops(axis, p)
        for op in ops:
            ours, ref = table[op]
            for n in sizes:
                elems = max(n // 4 // p * p, p)
                spec = P(axis)
                wrap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec,  # noqa: E731
                                                       axis_names={axis}, check_vma=False))
                x = jax.device_put(jnp.arange(p * elems, dtype=jnp.float32) % 251 / 251,
                                   NamedSharding(mesh, spec))
                f = wrap(ours)
                got = f(x)
                if ref is not None:
                    want = wrap(ref)(x)
                    if not np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5):
                        raise AssertionError(f"{op} over {axis} (p={p}, {n} B): result differs from the library collective")
                if check_only:
                    rows.append({"axis": axis, "p": p, "op": op, "bytes": elems * 4, "checked": ref is not None})
                    continue
                jax.block_until_ready(f(x))
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(x))
                    times.append(time.perf_counter() - t0)
                t = float(np.median(times))
                nb = elems * 4
                rows.append({"axis": axis, "p": p, "op": op, "bytes": nb, "time_s": t, "checked": ref is not None,
                             "algbw_GBps": nb / t / 1e9, "busbw_GBps": wire_bytes(op, nb, p) / t / 1e9})
    return rows


def fit(rows: list[dict]) -> dict:
    """alpha and BW per axis from ppermute (one message each way: T = alpha + n/BW, least squares)."""
    import numpy as np
    out = {}
    for axis in sorted({r["axis"] for r in rows}):
        pts = [(r["bytes"], r["time_s"]) for r in rows if r["axis"] == axis and r["op"] == "ppermute" and "time_s" in r]
        if len(pts) < 2:
            continue
        n, t = np.array(pts, dtype=float).T
        slope, alpha = np.polyfit(n, t, 1)
        p = next(r["p"] for r in rows if r["axis"] == axis)
        # Noisy timings (CPU) can give a flat or negative slope: then the best observed rate bounds BW.
        bw = float(1.0 / slope) if slope > 0 else float(np.max(n / t))
        out[axis] = {"alpha_s": max(float(alpha), 0.0), "bw_Bps": bw,
                     "p": p, "points": len(pts), "note": "" if p > 1 else "single device: overheads only, not a link"}
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
    big = {}
    for r in rows:   # per axis and op: the smallest and the largest message
        key = (r["axis"], r["op"])
        big.setdefault(key, []).append(r)
    for key, rs in big.items():
        for r in (min(rs, key=lambda r: r["bytes"]), max(rs, key=lambda r: r["bytes"])):
            add += (f"| {day} | {prof['device']} | {prof['jax']} | {r['axis']} | {r['p']} | {r['op']} | {r['bytes']} | "
                    f"{r['time_s'] * 1e6:.1f} | {r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} |\n")
    for axis, v in prof["axes"].items():
        add += (f"| {day} | {prof['device']} | {prof['jax']} | {axis} | {v['p']} | fit (ppermute) | | "
                f"alpha {v['alpha_s'] * 1e6:.1f} | BW {v['bw_Bps'] / 1e9:.2f} | {v['note']} |\n")
    with path.open("a") as fh:
        fh.write(add)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="data=-1")
    ap.add_argument("--min-bytes", default="4KiB")
    ap.add_argument("--max-bytes", default="", help="default 1GiB on GPU, 1MiB on CPU")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
    ap.add_argument("--out", default=str(ROOT / "profiles" / "collectives.json"))
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"))
    a = ap.parse_args(argv)
    if a.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={a.cpu_devices}").strip()
    import jax
    try:
        lo = _parse_bytes(a.min_bytes)
        hi = _parse_bytes(a.max_bytes or ("1GiB" if jax.default_backend() == "gpu" else "1MiB"))
    except ValueError:
        print(f"bench_collectives.py: sizes must look like 4KiB, 64MiB, 1GiB (got {a.min_bytes!r}, {a.max_bytes!r})",
              file=sys.stderr)
        return 2
    sizes = []
    n = lo
    while n <= hi:
        sizes.append(n)
        n *= 4
    dev = jax.devices()[0]
    rows = run(a.mesh, sizes, a.reps)
    prof = {"device": f"{jax.device_count()}x {getattr(dev, 'device_kind', dev.platform)}", "platform": dev.platform,
            "jax": jax.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "axes": fit(rows), "rows": rows}
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        prof["memory_bytes"] = int(stats["bytes_limit"])
    print(f"{'axis':<8} {'p':>2} {'op':<16} {'bytes':>11} {'time us':>10} {'busbw GB/s':>11}")
    for r in rows:
        print(f"{r['axis']:<8} {r['p']:>2} {r['op']:<16} {r['bytes']:>11} {r['time_s'] * 1e6:>10.1f} {r['busbw_GBps']:>11.2f}")
    for axis, v in prof["axes"].items():
        print(f"fit {axis}: alpha {v['alpha_s'] * 1e6:.1f} us, BW {v['bw_Bps'] / 1e9:.2f} GB/s {v['note']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(prof, indent=1))
    append_markdown(rows, prof, Path(a.markdown))
    print(f"wrote {a.out}; appended to {a.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
