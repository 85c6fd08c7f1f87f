"""The model's fused-op switches: a whole `tiny` training step with every Pallas fused op on
(interpret mode on CPU) equals the unfused step, on 2 data-parallel devices."""
import jax
import numpy as np
import pytest

from meshlab.train.loop import train
from tests.helpers import small_config

FUSED = ["model.fused_norm=true", "model.fused_swiglu=true", "model.fused_rope=true", "model.loss_impl=pallas"]


def run(extra):
    cfg = small_config("dp", mesh="data=2", steps=2, extra=["data.global_batch=4", "data.seq_len=16"] + extra)
    out = train(cfg, devices=jax.devices()[:2], progress=False, write=False)
    return out["losses"], jax.device_get(out["state"]["params"])


@pytest.fixture(scope="module")
def unfused():
    return run([])


def test_fused_step_matches_unfused(unfused):
    ref_losses, ref_params = unfused
    losses, params = run(FUSED)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params, ref_params)))
    assert diff < 2e-5, diff


def test_chunked_loss_matches_dense(unfused):
    ref_losses, _ = unfused
    losses, _ = run(["model.loss_impl=chunked"])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
