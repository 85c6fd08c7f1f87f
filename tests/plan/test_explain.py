"""scripts/explain.py: per-parameter specs and bytes per device from abstract shapes, totals, errors."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import pytest

import models
from meshlab.plan import account, explain, memory
from meshlab.plan.search import PlanMesh
from meshlab.rules import load_rules
from models import model_def

SCRIPT = Path(__file__).parents[2] / "scripts" / "explain.py"


def _script():
    spec = importlib.util.spec_from_file_location("explain_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rules,mesh,shards", [("dp", {"data": 8}, (1, 1, 1)), ("zero1", {"data": 8}, (1, 1, 8)),
                                               ("zero2", {"data": 8}, (1, 8, 8)), ("fsdp", {"fsdp": 8}, (8, 8, 8))])
def test_state_totals_follow_zero_stage(rules, mesh, shards):
    md = model_def(models.preset("tiny"))
    full = 4 * md.param_count()
    st = memory.state_memory(md, load_rules(rules), PlanMesh(mesh))
    assert (st["params"], st["grads"], st["optimizer"]) == (full // shards[0], full // shards[1], 2 * full // shards[2])


def test_rows_add_up_and_name_every_leaf():
    md = model_def(models.preset("llama3_8b"))      # abstract: nothing allocated
    rules, mesh = load_rules("fsdp_tp"), PlanMesh({"fsdp": 8, "tensor": 8})
    rows = account.param_table(md, rules, mesh)
    assert len(rows) == len(jax.tree.leaves(md.abstract))
    assert sum(r.bytes_per_device for r in rows) == memory.state_memory(md, rules, mesh)["params"]
    # everything / 64 except the norm scales, split over fsdp only
    norms = sum(4 * r.shape[-1] * (r.shape[0] if len(r.shape) > 1 else 1) for r in rows if "norm" in r.path)
    assert sum(r.bytes_per_device for r in rows) == (4 * md.param_count() - norms) // 64 + norms // 8
    text = explain.describe(md, rules, mesh)
    assert "['layers']['mlp']['w_gate']" in text and "(None, 'fsdp', 'tensor')" in text
    assert "residual stream" in text and "P('fsdp', None, 'tensor')" in text


def test_script_output_and_errors(capsys):
    mod = _script()
    assert mod.main(["--rules", "fsdp_tp", "--model", "tiny", "--mesh", "data=1,fsdp=-1,tensor=2"]) == 0
    out = capsys.readouterr().out
    assert "mesh {'fsdp': 4, 'tensor': 2}" in out and "optimizer (Adam mu+nu fp32)" in out
    assert mod.main(["--rules", "fsdpp", "--model", "tiny"]) == 2
    assert "did you mean 'fsdp'" in capsys.readouterr().err
    assert mod.main(["--rules", "tp", "--model", "tiny", "--mesh", "tensor=8"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert mod.main(["--rules", "dp", "--model", "tiny", "--mesh", "data=3"]) == 2
    assert "devices" in capsys.readouterr().err
    assert mod.main(["--rules", "dp", "--model", "tiny", "--seq", "-5"]) == 2
    assert "sequence length -5 must be >= 1" in capsys.readouterr().err
    assert mod.main(["--rules", "dp", "--model", "tiny", "--seq", "0"]) == 2
    assert capsys.readouterr().err == "explain.py: sequence length 0 must be >= 1 (--seq)\n"
    assert mod.main(["--rules", "fsdp_tp", "--model", "tiny", "--devices", "0"]) == 2   # was a mesh with fsdp=0
    assert capsys.readouterr().err == "explain.py: --devices 0 must be >= 1 (the device count a -1 axis fills)\n"
    assert mod.main(["--rules", "ep", "--model", "moe_tiny", "--batch", "-1"]) == 2
    assert capsys.readouterr().err.startswith("explain.py: global batch -1 must be >= 1 (--batch; 0 or left out")
