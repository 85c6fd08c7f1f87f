"""Ahead-of-time compile of meshlab's real train step for a described multi-GPU topology, on a machine
with one GPU: does XLA:GPU compile each rule file for N devices (the context-parallel files segfaulted
in backend_compile on 2 H200s), and in the programs that compile, do the async collectives have
compute scheduled between their start and done (the overlap question)?

    PYTHONPATH=$PWD python3 scripts/diag_aot_topology.py                  # 2 x the attached GPU
    PYTHONPATH=$PWD python3 scripts/diag_aot_topology.py --gpus 8 --cases llama3_1b:fsdp_cp:32768
    PYTHONPATH=$PWD python3 scripts/diag_aot_topology.py --cpu            # mechanics, simulated CPU devices

The devices come from `jax.experimental.topologies.get_topology_desc(platform="cuda",
topology="1x1xN")` (partitions x hosts x GPUs per host): compile-only devices of the attached GPU's
kind (XLA reads its target description from the local GPU). A first probe process compiles a small
sharded program; if topologies are unsupported the script stops there with one line. Then each case
(MODEL:RULES[:SEQ]) lowers and compiles the train step on abstract inputs in its own process under a
timeout, so a segfault is reported as its case. Per case: ok / the error's first line / killed by
signal (11 = segfault) / timeout; for ok ones the async collectives' start/done counts and how many
have compute between start and done (meshlab/bench/hlo_schedule.py). --cpu: 8 simulated CPU devices,
no topology (XLA:CPU's collectives are synchronous: the schedule read shows `sync` only).
Rows in $OUT/diag_aot.json when OUT is set.
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The crashing context-parallel files at 32k first, then the overlap questions at tiny and llama3_1b
# shapes (fsdp_tp_sp_cm: tensor parallelism with collective matmul; fsdp_tp_sp: its plain form).
CASES = ("llama3_1b:fsdp_cp:32768", "llama3_1b:cp_ring:32768", "tiny:dp", "tiny:fsdp", "tiny:zero2",
         "tiny:fsdp_tp_sp_cm", "tiny:fsdp_tp_sp", "tiny:fsdp_cp", "tiny:cp_ring", "moe_tiny:ep",
         "llama3_1b:fsdp_tp_sp_cm:4096", "llama3_1b:zero2:4096", "llama3_1b:fsdp:4096")
DEFAULT_SEQ = 256


def parse_case(spec: str) -> tuple[str, str, int]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise SystemExit(f"error: case {spec!r} is not MODEL:RULES[:SEQ] (e.g. llama3_1b:fsdp_cp:32768)")
    try:
        seq = int(parts[2]) if len(parts) == 3 else DEFAULT_SEQ
    except ValueError:
        raise SystemExit(f"error: case {spec!r}: SEQ {parts[2]!r} is not a whole number") from None
    return parts[0], parts[1], seq


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated MODEL:RULES[:SEQ]")
    p.add_argument("--gpus", type=int, default=2, help="devices in the described topology (one host)")
    p.add_argument("--per-device-batch", type=int, default=2, help="rows per data-parallel rank (1 at SEQ > 4096)")
    p.add_argument("--model-over", default="", help="model config fields for every case, e.g. attention=cudnn,remat=full")
    p.add_argument("--timeout", type=float, default=90, help="seconds per case process")
    p.add_argument("--budget-s", type=float, default=80, help="start no case after this many seconds (wall: probe + this + a timeout)")
    p.add_argument("--jobs", type=int, default=4, help="case processes at once (--cpu: 1)")
    p.add_argument("--cpu", action="store_true", help="simulated CPU devices instead of a GPU topology")
    p.add_argument("--child", nargs=1, metavar="CASE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.case_list = [c for c in args.cases.split(",") if c]
    for c in args.case_list:
        if c != "probe":
            parse_case(c)
    if args.gpus < 2:
        raise SystemExit("error: --gpus must be at least 2 (one device has no collectives)")
    args.over = dict(kv.split("=", 1) for kv in args.model_over.split(",") if kv)
    return args


def devices(args):
    import jax
    if args.cpu:
        return jax.devices()[:args.gpus]
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="cuda", topology=f"1x1x{args.gpus}").devices


def child(args) -> None:
    """One case (or the probe) in this process; prints {"phase": ...} JSON lines as it gets past each step."""
    say = lambda **kw: print(json.dumps(kw), flush=True)   # noqa: E731
    if args.cpu:
        from meshlab import compat
        compat.set_cpu_devices(max(args.gpus, 8))
    import jax
    import jax.numpy as jnp
    from meshlab.bench import hlo_schedule
    devs = devices(args)
    say(phase="topology", devices=len(devs), kind=devs[0].device_kind, jax=jax.__version__)
    case = args.child[0]
    if case == "probe":
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import numpy as np
        sh = NamedSharding(Mesh(np.array(devs), ("x",)), P("x"))
        x = jax.ShapeDtypeStruct((len(devs) * 256, 256), jnp.float32, sharding=sh)
        compiled = jax.jit(lambda a: (a @ a.T).sum(0), out_shardings=sh).lower(x).compile()
    else:
        compiled = compile_step(args, *parse_case(case), devs, say)
    summary, _ = hlo_schedule.read(compiled.as_text())
    say(phase="compiled", schedule=summary)


def compile_step(args, model, rule_name, seq, devs, say):
    """The train step (meshlab.train.step) for this case, lowered and compiled on abstract inputs."""
    import dataclasses
    import jax
    import jax.numpy as jnp
    import models
    from meshlab import rules as R
    from meshlab.layout import Layout, to_shardings
    from meshlab.mesh import make_mesh
    from meshlab.train.optimizer import OptimConfig, make_optimizer
    from meshlab.train.state import abstract_state, state_specs
    from meshlab.train.step import BATCH_KEYS, make_train_step
    cfg = models.preset(model)
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for k, v in args.over.items():
        if k not in fields:
            raise SystemExit(f"error: --model-over {k}: not a field of {type(cfg).__name__}")
        cur = getattr(cfg, k)
        setattr(cfg, k, v.lower() in ("1", "true") if isinstance(cur, bool) else type(cur)(v))
    if args.cpu:
        cfg.dtype = "float32"   # XLA:CPU aborts on some bf16 programs of this size (tests/plan/test_memory_comm.py)
    rules = R.load_rules(rule_name)
    mesh = make_mesh(rules.mesh, devs)
    batch = (1 if seq > 4096 else args.per_device_batch) * rules.data_parallel_size(mesh)
    md = models.model_def(cfg)
    tx = make_optimizer(OptimConfig(lr=1e-4, warmup_steps=2), 100, md.names)
    layout = Layout.build(md, rules, mesh)
    sh = to_shardings(mesh, state_specs(md, rules, mesh, tx, False, layout=layout))
    step = make_train_step(md, rules, mesh, tx, sh, layout=layout)
    data = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=layout.batch_sharding) for k in BATCH_KEYS}
    say(phase="built", mesh={a: s for a, s in mesh.shape.items() if s > 1}, batch=batch, seq=seq,
        attention=cfg.attention, remat=cfg.remat)
    t = time.perf_counter()
    lowered = step.lower(abstract_state(md, tx, sh, False), data)
    say(phase="lowered", lower_s=round(time.perf_counter() - t, 1))
    t = time.perf_counter()
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    say(phase="backend", compile_s=round(time.perf_counter() - t, 1), temp_gib=round(mem.temp_size_in_bytes / 2**30, 2))
    return compiled


def run_one(args, case: str) -> dict:
    row = {"case": case}
    cmd = [sys.executable, __file__, "--child", case, "--gpus", str(args.gpus),
           "--per-device-batch", str(args.per_device_batch), "--model-over", args.model_over] + (["--cpu"] if args.cpu else [])
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")   # several children share the one GPU
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        row["rc"], out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        dec = lambda s: s.decode() if isinstance(s, bytes) else (s or "")   # noqa: E731
        row["rc"], out, err = "timeout", dec(e.stdout), dec(e.stderr)
    row["wall_s"] = round(time.perf_counter() - t, 1)
    phases = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    for ph in phases:
        row.update({k: v for k, v in ph.items() if k != "phase"})
    row["last_phase"] = phases[-1]["phase"] if phases else "start"
    if row["rc"] == 0 and row["last_phase"] == "compiled":
        row["status"] = "compiled OK"
    elif row["rc"] == "timeout":
        row["status"] = f"timeout after {args.timeout:.0f} s"
    elif isinstance(row["rc"], int) and row["rc"] < 0:
        row["status"] = f"killed by signal {-row['rc']}" + (" (segfault)" if row["rc"] == -11 else "")
    else:
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("Traceback", "  ", "---", "For simplicity"))]
        row["status"] = "error: " + (next((x for x in lines if "Error" in x or "error" in x), lines[-1] if lines else "?"))[:240]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    from meshlab.bench.hlo_schedule import format_summary
    probe = run_one(args, "probe")
    if probe["status"] != "compiled OK":
        print(f"ahead-of-time compile for a {args.gpus}-GPU topology is not available here: {probe['status']}")
        return 2
    print(f"topology: {probe.get('devices')} x {probe.get('kind')} (jax {probe.get('jax')}); probe: "
          f"{format_summary(probe.get('schedule', {}))}", flush=True)
    start, rows = time.perf_counter(), []

    def job(case):
        if time.perf_counter() - start > args.budget_s:
            return {"case": case, "status": "not run (budget)"}
        return run_one(args, case)

    with concurrent.futures.ThreadPoolExecutor(1 if args.cpu else args.jobs) as pool:
        for r in pool.map(job, args.case_list):
            rows.append(r)
            extra = f" ({r.get('compile_s')} s, temp {r.get('temp_gib')} GiB)" if "compile_s" in r else ""
            print(f"{r['case']:<30} {r['status']}{extra}", flush=True)
            if r.get("schedule") is not None:
                print(f"    {format_summary(r['schedule'])}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "diag_aot.json").write_text(json.dumps({"probe": probe, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
