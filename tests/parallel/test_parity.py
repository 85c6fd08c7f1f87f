"""Every shipped rule file reproduces the single-device run: losses and parameters after 3 fp32
steps with a learning rate large enough that the parameters visibly move. The expert-parallel files
train moe_tiny against its own single-device run (tests/models/test_moe.py, with dropped tokens and the
router statistics checked too); a test here fails if a shipped file is covered by neither."""
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlab.train.loop import train
from tests.helpers import EP_MESH, MESH_FOR, one_device, small_config

# fp32 with different reduction orders across shards: Adam's normalised update turns ~1e-7
# gradient differences into at most ~1e-6 parameter differences over 3 steps.
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5
# One xdist worker runs the whole file: the single-device `reference` run is trained once, not once per worker
# (make test: --dist loadgroup).
# Compiling dominates (a tiny model, 3 steps): cheap_codegen.
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.xdist_group("parity"), pytest.mark.cheap_codegen]


@pytest.fixture(scope="module")
def reference():
    out = train(small_config("dp", mesh="data=1"), devices=one_device(), progress=False, write=False)
    return out["losses"], jax.device_get(out["state"]["params"])


# Pipeline rule files (2 stages of the 2-layer model, 2 micro-batches; pp_fsdp_tp on 2 x 2 x 2, the
# articles' TP4 x PP2 x DP8 file at tensor=2 for the model's 2 kv heads).
PIPELINE_MESH = {"pp_dp": "data=4,stage=2", "pp_fsdp": None, "pp_fsdp_tp": "stage=2,fsdp=2,tensor=2",
                 "pp_tp_dp": "data=2,stage=2,tensor=2"}


@pytest.mark.parametrize("rules", sorted({**MESH_FOR, **PIPELINE_MESH}))
def test_rule_file_matches_single_device(rules, reference):
    ref_losses, ref_params = reference
    mesh = PIPELINE_MESH[rules] if rules in PIPELINE_MESH else MESH_FOR[rules]
    extra = ["data.microbatches=2"] if rules in PIPELINE_MESH else []
    out = train(small_config(rules, mesh=mesh, extra=extra), progress=False, write=False)
    assert out["trainer"].mesh.devices.size == 8
    np.testing.assert_allclose(out["losses"], ref_losses, rtol=LOSS_RTOL)
    params = jax.device_get(out["state"]["params"])
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), params, ref_params))
    assert max(moved) < PARAM_ATOL, f"{rules}: max param difference {max(moved):.2e}"


# Rule files that load but lay activations out unlike the shipped ones (found by random rule files): the
# step's plain attention must still see whole sequences and, per device, the kv heads of its query heads.
ODD_LAYOUTS = {
    "q heads whole, kv heads split": ("fsdp_tp", {"act_heads": "null", "act_kv_heads": "tensor"}, "fsdp=4,tensor=2"),
    "q heads over 4, 2 kv heads": ("fsdp_tp", {"kv_heads": "null", "act_kv_heads": "null"}, "fsdp=2,tensor=4"),
    "sequence split in plain attention": ("fsdp", {"act_attn_seq": "tensor"}, "fsdp=4,tensor=2"),
    # the dense loss's label logit was a gather, on which XLA's partitioner aborted the process
    "loss: sequence and vocabulary split over two axes": (
        "dp", {"batch": "[context]", "act_batch": "null", "act_attn_seq": "tensor", "act_vocab": "fsdp"},
        "fsdp=2,context=2,tensor=2"),
    # and on the embedding's gather with the table split over two axes and the sequence over one of them
    "embedding: table split over two axes, sequence split": (
        "dp", {"embed": "fsdp", "vocab": "tensor", "act_seq": "tensor"}, "data=2,fsdp=2,tensor=2"),
    # sequence parallelism under a pipeline: the executor's conds hand on the stream placed alike in both branches
    "pipeline with the sequence split over tensor": ("pp_fsdp_tp", {"act_seq": "tensor"}, "stage=2,fsdp=2,tensor=2"),
    # the batch over data alone, so fsdp stays Auto in the stages: the table's width and the rows' batch on one axis
    "pipeline, embedding width and rows' batch on one Auto axis": ("pp_fsdp_tp", {"batch": "[data]"},
                                                                    "stage=2,fsdp=2,tensor=2"),
    # the batch over tensor alone: the table's vocabulary on fsdp, its width on context, the rows' batch on fsdp
    "embedding vocabulary and rows' batch on one Auto axis, width on another": (
        "dp", {"batch": "[tensor]", "act_batch": "fsdp", "vocab": "fsdp", "embed": "context"}, "fsdp=2,context=2,tensor=2"),
}


@pytest.mark.parametrize("case", sorted(ODD_LAYOUTS))
def test_layouts_unlike_the_shipped_ones_match_single_device(case, reference, tmp_path):
    import re
    base, edits, mesh = ODD_LAYOUTS[case]
    text = (ROOT / "sharding_rules" / f"{base}.yaml").read_text()
    for name, value in edits.items():
        text = re.sub(rf"^( *){name}: .*$", rf"\g<1>{name}: {value}", text, count=1, flags=re.M)
    (tmp_path / "odd.yaml").write_text(text)
    ref_losses, ref_params = reference
    extra = ["data.microbatches=2"] if base in PIPELINE_MESH else []
    out = train(small_config(str(tmp_path / "odd.yaml"), mesh=mesh, extra=extra), progress=False, write=False)
    np.testing.assert_allclose(out["losses"], ref_losses, rtol=LOSS_RTOL)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), jax.device_get(out["state"]["params"]),
                                         ref_params))
    assert max(moved) < PARAM_ATOL, f"{case}: max param difference {max(moved):.2e}"


def test_parameters_visibly_move(reference):
    """The parity above is meaningful only if three steps change the parameters a lot."""
    from meshlab.train.loop import build_trainer
    from meshlab.train.state import init_state
    cfg = small_config("dp", mesh="data=1")
    tr = build_trainer(cfg, one_device())
    init = init_state(tr.md, tr.tx, tr.shardings, cfg.seed, False)   # what the reference run started from
    _, ref_params = reference
    delta = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), jax.device_get(init["params"]),
                                         ref_params))
    assert min(delta) > 100 * PARAM_ATOL


def test_grad_accumulation_with_unequal_valid_tokens_equals_big_batch():
    """k micro-batches with different numbers of padding labels == one batch: the loss is the
    mean over all valid tokens of the global batch."""
    import jax.numpy as jnp
    from meshlab.train.loop import build_trainer, device_batch
    from meshlab.train.state import init_state

    results = {}
    for k in (1, 4):
        cfg = small_config("zero2", extra=[f"data.microbatches={k}"] if k > 1 else [])
        cfg.data.global_batch = 32
        tr = build_trainer(cfg)
        host = tr.batches.batch(0)
        # Rows get 0..31 trailing padding labels: every micro-batch has a different valid count.
        for r in range(host["labels"].shape[0]):
            host["labels"][r, cfg.data.seq_len - r:] = -1
        state = init_state(tr.md, tr.tx, tr.shardings, 0, False)
        state, metrics = tr.step_fn(state, device_batch(tr, host))
        results[k] = (float(metrics["loss"]), float(metrics["grad_norm"]), jax.device_get(state["params"]))
    assert results[1][0] == pytest.approx(results[4][0], rel=1e-5)
    assert results[1][1] == pytest.approx(results[4][1], rel=1e-5)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), results[1][2], results[4][2]))
    assert max(diffs) < PARAM_ATOL


def test_every_shipped_rule_file_has_a_parity_test():
    from pathlib import Path
    shipped = {p.stem for p in (Path(__file__).resolve().parents[2] / "sharding_rules").glob("*.yaml")}
    covered = set(MESH_FOR) | set(PIPELINE_MESH) | set(EP_MESH)
    assert shipped - covered == set(), f"rule files without a parity test: {sorted(shipped - covered)}"
