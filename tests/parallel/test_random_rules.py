"""Rule files drawn at random train like one device: a shipped file with its rules, batch axes and ZeRO
stage redrawn over a random 8-device mesh, for the dense model, moe_tiny (dropless, and capacity dispatch
that drops tokens), the dense model under a pipeline (gpipe, 1f1b, zb; on 2 stages also interleaved and
GPipe over 2 virtual stages, whose state stores the layers in chunk order: the parameters are compared in
model order) and collective matmul (fsdp_tp_sp_cm: the names it needs keep tensor, the rest are redrawn,
with remat, gate|up and fsdp_gather drawn too); a fifth of the runs in bf16, whose losses are compared with a
bf16 single device at BF16_LOSS_RTOL and parameters not at all. A drawn file that the loader or the step refuses with a
RulesError, MeshError or ValueError is fine (most draws use one mesh axis twice or split 2 kv heads 4 ways);
one that trains must match the single-device losses and parameters, and nothing may crash.

Marked slow: `pytest -m slow tests/parallel/test_random_rules.py` (RULE_EPISODES=N draws a family, 40 by
default; RULES_SEED picks the draws; RULES_WHY=N prints N characters of each kind of refusal). The faults
these draws found have their own cases in the default run (test_parity.py's ODD_LAYOUTS, test_moe.py's
expert width on a batch axis, test_collective_matmul.py's refusal of a pipeline)."""
import collections
import os
import random

import jax
import numpy as np
import pytest
import yaml

from meshlab.mesh import MeshError
from meshlab.parallel.pipeline import reorder
from meshlab.rules import RulesError, load_rules
from meshlab.train.loop import train
from tests.helpers import one_device, small_config

pytestmark = [pytest.mark.slow, pytest.mark.cheap_codegen]

EPISODES = int(os.environ.get("RULE_EPISODES", "40"))
SEED = int(os.environ.get("RULES_SEED", "0"))
WHY = int(os.environ.get("RULES_WHY", "90"))    # characters of each refusal printed
MOE = ["model.name=moe_tiny", "model.aux_loss_weight=0.1", "model.z_loss_weight=0.01"]
DENSE_NAMES = ["vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "act_batch", "act_seq", "act_attn_seq",
               "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab"]
MOE_NAMES = ["vocab", "embed", "heads", "kv_heads", "mlp", "experts", "act_batch", "act_seq", "act_embed",
             "act_heads", "act_kv_heads", "act_mlp", "act_vocab", "act_experts"]
MOE_MESHES = ["expert=8", "fsdp=2,expert=4", "fsdp=2,tensor=2,expert=2", "data=2,expert=4", "data=2,fsdp=2,expert=2",
              "tensor=2,expert=4"]
# (shipped base, meshes of 8 devices, logical names redrawn, extra overrides, parameter tolerance)
FAMILIES = {
    "dense": ("fsdp_tp", ["data=8", "fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2",
                          "fsdp=2,context=2,tensor=2", "data=2,context=4", "data=4,tensor=2"], DENSE_NAMES, [], 2e-5),
    "moe": ("fsdp_tp_ep", MOE_MESHES, MOE_NAMES, MOE, 1e-4),
    "moe_capacity": ("fsdp_tp_ep", MOE_MESHES, MOE_NAMES, MOE, 1e-4),
    "pipeline": ("pp_fsdp_tp", ["stage=2,data=4", "stage=2,fsdp=4", "stage=2,fsdp=2,tensor=2",
                                "stage=2,data=2,tensor=2", "stage=2,fsdp=2,context=2", "stage=4,fsdp=2",
                                "stage=4,tensor=2"],
                 [n for n in DENSE_NAMES if n != "head_dim"], ["data.microbatches=2"], 2e-5),
    # collective matmul: the names it needs on tensor keep it (alone or beside another axis), the rest are
    # free; with a stage axis (a pipeline around it) the loader must refuse the file
    "collective_matmul": ("fsdp_tp_sp_cm", ["fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2", "fsdp=2,context=2,tensor=2",
                                            "data=4,tensor=2", "fsdp=2,tensor=4", "data=2,tensor=4", "tensor=8",
                                            "stage=2,fsdp=2,tensor=2"],
                          DENSE_NAMES, ["data.microbatches=2"], 2e-5),
}
# capacity 1.0 drops tokens: each layout must drop the ones the single device drops
EXPERTS = {"moe": {"dispatch": "dropless"}, "moe_capacity": {"dispatch": "capacity", "capacity_factor": 1.0}}
ZERO = [dict(params=p, grads=g, optimizer="sharded") for p, g in (("replicated", "replicated"),
                                                                   ("replicated", "sharded"), ("sharded", "sharded"))]
# the logical names collective matmul needs split over tensor (meshlab/rules.py _collective_matmul)
ON_TENSOR = ("heads", "kv_heads", "mlp", "act_heads", "act_kv_heads", "act_mlp")
# Adam's first update is lr * g / (|g| + eps): at eps 1e-8 an element whose gradient is ~1e-9 (every model here
# has some) turns an fp32 reduction-order difference of 1e-11 into a parameter difference of ~2e-5. At 1e-6 that
# gain is at most lr / eps = 1e4, and every element with |g| >> 1e-6 (nearly all) updates as before.
ADAM = ["optim.eps=1e-6"]
BF16_LOSS_RTOL = 2e-3      # 8 bits of mantissa, sums in other orders (tests/parallel/test_bf16_layouts.py)


def _pipeline(rng, stages: int) -> tuple[dict, list[str]]:
    """A schedule for `stages` stages of the 2-micro-batch run and the model overrides it needs: 2 layers per
    stage-chunk count (4 layers for 4 stages, or for 2 stages x 2 virtual, whose state stores chunk order)."""
    if stages == 2 and rng.random() < 0.35:
        return {"schedule": rng.choice(["interleaved", "gpipe"]), "virtual": 2}, ["model.n_layers=4"]
    return {"schedule": rng.choice(["gpipe", "1f1b", "zb"]), "virtual": 1}, ["model.n_layers=4"] if stages == 4 else []


def draw(rng, family):
    """(rule file as a dict, mesh spec, model overrides of the run and its reference, overrides of the run
    alone) for one episode."""
    base, meshes, names, _, _ = FAMILIES[family]
    raw = yaml.safe_load(open(load_rules(base).path).read())
    mesh = rng.choice(meshes)
    axes = [kv.split("=")[0] for kv in mesh.split(",") if not kv.startswith("stage")]
    stages = int(dict(kv.split("=") for kv in mesh.split(",")).get("stage", 1))
    # an axis of size 1 for the batch to draw too: a batch over it alone leaves the others Auto in the step
    one = [rng.choice([a for a in ("data", "fsdp", "context") if a not in axes])] if rng.random() < 0.25 else []
    model, run = [], []
    cm = family == "collective_matmul" and rng.random() < 0.9     # else every name drawn freely (mostly refused)
    for name in names:
        r = rng.random()
        # under collective matmul tensor is taken by the heads' and mlp's specs: other names that share a spec
        # with them draw from the other axes
        pool = [a for a in axes if a != "tensor"] if cm and name not in ("vocab", "act_vocab") else axes
        raw["rules"][name] = (None if r < 0.4 or not pool else rng.choice(pool) if r < 0.85 else
                              rng.sample(pool, min(2, len(pool))))
        if cm and name in ON_TENSOR and "tensor" not in (raw["rules"][name] or ()):
            others = [a for a in axes if a != "tensor"]
            raw["rules"][name] = ("tensor" if r < 0.7 or not others else
                                  rng.choice([["tensor", rng.choice(others)], [rng.choice(others), "tensor"]]))
        if cm and name == "act_seq" and r < 0.95:
            raw["rules"][name] = "tensor"
    raw["batch"] = rng.sample(axes + one, rng.randint(1, len(axes + one)))
    raw["state"] = rng.choice(ZERO)
    strategies = raw["strategies"]
    if stages > 1:
        strategies["pipeline"], model = _pipeline(rng, stages)
        raw["rules"]["layers"] = "stage"
    if family in ("dense", "collective_matmul") and "context" in axes and rng.random() < 0.5:
        strategies["attention"] = rng.choice(["ring", "ulysses"])
    if family == "collective_matmul":
        if "tensor=8" in mesh:                         # whole heads and kv heads per device
            model += ["model.n_heads=8", "model.n_kv_heads=8", "model.head_dim=4"]
        elif "tensor=4" in mesh or rng.random() < 0.3:
            model.append("model.n_kv_heads=4")
        run += [f"model.gate_up={rng.choice(['split', 'stacked'])}",
                f"model.remat={rng.choice(['none', 'full', 'save_dots'])}"]
        strategies["fsdp_gather"] = "per_layer" if stages > 1 else rng.choice(["per_layer", "per_step"])
    if family.startswith("moe"):
        strategies["experts"] = dict(EXPERTS[family], chunks=rng.choice([1, 2]))
    if rng.random() < 0.2:        # bf16 (its CPU collectives: meshlab.compat), against a bf16 single device
        model.append("model.dtype=bfloat16")
    return raw, mesh, model, run


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_rule_files_train_like_one_device(family, tmp_path):
    base, _, _, extra, param_atol = FAMILIES[family]
    ref_rules = "dp"
    if family in EXPERTS:            # the base file on one device, with the family's dispatch
        raw = yaml.safe_load(open(load_rules(base).path).read())
        raw["strategies"]["experts"] = EXPERTS[family]
        ref_rules = str(tmp_path / "reference.yaml")
        (tmp_path / "reference.yaml").write_text(yaml.safe_dump(raw))
    refs = {}

    def reference(model):           # the single-device run of the model an episode trains, once per model
        if model not in refs:
            over = [e for e in extra if e.startswith("model.")] + ADAM + list(model)
            ref = train(small_config(ref_rules, mesh="data=1", extra=over), devices=one_device(), progress=False,
                        write=False)
            refs[model] = ref["losses"], jax.device_get(ref["state"]["params"])
        return refs[model]

    reference(())
    rng = random.Random(f"{SEED}-{family}")
    trained, refused, kinds = 0, collections.Counter(), collections.Counter()
    for episode in range(EPISODES):
        raw, mesh, model, run = draw(rng, family)
        path = tmp_path / f"{family}{episode}.yaml"
        path.write_text(yaml.safe_dump(raw))
        try:
            out = train(small_config(str(path), mesh=mesh, extra=extra + ADAM + model + run), progress=False, write=False)
        except (RulesError, MeshError, ValueError) as e:
            refused[f"{type(e).__name__}: {str(e).split(': ', 1)[-1][:WHY]}"] += 1
            continue
        trained += 1
        pipe = raw["strategies"].get("pipeline")
        kinds[mesh + (f" {pipe['schedule']} x{pipe['virtual']}" if pipe and "stage" in mesh else "")
              + (" bf16" if "model.dtype=bfloat16" in model else "")] += 1
        ref_losses, ref_params = reference(tuple(model))
        where = f"{path.name} on {mesh} with {model + run}:\n{path.read_text()}"
        bf16 = "model.dtype=bfloat16" in model
        np.testing.assert_allclose(out["losses"], ref_losses, rtol=BF16_LOSS_RTOL if bf16 else 1e-5, err_msg=where)
        if bf16:      # bf16 gradient noise through Adam's first steps: parameters within about lr, not compared
            continue
        # an interleaved pipeline's state stores the layer stack in chunk order: compare in model order
        params = reorder(jax.device_get(out["state"]["params"]), out["trainer"].layout.layer_order, None)
        diff = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params, ref_params))
        assert max(diff) < param_atol, f"max param difference {max(diff):.2e}, {where}"
    print(f"{family}: {trained} of {EPISODES} drawn files trained, {EPISODES - trained} refused")
    print("  trained:", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    for why, n in refused.most_common():
        print(f"  {n:4d} x {why}")
    assert trained >= EPISODES // 10, f"only {trained} of {EPISODES} drawn files trained: the draws test little"
