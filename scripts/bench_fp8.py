"""FP8 against bf16 training: the same shipped config, data order and seed, trained twice through
the training loop scripts/train.py runs (meshlab.train.loop.train), once with model.matmul_dtype=bfloat16
and once with float8 (models/fp8.py); loss curves every 10 steps, the final loss (mean of the last 20
steps) of each and their difference against the 0.02-nat tolerance, median tokens/s over steps 20..N
of each and the ratio, and the FP8 and bf16 GEMMs in the compiled FP8 step.

    PYTHONPATH=$PWD python3 scripts/bench_fp8.py [--config llama3_1b] [--rules dp] [--steps 300]
    PYTHONPATH=$PWD python3 scripts/bench_fp8.py --cpu-smoke      # tiny model, 8 steps: the mechanics
    ... --steps 300 model.scan_layers=true    # overrides apply to both runs (here: a shorter compile)
    ... --torch-peer      # also torch FSDP2 in bf16 and with torchao float8, timed first (needs torchao)

The config's own schedule is kept (llama3_1b: linear warmup over 100 steps to 3e-4, cosine to 10% over
`--steps`), so 300 steps see warmup, peak and decay. A tolerance needs runs that agree without FP8: at 3e-4
two bf16 runs of the same math (another rounding order) ended 0.06 nats apart by step 300 on the H200, at
`optim.lr=1e-4` 0.017 (docs/benchmarks.md, Training), so the comparison against 0.02 is made there.
Its corpus (the embedded standard library) is prepared on first use, as train.py does. Prints a table;
on a GPU appends dated rows to docs/archive/benchmarks-diary.md; $OUT/bench_fp8.json holds the curves,
$OUT/bench_fp8_rows.md the rows. A ratio is reported only for a run whose final loss is within the tolerance.
"""
import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from meshlab.bench import diary  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3_1b")
    p.add_argument("--rules", default="dp")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tail", type=int, default=20, help="final loss = mean of the last TAIL steps")
    p.add_argument("--time-from", type=int, default=20, help="tokens/s = median over steps >= this")
    p.add_argument("--every", type=int, default=10, help="loss curve: every EVERY steps")
    p.add_argument("--tol", type=float, default=0.02, help="final-loss tolerance, nats")
    p.add_argument("--only", choices=("bfloat16", "float8"),
                   help="train one of the two (a control: a repeat, another seed, or bf16 with the layer loop flipped "
                        "by an override, to see how far two runs of the same math drift apart by step N)")
    p.add_argument("--torch-peer", action="store_true",
                   help="first time torch FSDP2 in bf16 and with torchao float8 (bench_scaling_torch.py --float8), "
                        "same shape and batch, each in its own process before JAX takes the GPU")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, --steps 8: mechanics only")
    p.add_argument("overrides", nargs="*", help="config overrides for both runs, key=value")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.config, args.steps = "default", min(args.steps, 8)
        args.tail, args.time_from, args.every = 4, 4, 2
        args.overrides = ["model.dtype=bfloat16", "data.seq_len=64", "data.global_batch=4", "mesh=data=1",
                          *args.overrides]
    return args


def gemm_counts(compiled) -> dict:
    """FP8 GEMMs (cuBLASLt FP8 calls, Triton GEMM fusions reading float8) and all GEMMs in a compiled GPU step."""
    from meshlab.plan.hlo import gemms
    text = compiled.as_text() if hasattr(compiled, "as_text") else ""
    found = gemms(text)
    return {"fp8_gemms": sum(g.fp8 for g in found), "gemms": len(found)} if text else {}


def run(args, matmul_dtype: str) -> dict:
    import jax
    import numpy as np
    from meshlab.train.config import load_config
    from meshlab.train.loop import train
    over = [f"rules={args.rules}", f"steps={args.steps}", "log_every=1", "sample_tokens=0",
            f"run_dir=/tmp/bench_fp8_{matmul_dtype}", *args.overrides, f"model.matmul_dtype={matmul_dtype}"]
    cfg = load_config(args.config, over)
    t0 = time.perf_counter()
    res = train(cfg, progress=False, write=False)
    wall = time.perf_counter() - t0
    rates = [r["tokens_per_s"] for r in res["rows"] if r["step"] >= args.time_from]
    out = {"matmul_dtype": matmul_dtype, "losses": [float(v) for v in res["losses"]],
           "final_loss": float(np.mean(res["losses"][-args.tail:])),
           "tokens_per_s": float(np.median(rates)) if rates else float("nan"), "steps_timed": len(rates),
           **gemm_counts(getattr(res["trainer"].step_fn, "fn", None)), "model": cfg.model.name,
           "batch": f"{cfg.data.global_batch} x {cfg.data.seq_len}", "device": jax.devices()[0].device_kind,
           "notes": [n for n in res["trainer"].notes if n], "wall_s": round(wall, 1)}
    print(f"{matmul_dtype}: final loss {out['final_loss']:.4f} (last {args.tail}), {out['tokens_per_s']:,.0f} "
          f"tokens/s (median, steps >= {args.time_from}), GEMMs in the step {out.get('gemms', 'n/a')}, of them "
          f"cuBLASLt FP8 {out.get('fp8_gemms', 'n/a')}; {wall:.0f} s with the compile", flush=True)
    del res
    gc.collect()
    jax.clear_caches()   # the first run's program and buffers go before the second compiles
    return out


def report(args, bf, f8) -> str:
    import jax
    diff = f8["final_loss"] - bf["final_loss"]
    ok = abs(diff) <= args.tol
    ratio = f8["tokens_per_s"] / bf["tokens_per_s"]
    date = datetime.date.today().isoformat()
    lines = [f"\n### FP8 training, {bf['model']}, batch {bf['batch']}, {args.steps} steps ({date}, {bf['device']}, "
             f"jax {jax.__version__})\n",
             f"`scripts/bench_fp8.py --config {args.config} --rules {args.rules} --steps {args.steps}"
             + (" " + " ".join(args.overrides) if args.overrides else "") + "`: the same data order and seed; "
             "projections (q|k|v, o, gate, up, down) e4m3 forward / e5m2 gradients, current per-tensor scaling; "
             "LM head, embedding and attention bf16.\n",
             "| run | final loss (mean of last %d) | tokens/s (median, steps %d-%d) | GEMMs in the step (FP8 / all) |"
             % (args.tail, args.time_from, args.steps), "|---|---|---|---|"]
    for r in (bf, f8):
        lines.append(f"| {r['matmul_dtype']} | {r['final_loss']:.4f} | {r['tokens_per_s']:,.0f} | "
                     f"{r.get('fp8_gemms', 'n/a')} / {r.get('gemms', 'n/a')} |")
    lines.append(f"\nFinal loss fp8 - bf16: {diff:+.4f} nats, tolerance {args.tol}: {'within' if ok else 'OUTSIDE'}. "
                 + (f"Speed fp8 / bf16: {ratio:.3f}x." if ok else f"Speed ratio void (loss outside tolerance; raw "
                                                                 f"{ratio:.3f}x)."))
    lines += ["", "| step | bf16 loss | fp8 loss | fp8 - bf16 |", "|---|---|---|---|"]
    for s in range(args.every, args.steps + 1, args.every):
        a, b = bf["losses"][s - 1], f8["losses"][s - 1]
        lines.append(f"| {s} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    return "\n".join(lines) + "\n"


def torch_peers(model: str, batch: int, seq: int, runner=None) -> dict:
    """{"bfloat16": row, "float8": row}: torch FSDP2 at this shape without and with torchao float8, one
    after the other on GPU 0 (meshlab.bench.train.torch_peer's rows)."""
    from meshlab.bench.train import torch_peer
    return {dtype: torch_peer(model, batch, seq, extra, runner=runner)
            for dtype, extra in (("bfloat16", ()), ("float8", ("--float8",)))}


def report_peers(peers: dict, ours: dict) -> str:
    """Rows of the torch peers beside ours: tokens/s, and float8 over bf16 on each side."""
    lines = ["", "| torch FSDP2 (per-layer compile, fused AdamW) | tokens/s | ours / peer |", "|---|---|---|"]
    rate = {k: v.get("tokens_per_s_per_gpu") for k, v in peers.items()}
    for dtype, row in peers.items():
        mine = ours.get(dtype, {}).get("tokens_per_s")
        label = "float8 (torchao, tensorwise)" if dtype == "float8" else "bfloat16"
        if rate[dtype] is None:
            lines.append(f"| {label} | failed: {row.get('error', '?')[:120]} | - |")
        else:
            lines.append(f"| {label} | {rate[dtype]:,.0f} | " + (f"{mine / rate[dtype]:.3f} |" if mine else "- |"))
    if rate.get("float8") and rate.get("bfloat16"):
        lines.append(f"\ntorch float8 / bf16: {rate['float8'] / rate['bfloat16']:.3f}x.")
    return "\n".join(lines) + "\n"


def report_one(args, r) -> str:
    """The rows of a single control run: its final loss, speed and curve."""
    import jax
    lines = [f"\n### {r['matmul_dtype']} control run, {r['model']}, batch {r['batch']}, {args.steps} steps "
             f"({datetime.date.today().isoformat()}, {r['device']}, jax {jax.__version__})\n",
             f"`scripts/bench_fp8.py --config {args.config} --rules {args.rules} --steps {args.steps} --only "
             f"{r['matmul_dtype']}" + (" " + " ".join(args.overrides) if args.overrides else "") + "`: final loss "
             f"(mean of last {args.tail}) {r['final_loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s (median, steps "
             f"{args.time_from}-{args.steps}).\n", "| step | loss |", "|---|---|"]
    lines += [f"| {s} | {r['losses'][s - 1]:.4f} |" for s in range(args.every, args.steps + 1, args.every)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse(argv)
    peers = None
    if args.torch_peer:   # before this process initialises a JAX backend: torch gets the whole GPU
        from meshlab.bench.train import config_shape
        peers = torch_peers(*config_shape(args.config, args.overrides))
    import jax
    if args.only:
        runs = {args.only: run(args, args.only)}
        text = report_one(args, runs[args.only])
    else:
        runs = {"bf16": run(args, "bfloat16"), "fp8": run(args, "float8")}
        text = report(args, runs["bf16"], runs["fp8"])
    if peers is not None:
        text += report_peers(peers, {r["matmul_dtype"]: r for r in runs.values()})
        runs["torch_peers"] = peers
    print(text)
    diary.append(text, backend=jax.default_backend())
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_fp8.json").write_text(json.dumps(runs, indent=1))
        Path(os.environ["OUT"], "bench_fp8_rows.md").write_text(text)   # the diary rows, for a remote run


if __name__ == "__main__":
    main()
