"""AdamW with warmup-cosine schedule, global-norm clipping, no decay on norms (1-D leaves); the
schedule as a table on the host for the training loop (`host_schedule`)."""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
import optax


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 20
    decay_steps: int = 0          # 0: decay over the whole run
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0        # 0 disables clipping


SCHEDULE_KEYS = ("lr", "warmup_steps", "decay_steps", "min_lr_ratio")   # what `schedule` reads, with the steps


def schedule(cfg: OptimConfig, total_steps: int):
    decay = cfg.decay_steps or max(total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, decay, cfg.lr * cfg.min_lr_ratio)


HOST_BLOCK = 4096     # steps of the schedule computed at once on the host


def host_schedule(ocfg, steps: int, block: int = HOST_BLOCK):
    """step -> learning rate as a Python float, computed on the host CPU a block of steps at a time.
    optax's schedule is jnp: called per step on the default device (the GPU), its ops queued behind
    the step in flight and `float()` waited for that step, so the next step was dispatched only after
    it ended (a device-idle gap every step, which the metrics-one-step-late loop exists to avoid).
    One block at a time, not the whole run: a table of every step would take minutes and gigabytes
    before the first step of a run of 10^9 steps."""
    sched = schedule(ocfg, steps)
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:       # no CPU backend in this process (JAX_PLATFORMS without cpu): once, here
        cpu = None
    last, held = max(steps, 1) - 1, {}

    def lr_at(step: int) -> float:
        s = min(max(step, 0), last)
        i = s // block
        if i not in held:
            held.clear()
            with jax.default_device(cpu) if cpu is not None else contextlib.nullcontext():
                held[i] = np.asarray(jax.vmap(sched)(np.arange(i * block, min((i + 1) * block, last + 1))), np.float64)
        return float(held[i][s - i * block])
    return lr_at


def decay_mask(names_tree):
    """Weight decay on matrices only: a leaf whose logical names (less `layers`) are 1-D is a norm
    scale or a bias. Decided from names, since the layer scan stacks norm scales into [L, d]."""
    return jax.tree.map(lambda names: len([n for n in names if n != "layers"]) >= 2, names_tree,
                        is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(cfg: OptimConfig, total_steps: int, names_tree) -> optax.GradientTransformation:
    sched = schedule(cfg, total_steps)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mask=decay_mask(names_tree)))
    return optax.chain(*parts)
