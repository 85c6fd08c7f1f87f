"""A checkpoint written under a pipeline rule file (interleaved: 2 stages x 2 virtual, ZeRO-3 inside
each stage) restores under `fsdp` and back with equal parameters and Adam moments: the state keeps
the layer stack in model order whatever the schedule (meshlab/parallel/pipeline/layout.py), so
only the sharding changes on the way."""
from __future__ import annotations

import jax
import numpy as np

from meshlab import rules as R
from meshlab.mesh import make_mesh
from meshlab.checkpoint import Checkpointer
from meshlab.train.optimizer import make_optimizer
from meshlab.layout import to_shardings
from meshlab.train.state import abstract_state, state_specs
from models import model_def
from tests.helpers import small_config


def test_pipeline_checkpoint_restores_under_fsdp_and_back(tmp_path):
    cfg = small_config("pp_fsdp", extra=["model.n_layers=4"])
    src = R.load_rules("pp_fsdp").path
    text = open(src).read().replace("pipeline: {schedule: 1f1b, virtual: 1}", "pipeline: {schedule: interleaved, virtual: 2}")
    (tmp_path / "pp_interleaved.yaml").write_text(text)
    pp_rules, fsdp_rules = R.load_rules(tmp_path / "pp_interleaved.yaml"), R.load_rules("fsdp")
    assert pp_rules.strategies["pipeline"] == {"schedule": "interleaved", "virtual": 2}
    pp_mesh, fsdp_mesh = make_mesh("stage=2,fsdp=4"), make_mesh("fsdp=8")
    md = model_def(cfg.model)
    tx = make_optimizer(cfg.optim, 10, md.names)
    pp_sh = to_shardings(pp_mesh, state_specs(md, pp_rules, pp_mesh, tx, False))
    fsdp_sh = to_shardings(fsdp_mesh, state_specs(md, fsdp_rules, fsdp_mesh, tx, False))
    layer_spec = pp_sh["params"]["layers"]["attn"]["wq"].spec
    assert layer_spec[0] == "stage", layer_spec                 # the stack really is split by depth

    # The state's layout under the pipeline rule file, filled with distinct values per element (so a
    # permuted layer order could not pass) straight from the host: no init program to compile.
    state = jax.tree.map(lambda a: jax.device_put((np.arange(a.size).reshape(a.shape) * 1e-3).astype(a.dtype)
                                                  if a.ndim else np.zeros((), a.dtype), a.sharding),
                         abstract_state(md, tx, pp_sh, False))
    want = jax.device_get(state)

    first = Checkpointer(tmp_path / "a", async_save=False)
    first.save(1, state, {"rules": pp_rules.name}, wait=True)
    on_fsdp, _ = first.restore(abstract_state(md, tx, fsdp_sh, False))
    assert on_fsdp["params"]["layers"]["attn"]["wq"].sharding.spec == fsdp_sh["params"]["layers"]["attn"]["wq"].spec
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(on_fsdp), want)

    second = Checkpointer(tmp_path / "b", async_save=False)
    second.save(1, on_fsdp, {"rules": "fsdp"}, wait=True)
    back, _ = second.restore(abstract_state(md, tx, pp_sh, False))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(back), want)
    first.close()
    second.close()
