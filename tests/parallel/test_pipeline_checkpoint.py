"""A checkpoint written under an interleaved pipeline rule file (2 stages x 2 virtual, ZeRO-3 inside
each stage), whose state stores the layer stack in chunk order, restores under `fsdp` in model order
and back, and under another interleaved layout (4 stages x 2 virtual) in that layout's chunk order:
the checkpoint records the order it was written in, a restore converts (parameters and Adam
moments), a checkpoint without the record is model order (meshlab/parallel/pipeline/layout.py)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from meshlab import rules as R
from meshlab.checkpoint import Checkpointer, read_meta
from meshlab.layout import Layout, to_shardings
from meshlab.mesh import make_mesh
from meshlab.parallel.pipeline import LayoutError, reorder
from meshlab.train.optimizer import make_optimizer
from meshlab.train.state import abstract_state, state_specs
from models import model_def
from tests.helpers import small_config

# Compiling dominates (the pipelined step, its validation and the one-device forward): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen


def _interleaved(tmp_path, virtual=2):
    text = open(R.load_rules("pp_fsdp").path).read()
    text = text.replace("pipeline: {schedule: 1f1b, virtual: 1}", f"pipeline: {{schedule: interleaved, virtual: {virtual}}}")
    (tmp_path / f"pp_interleaved_{virtual}.yaml").write_text(text)
    return R.load_rules(tmp_path / f"pp_interleaved_{virtual}.yaml")


def test_pipeline_checkpoint_restores_under_fsdp_and_another_pipeline_and_back(tmp_path):
    cfg = small_config("pp_fsdp", extra=["model.n_layers=8"])
    md = model_def(cfg.model)
    tx = make_optimizer(cfg.optim, 10, md.names)
    pp_rules, fsdp_rules = _interleaved(tmp_path), R.load_rules("fsdp")
    assert pp_rules.strategies["pipeline"] == {"schedule": "interleaved", "virtual": 2}
    places = {"pp2": (pp_rules, make_mesh("stage=2,fsdp=4")), "pp4": (pp_rules, make_mesh("stage=4,fsdp=2")),
              "fsdp": (fsdp_rules, make_mesh("fsdp=8"))}
    layouts = {k: Layout.build(md, r, m) for k, (r, m) in places.items()}
    sh = {k: to_shardings(places[k][1], state_specs(md, *places[k], tx, False, layout=lay)) for k, lay in layouts.items()}
    order = {k: lay.layer_order for k, lay in layouts.items()}
    # Stage s's contiguous block holds its chunks s, p + s: the order is the rule file's and the mesh's.
    assert order == {"pp2": (0, 1, 4, 5, 2, 3, 6, 7), "pp4": (0, 4, 1, 5, 2, 6, 3, 7), "fsdp": None}
    assert sh["pp2"]["params"]["layers"]["attn"]["wq"].spec[0] == "stage"      # the stack really is split by depth

    # The state as the 2-stage pipeline stores it, distinct values per element (so a layer in the
    # wrong row could not pass), straight from the host: no init program to compile.
    stored = jax.tree.map(lambda a: jax.device_put((np.arange(a.size).reshape(a.shape) * 1e-3).astype(a.dtype)
                                                   if a.ndim else np.zeros((), a.dtype), a.sharding),
                          abstract_state(md, tx, sh["pp2"], False))
    stored_np = jax.device_get(stored)
    model = reorder(stored_np, order["pp2"], None)                # the same state in model order
    assert not np.array_equal(model["params"]["layers"]["attn"]["wq"], stored_np["params"]["layers"]["attn"]["wq"])

    def restore(ckpt, where):
        got, _ = ckpt.restore(abstract_state(md, tx, sh[where], False), layer_order=order[where])
        assert got["params"]["layers"]["mlp"]["w_up"].sharding == sh[where]["params"]["layers"]["mlp"]["w_up"]
        return got

    first = Checkpointer(tmp_path / "a", async_save=False)
    first.save(1, stored, {"rules": pp_rules.name}, wait=True, layer_order=order["pp2"])
    assert read_meta(tmp_path / "a", 1)["layer_order"] == list(order["pp2"])
    on_fsdp = restore(first, "fsdp")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(on_fsdp), model)        # Adam moments too
    on_pp4 = restore(first, "pp4")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(on_pp4), reorder(model, None, order["pp4"]))

    second = Checkpointer(tmp_path / "b", async_save=False)
    second.save(1, on_fsdp, {"rules": "fsdp"}, wait=True)
    assert "layer_order" not in read_meta(tmp_path / "b", 1)                # no record: model order
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restore(second, "pp2")), stored_np)
    first.close()
    second.close()
    with pytest.raises(LayoutError, match=r"layer order \[0, 2, 1\] is not an order of the model's 8 layers"):
        reorder(model, [0, 2, 1], None)                           # a record written for another model


def test_interleaved_run_trains_validates_and_serves_as_the_model(tmp_path):
    """The train loop under an interleaved rule file: its fresh state is the model of the same seed
    (stored in chunk order), its step-1 loss is that model's, its trained parameters mapped back to model
    order are the one-device step's, its validation loss is the trained model's, its checkpoint records
    the order and serving reads model order from it. One pipelined run; the reference is the one-device
    forward and gradient (small compiles, no second training run)."""
    import optax
    from flax import nnx

    import models
    from meshlab.infer.loading import load_checkpoint
    from meshlab.train.loop import load_batches, train
    cfg = small_config(str(_interleaved(tmp_path).path), mesh="stage=2,fsdp=4", steps=1, tmp_path=tmp_path / "pp",
                       extra=["model.n_layers=4", "data.microbatches=2", "val.every=1", "val.batches=1",
                              "checkpoint.async_save=false", "optim.eps=1e-6"])
    # Adam's first update is lr * g / (|g| + eps): at eps 1e-8 this model's smallest gradients (~5e-10) would
    # turn fp32 reduction-order differences into parameter differences of ~1e-5; at 1e-6 they stay ~1e-7
    run = train(cfg, progress=False)
    order = run["trainer"].layout.layer_order
    assert order == (0, 2, 1, 3) and read_meta(tmp_path / "pp" / "checkpoints", 1)["layer_order"] == [0, 2, 1, 3]
    _, md, served, _ = load_checkpoint(str(tmp_path / "pp"))
    served = jax.device_get(served)
    jax.tree.map(np.testing.assert_array_equal, reorder(jax.device_get(run["state"]["params"]), order, None), served)

    @jax.jit
    def mean_loss(params, b):
        m = md.bind(params)
        return m.loss_sum(m.hidden(b["tokens"], b["positions"], b["segment_ids"]), b["labels"]) / (b["labels"] >= 0).sum()
    init = nnx.to_pure_dict(nnx.state(models.build(cfg.model, nnx.Rngs(jax.random.key(cfg.seed))), nnx.Param))
    rows = range(cfg.data.global_batch)
    first = load_batches(cfg).batch(0, rows)
    assert run["losses"][0] == pytest.approx(float(mean_loss(init, first)), rel=1e-5)
    tx = run["trainer"].tx
    stepped = jax.jit(lambda p: optax.apply_updates(p, tx.update(jax.grad(mean_loss)(p, first), tx.init(p), p)[0]))(init)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), served, jax.device_get(stepped)))
    assert max(moved) < 2e-5, f"max parameter difference {max(moved):.2e} from the one-device step"
    val = float(mean_loss(served, load_batches(cfg, "val").batch(0, rows)))
    assert run["rows"][-1]["val_loss"] == pytest.approx(val, rel=1e-5)
