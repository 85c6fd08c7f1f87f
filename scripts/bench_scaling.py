"""Scaling of each rule file from 1 to N GPUs of one host: tokens/s per GPU, MFU, program memory
per GPU, scaling efficiency against the same model on 1 GPU, and the planner's step-time
estimate beside each measurement. One process sees every GPU (no multi-process launch).

    PYTHONPATH=$PWD python3 scripts/bench_scaling.py [--models llama3_1b,llama3_3b,llama3_8b]
        [--rules dp,zero1,zero2,fsdp,tp,fsdp_tp,fsdp_tp_sp,fsdp_cp] [--gpus 1,2,4,8] [--seq 4096]
        [--per-device-batch 4] [--cp-seqs 32768,65536,131072] [--budget-s 540]
    # or an explicit, ordered list (most important first; runs that no longer fit the budget are rows):
    ... --runs llama3_1b:dp:1,llama3_1b:fsdp:2,llama3_8b:fsdp:2,llama3_1b:cp_ring:2:32768
        --model-over attention=cudnn,loss_impl=pallas,fused_swiglu=1,fused_norm=1,remat=none
        --model-over llama3_8b:remat=save_dots_no_batch,per_device_batch=2 --model-over seq65536:remat=full
CPU check of the mechanics: --cpu-devices 8 --models tiny --seq 64 --per-device-batch 2 --dtype float32
(tiny has 2 kv heads: tp over 4 and 8 devices are rows "not run", the rule file refusing the split).

Global batch = per-device batch x GPUs (the same tokens per GPU under every rule file, as DDP runs;
--batch-per replica gives per-device batch x data-parallel size instead); context-parallel runs at
long sequences use --cp-batch. The Pallas fused ops run per device inside the data-parallel region:
on a run with a tensor or context axis they would be gathered around, so --sharded-over resets them
there (default) - each row says which settings it ran with. A run whose rule file resolves to the
same program as an earlier row on this mesh (e.g. fsdp_tp == tp on 2 GPUs: fsdp has size 1) is
reported as that row, not compiled again. Rows stream to $OUT/bench_scaling.jsonl as they finish.
"""
import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from meshlab.bench import diary  # noqa: E402
FUSED = "loss_impl=dense,fused_swiglu=0,fused_norm=0,fused_rope=0"


def parse_over(items: list[str]) -> list[tuple[str | None, dict]]:
    """`[SELECTOR:]key=value,...` -> [(selector or None, {key: value})]. A selector is a model name, a rule
    file, xN (GPU count) or seqS, or several joined by '/' (all must match): llama3_8b:..., tp/x2:..., seq65536:..."""
    out = []
    for item in items:
        sel, _, body = item.partition(":") if ":" in item.split("=", 1)[0] else (None, None, item)
        kv = dict(p.split("=", 1) for p in body.split(",") if p)
        out.append((sel or None, kv))
    return out


def selected(sel: str | None, model: str, rule: str, n: int, seq: int) -> bool:
    return sel is None or all(t in (model, rule, f"x{n}", f"seq{seq}") for t in sel.split("/"))


def apply_over(cfg, kv: dict) -> dict:
    """Set config fields from strings (typed by the dataclass field); returns what was not a field."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    rest = {}
    for k, v in kv.items():
        if k not in fields:
            rest[k] = v
            continue
        cur = getattr(cfg, k)
        val = (v.lower() in ("1", "true", "yes", "on")) if isinstance(cur, bool) else type(cur)(v)
        setattr(cfg, k, val)
    return rest


def plan_runs(a) -> list[tuple[str, str, int, int]]:
    if a.runs:
        runs = []
        for r in a.runs.split(","):
            parts = r.split(":")
            runs.append((parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) > 3 else a.seq))
        return runs
    runs = [(m, r, n, a.seq) for m in a.models.split(",") for n in map(int, a.gpus.split(",")) for r in a.rules.split(",")
            if not (m == "llama3_8b" and n == 1)]   # 8b's state (16 B/param) barely fits one card
    seen, uniq = set(), []
    for m, r, n, s in runs:   # on one GPU every rule file is the same single-device program: one baseline
        key = (m, "dp" if n == 1 else r, n, s)
        if key not in seen:
            seen.add(key)
            uniq.append(key)
    gmax = max(map(int, a.gpus.split(",")))
    return uniq + [(a.models.split(",")[0], "cp_ring", gmax, int(s)) for s in a.cp_seqs.split(",") if s]


def signature(rules, mesh) -> tuple:
    """What decides the program: mesh axes > 1, each logical name's axes, where params/grads/optimizer state
    live (a `replicated` kind drops the batch axes), strategies and batch axes, all after size-1 axes drop out."""
    from meshlab.rules import LOGICAL_NAMES
    names = [n for n in sorted(LOGICAL_NAMES) if n in rules.rules]
    batch = rules.batch_axes(mesh)
    axes = {n: rules.axes(n, mesh) for n in names}
    state = tuple((kind, tuple((n, tuple(a for a in axes[n] if not (mode == "replicated" and a in batch))) for n in names))
                  for kind, mode in sorted(rules.state.items()))
    return (tuple(sorted((k, v) for k, v in mesh.shape.items() if v > 1)), tuple(axes.items()), state,
            repr(sorted(rules.strategies.items())), batch)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3_1b,llama3_3b,llama3_8b")
    p.add_argument("--rules", default="dp,zero1,zero2,fsdp,tp,fsdp_tp,fsdp_tp_sp,fsdp_cp")
    p.add_argument("--gpus", default="1,2,4,8")
    p.add_argument("--runs", default="", help="ordered MODEL:RULES:GPUS[:SEQ],... (replaces models/rules/gpus/cp-seqs)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--batch-per", choices=("gpu", "replica"), default="gpu")
    p.add_argument("--cp-seqs", default="", help="context-parallel runs (cp_ring over all GPUs)")
    p.add_argument("--cp-batch", type=int, default=1, help="global batch of runs at sequences above --seq")
    p.add_argument("--model-over", action="append", default=[], help="[MODEL:]field=value,... (repeatable; "
                   "per_device_batch=N is allowed too)")
    p.add_argument("--sharded-over", default=FUSED, help="applied last on runs with a tensor/context axis > 1 "
                   "('' to keep the fused Pallas ops there)")
    p.add_argument("--attention", default="auto")
    p.add_argument("--remat", default="save_dots_no_batch")
    p.add_argument("--oom-remat", default="save_dots_no_batch", help="a run out of memory is retried once with this "
                   "remat policy when the budget allows ('' = never)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--first-run-s", type=float, default=60, help="time assumed for a model's first run (budget)")
    p.add_argument("--hardware", default="h200", help="planner hardware: h200 or a profile .json from bench_collectives")
    p.add_argument("--cpu-devices", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="float32 for the CPU check (XLA:CPU fails on some bf16 steps)")
    args = p.parse_args(argv)
    if args.cpu_devices:
        from meshlab.compat import set_cpu_devices
        set_cpu_devices(args.cpu_devices)
    start = time.perf_counter()
    import jax
    import models
    from meshlab import rules as R
    from meshlab.mesh import make_mesh
    from meshlab.plan.hardware import HardwareError, get_hardware
    from meshlab.plan.search import evaluate
    from meshlab.bench.train import time_steps
    from meshlab.peak import measured_matmul_flops
    from models import model_def

    devices = jax.devices()
    peak = measured_matmul_flops(make_mesh("data=1", devices[:1]))   # one device's bf16 rate
    try:
        hw = get_hardware(args.hardware)
    except HardwareError as e:
        print(f"bench_scaling: {e}; planner on the h200 datasheet", flush=True)
        hw = get_hardware("h200")
    overs = parse_over(args.model_over)
    sharded_over = parse_over([args.sharded_over])[0][1] if args.sharded_over else {}
    out_dir = os.environ.get("OUT")
    sink = open(Path(out_dir, "bench_scaling.jsonl"), "a") if out_dir else None
    print(f"{len(devices)} x {devices[0].device_kind}; matmul {peak / 1e12:.0f} TFLOP/s per device; planner: {hw.name}",
          flush=True)
    rows, base, seen, took = [], {}, {}, {}

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps({"date": datetime.date.today().isoformat(), "devices": len(devices),
                                   "device": devices[0].device_kind, "jax": jax.__version__, **row}) + "\n")
            sink.flush()

    for model, rule_name, n, seq in plan_runs(args):
        label = f"{model} {rule_name} x{n} seq {seq}"
        if n > len(devices):
            record({"run": label, "error": f"not run: {n} GPUs asked, {len(devices)} present"})
            continue
        left = args.budget_s - (time.perf_counter() - start)
        need = took.get(model) or (2 * max(took.values()) if took else args.first_run_s)
        if need > left:
            record({"run": label, "error": f"not run: ~{need:.0f} s needed, {max(left, 0):.0f} s of the budget left"})
            continue
        t_run = time.perf_counter()
        try:
            cfg = models.preset(model)
            cfg.dtype, cfg.attention, cfg.remat = args.dtype, args.attention, args.remat
            rules = R.load_rules(rule_name)
            mesh = make_mesh(rules.mesh if n > 1 else "data=1", devices[:n])
            rest = {}
            for sel, kv in overs:
                if selected(sel, model, rule_name, n, seq):
                    rest.update(apply_over(cfg, kv))
            sharded = any(s > 1 for a, s in mesh.shape.items() if a not in rules.batch_axes(mesh))
            if sharded and sharded_over:
                apply_over(cfg, sharded_over)
            pdb = int(rest.pop("per_device_batch", args.per_device_batch))
            if rest:
                raise ValueError(f"--model-over: not config fields: {sorted(rest)}")
            dp = rules.data_parallel_size(mesh)
            if seq > args.seq:
                batch = max(args.cp_batch, dp)
            else:
                batch = pdb * (n if args.batch_per == "gpu" else dp)
                batch = -(-batch // dp) * dp
            setting = {k: getattr(cfg, k) for k in ("attention", "remat", "loss_impl", "fused_swiglu", "fused_norm",
                                                    "fused_rope")}
            sig = (model, seq, batch, tuple(sorted(setting.items())), signature(rules, mesh))
            if sig in seen:
                record({**seen[sig], "run": label, "same_as": seen[sig]["run"]})
                continue
            note = ""
            while True:
                try:
                    tok_s, dt, loss, mem = time_steps(cfg, rules, mesh, batch, seq, args.steps)
                    break
                except Exception as e:  # out of memory: once more with --oom-remat if the time is there
                    oom = "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)
                    spent, now_left = time.perf_counter() - t_run, args.budget_s - (time.perf_counter() - start)
                    if not (oom and args.oom_remat and cfg.remat != args.oom_remat and now_left > spent):
                        raise
                    note = f"remat {cfg.remat} ran out of memory; ran with remat {args.oom_remat}"
                print(f"{label}: {note}", flush=True)
                cfg.remat = args.oom_remat
            setting["remat"] = cfg.remat
            plan = evaluate(model_def(cfg), rules, dict(mesh.shape), batch, seq, cfg.remat, 1, hw)
        except R.RulesError as e:  # the model does not split on this mesh (tp past kv_heads): not a failure
            record({"run": label, "error": f"not run: {str(e).split(': ', 1)[-1]}", "run_s": time.perf_counter() - t_run})
            continue
        except Exception as e:  # a variant that fails (OOM) is a row, not the end
            record({"run": label, "error": f"{type(e).__name__}: {str(e)[:200]}", "run_s": time.perf_counter() - t_run})
            took[model] = max(took.get(model, 0), time.perf_counter() - t_run)
            continue
        took[model] = max(took.get(model, 0), time.perf_counter() - t_run)
        per_gpu = tok_s / n
        if n == 1:
            base.setdefault((model, seq), per_gpu)
        ref = base.get((model, seq))
        flops = cfg.train_flops_per_token(seq)
        row = {"run": label, "batch": batch, "tok_s_gpu": per_gpu, "mfu": per_gpu * flops / peak,
               "mfu_989": per_gpu * flops / 989e12, "gib": mem / 2**30, "eff": per_gpu / ref if ref else None,
               "step_ms": dt * 1e3, "plan_ms": plan.step_s * 1e3 if plan.step_s else None,
               "plan_note": "" if plan.ok else plan.reason, "loss": loss, "run_s": time.perf_counter() - t_run,
               "settings": setting, **({"note": note} if note else {})}
        seen[sig] = row
        record(row)
    write(rows, devices, peak)


def write(rows, devices, peak):
    import jax
    lines = [f"\n### Scaling ({datetime.date.today()}, {len(devices)} x {devices[0].device_kind}, jax {jax.__version__})\n",
             f"MFU against the measured per-device matmul rate ({peak / 1e12:.3g} TFLOP/s) and against 989 TFLOP/s; "
             "efficiency = tokens/s per GPU over the same model and sequence on 1 GPU; planner = meshlab.plan "
             "estimate.\n",
             "| run | global batch | tokens/s per GPU | MFU (measured peak) | MFU (989) | program GiB/GPU | efficiency | "
             "step ms | planner ms | settings |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            why = r["error"] if r["error"].startswith("not run") else f"FAILED: {r['error']}"
            lines.append(f"| {r['run']} | | {why} | | | | | | | |")
            continue
        eff = f"{100 * r['eff']:.0f}%" if r["eff"] else "-"
        plan = (f"{r['plan_ms']:.0f}" if r["plan_ms"] else "-") + (f" (planner: {r['plan_note'][:50]})" if r["plan_note"] else "")
        s = r["settings"]
        note = (f"attn {s['attention']}, remat {s['remat']}, loss {s['loss_impl']}"
                + "".join(f", {k}" for k in ("fused_swiglu", "fused_norm", "fused_rope") if s[k])
                + (f"; same program as {r['same_as']}" if "same_as" in r else "")
                + (f"; {r['note']}" if r.get("note") else ""))
        lines.append(f"| {r['run']} | {r['batch']} | {r['tok_s_gpu']:,.0f} | {100 * r['mfu']:.1f}% | "
                     f"{100 * r['mfu_989']:.1f}% | {r['gib']:.1f} | {eff} | {r['step_ms']:.0f} | {plan} | {note} |")
    text = "\n".join(lines) + "\n"
    print(text)
    diary.append(text, backend=devices[0].platform)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_scaling.md").write_text(text)


if __name__ == "__main__":
    main()
