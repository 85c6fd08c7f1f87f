"""Scaling of each rule file from 1 to N GPUs of one host: tokens/s per GPU, MFU, program memory
per GPU, scaling efficiency against the same model on 1 GPU, and the planner's step-time
estimate beside each measurement. One call per machine; appends rows to docs/benchmarks.md.

    PYTHONPATH=$PWD python3 scripts/bench_scaling.py [--models llama3_1b,llama3_3b,llama3_8b]
        [--rules dp,zero1,zero2,fsdp,tp,fsdp_tp,fsdp_tp_sp,fsdp_cp] [--gpus 1,2,4,8] [--seq 4096]
        [--per-device-batch 4] [--cp-seqs 32768,65536,131072] [--budget-s 540]
CPU check of the mechanics: --cpu-devices 8 --models tiny --seq 64 --per-device-batch 2 --dtype float32.
"""
import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="llama3_1b,llama3_3b,llama3_8b")
    p.add_argument("--rules", default="dp,zero1,zero2,fsdp,tp,fsdp_tp,fsdp_tp_sp,fsdp_cp")
    p.add_argument("--gpus", default="1,2,4,8")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--cp-seqs", default="", help="context-parallel runs (cp_ring over all GPUs, batch 1)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--cpu-devices", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="float32 for the CPU check (XLA:CPU fails on some bf16 steps)")
    args = p.parse_args()
    if args.cpu_devices:
        from meshlab.compat import set_cpu_devices
        set_cpu_devices(args.cpu_devices)
    import jax
    import models
    from meshlab import rules as R
    from meshlab.mesh import make_mesh
    from meshlab.plan import account
    from meshlab.plan.hardware import get_hardware
    from meshlab.plan.search import evaluate
    from meshlab.train.bench import time_steps
    from meshlab.train.peak import measured_matmul_flops
    from meshlab.train.state import model_def

    devices = jax.devices()
    peak = measured_matmul_flops(make_mesh("data=1", devices[:1]))   # one device's bf16 rate
    hw = get_hardware("h200")
    print(f"{len(devices)} x {devices[0].device_kind}; matmul {peak / 1e12:.0f} TFLOP/s per device", flush=True)
    start, rows = time.perf_counter(), []
    counts = [n for n in map(int, args.gpus.split(",")) if n <= len(devices)]
    runs = [(m, n, r, args.seq) for m in args.models.split(",") for n in counts for r in args.rules.split(",")
            if not (m == "llama3_8b" and n == 1)]   # 8b's state (16 B/param) barely fits one card
    runs += [(args.models.split(",")[0], len(devices), "cp_ring", int(s)) for s in args.cp_seqs.split(",") if s]
    base: dict = {}
    for model, n, rule_name, seq in runs:
        label = f"{model} {rule_name} x{n} seq {seq}"
        if time.perf_counter() - start > args.budget_s:
            rows.append({"run": label, "error": "not run: past this call's budget"})
            continue
        cfg = models.preset(model)
        cfg.dtype, cfg.attention, cfg.remat = args.dtype, "auto", "save_dots_no_batch"
        try:
            rules = R.load_rules(rule_name)
            # On one device every rule file is the same single-device program: the baseline.
            mesh = make_mesh(rules.mesh if n > 1 else "data=1", devices[:n])
            batch = max(1, args.per_device_batch * rules.data_parallel_size(mesh)) if rule_name != "cp_ring" else 1
            batch = max(batch, rules.data_parallel_size(mesh))
            tok_s, dt, loss, mem = time_steps(cfg, rules, mesh, batch, seq, args.steps)
            plan = evaluate(model_def(cfg), rules, dict(mesh.shape), batch, seq, cfg.remat, 1, hw)
        except Exception as e:  # a variant that fails (OOM, indivisible shapes) is a row, not the end
            rows.append({"run": label, "error": f"{type(e).__name__}: {str(e)[:150]}"})
            print(rows[-1], flush=True)
            continue
        per_gpu = tok_s / n
        if n == 1 or (model, seq) not in base:
            base.setdefault((model, seq), per_gpu if n == 1 else None)
        ref = base.get((model, seq))
        rows.append({"run": label, "batch": batch, "tok_s_gpu": per_gpu, "mfu": per_gpu *
                     account.train_flops_per_token(cfg, seq) / peak, "gib": mem / 2**30,
                     "eff": per_gpu / ref if ref else None, "step_ms": dt * 1e3,
                     "plan_ms": plan.step_s * 1e3 if plan.ok else None, "loss": loss})
        print(rows[-1], flush=True)
    write(rows, devices, peak)


def write(rows, devices, peak):
    import jax
    lines = [f"\n### Scaling ({datetime.date.today()}, {len(devices)} x {devices[0].device_kind}, jax {jax.__version__})\n",
             f"MFU against the measured per-device matmul rate ({peak / 1e12:.0f} TFLOP/s); efficiency = tokens/s per "
             "GPU over the same model and sequence on 1 GPU; planner = meshlab.plan estimate (h200 datasheet links).\n",
             "| run | global batch | tokens/s per GPU | MFU | program GiB/GPU | efficiency | step ms | planner ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | | FAILED: {r['error']} | | | | | |")
            continue
        eff = f"{100 * r['eff']:.0f}%" if r["eff"] else "-"
        plan = f"{r['plan_ms']:.0f}" if r["plan_ms"] else "no fit"
        lines.append(f"| {r['run']} | {r['batch']} | {r['tok_s_gpu']:,.0f} | {100 * r['mfu']:.1f}% | {r['gib']:.1f} | "
                     f"{eff} | {r['step_ms']:.0f} | {plan} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if devices[0].platform != "cpu":   # only real measurements go into the record
        with (ROOT / "docs" / "benchmarks.md").open("a") as f:
            f.write(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_scaling.md").write_text(text)


if __name__ == "__main__":
    main()
