"""Rule files drawn at random train like one device: a shipped file with its rules, batch axes and ZeRO
stage redrawn over a random 8-device mesh, for the dense model, moe_tiny (dropless, and capacity dispatch
that drops tokens) and the dense model under a pipeline. A drawn file that the loader or the step refuses with a RulesError, MeshError or
ValueError is fine (most draws use one mesh axis twice or split 2 kv heads 4 ways); one that trains
must match the single-device losses and parameters, and nothing may crash.

Marked slow: `pytest -m slow tests/parallel/test_random_rules.py` (RULE_EPISODES=N draws a family, 40 by
default; RULES_SEED picks the draws). The faults these draws found have their own cases in the default
run (test_parity.py's ODD_LAYOUTS, test_moe.py's expert width on a batch axis)."""
import os
import random

import jax
import numpy as np
import pytest
import yaml

from meshlab.mesh import MeshError
from meshlab.rules import RulesError, load_rules
from meshlab.train.loop import train
from tests.helpers import one_device, small_config

pytestmark = [pytest.mark.slow, pytest.mark.cheap_codegen]

EPISODES = int(os.environ.get("RULE_EPISODES", "40"))
SEED = int(os.environ.get("RULES_SEED", "0"))
MOE = ["model.name=moe_tiny", "model.aux_loss_weight=0.1", "model.z_loss_weight=0.01"]
# (shipped base, meshes of 8 devices, logical names redrawn, extra overrides, parameter tolerance)
FAMILIES = {
    "dense": ("fsdp_tp", ["data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2",
                          "fsdp=2,context=2,tensor=2", "data=2,context=4", "data=4,tensor=2"],
              ["vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "act_batch", "act_seq", "act_attn_seq",
               "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab"], [], 2e-5),
    "moe": ("fsdp_tp_ep", ["expert=8", "fsdp=2,expert=4", "fsdp=2,tensor=2,expert=2", "data=2,expert=4",
                           "data=2,fsdp=2,expert=2", "tensor=2,expert=4"],
            ["vocab", "embed", "heads", "kv_heads", "mlp", "experts", "act_batch", "act_seq", "act_embed",
             "act_heads", "act_kv_heads", "act_mlp", "act_vocab", "act_experts"], MOE, 1e-4),
    "moe_capacity": ("fsdp_tp_ep", ["expert=8", "fsdp=2,expert=4", "fsdp=2,tensor=2,expert=2", "data=2,expert=4",
                                    "data=2,fsdp=2,expert=2", "tensor=2,expert=4"],
                     ["vocab", "embed", "heads", "kv_heads", "mlp", "experts", "act_batch", "act_seq", "act_embed",
                      "act_heads", "act_kv_heads", "act_mlp", "act_vocab", "act_experts"], MOE, 1e-4),
    "pipeline": ("pp_fsdp_tp", ["stage=2,data=4", "stage=2,fsdp=4", "stage=2,fsdp=2,tensor=2",
                                "stage=2,data=2,tensor=2", "stage=2,fsdp=2,context=2"],
                 ["vocab", "embed", "heads", "kv_heads", "mlp", "act_batch", "act_seq", "act_attn_seq",
                  "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab"], ["data.microbatches=2"], 2e-5),
}
# capacity 1.0 drops tokens: each layout must drop the ones the single device drops
EXPERTS = {"moe": {"dispatch": "dropless"}, "moe_capacity": {"dispatch": "capacity", "capacity_factor": 1.0}}
ZERO = [dict(params=p, grads=g, optimizer="sharded") for p, g in (("replicated", "replicated"),
                                                                   ("replicated", "sharded"), ("sharded", "sharded"))]


def draw(rng, family):
    """(rule file as a dict, mesh spec) for one episode."""
    base, meshes, names, _, _ = FAMILIES[family]
    raw = yaml.safe_load(open(load_rules(base).path).read())
    mesh = rng.choice(meshes)
    axes = [kv.split("=")[0] for kv in mesh.split(",") if not kv.startswith("stage")]
    for name in names:
        r = rng.random()
        raw["rules"][name] = None if r < 0.4 else rng.choice(axes) if r < 0.85 else rng.sample(axes, min(2, len(axes)))
    raw["batch"] = rng.sample(axes, rng.randint(1, len(axes)))
    raw["state"] = rng.choice(ZERO)
    strategies = raw["strategies"]
    if family == "pipeline":
        strategies["pipeline"] = {"schedule": rng.choice(["gpipe", "1f1b", "zb"]), "virtual": 1}
    elif family == "dense" and "context" in axes and rng.random() < 0.5:
        strategies["attention"] = rng.choice(["ring", "ulysses"])
    if family.startswith("moe"):
        strategies["experts"] = dict(EXPERTS[family], chunks=rng.choice([1, 2]))
    return raw, mesh


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_rule_files_train_like_one_device(family, tmp_path):
    base, _, _, extra, param_atol = FAMILIES[family]
    ref_rules = "dp"
    if family in EXPERTS:            # the base file on one device, with the family's dispatch
        raw = yaml.safe_load(open(load_rules(base).path).read())
        raw["strategies"]["experts"] = EXPERTS[family]
        ref_rules = str(tmp_path / "reference.yaml")
        (tmp_path / "reference.yaml").write_text(yaml.safe_dump(raw))
    ref = train(small_config(ref_rules, mesh="data=1", extra=extra if family in EXPERTS else []), devices=one_device(),
                progress=False, write=False)
    ref_params = jax.device_get(ref["state"]["params"])
    rng = random.Random(f"{SEED}-{family}")
    trained = 0
    for episode in range(EPISODES):
        raw, mesh = draw(rng, family)
        path = tmp_path / f"{family}{episode}.yaml"
        path.write_text(yaml.safe_dump(raw))
        try:
            out = train(small_config(str(path), mesh=mesh, extra=extra), progress=False, write=False)
        except (RulesError, MeshError, ValueError):
            continue
        trained += 1
        where = f"{path.name} on {mesh}:\n{path.read_text()}"
        np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5, err_msg=where)
        diff = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()),
                                            jax.device_get(out["state"]["params"]), ref_params))
        assert max(diff) < param_atol, f"max param difference {max(diff):.2e}, {where}"
    print(f"{family}: {trained} of {EPISODES} drawn files trained")
    assert trained >= EPISODES // 10, f"only {trained} of {EPISODES} drawn files trained: the draws test little"
