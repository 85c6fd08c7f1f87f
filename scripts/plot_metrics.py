"""Plot loss, learning rate, throughput and MFU of one or several runs into one PNG:
python scripts/plot_metrics.py RUN_DIR [RUN_DIR...] [--out FILE.png]

Each run's metrics.jsonl is read as written (appended across resumes): rows after the last
fresh start, and for a step logged twice (a resume from an earlier checkpoint) the later row.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from meshlab.train.metrics import this_run  # noqa: E402

PANELS = (("loss", "loss (nats/token)"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"),
          ("mfu", "MFU (datasheet peak)"))


def load_run(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; pass run directories written by scripts/train.py")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path}:{n} is not JSON (a line cut by a crash?); skipped", file=sys.stderr)
    return this_run(rows)


def label_of(run_dir: Path) -> str:
    cfg = run_dir / "config.yaml"
    rules = ""
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            if line.startswith("rules:"):
                rules = f" ({line.split(':', 1)[1].strip()})"
    return run_dir.name + rules


def plot(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {run: load_run(run) for run in run_dirs}
    for run in [r for r, rows in runs.items() if not rows]:
        print(f"warning: {run}/metrics.jsonl has no step rows since its last fresh start (a run stopped before "
              "its first step?); not drawn", file=sys.stderr)
    if not any(runs.values()):
        raise SystemExit("error: no run to draw: none of them has a step row in metrics.jsonl")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for i, (run, rows) in enumerate(runs.items()):
        label, color = label_of(run), f"C{i}"      # one colour a run in every panel, its val line too
        for ax, (key, title) in zip(axes.flat, PANELS):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]   # MFU n/a: no peak
            if pts:
                ax.plot(*zip(*pts), color=color, label=label)
            if key == "loss":
                val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
                if val:
                    ax.plot(*zip(*val), "o--", color=color, label=f"{label} val")
    for ax, (key, title) in zip(axes.flat, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        else:                # MFU where no device has a datasheet peak (a CPU)
            ax.text(0.5, 0.5, "n/a: no datasheet peak for this device" if key == "mfu" else "no rows",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", type=Path, help="PNG path (default: metrics.png in the first run directory)")
    args = p.parse_args(argv)
    out = plot(args.runs, args.out or args.runs[0] / "metrics.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
