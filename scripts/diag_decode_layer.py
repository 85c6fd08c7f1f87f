"""Where a batch-1 decode layer's time goes, without the engine: meshlab/bench/layer_chain.py.

    PYTHONPATH=$PWD python3 scripts/diag_decode_layer.py [--cpu-smoke] [--variants shipped,s1,...]
    ncu --profile-from-start on --clock-control none -k regex:'paged|decode_gemv' -o $OUT/layer \
        python3 scripts/diag_decode_layer.py --once      # each variant's chain run once, one layer

Times the chain of a decode layer's six launches over 16 layers of llama3_1b shape (bf16, random
weights, ctx 2048 in a cache sized for 8,448 tokens as bench_decode's engine is): per attention
tiling (layer_chain.attention_variants) and with one stage left out (no_attention, no_mlp,
no_wo), us per layer, medians. Rows in $OUT/diag_decode_layer.json and a table on stdout.
--once: each variant's chain over one layer, run once (no timing): what a profiler should see.
"""
import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SKIPS = {"no_attention": {"attention"}, "no_mlp": {"mlp"}, "no_wo": {"wo"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny model in interpret mode, 2 layers")
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--once", action="store_true", help="run each variant once over one layer, untimed (for ncu)")
    ap.add_argument("--ncu-summary", default="", help="print per-kernel metrics of an `ncu --page raw --csv` file and exit")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=8448)
    args = ap.parse_args()
    if args.ncu_summary:
        return ncu_summary(args.ncu_summary)
    import jax
    import models
    from meshlab.bench import layer_chain as lc
    name, dtype, layers = ("tiny", "float32", 2) if args.cpu_smoke else ("llama3_1b", "bfloat16", 16)
    ctx, max_len = (48, 128) if args.cpu_smoke else (args.ctx, args.max_len)
    cfg = dataclasses.replace(models.preset(name), dtype=dtype)
    state = lc.chain_state(cfg, 1 if args.once else layers, ctx, max_len)
    attn = lc.attention_variants(state.table.shape[1])
    wanted = [v for v in args.variants.split(",") if v] or list(attn) + list(SKIPS)
    rows, first_x = [], None
    for v in wanted:
        tiles, skip = (attn.get(v), frozenset(SKIPS.get(v, ())))
        if tiles is None and v not in SKIPS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(list(attn) + list(SKIPS))}")
        try:
            if args.once:
                fn = lc.chain_fn(cfg, tiles, skip, interpret=args.cpu_smoke)
                x, k, v_ = fn(state.x, state.weights, state.k, state.v, state.table, state.lengths, state.cos_sin)
                jax.block_until_ready(x)
                state = dataclasses.replace(state, k=k, v=v_)
                row = {"variant": v, "ran": True}
            else:
                us, x, state = lc.chain_time(cfg, state, tiles, skip, reps=3 if args.cpu_smoke else 20,
                                              interpret=args.cpu_smoke)
                row = {"variant": v, "us_per_layer": round(us, 2), "tiles": str(tiles) if tiles else ""}
                if not skip:        # every full chain computes the same x (bf16: the sum orders differ)
                    first_x = x if first_x is None else first_x
                    row["max_abs_diff_vs_first"] = float(jax.numpy.max(jax.numpy.abs(
                        x.astype(jax.numpy.float32) - first_x.astype(jax.numpy.float32))))
        except Exception as e:  # noqa: BLE001 - a tiling that fails to lower is a row, not the end
            row = {"variant": v, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print("ROW", json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp")) / "diag_decode_layer.json"
    out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['variant']:14s} {r.get('us_per_layer', r.get('error', 'ran'))}")


STALLS = "smsp__average_warps_issue_stalled_"
KEYS = {"us": "gpu__time_duration.sum", "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram_MB": "dram__bytes_read.sum", "regs": "launch__registers_per_thread", "grid": "launch__grid_size",
        "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active"}


def ncu_summary(path: str) -> None:
    """Per profiled kernel: duration, DRAM, registers, grid, occupancy and its four largest stall reasons."""
    import csv
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]          # ncu prints its own log lines first
    head, units, *kernels = list(csv.reader(lines))
    col = {name: i for i, name in enumerate(head)}
    for r in kernels:
        get = lambda key: r[col[key]] if key in col else "?"   # noqa: E731
        stalls = sorted(((float(r[i].replace(",", "") or 0), n[len(STALLS):].split("_per_issue")[0])
                         for n, i in col.items() if n.startswith(STALLS) and n.endswith("per_issue_active.ratio")),
                        reverse=True)[:4]
        vals = {k: get(m) for k, m in KEYS.items()}
        if vals["dram_MB"] != "?":
            unit = units[col[KEYS["dram_MB"]]]
            scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(unit, float("nan"))
            vals["dram_MB"] = f"{float(vals['dram_MB'].replace(',', '')) * scale:.2f}"
        print(get("Kernel Name")[:40], vals, "stalls:", ", ".join(f"{n} {x:.1f}" for x, n in stalls))


if __name__ == "__main__":
    main()
