"""Run-directory outputs: metrics.jsonl (append-only), TensorBoard events, the loss plot, and the
live progress line. Device metrics are read one step late, so the loop never waits on the device."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:  # TensorBoard output is optional; the jsonl is the record
                self.tb = None

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            # Step rows only, under their own names; an event row (start, resume, the summary) is no point
            # of a curve: its median tokens/s or wall-clock time would join the per-step series.
            if "event" in row:
                return
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def this_run(rows: list[dict]) -> list[dict]:
    """The step rows (those with a loss) of metrics.jsonl's rows from the run's last fresh start on,
    by step; for a step logged twice (a resume from an earlier checkpoint) the later row. A run
    directory trained again from scratch appends to the file, as resumes do."""
    starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
    by_step = {r["step"]: r for r in (rows[starts[-1]:] if starts else rows) if "loss" in r and "event" not in r}
    return [by_step[s] for s in sorted(by_step)]


def plot_loss(run_dir: Path, rows: list[dict]) -> Path:
    """loss.png of step rows (this_run's)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


class Progress:
    """One live line on a terminal; plain lines every log step elsewhere (CI, pipes)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled = total, enabled and jax.process_index() == 0
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, row: dict, force_line: bool = False) -> None:
        if not self.enabled:
            return
        done = row["step"]
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1) * (self.total - done)
        mfu = "  n/a " if row.get("mfu") is None else f"{100 * row['mfu']:5.2f}%"   # no known peak: n/a
        text = (f"step {done:>5}/{self.total}  loss {row['loss']:.4f}  {row['tokens_per_s']:>9,.0f} tok/s  "
                f"MFU {mfu}  {row['step_ms']:7.1f} ms/step  ETA {eta:5.0f}s")
        if self.tty:
            sys.stdout.write("\r" + text)
            sys.stdout.flush()
            if force_line:
                sys.stdout.write("\n")
        elif force_line:
            print(text, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stdout.write("\n")
