"""Training throughput on one GPU: bf16 matmul rate, `llama3_1b` at seq 4096 with cudnn / xla /
pallas attention, fused ops on and off, every remat policy, vocab 50257 vs 50304, and the torch
peer (own process; `--peer-json` takes its line when it ran before JAX took the GPU).

    PYTHONPATH=$PWD python3 scripts/bench_train.py [--steps 8] [--profile] [--variants ...]
    ... --variants A B --rounds 3     # A B A B A B: each compiled once, the median round reported
    ... --tokens text                 # byte text as train.py's embedded corpus feeds (default: random ids)
Appends dated rows to docs/archive/benchmarks-diary.md (meshlab/bench/diary.py). Needs a GPU: on another
backend it stops at once. The batch is chosen from the compiled memory analysis.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from meshlab import rules as R  # noqa: E402
from meshlab.mesh import make_mesh  # noqa: E402
from meshlab.bench import diary  # noqa: E402
from meshlab.bench.train import StepRunner, pick_batch, torch_gemm_tflops  # noqa: E402
from meshlab.peak import measured_gemm_flops, peak_flops  # noqa: E402


def run_peer(batch, seq, steps):
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train_torch.py"), "--batch", str(batch), "--seq", str(seq),
           "--steps", str(steps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        return json.loads(line[-1]) if line else {"error": (out.stderr or out.stdout)[-400:]}
    except Exception as e:  # the peer failing must not hide our numbers
        return {"error": str(e)[:400]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3_1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=0, help="0: choose from the compiled memory analysis")
    p.add_argument("--attention", default="cudnn,xla,pallas")
    p.add_argument("--remat", default="none,save_dots_no_batch,full", help="policies timed with cudnn attention")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--peer-json", help="the peer's JSON line, measured before this process took the GPU")
    p.add_argument("--budget-s", type=float, default=330, help="start no new variant after this many seconds")
    p.add_argument("--profile", action="store_true", help="trace 2 extra steps per variant; kernel table to $OUT")
    p.add_argument("--variants", nargs="*", help="only these, e.g. 'remat=none,loss_impl=pallas,fused_swiglu=1'")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="MFU's peak per device (default: the device kind's datasheet dense bf16 figure)")
    p.add_argument("--no-torch-gemm", action="store_true", help="skip torch's GEMM rate (own process)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant again this many rounds, alternating (each variant's state stays on the "
                        "device: for variants whose states fit together); a row reports the median round")
    p.add_argument("--tokens", default="random", choices=("random", "text"),
                   help="the batch: ids uniform over the vocabulary, or byte text as train.py's corpus feeds")
    args = p.parse_args()
    dev = jax.devices()[0]
    if dev.platform != "gpu":   # every default variant but one runs cuDNN attention or Mosaic GPU kernels
        sys.exit(f"error: bench_train.py times training on one GPU; JAX's backend here is {dev.platform}. "
                 "To check a training step on a CPU, run `make train` (the tiny model on simulated devices).")
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    rules = R.load_rules("dp")
    hbm = dev.memory_stats().get("bytes_limit", 80e9)
    peak, peak_src = peak_flops(dev, args.peak_tflops)
    if peak is None:
        sys.exit(f"error: {peak_src}")
    gemm = {"jax": measured_gemm_flops(dev) / 1e12,
            "torch": {} if args.no_torch_gemm else torch_gemm_tflops(),
            "peak": peak_src}
    print(f"device {dev.device_kind}; MFU peak: {peak_src}; HBM {hbm / 2**30:.0f} GiB")
    print(f"bf16 GEMM 8192^3 measured (its own figure, not MFU's peak): {gemm_text(gemm)}", flush=True)
    base = models.preset(args.model)
    base.dtype = "bfloat16"
    rows = []

    out_dir = Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)   # the profile table is appended there after the timing

    runners = []   # (row, runner) kept for --rounds > 1

    def record(label, cfg, batch, seq):
        prof = Path("/tmp/meshlab_traces") / f"v{len(rows)}" if args.profile else None
        try:
            runner = StepRunner(cfg, rules, mesh, batch, seq, args.tokens)
            dt = runner.time(args.steps)
            if prof:
                runner.profile(prof)
        except Exception as e:  # an unavailable or failing variant is reported, not fatal
            rows.append({"variant": label, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(rows[-1], flush=True)
            return
        f = cfg.train_flops_per_token(seq)
        rows.append({"variant": label, "batch": batch, "seq": seq, "tokens": args.tokens,
                     "tokens_per_s": round(batch * seq / dt), "step_ms": round(dt * 1e3, 1),
                     "mfu": round(batch * seq / dt * f / peak, 4), "program_gib": round(runner.program_bytes / 2**30, 1),
                     "loss": round(runner.loss, 3), "vocab": cfg.vocab_size, "flops_per_token": f})
        print(rows[-1], flush=True)
        if prof:
            write_profile(prof, label, dt, out_dir / "profiles.md")
        if args.rounds > 1:
            rows[-1]["rounds_ms"] = [rows[-1]["step_ms"]]
            runners.append((rows[-1], runner))
        else:
            runner.close()

    def more_rounds():
        """Rounds 2..R, the variants alternating; each row then reports its median round."""
        for _ in range(args.rounds - 1):
            for row, runner in runners:
                row["rounds_ms"].append(round(runner.time(args.steps) * 1e3, 1))
        for row, runner in runners:
            runner.close()
            dt = float(np.median(row["rounds_ms"])) / 1e3
            row.update(step_ms=round(dt * 1e3, 1), tokens_per_s=round(row["batch"] * row["seq"] / dt),
                       mfu=round(row["batch"] * row["seq"] / dt * row["flops_per_token"] / peak, 4))
            print({"variant": row["variant"], "rounds_ms": row["rounds_ms"], "tokens_per_s": row["tokens_per_s"]},
                  flush=True)

    def variant(attention="cudnn", remat="none", **over):
        cfg = models.preset(args.model)
        cfg.dtype, cfg.attention, cfg.remat = "bfloat16", attention, remat
        for k, v in over.items():
            setattr(cfg, k, v)
        return cfg

    # The batch is sized for remat=none (the fastest policy when it fits), so every variant runs
    # at one batch and the remat rows show what recomputation costs and saves at equal work.
    first = variant(attention=args.attention.split(",")[0])
    batch, mem_fit = (args.batch, None) if args.batch else pick_batch(first, rules, mesh, args.seq, hbm)
    print(f"batch {batch} (compiled at batch 2: args {mem_fit[0] / 2**30:.1f} GiB, temp/row <= "
          f"{mem_fit[2] / 2**30:.2f} GiB)" if mem_fit else f"batch {batch}", flush=True)
    # Most important first: a call that runs out of time still reports these.
    attns = args.attention.split(",")
    plan = [(f"attention={attns[0]} remat=none", variant(attention=attns[0])),
            ("cudnn + fused CE (pallas)", variant(loss_impl="pallas")),
            ("cudnn + onepass CE", variant(loss_impl="onepass")),
            ("cudnn + onepass CE remat=save_dots_no_batch", variant(remat="save_dots_no_batch", loss_impl="onepass")),
            ("cudnn + fused CE/SwiGLU/RMSNorm (pallas)", variant(loss_impl="pallas", fused_swiglu=True, fused_norm=True))]
    plan += [(f"attention={a} remat=none", variant(attention=a)) for a in attns[1:]]
    plan += [(f"attention=cudnn remat={r}", variant(remat=r)) for r in args.remat.split(",") if r != "none"]
    plan += [(f"vocab={v} (unpadded)", variant(vocab_size=v, vocab_multiple=1)) for v in (50257, 50304)]
    if args.variants:   # explicit model-config variants instead of the default sweep
        def parse(spec):
            kv = dict(item.split("=", 1) for item in spec.split(",") if item)
            base = models.preset(args.model)
            typed = {k: (v.lower() in ("1", "true") if isinstance(getattr(base, k, None), bool)
                         else int(v) if v.isdigit() else v) for k, v in kv.items()}
            return variant(**typed)
        plan = [(f"{spec} {os.environ.get('XLA_FLAGS', '')}".strip(), parse(spec)) for spec in args.variants]
    peer = {}
    start = time.perf_counter()
    for i, (label, cfg) in enumerate(plan):
        if time.perf_counter() - start > args.budget_s:
            rows.append({"variant": label, "error": f"not run: past the {args.budget_s}s budget of this call"})
            continue
        record(label, cfg, batch, args.seq)
        if i == 0 and not args.no_peer and not args.peer_json:
            peer = run_peer(min(batch, 8), args.seq, args.steps)
            print("peer:", peer, flush=True)
    more_rounds()
    if args.peer_json:
        lines = [x for x in Path(args.peer_json).read_text().splitlines() if x.startswith("{")]
        peer = json.loads(lines[-1]) if lines else {"error": Path(args.peer_json).read_text()[-300:]}
    write_rows(dev, peak, gemm, rows, peer, args)


def gemm_text(gemm) -> str:
    tflops = lambda x: f"{x:.0f} TFLOP/s" if x else "not measured"   # noqa: E731
    return (f"jax {tflops(gemm['jax'])}, torch {tflops(gemm['torch'].get('tflops'))}"
            + (f" ({gemm['torch']['error'][:120]})" if gemm["torch"].get("error") else ""))


def write_profile(trace_dir, label, step_s, dest):
    """Kernel-time table of the traced steps (the trace itself stays on the device machine)."""
    from meshlab.profile_summary import format_summary, hlo_kernels, summarize
    try:
        hlo = Path(trace_dir) / "step.hlo.txt"
        names = hlo_kernels(hlo.read_text()) if hlo.exists() else None
        text = format_summary(summarize(trace_dir, steps=2), label, step_s * 1e3, kernels_hlo=names)
    except Exception as e:  # a profile that fails must not lose the timing rows
        text = f"profile of {label} failed: {type(e).__name__}: {str(e)[:300]}\n"
    with dest.open("a") as f:
        f.write(text + "\n")
    print(text, flush=True)


def write_rows(dev, peak, gemm, rows, peer, args):
    # Against the peer only rows of its shape: the vocab rows change the model.
    ok = [r for r in rows if "tokens_per_s" in r and r["vocab"] == models.preset(args.model).vocab_size]
    best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    date = datetime.date.today().isoformat()
    lines = [f"\n### Training, {args.model}, seq {args.seq} ({date}, {dev.device_kind}, jax {jax.__version__})\n",
             f"MFU = tokens/s x (6N + 6 L S d) / peak; peak: {gemm['peak']}. bf16 GEMM 8192^3 measured in "
             f"this call: {gemm_text(gemm)}.\n",
             f"| variant | batch | tokens/s | step ms | MFU ({peak / 1e12:g}) | program GiB (compiled) | loss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | FAILED: {r['error']} | | | | |")
        else:
            rounds = f" (rounds {' / '.join(map(str, r['rounds_ms']))})" if "rounds_ms" in r else ""
            lines.append(f"| {r['variant']} | {r['batch']} | {r['tokens_per_s']:,} | {r['step_ms']}{rounds} | "
                         f"{100 * r['mfu']:.1f}% | {r['program_gib']} | {r['loss']} |")
    if peer.get("tokens_per_s"):
        lines.append(f"| peer: transformers Llama, torch.compile + AMP bf16 + fused AdamW | {peer['batch']} | "
                     f"{peer['tokens_per_s']:,.0f} | {peer['step_ms']:.1f} | {100 * peer['mfu_989']:.1f}% | "
                     f"{peer['peak_mem_gib']:.1f} | {peer['loss']:.3f} |")
        if best:
            lines.append(f"\nBest meshlab / peer: {best['tokens_per_s'] / peer['tokens_per_s']:.2f}x ({best['variant']}).")
    else:
        lines.append(f"\npeer: not measured ({peer.get('error', 'skipped')[:200]})")
    text = "\n".join(lines) + "\n"
    diary.append(text, backend=dev.platform)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_train.json").write_text(json.dumps({"rows": rows, "peer": peer, "gemm_tflops": gemm},
                                                            indent=1))
    print(text)


if __name__ == "__main__":
    main()
