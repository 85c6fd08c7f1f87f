"""Pipeline executor on one GPU, and the bubble of every schedule table.

    PYTHONPATH=$PWD python3 scripts/bench_pipeline.py [--model llama3_1b --seq 4096 --rows 8]

1. The executor forced on a 1-stage mesh (1F1B table, M = rows micro-batches of one row) against the
   plain step's micro-batch scan with the same M: the loss-and-gradients of one step, which is all
   that differs (the optimizer update is the same code). Loss and gradient norm are checked equal
   (bf16) before a time is reported; then A/B alternated, median per side.
2. Empty-tick overhead: the same compiled program (the table is an argument, so no second compile)
   run with an all-idle table of the same length: its time / ticks bounds one empty tick from above
   (it includes the step's fixed work: zeroing the accumulators, the final sums).
   --tick-slope compiles the executor once more with 4x the ticks: the slope between the two idle
   runs is one empty tick without the fixed work.
   --previous-executor FILE times an earlier executor.py in the same call, alternated with the others
   (its program and its all-idle table): old against new on the same card and shapes.
3. Bubble table (host only): p = 2, 4, 8 and m = 4 .. 64, theory vs the schedule table (idle op
   ticks, and lockstep time with F = 1, B = 2, BI = W = 1).
Prints the tables; appends them, dated, to docs/archive/benchmarks-diary.md ($OUT/bench_pipeline.json too).
"""
import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from meshlab import rules as R  # noqa: E402
from meshlab.bench import diary  # noqa: E402
from meshlab.mesh import make_mesh  # noqa: E402
from meshlab.parallel.pipeline import bubble, build, runner, theory_bubble  # noqa: E402
from meshlab.parallel.pipeline.schedules import COLS  # noqa: E402
from meshlab.plan import hlo  # noqa: E402
from meshlab.plan.pipeline import loop_copies  # noqa: E402
from meshlab.layout import to_shardings  # noqa: E402
from meshlab.train.state import init_state, state_specs  # noqa: E402
from models import model_def  # noqa: E402
from meshlab.train.optimizer import OptimConfig, make_optimizer  # noqa: E402
from meshlab.train.step import make_loss_and_grads  # noqa: E402


def bubble_rows():
    rows = []
    for p in (2, 4, 8):
        for m in (4, 8, 16, 32, 64):
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)):
                if name == "interleaved" and m % p:
                    continue
                b = bubble(build(name, p, m, v))
                theory = (p - 1) / (3 * m + p - 1) if name == "zb" else theory_bubble(p, m, v)
                rows.append({"p": p, "m": m, "schedule": name + (f" v={v}" if v > 1 else ""), "theory": theory,
                             "idle": b["idle"], "lockstep": b["lockstep"], "ticks": b["ticks"]})
    return rows


def timed(fn, args, n):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return ts, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_1b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=8, help="global batch = micro-batches (one row each)")
    ap.add_argument("--remat", default="save_dots_no_batch")
    ap.add_argument("--attention", default="cudnn")
    ap.add_argument("--loss-impl", default="dense")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per side and round (3 rounds)")
    ap.add_argument("--layers", type=int, default=0, help="model.n_layers (0: the preset's)")
    ap.add_argument("--tick-slope", action="store_true", help="one more compile: the executor with 4x the ticks, all "
                    "idle; (its time - the idle run's) / (3 x ticks) is one empty tick without the step's fixed work")
    ap.add_argument("--previous-executor", metavar="FILE", help="an earlier executor.py to time beside this one "
                    "(git show REV:meshlab/parallel/pipeline/executor.py > FILE)")
    ap.add_argument("--host-only", action="store_true", help="only the bubble table")
    ap.add_argument("--no-record", action="store_true", help="print only; leave the benchmarks diary alone")
    a = ap.parse_args()
    brows = bubble_rows()
    out = {"bubble": brows}
    lines = [f"\n### Pipeline ({datetime.date.today().isoformat()}, scripts/bench_pipeline.py)\n",
             "Bubble: theory (GPipe/1F1B (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1)) vs the "
             "schedule table: idle op ticks, and lockstep time (a tick lasts its costliest op; F=1, B=2, BI=W=1).\n",
             "| p | m | schedule | theory | table idle | table lockstep | ticks |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['p']} | {r['m']} | {r['schedule']} | {r['theory']:.3f} | {r['idle']:.3f} | {r['lockstep']:.3f} | "
              f"{r['ticks']} |" for r in brows]
    if not a.host_only:
        out["device"], dev_lines = device_part(a)
        lines += dev_lines
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_record:
        diary.append(text, backend=jax.default_backend())
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_pipeline.json").write_text(json.dumps(out, indent=1))


def load_executor(path):
    """A previous executor.py (`git show REV:meshlab/parallel/pipeline/executor.py > FILE`), to time beside this one."""
    spec = importlib.util.spec_from_file_location("bench_pipeline_previous_executor", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def compile_pipe(md, rules, mesh, m, args, executor=None):
    """The executor forced on the 1-stage mesh (1F1B table), traced with `executor` standing in for
    meshlab/parallel/pipeline/executor.py when given (the runner looks it up when it traces)."""
    saved = runner.executor
    runner.executor = executor or saved
    try:
        fn = make_loss_and_grads(md, rules, mesh, m, pipeline={"schedule": "1f1b", "virtual": 1})
        return jax.jit(fn).lower(*args).compile()
    finally:
        runner.executor = saved


def idle_table(sched):
    """The schedule's shape with every stage idle and nothing received: the same compiled program runs it."""
    idle = np.zeros_like(sched.table)
    idle[..., COLS.index("recv_f")] = sched.slots["fin"]
    idle[..., COLS.index("recv_b")] = sched.slots["bin"]
    return jnp.asarray(idle)


def grad_norm(g):
    return float(jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(g))))


def device_part(a):
    dev = jax.devices()[0]
    cfg = dataclasses.replace(models.preset(a.model), dtype="bfloat16", remat=a.remat, attention=a.attention,
                              loss_impl=a.loss_impl, **({"n_layers": a.layers} if a.layers else {}))
    md = model_def(cfg)
    rules = R.load_rules("dp")
    mesh = make_mesh("data=1", devices=[dev])
    tx = make_optimizer(OptimConfig(lr=1e-4, warmup_steps=2), 100, md.names)
    m = a.rows
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (m, a.seq + 1)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": np.zeros((m, a.seq), np.int32),
             "positions": np.broadcast_to(np.arange(a.seq, dtype=np.int32), (m, a.seq)).copy()}
    batch = jax.device_put(batch, dev)
    one = jnp.float32(1.0)
    sched = build("1f1b", 1, m)
    table, idle = jnp.asarray(sched.table), idle_table(sched)
    compile_s, progs, built = {}, {}, {}
    with R.use_rules(rules, mesh):
        params = init_state(md, tx, to_shardings(mesh, state_specs(md, rules, mesh, tx, False)), 0, False)["params"]
        t = time.perf_counter()
        plain = jax.jit(make_loss_and_grads(md, rules, mesh, m)).lower(params, batch, one).compile()
        compile_s["plain"] = time.perf_counter() - t
        progs["plain"], built["plain"] = (plain, (params, batch, one)), plain
        sides = [("pipe", None)] + ([("previous", load_executor(a.previous_executor))] if a.previous_executor else [])
        for name, mod in sides:
            t = time.perf_counter()
            fn = compile_pipe(md, rules, mesh, m, (params, batch, one, table), mod)
            compile_s[name] = time.perf_counter() - t
            progs[name], built[name] = (fn, (params, batch, one, table)), fn
            progs[name + " idle"] = (fn, (params, batch, one, idle))
        if a.tick_slope:   # same slots, 4x the ticks: a second program (the table's length is its shape)
            idle4 = idle_table(sched.padded(4 * sched.ticks, sched.slots))
            progs["pipe idle x4"] = (compile_pipe(md, rules, mesh, m, (params, batch, one, idle4)), (params, batch, one, idle4))
    times, outs = {k: [] for k in progs}, {}
    for _ in range(3):   # alternate the sides: clocks and neighbours drift
        for name, (fn, args) in progs.items():
            ts, outs[name] = timed(fn, args, a.reps)
            times[name] += ts
    ref = outs["plain"]
    errs = {}
    for name, _ in sides:
        got = outs[name]
        errs[name] = (abs(float(got[0]) - float(ref[0])) / abs(float(ref[0])),
                      abs(grad_norm(got[1]) - grad_norm(ref[1])) / grad_norm(ref[1]))
    ok = all(le < 1e-2 and ge < 2e-2 for le, ge in errs.values())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    # Per program: compiled temp and the copies of >= 1 MB inside loops or branches (the tick loop's
    # buffers moved per tick; none is the executor's promise).
    mem = {k: (c.memory_analysis().temp_size_in_bytes / 2**30, loop_copies(c.as_text(), 2**20)) for k, c in built.items()}
    res = {"device": dev.device_kind, "jax": jax.__version__, "model": a.model, "n_layers": cfg.n_layers, "seq": a.seq,
           "microbatches": m, "remat": a.remat, "attention": a.attention, "rel_err": errs, "ok": ok, "ms": med,
           "compile_s": compile_s, "ticks": sched.ticks,
           "temp_gib": {k: t for k, (t, _) in mem.items()}, "loop_copies": {k: len(c) for k, (_, c) in mem.items()}}
    return res, device_lines(a, cfg, dev, sched, med, errs, ok, compile_s, mem)


def device_lines(a, cfg, dev, sched, med, errs, ok, compile_s, mem):
    err_text = "; ".join(f"{k}: loss {le:.1e}, grad norm {ge:.1e}" for k, (le, ge) in errs.items())
    lines = [f"\nExecutor forced on one stage: {a.model} ({cfg.n_layers} layers), {a.rows} micro-batches of 1 x {a.seq}, "
             f"bf16, remat {a.remat}, attention {a.attention}, loss {a.loss_impl}, {dev.device_kind}, jax {jax.__version__}; "
             f"loss-and-gradients of one step, median of {3 * a.reps} alternated calls. Relative errors vs plain: "
             f"{err_text}. Compile s: " + ", ".join(f"{k} {v:.0f}" for k, v in compile_s.items()) + ".\n",
             "| program | ms | vs plain | per tick (us) | temp GiB | copies >= 1 MB in loops |", "|---|---|---|---|---|---|"]
    if not ok:
        return lines + [f"| FAILED: the pipelined gradients differ from the plain step's ({err_text}); no time reported "
                        "| | | | | |"]
    names = {"plain": f"plain micro-batch scan (M={a.rows})",
             "pipe": f"pipeline executor, 1F1B table, 1 stage ({sched.ticks} ticks)",
             "pipe idle": f"same program, all {sched.ticks} ticks idle",
             "previous": f"previous executor ({a.previous_executor}), same table",
             "previous idle": "previous executor, all ticks idle",
             "pipe idle x4": f"executor, {4 * sched.ticks} ticks all idle (a second program)"}
    for k, ms in med.items():
        tick = f"{ms / sched.ticks * 1e3:.0f}" if k.endswith("idle") else ""
        if k == "pipe idle x4":
            tick = f"{(ms - med['pipe idle']) / (3 * sched.ticks) * 1e3:.0f} (slope)"
        temp, copies = mem.get(k, (None, None))
        extra = "| |" if temp is None else f"| {temp:.2f} | {len(copies)} ({sum(hlo.shape_bytes(s) for _, s in copies) / 2**30:.2f} GiB) |"
        lines.append(f"| {names[k]} | {ms:.2f} | {ms / med['plain']:.3f} | {tick} {extra}")
    lines.append(f"\nExecutor overhead {(med['pipe'] / med['plain'] - 1) * 100:+.2f}% (target < 3%); an empty tick at most "
                 f"{med['pipe idle'] / sched.ticks * 1e3:.0f} us (the idle run includes the step's fixed work: zeroing the "
                 "fp32 gradient accumulators and the stash)" + (
                     f"; {(med['pipe idle x4'] - med['pipe idle']) / (3 * sched.ticks) * 1e3:.0f} us without it (slope "
                     "over 4x the ticks)." if "pipe idle x4" in med else "."))
    return lines


if __name__ == "__main__":
    main()
