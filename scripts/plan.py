"""Which mesh and rule file to train with: every plan priced without compiling, ranked by step time.

    python scripts/plan.py --model llama3_8b --devices 16 --hosts 2 --batch 64 --seq 4096 --hardware h200
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # planning never touches an accelerator

import models  # noqa: E402
from meshlab.plan import account, compute, search  # noqa: E402
from meshlab.plan.hardware import HardwareError, get_hardware  # noqa: E402
from meshlab.rules import RulesError  # noqa: E402


PRESETS = ", ".join(n for *_, presets in models.ARCHITECTURES.values() for n in presets)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def _param_line(cfg) -> str:
    """Matmul parameters (6N's N); a mixture of experts: those one token uses, and all of them."""
    if hasattr(cfg, "n_experts"):
        return (f"{_count(cfg.matmul_param_count(active=True))} matmul params active per token "
                f"({_count(cfg.matmul_param_count(active=False))} in all)")
    return f"{_count(cfg.matmul_param_count())} matmul params"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="preset name: " + PRESETS)
    ap.add_argument("--devices", type=int, required=True, help="devices in all (GPUs), a multiple of --hosts")
    ap.add_argument("--hosts", type=int, default=1, help="hosts the devices are spread over (default 1)")
    ap.add_argument("--batch", type=int, default=0, help="global batch in sequences (default: 2 per device)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length in tokens (default 4096)")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16 (default), float16 or float32")
    ap.add_argument("--attention", default="cudnn", help="xla keeps the [S,S] softmax; cudnn (default)/pallas keep only "
                    "the lse")
    ap.add_argument("--hardware", default="h200", help="h200 | h100 | a100 | a profile .json from bench_collectives.py")
    ap.add_argument("--rules", default="", help="comma-separated rule files to consider (default: all shipped)")
    ap.add_argument("--top", type=int, default=10, help="plans to list (default 10)")
    ap.add_argument("--explain", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="print the arithmetic of plan N (alone: the first)")
    ap.add_argument("--out", default="", help="write the top plans' rule files and plan.png here")
    a = ap.parse_args(argv)
    try:
        if a.explain < 0:    # a negative N would index the ranking from its end and explain another plan
            raise ValueError(f"--explain {a.explain}: N is a plan's rank in the list, 1 or more")
        if a.devices < 1 or a.hosts < 1 or a.devices % a.hosts:
            raise ValueError(f"--devices {a.devices} must be a positive multiple of --hosts {a.hosts}")
        cfg = models.preset(a.model)
        cfg.dtype, cfg.attention = a.dtype, a.attention
        hw = get_hardware(a.hardware)
        batch = a.batch or 2 * a.devices
        names = [n.strip() for n in a.rules.split(",") if n.strip()] or None
        good, bad = search.search(cfg, a.devices, batch, a.seq, hw, a.hosts, names)
    except (KeyError, ValueError, HardwareError, RulesError) as e:
        print(f"plan.py: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(f"{cfg.name}: {_param_line(cfg)}, batch {batch} x {a.seq} tokens, {a.devices} devices on {a.hosts} host(s), "
          f"{hw.name}")
    print(f"attention FLOPs pass the projections+MLP above S = {compute.crossover_seq(cfg):.0f}\n")
    rw = max([len("rules")] + [len(p.rules) for p in good[:a.top] + bad])    # the rule file column fits its names
    print("k: micro-batches a step (data.microbatches); step: compute plus the communication it does not hide\n")
    print(f"{'#':>3} {'rules':<{rw}} {'mesh':<26} {'remat':<19} {'k':>2} {'mem/dev':>10} {'compute':>9} {'comm':>9} "
          f"{'step':>9} {'MFU':>5}")
    for i, p in enumerate(good[:a.top], 1):
        print(f"{i:>3} {p.rules:<{rw}} {p.mesh_string:<26} {p.remat:<19} {p.microbatches:>2} {account.fmt_bytes(p.mem_bytes):>10} "
              f"{p.compute_s * 1e3:>7.1f}ms {p.comm['total'] * 1e3:>7.1f}ms {p.step_s * 1e3:>7.1f}ms {p.mfu:>5.0%}")
    if not good:
        print("  (no plan fits: more devices, a smaller batch or sequence, or a larger --hardware)")
    print(f"\n{len(bad)} rejected; one per rule file and reason:")
    seen = set()
    for p in bad:
        key = (p.rules, p.reason.split(" per device")[0][:40] if "needs" not in p.reason else "memory")
        if key in seen:
            continue
        seen.add(key)
        print(f"  {p.rules:<{rw}} {p.mesh_string:<26} {p.remat:<19} k={p.microbatches}: {p.reason}")
    if a.explain and good:
        print("\n" + search.explain(good[min(a.explain, len(good)) - 1], cfg, hw))
    if a.out and good:
        out = Path(a.out)
        print()
        for i, p in enumerate(good[:3], 1):
            path = search.write_rule_file(p, out, i)
            print(f"wrote {path}  (--mesh {p.mesh_string} model.remat={p.remat} data.microbatches={p.microbatches})")
        print(f"wrote {search.plot(good, out / 'plan.png', f'{cfg.name}, {a.devices} devices, batch {batch}x{a.seq}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
