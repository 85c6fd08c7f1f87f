"""Shared set-up for the training tests: a very small model and config, built in-process."""
from __future__ import annotations

import jax

from meshlab.train.config import load_config

SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
         "model.mlp_dim=64", "model.dtype=float32", "data.seq_len=32", "data.global_batch=16",
         "optim.lr=1e-2", "optim.warmup_steps=0", "sample_tokens=0", "log_every=1"]

# Mesh per shipped rule file on 8 devices (tp needs tensor <= kv_heads = 2 here).
MESH_FOR = {"dp": None, "zero1": None, "zero2": None, "fsdp": None, "tp": "data=4,tensor=2",
            "fsdp_tp": None, "fsdp_tp_sp": None,
            # context parallel (issue 5): ring with zig-zag order inside the step, and all-to-all
            "fsdp_cp": None, "cp_ring": "data=2,context=4", "cp_ulysses": "data=4,context=2"}


def small_config(rules="dp", mesh=None, steps=3, extra=(), tmp_path=None):
    over = SMALL + [f"rules={rules}", f"steps={steps}"] + list(extra)
    if mesh:
        over.append(f"mesh={mesh}")
    if tmp_path is not None:
        over.append(f"run_dir={tmp_path}")
    return load_config("default", over)


def one_device():
    return [jax.devices()[0]]
