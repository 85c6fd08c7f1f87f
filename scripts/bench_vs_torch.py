"""`scripts/train.py --config C` against the torch FSDP2 peer of the same shape, alternating in one call:
peer, ours, peer, ours, ... (`--rounds`), each run in its own process, so torch never shares the GPU
with a JAX process. The comparison the training-speed rows of docs/benchmarks.md state.

    PYTHONPATH=$PWD python3 scripts/bench_vs_torch.py --config llama3_1b [--rounds 2] [--peer-floor 61163]
    ... --config llama3_3b --rounds 1 --ours-timeout 420       # the unrolled 3b compiles for minutes

Ours: train.py's steady state (median tokens/s over steps 10..N, the summary row of its metrics.jsonl),
the config as shipped plus `overrides`. Peer: bench_scaling_torch.py --gpus 1 --modes fsdp2 (transformers'
Llama of the config's shape, each decoder layer compiled, bf16 params with fp32 reduce, fused AdamW),
at the config's batch and sequence length. A round's ratio is ours over the peer of the same round; with
--peer-floor, a round whose peer is below that rate is void (the peer is not at its known level there).
Prints a table; on a GPU appends it to docs/archive/benchmarks-diary.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from meshlab.bench import diary  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3_1b", help="a shipped config (meshlab/configs) or a YAML path")
    p.add_argument("--rounds", type=int, default=2, help="peer then ours, this many times")
    p.add_argument("--peer-floor", type=float, default=0.0, help="a round whose peer is below this is void")
    p.add_argument("--steps", type=int, default=40, help="train.py's steps (steady state: median of 10..N)")
    p.add_argument("--rules", default="dp")
    p.add_argument("--peer-timeout", type=float, default=150)
    p.add_argument("--ours-timeout", type=float, default=200)
    p.add_argument("--run-dir", default="/tmp/bench_vs_torch")
    p.add_argument("overrides", nargs="*", help="config overrides for train.py, key=value")
    return p.parse_args(argv)


def ours_command(args) -> list:
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", args.config, "--rules", args.rules,
            "--steps", str(args.steps), "--run-dir", args.run_dir, "checkpoint.at_end=false", *args.overrides]


def _stdout(cmd, timeout) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return ""      # no summary row is written: the round reports the run as failed


def ours_rate(run_dir: Path) -> float | None:
    """The steady-state tokens/s of train.py's summary row; None when the run ended without one."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    summary = [r for r in rows if r.get("event") == "summary"]
    return summary[-1]["tokens_per_s"] if summary else None


def measure(args, shape, runner=_stdout) -> list[dict]:
    """One row per round: the peer's and our tokens/s, the ratio, and whether the round counts."""
    from meshlab.bench.train import torch_peer
    out = []
    for i in range(args.rounds):
        peer = torch_peer(*shape, timeout=args.peer_timeout, runner=runner).get("tokens_per_s_per_gpu")
        shutil.rmtree(args.run_dir, ignore_errors=True)     # a stale summary row never stands for this run
        runner(ours_command(args), args.ours_timeout)
        ours = ours_rate(args.run_dir)
        ratio = ours / peer if ours and peer else None
        valid = ratio is not None and peer >= args.peer_floor
        out.append({"round": i + 1, "peer": peer, "ours": ours, "ratio": ratio, "valid": valid})
        print(json.dumps(out[-1]), flush=True)
    return out


def report(args, shape, rounds) -> str:
    model, batch, seq = shape
    fmt = lambda v, f: "failed" if v is None else format(v, f)   # noqa: E731
    lines = [f"\n### train.py --config {args.config} against torch FSDP2, {model}, batch {batch} x {seq} "
             f"({datetime.date.today().isoformat()})\n",
             "`scripts/bench_vs_torch.py --config " + args.config + f" --rounds {args.rounds}"
             + (f" --peer-floor {args.peer_floor:g}" if args.peer_floor else "")
             + (" " + " ".join(args.overrides) if args.overrides else "") + "`\n",
             "| round | torch FSDP2 tokens/s | train.py tokens/s (steady state) | ratio | counts |", "|---|---|---|---|---|"]
    for r in rounds:
        lines.append(f"| {r['round']} | {fmt(r['peer'], ',.0f')} | {fmt(r['ours'], ',.0f')} | {fmt(r['ratio'], '.3f')} | "
                     + ("yes" if r["valid"] else f"no (peer below {args.peer_floor:,.0f} or a run failed)") + " |")
    valid = [r["ratio"] for r in rounds if r["valid"]]
    lines.append("\n" + (f"Median ratio of the rounds that count: {statistics.median(valid):.3f} ({len(valid)} of "
                         f"{len(rounds)})." if valid else "No round counts."))
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse(argv)
    from meshlab.bench.train import config_shape
    from meshlab.xla_flags import on_gpu
    shape = config_shape(args.config, args.overrides)
    rounds = measure(args, shape)
    text = report(args, shape, rounds)
    print(text)
    if any(r["ours"] for r in rounds):
        diary.append(text, backend="gpu" if on_gpu() else "cpu")     # train.py measured in its own process


if __name__ == "__main__":
    main()
