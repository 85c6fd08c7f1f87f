"""ZeRO as the articles describe it, checked against the compiled step (8 CPU devices).

- zero1 moves one all-reduce's bytes: a reduce-scatter of the gradients onto the Adam shards and an
  all-gather of the updated params, (p-1)/p each on the ring; dp's all-reduce is 2(p-1)/p. Planner
  and HLO both agree within 1%, and the HLO holds no gradient-sized all-reduce.
- zero2 reduce-scatters each layer's gradient inside the backward layer loop (grad_sync), so its
  compiled temporary memory is below zero1's by at least the full fp32 gradient.
- fsdp with remat=none and `fsdp_gather: per_layer` drops each layer's gathered weights after the
  forward and gathers them again in the backward: per extra layer its compiled temp grows by a
  layer's gathered weights less than `keep`'s (the old behaviour), and by less than one layer's.
"""
from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import small_config
from meshlab.plan import comm, hlo
from meshlab.train import compiled
from meshlab.train.loop import build_trainer

# One xdist worker runs test_zero, test_memory_comm and test_plan: compiled.measure caches each rule file's compiled step per
# process, and the files measure the same steps (make test: --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("compiled_steps"), pytest.mark.cheap_codegen]

# Weight-heavy: one row per device and 16 tokens, so state and gathered weights dominate temp.
HEAVY = ["model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=32", "model.mlp_dim=512",
         "model.vocab_size=512", "data.seq_len=16", "data.global_batch=8", "model.remat=none"]


def _wire(comms) -> float:
    """Bytes each device sends per step on the ring (Comm.nbytes is a reduce-scatter's output shard)."""
    return sum(x.count * comm.wire_bytes(x.kind, x.nbytes * (x.group if x.kind == "reduce-scatter" else 1), x.group)
               for x in comms)


def _hlo_wire(m, p: int = 8) -> float:
    """The same for the compiled HLO's collectives (all over the 8 devices here; loop bodies x n_layers)."""
    return sum(comm.wire_bytes(k, n * (p if k == "reduce-scatter" else 1), p) for k, n in m.per_step.items())


def _plan(cfg):
    tr = build_trainer(cfg)
    return tr, comm.step_collectives(tr.md, tr.rules, tr.mesh, cfg.data.global_batch, cfg.data.seq_len,
                                     cfg.data.microbatches, cfg.model.remat)


def test_zero1_moves_one_all_reduce_of_bytes():
    _, dp = _plan(small_config("dp"))
    tr, z1 = _plan(small_config("zero1"))
    print(f"\nplanner wire bytes per device: dp {_wire(dp):.0f}, zero1 {_wire(z1):.0f}")
    assert abs(_wire(z1) / _wire(dp) - 1) <= 0.01
    assert {x.kind for x in z1 if x.nbytes > 1024} == {"reduce-scatter", "all-gather"}
    # The compiled programs (shared with test_memory_comm's cache): the same wire bytes; zero1's only
    # all-reduces are scalars (loss, token count, grad norm); the layers' reductions sit in the
    # backward layer loop (dp: all-reduce, zero1: reduce-scatter), the rest after it.
    m_dp = compiled.measure(small_config("dp"), grads=False)
    m_z1 = compiled.measure(small_config("zero1"), grads=True)
    got_dp, got_z1 = _hlo_wire(m_dp), _hlo_wire(m_z1)
    print(f"HLO wire bytes per device: dp {got_dp:.0f}, zero1 {got_z1:.0f}")
    assert abs(got_z1 / got_dp - 1) <= 0.01
    assert sum(c.bytes for c in m_z1.collectives if c.kind == "all-reduce") < 1024
    full = 4 * sum(math.prod(a.shape) for a in jax.tree.leaves(tr.md.abstract))
    layers = 4 * sum(math.prod(a.shape) for a in jax.tree.leaves(tr.md.abstract["layers"]))
    assert m_z1.per_step["reduce-scatter"] == full // 8
    L = tr.cfg.model.n_layers
    for m, kind, n in ((m_dp, "all-reduce", layers), (m_z1, "reduce-scatter", layers // 8)):
        inside = [c for c in m.collectives if c.kind == kind and c.in_loop]
        assert sum(c.bytes for c in inside) * L == n and all("transpose(" in c.line for c in inside), m.rules


def test_zero2_reduce_scatters_per_layer_inside_the_backward_loop():
    cfg = small_config("zero2")
    m = compiled.measure(cfg, grads=True)   # shared with test_memory_comm
    tr = build_trainer(cfg)
    L = cfg.model.n_layers
    layered = sum(4 * math.prod(a.shape) for a in jax.tree.leaves(tr.md.abstract["layers"]))
    rs = [c for c in m.collectives if c.kind == "reduce-scatter"]
    inside = [c for c in rs if c.in_loop]
    assert inside and all("transpose(" in c.line for c in inside), [c.line[:120] for c in rs]
    assert sum(c.bytes for c in inside) * L == layered // 8        # every layer's grads, scattered per layer
    outside = sum(c.bytes for c in rs if not c.in_loop)
    rest = 4 * sum(math.prod(a.shape) for k, v in tr.md.abstract.items() if k != "layers" for a in jax.tree.leaves(v))
    assert outside <= 2 * rest // 8                                 # embedding (used twice, tied) + final norm only
    assert m.grads == (layered + rest) // 8


def test_zero2_temp_below_zero1_by_the_full_gradient():
    extra = HEAVY + ["model.n_layers=4", "data.microbatches=2", "data.global_batch=16"]
    t1 = compiled.measure(small_config("zero1", extra=extra), grads=False).temp
    t2 = compiled.measure(small_config("zero2", extra=extra), grads=False).temp
    md = build_trainer(small_config("zero2", extra=extra)).md
    full = 4 * sum(math.prod(a.shape) for a in jax.tree.leaves(md.abstract))
    print(f"\ntemp zero1 {t1} B, zero2 {t2} B, full fp32 gradient {full} B")
    assert t1 - t2 >= full


@pytest.fixture(scope="module")
def one_device_run():
    """2 steps of dp on one device: the reference of the micro-batch parity tests below (trained once)."""
    from meshlab.train.loop import train
    from tests.helpers import one_device
    ref = train(small_config("dp", mesh="data=1", steps=2), devices=one_device(), progress=False, write=False)
    return ref["losses"], jax.device_get(ref["state"]["params"])


def test_zero1_with_micro_batches_matches_one_device(one_device_run):
    """Earlier micro-batches accumulate locally; the last one's backward reduce-scatters their sum per
    layer (dp's psum path, the same tie without the scatter, is in test_parity at one micro-batch)."""
    from meshlab.train.loop import train
    ref_losses, ref_params = one_device_run
    for rules in ("zero1",):
        out = train(small_config(rules, steps=2, extra=["data.microbatches=2"]), progress=False, write=False)
        np.testing.assert_allclose(out["losses"], ref_losses, rtol=1e-5)
        diff = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), jax.device_get(out["state"]["params"]),
                                            ref_params))
        assert max(diff) < 2e-5, (rules, max(diff))


def _fsdp_file(tmp, gather: str) -> str:
    text = (Path(__file__).parents[2] / "sharding_rules" / "fsdp.yaml").read_text()
    path = Path(tmp) / f"fsdp_{gather}.yaml"
    path.write_text(text.replace("fsdp_gather: per_layer", f"fsdp_gather: {gather}"))
    return str(path)


@pytest.fixture(scope="module")
def fsdp_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rules")
    return {g: _fsdp_file(tmp, g) for g in ("per_layer", "keep", "per_step")}


@pytest.fixture(scope="module")
def fsdp_heavy_runs(fsdp_files):
    """2 steps of the 2-layer weight-heavy model under per_layer and keep, trained once: the numeric
    test compares their losses, the memory test reads their compiled steps (jax's cache: no compile)."""
    from meshlab.train.loop import train
    return {g: train(small_config(fsdp_files[g], steps=2, extra=HEAVY + ["model.n_layers=2"]), progress=False,
                     write=False) for g in ("per_layer", "keep")}


def test_fsdp_reshards_after_forward(fsdp_files, fsdp_heavy_runs):
    temps, files = {}, {g: fsdp_files[g] for g in ("per_layer", "keep")}
    for gather, path in files.items():
        run = fsdp_heavy_runs[gather]
        temps[gather, 2] = compiled.compiled_step(run["trainer"], run["state"]).memory_analysis().temp_size_in_bytes
        temps[gather, 4] = compiled.measure(small_config(path, extra=HEAVY + ["model.n_layers=4"]), grads=False).temp
    md = fsdp_heavy_runs["keep"]["trainer"].md
    layer = 4 * sum(math.prod(a.shape[1:]) for a in jax.tree.leaves(md.abstract["layers"]))  # one layer, gathered
    slope = {g: (temps[g, 4] - temps[g, 2]) / 2 for g in files}
    print(f"\nfsdp remat=none temp per extra layer: {slope} B; one layer's gathered weights {layer} B")
    # Both grow by the sharded state's update temporaries (~3.6 x a layer's shard here); keep also
    # by the layer's saved gathered weights, per_layer not (its growth stays under one layer's).
    assert slope["keep"] - slope["per_layer"] >= 0.9 * layer
    assert slope["per_layer"] < layer
    assert temps["per_layer", 4] <= temps["keep", 4] - 2 * layer   # at most two layers' gathered weights live


def test_fsdp_keep_matches_per_layer_numerically(fsdp_heavy_runs):
    out = fsdp_heavy_runs
    np.testing.assert_allclose(out["keep"]["losses"], out["per_layer"]["losses"], rtol=1e-6)


def test_fsdp_per_step_gathers_once_and_matches_one_device(fsdp_files, one_device_run):
    """fsdp_gather: per_step over 2 micro-batches: the single-device losses and parameters; in the
    compiled step every all-gather and reduce-scatter sits outside the loops (once per step), with the
    planner's bytes."""
    from meshlab.train.loop import train
    cfg = small_config(fsdp_files["per_step"], steps=2, extra=["data.microbatches=2"])
    ref_losses, ref_params = one_device_run
    out = train(cfg, progress=False, write=False)
    np.testing.assert_allclose(out["losses"], ref_losses, rtol=1e-5)
    diff = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), jax.device_get(out["state"]["params"]),
                                        ref_params))
    assert max(diff) < 2e-5
    # the program the run compiled (jax's cache: no second compile), read as compiled.measure reads it
    colls = hlo.collectives(compiled.compiled_step(out["trainer"], out["state"]).as_text())
    moved = [c for c in colls if c.kind in ("all-gather", "reduce-scatter")]
    assert moved and not [c for c in moved if c.in_loop], [c for c in moved if c.in_loop]
    want = comm.cpu_view(_plan(cfg)[1])
    for kind in ("all-gather", "reduce-scatter"):
        got = sum(c.bytes for c in moved if c.kind == kind)   # none in a loop: once per step
        print(f"\nper_step {kind}: HLO {got} B, plan {want[kind]} B")
        assert got == pytest.approx(want[kind], rel=0.01)


def test_fsdp_per_step_is_refused_with_expert_weights(tmp_path):
    """per_step with expert weights: one clear error at build time (under a pipeline: test_pipeline)."""
    from meshlab.rules import RulesError
    moe_path = tmp_path / "fsdp_per_step.yaml"
    moe_path.write_text((Path(__file__).parents[2] / "sharding_rules" / "fsdp.yaml").read_text()
                        .replace("fsdp_gather: per_layer", "fsdp_gather: per_step"))
    with pytest.raises(RulesError, match="per_step` with expert weights"):
        build_trainer(small_config(str(moe_path), extra=["model.name=moe_tiny"]))


def test_planner_prices_overlap_per_layer():
    """The layers' gradient reductions (dp all-reduce, zero1/zero2 reduce-scatter, per layer in the
    backward) hide behind the layers' compute; what runs outside the layer scan (embedding grads,
    the updated params' all-gather) is exposed whole; the step is compute + exposed."""
    import models
    from meshlab.plan import hardware, search
    from meshlab.rules import load_rules
    from models import model_def
    md, hw = model_def(models.preset("llama3_1b")), hardware.get_hardware("h200")
    plans = {r: search.evaluate(md, load_rules(r), {"data": 8}, 32, 4096, "full", 1, hw)
             for r in ("dp", "zero1", "zero2")}
    for r, p in plans.items():
        ov = p.comm["overlap"]
        print(f"\n{r}: comm {p.comm['total'] * 1e3:.2f} ms, exposed {ov['exposed'] * 1e3:.2f} ms, "
              f"step {p.step_s * 1e3:.1f} ms")
        assert p.step_s == pytest.approx(p.compute_s + ov["exposed"])
    for r, p in plans.items():
        ov, L = p.comm["overlap"], md.cfg.n_layers
        layered = sum(t for c, t in p.comm["rows"] if "grads" in c.what and c.count >= L)
        outside = sum(t for c, t in p.comm["rows"] if c.count < L)
        assert ov["per_layer_comm"] < ov["layer_compute"] and layered > 0, r
        assert ov["hidden"] == pytest.approx(layered) and ov["exposed"] == pytest.approx(outside), r
