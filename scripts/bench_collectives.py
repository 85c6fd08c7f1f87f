"""Collectives over each mesh axis, timed through shard_map; alpha and BW fitted per axis.

    PYTHONPATH=$PWD python3 scripts/bench_collectives.py --mesh data=-1 --out $OUT/h200.json
    python scripts/bench_collectives.py --cpu-devices 8 --mesh data=2,tensor=4 --max-bytes 1MiB
    # 2 GPUs: the four NCCL collectives 1 MiB .. 4 GiB, then why psum trails torch
    ... --ops all-reduce,all-gather,reduce-scatter,all-to-all,ppermute --min-bytes 1MiB --max-bytes 4GiB --variants all

What is measured and how (the collectives, the ppermute-built ones, the checks, the two times, the
fit): meshlab/bench/collectives.py.
--variants re-times the all-reduce in fresh processes, one change each (NCCL protocol/algorithm,
XLA user/symmetric buffers, XLA's one-shot all-reduce kernel, one process per GPU, combining, in
place). Flags checked to parse in jax 0.10.2; the GPU's jax may differ: an unknown one is an error row.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the variants' children run this file without PYTHONPATH
from meshlab.bench.diary import DIARY, out_dir  # noqa: E402
from meshlab.bench.collectives import OPS, parse_bytes, sweep, use_cpu_devices  # noqa: E402
from meshlab.bench.collectives_variants import VARIANTS, child_variant, sweep_then_variants  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="data=-1")
    ap.add_argument("--min-bytes", default="4KiB")
    ap.add_argument("--max-bytes", default="", help="default 1GiB on GPU, 1MiB on CPU")
    ap.add_argument("--ops", default="", help=f"comma list from {', '.join(OPS)} (default: all)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check-max-bytes", default="64MiB", help="check hand-written ops against lax up to this size")
    ap.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
    ap.add_argument("--out", default="", help="the fitted profile's JSON (the planner's --hardware file); default "
                    "$OUT/collectives.json, else <tmp>/meshlab_bench_collectives/collectives.json")
    ap.add_argument("--markdown", default=str(DIARY), help="the diary its rows go to (a GPU run's only)")
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
    a.out = a.out or str(out_dir("bench_collectives") / "collectives.json")
    if a.cpu_devices:   # each process of a multi-process variant gets its share; jax.distributed joins them
        use_cpu_devices(a.cpu_devices, a.mp_size)
    try:
        lo, hi = parse_bytes(a.min_bytes), parse_bytes(a.max_bytes) if a.max_bytes else None
        check_max = parse_bytes(a.check_max_bytes)
        [parse_bytes(s) for s in a.variant_sizes.split(",")]
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
    return sweep(a, lo, hi, ops, check_max)


if __name__ == "__main__":
    sys.exit(main())
