"""What makes a run survive: SIGTERM / Ctrl-C turned into a save and a clean exit, a fresh run's old
checkpoints set aside (never mixed with or overwritten by the new run's), the state restored into this
run's shardings with its step checked against `steps`, and the metadata each checkpoint carries (config,
rules, mesh, the data iterator's position)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

from meshlab.checkpoint import Checkpointer
from meshlab.train.config import TrainConfig, schedule_changes, to_yaml
from meshlab.train.state import abstract_state, init_state


class StopRequest:
    """SIGTERM / Ctrl-C set a flag; the loop finishes the step in flight, saves and exits.
    In a multi-process run the flag is agreed on by all processes every AGREE_EVERY steps
    (a tiny all-gather, which waits for the device: done every step it would stall the loop's
    one-step-ahead dispatch), so every process stops after the same step and the final
    checkpoint is collective. A signal is honoured within AGREE_EVERY steps."""

    AGREE_EVERY = 10

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user really wants out now
        self.signal = signal.Signals(signum).name
        print(f"\nmeshlab: {self.signal} received; finishing this step and saving a checkpoint", flush=True)

    def requested(self, step: int) -> bool:
        local = self.signal is not None
        if jax.process_count() == 1:
            return local
        if step % self.AGREE_EVERY:
            return False
        from jax.experimental import multihost_utils
        return bool(np.any(multihost_utils.process_allgather(np.int32(local))))

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def checkpointer(cfg: TrainConfig, run_dir: Path) -> Checkpointer:
    c = cfg.checkpoint
    return Checkpointer(c.dir or run_dir / "checkpoints", every=c.every, keep=c.keep,
                        keep_every=c.keep_every, async_save=c.async_save)


def set_aside(directory: Path) -> None:
    """A fresh run into a directory that holds checkpoints: keep them (renamed), never mix steps
    of two runs in one directory and never overwrite them."""
    if jax.process_index() == 0 and directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir()):
        dst = directory.with_name(f"{directory.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(directory, dst)
        print(f"meshlab: {directory} held checkpoints of an earlier run; kept as {dst} "
              "(pass --resume to continue a run instead)", file=sys.stderr)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("meshlab_set_aside")


def start_state(tr, ckpt: Checkpointer | None, fp16: bool):
    """(state, start step): fresh, or restored into this run's shardings."""
    cfg = tr.cfg
    if not cfg.checkpoint.resume:
        return init_state(tr.md, tr.tx, tr.shardings, cfg.seed, fp16, initial_scale=cfg.loss_scale_init,
                          layer_order=tr.layout.layer_order), 0
    if ckpt is None:
        raise ValueError("checkpoint.resume needs a run that writes its run directory (write=True)")
    step = None if cfg.checkpoint.resume == "latest" else int(cfg.checkpoint.resume)
    state, meta = ckpt.restore(abstract_state(tr.md, tr.tx, tr.shardings, fp16), step, layer_order=tr.layout.layer_order)
    check_resume_step(cfg, int(meta["step"]), ckpt, restored=True)
    # Steps after the restored one are the run this resume branches away from: set aside, or this
    # run's saves of those step numbers would be skipped and a later resume would take the old state.
    ckpt.set_aside_after(int(meta["step"]))
    saved = meta.get("data", {})
    now = {"seed": cfg.data.seed, "global_batch": cfg.data.global_batch, "seq_len": cfg.data.seq_len,
           "corpus": cfg.data.corpus}
    changed = {k: (saved.get(k), v) for k, v in now.items() if k in saved and saved[k] != v}
    if changed and jax.process_index() == 0:
        print(f"meshlab: warning: data settings changed since the checkpoint {changed}; "
              "the batches after the resume differ from the original run's", file=sys.stderr)
    schedule = schedule_changes(meta.get("config"), cfg)
    if schedule and jax.process_index() == 0:
        print(f"meshlab: warning: the learning-rate schedule changed since the checkpoint ({schedule}); the "
              f"steps after {meta['step']} follow the new one, whose rate there differs from what the run "
              "was heading to (steps is the schedule's length: to extend a run, expect the jump or re-warm)",
              file=sys.stderr)
    return state, int(meta["step"])


def check_resume_step(cfg: TrainConfig, step: int | None, ckpt, restored: bool = False) -> None:
    """`steps` is the run's total: a resume from step S trains steps S+1..steps, so S must be below it.
    Before the restore only a latest step past `steps` is refused (a damaged latest step falls back to
    an earlier one, which may still be below it); after it, the restored step itself."""
    if step is None or step < cfg.steps or (step == cfg.steps and not restored):
        return
    what = "restored checkpoint" if restored else "latest checkpoint"
    raise ValueError(f"the {what} in {ckpt.directory} is step {step} and steps={cfg.steps}: nothing to "
                     f"train. --steps is the run's total (the learning-rate schedule's length), not the steps "
                     f"to add: pass --steps N with N > {step} to continue"
                     + (" (no checkpoint was touched)" if restored else ""))


def run_meta(tr, step: int) -> dict:
    cfg = tr.cfg
    return {"config": to_yaml(cfg), "rules": tr.rules.name, "mesh": dict(tr.mesh.shape),
            "processes": jax.process_count(),
            # The batch is a function of (seed, step, row): the next step is the iterator state.
            "data": {"next_step": step, "seed": cfg.data.seed, "global_batch": cfg.data.global_batch,
                     "seq_len": cfg.data.seq_len, "corpus": cfg.data.corpus}}
