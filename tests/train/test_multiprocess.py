"""Several processes on 127.0.0.1 stand in for several hosts (CPU collectives: gloo):
2 processes x 4 devices match 1 process x 8 devices, their checkpoint restores in 1 process,
a config mismatch is refused, and a dead process stops the other with its name."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshlab.train import loop
from tests.helpers import SMALL, small_config
from tests.train.test_checkpoint import ROOT, compile_cache, subprocess_env  # noqa: F401 (autouse fixture)

TIMEOUT = 400
# One xdist worker runs the whole file: the two-process run of `two_process_run` happens once, not once
# per worker (make test: --dist loadgroup).
# Compiling dominates; its subprocesses compile as cheaply (test_checkpoint.subprocess_env).
pytestmark = [pytest.mark.xdist_group("multiprocess"), pytest.mark.cheap_codegen]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n, run_dir, extra=(), per_process=None, heartbeat=None):
    """Start n processes of scripts/train.py with 8/n simulated CPU devices each."""
    port, procs = free_port(), []
    for pid in range(n):
        args = [sys.executable, str(ROOT / "scripts/train.py"), "--cpu-devices", str(8 // n),
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(pid),
                "--run-dir", str(run_dir), *SMALL, *extra, *((per_process or {}).get(pid, ()))]
        if heartbeat:
            args.append(f"heartbeat_timeout={heartbeat}")
        procs.append(subprocess.Popen(args, env=subprocess_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    return procs


def finish(procs, timeout=TIMEOUT):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return outs


def losses_of(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("mp")
    outs = finish(launch(2, run, ["--rules", "fsdp_tp", "--steps", "4", "checkpoint.every=3"]))
    for rc, out, err in outs:
        assert rc == 0, err[-3000:]
    return run, outs


def test_two_processes_match_one(two_process_run):
    run, outs = two_process_run
    ref = loop.train(small_config("fsdp_tp", steps=4), progress=False, write=False)
    np.testing.assert_allclose(losses_of(run), ref["losses"], rtol=1e-5)
    assert "meshlab:" in outs[0][1] and "meshlab:" not in outs[1][1], "only process 0 logs"


def test_two_process_checkpoint_restores_in_one(two_process_run, tmp_path):
    """Written by 2 processes x 4 devices, restored by 1 process x 8 devices, continues the same.
    (Restoring onto another device count and rule file is tests/train/test_checkpoint.py's; the same
    mesh here reuses the reference run's compiled step.)"""
    run, _ = two_process_run
    ref = losses_of(run)
    cfg = small_config("fsdp_tp", steps=4, tmp_path=tmp_path,
                       extra=[f"checkpoint.dir={run / 'checkpoints'}", "checkpoint.resume=3"])
    out = loop.train(cfg, progress=False)
    assert out["step"] == 4
    np.testing.assert_allclose(out["losses"], ref[3:], rtol=1e-5)


def test_config_mismatch_is_refused(tmp_path):
    outs = finish(launch(2, tmp_path, ["--steps", "1"], per_process={1: ["optim.lr=5e-3"]}), timeout=180)
    for rc, _, err in outs:
        assert rc != 0
        assert "refusing to start" in err and "process 1" in err and "different config" in err, err[-2000:]


def test_dead_process_stops_the_other(tmp_path):
    """Process 1 is killed once training has started (process 0 printed its header, so the
    watchdog runs); process 0 must exit within the heartbeat timeout, naming process 1."""
    procs = launch(2, tmp_path, ["--rules", "fsdp_tp", "--steps", "4"], heartbeat=8)
    try:
        for line in procs[0].stdout:          # unbuffered: the header arrives as it is printed
            if line.startswith("meshlab:"):
                break
        os.killpg(procs[1].pid, signal.SIGKILL)
        t = time.time()
        _, err = procs[0].communicate(timeout=120)
        waited = time.time() - t
    finally:
        finish(procs, timeout=5)
    assert procs[0].returncode != 0
    assert waited < 60, f"process 0 took {waited:.0f} s to notice"
    print(err[-1500:])
    assert "process 1" in err, err[-2000:]


class FakeKV:
    """The coordination service's key-value calls the watchdog uses."""

    def __init__(self):
        self.d = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.d[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in list(self.d.items()) if k.startswith(prefix)]


@pytest.mark.parametrize("peer", ["dead", "hung"])
def test_watchdog_names_the_peer(peer, monkeypatch, capsys):
    """Dead: its heartbeat stops. Hung: its heartbeat goes on (thread alive) but its step does
    not, and neither does ours (blocked in a collective with it)."""
    from meshlab.train import distributed
    kv = FakeKV()
    monkeypatch.setattr(distributed, "_client", lambda: kv)
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
    exits = []
    wd = distributed.Watchdog(timeout=0.6, interval=0.05, exit_fn=exits.append)
    wd.beat(4)
    wd.start()
    t0 = time.time()
    while not exits and time.time() - t0 < 10:
        if peer == "hung" or time.time() - t0 < 0.2:
            kv.key_value_set("meshlab/hb/1", f"3 {time.time()}")   # alive, stuck at step 3
        if peer == "dead":
            wd.beat(4)      # our own loop is not blocked: only the peer's silence can fire
        time.sleep(0.05)
    wd._stop.set()
    wd.thread.join(2)
    err = capsys.readouterr().err
    assert exits == [3] or exits[:1] == [3]
    assert ("process 1 has not reported" if peer == "dead" else "process 1 is at step 3 (hung?)") in err, err


def test_a_collective_that_lost_its_peer_is_one_line(monkeypatch):
    """A peer killed mid-step fails the next collective before the watchdog's timeout: train.py prints
    this line instead of the runtime's traceback (and exits without JAX's barrier wait for the dead)."""
    from meshlab.train import distributed

    class JaxRuntimeError(Exception):   # the type's name is what peer_failure reads (jax moved it between versions)
        pass
    lost = JaxRuntimeError("UNKNOWN: Gloo ReduceScatter failed: [../gloo/transport/tcp/pair.cc:589] Connection reset "
                           "by peer\nmore lines")
    assert distributed.peer_failure(lost) is None                      # one process: no peer to blame
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
    msg = distributed.peer_failure(lost)
    assert msg.startswith("a collective of this 2-process run failed on process 0 (UNKNOWN: Gloo ReduceScatter")
    assert "more lines" not in msg and "--resume" in msg
    assert distributed.peer_failure(JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")) is None
    assert distributed.peer_failure(ValueError("Gloo")) is None


def test_slurm_launcher_finds_the_repository_from_slurms_copy_of_it(tmp_path):
    """sbatch runs a copy of scripts/launch_slurm.sh from its spool directory, where ../scripts/train.py is
    not: the launcher takes the submit directory instead, or stops with one line saying where to submit from."""
    spool, bin_dir = tmp_path / "spool" / "job7", tmp_path / "bin"
    spool.mkdir(parents=True)
    bin_dir.mkdir()
    (spool / "slurm_script").write_text((ROOT / "scripts/launch_slurm.sh").read_text())
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    (bin_dir / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_NNODES="1",
               SLURM_SUBMIT_DIR=str(ROOT), PYTHON="python3")
    out = subprocess.run(["bash", str(spool / "slurm_script"), "--rules", "dp"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"srun --kill-on-bad-exit=1 python3 {ROOT}/scripts/train.py --rules dp" in out.stdout
    out = subprocess.run(["bash", str(spool / "slurm_script")], env=dict(env, SLURM_SUBMIT_DIR=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(f"error: no scripts/train.py in {tmp_path}; submit from")
