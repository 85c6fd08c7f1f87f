"""The model's fused-op switches: a whole `tiny` training step with every Pallas fused op on
(interpret mode on CPU) equals the unfused step, on 2 data-parallel devices."""
import jax
import numpy as np
import pytest

from meshlab.train.loop import train
from tests.helpers import small_config

FUSED = ["model.fused_norm=true", "model.fused_swiglu=true", "model.fused_rope=true", "model.loss_impl=pallas"]
# One xdist worker runs the whole file: the `unfused` reference run is trained once, not once per worker
# (make test: --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("fused_model"), pytest.mark.cheap_codegen]


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


@pytest.mark.parametrize("rules,mesh,n,softmax", [("dp", "data=2", 2, "auto"), ("dp", "data=2", 2, "pallas"),
                                                  ("fsdp_tp_sp", "data=1,fsdp=2,tensor=2", 4, "auto")],
                         ids=["dp", "dp_slab_kernels", "tp_sp"])
def test_onepass_loss_matches_dense(unfused, rules, mesh, n, softmax):
    """The one-pass loss (gradients made in the forward, scaled by the step's 1/n_valid cotangent)
    gives the dense step's losses and parameters; under fsdp_tp_sp the head weight is vocab-sharded
    over tensor and the residual stream sequence-sharded, the same global batch (data order is
    mesh-independent). softmax=pallas: the slab's passes as kernels (interpreted) inside the
    data-parallel step's shard_map, where each device holds whole rows and the whole vocabulary."""
    ref_losses, ref_params = unfused
    cfg = small_config(rules, mesh=mesh, steps=2,
                       extra=["data.global_batch=4", "data.seq_len=16", "model.loss_impl=onepass",
                              f"model.loss_softmax={softmax}"])
    out = train(cfg, devices=jax.devices()[:n], progress=False, write=False)
    losses, params = out["losses"], jax.device_get(out["state"]["params"])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params, ref_params)))
    assert diff < 2e-5, diff
