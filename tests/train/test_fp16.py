"""fp16 training with dynamic loss scaling: an overflowing step is skipped and halves the scale,
finite steps leave params updated and double the scale every `loss_scale_growth` steps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.train.loop import build_trainer, device_batch
from meshlab.train.state import init_state
from tests.helpers import small_config

# Compiling the step dominates its few tiny runs: cheap_codegen.
pytestmark = pytest.mark.cheap_codegen


def test_dynamic_loss_scaling():
    cfg = small_config("dp", mesh="data=2", extra=["model.dtype=float16", "loss_scale_growth=2",
                                                   "data.global_batch=4"])
    tr = build_trainer(cfg, devices=jax.devices()[:2])
    batch = device_batch(tr, tr.batches.batch(0))
    state = init_state(tr.md, tr.tx, tr.shardings, 0, True)
    assert float(state["loss_scale"]["scale"]) == 2.0 ** 15
    before = jax.device_get(state["params"])
    # Overflow: the scaled loss is inf, so the update must be skipped and the scale halved.
    # The scaler's values are set on the state's own shardings: an uncommitted scalar would make jit
    # compile the fp16 step again (3 compiles of ~13 s instead of 1).
    sh = jax.tree.map(lambda a: a.sharding, state["loss_scale"])
    state["loss_scale"]["scale"] = jax.device_put(jnp.asarray(3e38, jnp.float32), sh["scale"])
    state, m = tr.step_fn(state, batch)
    assert not bool(m["finite"]) and float(state["loss_scale"]["scale"]) == np.float32(3e38) / 2
    same = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), jax.device_get(state["params"]), before))
    assert all(same)
    # Back to a sane scale: two finite steps update the params and double the scale once.
    state["loss_scale"] = jax.device_put({"scale": jnp.asarray(1024.0, jnp.float32),
                                          "good_steps": jnp.asarray(0, jnp.int32)}, sh)
    state, m1 = tr.step_fn(state, batch)
    state, m2 = tr.step_fn(state, batch)
    assert bool(m1["finite"]) and bool(m2["finite"]) and np.isfinite(float(m2["loss"]))
    assert float(state["loss_scale"]["scale"]) == 2048.0
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), jax.device_get(state["params"]), before))
    assert max(moved) > 0


def test_fp16_run_survives_overflow_steps(tmp_path):
    """The loop treats the scaler's overflow steps as routine, not as a NaN to stop on: started
    at 2^20 the fp16 backward overflows, the steps are skipped and halve the scale, then train."""
    from meshlab.train.loop import train
    cfg = small_config("dp", mesh="data=2", steps=8, extra=["model.dtype=float16", "data.global_batch=4",
                                                            f"loss_scale_init={2.0 ** 20}"])
    out = train(cfg, devices=jax.devices()[:2], progress=False, write=False)
    skipped = [r["step"] for r in out["rows"] if r.get("skipped") == "fp16 overflow"]
    assert skipped and skipped[0] == 1, skipped
    assert len(skipped) < 8 and np.isfinite(out["losses"][-1])
    assert float(out["state"]["loss_scale"]["scale"]) < 2.0 ** 20
