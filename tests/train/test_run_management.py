"""Run management: SIGTERM saves and says how to resume, the resumed run continues exactly,
metrics.jsonl is appended across the resume, validation loss and a profile window are
written, plot_metrics draws several runs."""
import os
import signal
import subprocess
import sys

import pytest

from meshlab.train import loop
from meshlab.checkpoint import Checkpointer
from meshlab.train.metrics import read_metrics
from tests.helpers import SMALL, small_config
from tests.train.test_checkpoint import ROOT, compile_cache, subprocess_env  # noqa: F401 (autouse fixture)

sys.path.insert(0, str(ROOT / "scripts"))
import plot_metrics  # noqa: E402

# The same program as tests/train/test_checkpoint.py (fsdp, 4 steps): its compiled step is cached.
ARGS = ["--rules", "fsdp", "--steps", "4", *SMALL, "checkpoint.every=2"]
# One xdist worker runs the whole file: `reference` is trained once, not once per worker (make test: --dist loadgroup).
# Compiling dominates; its subprocess compiles as cheaply (test_checkpoint.subprocess_env).
pytestmark = [pytest.mark.xdist_group("run_management"), pytest.mark.cheap_codegen]


def cfg(run, extra=()):
    return small_config("fsdp", steps=4, extra=["checkpoint.every=2", *extra], tmp_path=run)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference")
    return run, loop.train(cfg(run), progress=False)["losses"]


def test_sigterm_saves_then_resume_continues_exactly(reference, tmp_path):
    ref_dir, ref = reference
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, str(ROOT / "scripts/train.py"), "--cpu-devices", "8", "--run-dir", str(run),
                          *ARGS], env=subprocess_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in p.stdout:   # the handler is in place once the header is printed
            if line.startswith("meshlab:"):
                break
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert "SIGTERM received" in out and "resume with:" in out and "--resume" in out, out[-2000:]
    saved = Checkpointer(run / "checkpoints").steps()
    assert saved and saved[-1] < 4 and f"stopped after step {saved[-1]}" in out

    # Resume (with validation and a one-step profile window on the way) and compare.
    extra = ["checkpoint.resume=latest", "val.every=2", "val.batches=2", f"profile.start_step={saved[-1]}",
             "profile.num_steps=1"]
    res = loop.train(cfg(run, extra), progress=False)
    assert res["losses"] == ref[saved[-1]:]
    rows = read_metrics(run)
    events = [(r["event"], r["step"]) for r in rows if "event" in r]
    assert [e for e, _ in events if e != "checkpoint"] == ["start", "resume"]
    assert ("checkpoint", saved[-1]) in events and all(r["save_ms"] > 0 for r in rows if r.get("event") == "checkpoint")
    assert [r["step"] for r in rows if "loss" in r][-len(res["losses"]):] == list(range(saved[-1] + 1, 5))
    assert any("val_loss" in r and r["val_loss"] > 0 for r in rows)
    assert list((run / "profile").rglob("*.xplane.pb")), "profile trace written"
    assert list((run / "profile").rglob("perfetto_trace.json.gz")), "with a Perfetto copy"

    png = plot_metrics.plot([run, ref_dir], tmp_path / "cmp.png")
    assert png.stat().st_size > 10_000
    assert len(plot_metrics.load_run(run)) == 4       # one row per step, the resume's rows win


def test_fresh_run_keeps_old_checkpoints(reference, tmp_path):
    """A new run pointed at a directory with checkpoints keeps them under another name."""
    ref_dir, _ = reference
    import shutil
    run = tmp_path / "run"
    shutil.copytree(ref_dir, run)
    loop.train(cfg(run, ["checkpoint.every=3"]), progress=False)
    kept = [p for p in run.iterdir() if p.name.startswith("checkpoints.previous-")]
    assert kept and sorted(Checkpointer(kept[0]).steps()) == [2, 4]
    assert Checkpointer(run / "checkpoints").steps() == [3, 4]


def test_loss_plot_takes_the_whole_run_across_resumes():
    """loss.png draws the run's steps since its last fresh start, resumes included: a resumed run's plot
    is not only its last launch, and a run directory trained again from scratch starts over."""
    from meshlab.train.metrics import this_run
    old = [{"event": "start", "step": 0}, {"step": 1, "loss": 5.0}]
    run = [{"event": "start", "step": 0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.9},
           {"event": "resume", "step": 1}, {"step": 2, "loss": 3.0, "val_loss": 3.5}, {"event": "summary", "step": 2}]
    want = [run[1], run[4]]                       # step 2 as the resume from step 1 logged it again
    assert this_run(old + run) == want and this_run(run[1:]) == want
