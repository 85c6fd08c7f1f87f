"""Remat policies trade recomputation for memory: the compiled temporary memory of `tiny`
falls from `none` to `full` (read from the compiler's memory analysis, printed)."""
import jax
import numpy as np

from meshlab import rules as R
from meshlab.train.loop import build_trainer, device_batch
from meshlab.train.state import abstract_state
from tests.helpers import one_device, small_config

POLICIES = ("none", "save_dots", "save_dots_no_batch", "full")


def compiled_temp_bytes(policy):
    cfg = small_config("dp", mesh="data=1", extra=[f"model.remat={policy}", "model.n_layers=4", "model.d_model=64",
                                                   "model.mlp_dim=256", "data.seq_len=128"])
    tr = build_trainer(cfg, devices=one_device())
    with R.use_rules(tr.rules, tr.mesh):
        state = abstract_state(tr.md, tr.tx, tr.shardings, False)
        batch = device_batch(tr, tr.batches.batch(0))
        compiled = tr.step_fn.lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_remat_policies_reduce_temporary_memory():
    temps = {p: compiled_temp_bytes(p) for p in POLICIES}
    print("\nremat policy -> compiled temp bytes: " + ", ".join(f"{p}={t:,}" for p, t in temps.items()))
    assert temps["full"] < temps["none"]
    assert temps["save_dots_no_batch"] <= temps["save_dots"] <= temps["none"] * 1.05
    assert temps["full"] <= min(temps.values()) * 1.05
