"""One GPU, the ZeRO rule files: the single-device step must not get slower with them.

llama3_1b bf16, batch 4 x 4096, remat=save_dots_attn, loss_impl=onepass, attention=auto, under dp,
zero1, zero2, fsdp on a 1-device mesh (no data-parallel axis: each runs the plain step), with the
overlap flags of meshlab/xla_flags.py (MESHLAB_XLA_OVERLAP=0 to time without them).

    PYTHONPATH=$PWD python3 scripts/bench_zero.py [--rules dp,zero1,zero2,fsdp] [--steps 8]
Appends dated rows to docs/archive/benchmarks-diary.md (and $OUT/bench_zero.json when $OUT is set).
"""
import argparse
import datetime
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshlab import xla_flags  # noqa: E402

FLAGS = xla_flags.apply()      # before JAX starts a backend

import jax  # noqa: E402

import models  # noqa: E402
from meshlab import rules as R  # noqa: E402
from meshlab.bench import diary  # noqa: E402
from meshlab.mesh import make_mesh  # noqa: E402
from meshlab.bench.train import time_steps  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3_1b")
    p.add_argument("--rules", default="dp,zero1,zero2,fsdp")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--remat", default="save_dots_attn")
    p.add_argument("--no-record", action="store_true", help="print only; leave the benchmarks diary alone")
    args = p.parse_args()
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}; XLA_FLAGS {FLAGS or '(none)'}", flush=True)
    rows = []
    for name in args.rules.split(","):
        cfg = models.preset(args.model)
        cfg.dtype, cfg.attention, cfg.remat, cfg.loss_impl = "bfloat16", "auto", args.remat, "onepass"
        try:
            tok_s, dt, loss, mem = time_steps(cfg, R.load_rules(name), mesh, args.batch, args.seq, args.steps)
            rows.append({"rules": name, "tokens_per_s": round(tok_s), "step_ms": round(dt * 1e3, 1),
                         "program_gib": round(mem / 2**30, 1), "loss": round(loss, 3)})
        except Exception as e:   # one failing rule file is reported, the others still run
            rows.append({"rules": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        print(rows[-1], flush=True)
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n## {day}: bench_zero, {dev.device_kind}, {args.model} {args.batch} x {args.seq}, remat={args.remat}, "
             f"onepass CE, attention=auto, 1-device mesh; XLA_FLAGS `{FLAGS}`\n",
             "| rules | tokens/s | step ms | program GiB | loss |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rules']} | {r.get('tokens_per_s', r.get('error'))} | {r.get('step_ms', '')} | "
                     f"{r.get('program_gib', '')} | {r.get('loss', '')} |")
    text = "\n".join(lines) + "\n"
    if not args.no_record:
        diary.append(text, backend=dev.platform)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_zero.json").write_text(json.dumps({"rows": rows, "xla_flags": FLAGS}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
