"""The planner: FLOP split, alpha-beta arithmetic, search and ranking, rule files it writes, plot,
and the ranking checked against the compiler (a rejected plan exceeds the budget, the chosen fits)."""
from __future__ import annotations

import dataclasses

import pytest

import models
from helpers import MESH_FOR, small_config
from meshlab.plan import comm, compute, memory, search
from meshlab.train import compiled
from meshlab.plan.hardware import HARDWARE, HardwareError, get_hardware
from meshlab.rules import load_rules
from models import model_def

# One xdist worker runs this file with test_zero and test_memory_comm: the two steps the ranking test
# compiles (dp; fsdp/full on data=4,fsdp=2) are test_memory_comm's, cached per process by compiled.measure.
pytestmark = pytest.mark.xdist_group("compiled_steps")


def test_flop_split_matches_the_6n_rule_and_crossover():
    cfg = models.preset("llama3_8b")
    f = compute.step_flops(cfg, 1, 4096, "none")
    assert f["model"] == pytest.approx(cfg.train_flops_per_token(4096) * 4096, rel=1e-9)
    s = compute.crossover_seq(cfg)
    per = compute.layer_flops_per_token(cfg, int(s))
    assert per["attention"] == pytest.approx(per["projections"] + per["mlp"], rel=1e-3)
    assert compute.textbook_crossover(4096) == 3.5 * 4096
    full = compute.step_flops(cfg, 1, 4096, "full")
    head = 3 * 4096 * 2 * cfg.d_model * cfg.padded_vocab   # not under remat: not recomputed
    assert full["total"] - f["model"] == pytest.approx((f["model"] - head) / 3, rel=1e-9)   # one more forward


def test_ring_attention_recomputes_as_a_flash_kernel():
    """Ring attention recomputes as a flash attention does (meshlab/parallel/ring_attention.py): its
    forward runs again under save_dots (on a GPU its blocks are Pallas kernels, no dot to keep) and not
    under save_dots_attn (its output and lse are kept), even where `model.attention` is xla, whose
    batched dots save_dots keeps and save_dots_attn does not."""
    md = model_def(dataclasses.replace(models.preset("llama3_1b"), attention="xla"))
    hw = HARDWARE["h100"]

    def recompute(rules, sizes, remat):
        plan = search.evaluate(md, load_rules(rules), sizes, 8, 8192, remat, 1, hw)
        assert plan.flops is not None, plan.reason
        return plan.flops["remat recompute"]
    attention = 8 * 8192 * md.cfg.n_layers * compute.layer_flops_per_token(md.cfg, 8192)["attention"]
    assert recompute("cp_ring", {"context": 8}, "save_dots_attn") == 0
    assert recompute("cp_ring", {"context": 8}, "save_dots") == attention
    assert recompute("dp", {"data": 8}, "save_dots_attn") == attention
    assert recompute("dp", {"data": 8}, "save_dots") == 0


def test_alpha_beta_ring_and_tree():
    a, bw = 5e-6, 100e9
    n = 1 << 30
    ring = comm.collective_time("all-reduce", n, 8, a, bw, "ring")
    assert ring == pytest.approx(14 * a + 2 * 7 / 8 * n / bw)
    assert comm.collective_time("all-gather", n, 8, a, bw, "ring") == pytest.approx(7 * a + 7 / 8 * n / bw)
    # small messages: the tree's log2(p) start-ups win; large: the ring's bandwidth term wins
    small = 4096
    assert comm.collective_time("all-reduce", small, 64, a, bw) == comm.collective_time("all-reduce", small, 64, a, bw, "tree")
    assert comm.collective_time("all-reduce", n, 64, a, bw) == comm.collective_time("all-reduce", n, 64, a, bw, "ring")
    assert comm.collective_time("collective-permute", n, 2, a, bw) == pytest.approx(a + n / bw)
    assert comm.wire_bytes("all-reduce", n, 4) == 1.5 * n
    assert comm.collective_time("all-reduce", n, 1, a, bw) == 0.0


def test_crosses_hosts_by_mesh_order():
    shape = {"data": 2, "stage": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 2}
    assert not comm.crosses_hosts(shape, "tensor", 8)
    assert not comm.crosses_hosts(shape, "fsdp", 8)
    assert comm.crosses_hosts(shape, "data", 8)


def test_kv_cache_llama3_8b():
    # 32 layers x 8 kv heads x 128 x (K and V) x bf16 = 128 KiB per token
    assert memory.kv_cache_bytes(models.preset("llama3_8b"), 1, 8192) == 8192 * 128 * 1024
    assert memory.kv_cache_bytes(models.preset("llama3_8b"), 1, 8192, tensor=8) == 8192 * 16 * 1024


def test_textbook_sixteen_bytes_by_stage():
    t = [memory.textbook_memory(1000, s, 4)["total"] for s in range(4)]
    assert t[0] == 16000 and t[1] == 4000 + 3000 and t[2] == 2000 + 3500 and t[3] == 4000


def test_search_ranks_rejects_and_writes(tmp_path):
    cfg = models.preset("llama3_1b")
    good, bad = search.search(cfg, 16, 32, 8192, HARDWARE["h100"], hosts=2,
                              rule_names=["dp", "zero2", "fsdp", "fsdp_tp"], policies=("none", "full"), max_microbatches=2)
    assert good and bad
    assert [p.step_s for p in good] == sorted(p.step_s for p in good)
    assert all(p.mem_bytes <= HARDWARE["h100"].memory_bytes * search.USABLE for p in good)
    assert any("needs" in p.reason for p in bad) and all(p.reason for p in bad)
    best = good[0]
    assert best.step_s <= best.step_s_serial and best.mfu > 0
    path = search.write_rule_file(best, tmp_path, 1)
    rules = load_rules(path)   # the written file is a valid rule file with the chosen mesh
    assert {a: s for a, s in rules.mesh.items() if s > 1} == {a: s for a, s in best.mesh.items() if s > 1}
    text = search.explain(best, cfg, HARDWARE["h100"])
    assert "alpha-beta" in text and "MFU" in text and "textbook 16 B/param" in text and "KV cache" in text
    for p in good:     # the figure's stacked bars are the table's totals
        assert sum(search.memory_parts(p).values()) == pytest.approx(p.mem_bytes)
    png = search.plot(good, tmp_path / "plan.png", "test")
    assert png.stat().st_size > 1000


def test_hardware_errors(tmp_path):
    with pytest.raises(HardwareError, match="unknown hardware"):
        get_hardware("tpu9")
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    with pytest.raises(HardwareError, match="bench_collectives"):
        get_hardware(str(bad))


def test_plan_script(tmp_path, capsys):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("plan_script", Path(__file__).parents[2] / "scripts" / "plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", "llama3_1b", "--devices", "8", "--batch", "16", "--seq", "2048", "--rules", "fsdp,tp",
                     "--explain", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rejected" in out and "communication (alpha-beta" in out
    assert list(tmp_path.glob("plan_1_*.yaml")) and (tmp_path / "plan.png").exists()
    assert mod.main(["--model", "nope", "--devices", "8"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert mod.main(["--model", "tiny", "--devices", "8", "--seq", "0"]) == 2
    assert "sequence length 0 must be >= 1" in capsys.readouterr().err
    assert mod.main(["--model", "tiny", "--devices", "8", "--explain", "-1"]) == 2   # would explain the last plan but one
    assert capsys.readouterr().err == "plan.py: --explain -1: N is a plan's rank in the list, 1 or more\n"


def _compiled_total(m) -> int:
    return m.argument + m.temp + m.output - m.alias


def test_ranking_agrees_with_the_compiler():
    """A budget between two plans: the one the planner rejects exceeds it by the compiler's memory
    analysis, the one it chooses stays under it (tiny, 8 CPU devices)."""
    cfg = small_config("dp")
    md = model_def(cfg.model)
    n = cfg.data.global_batch
    seq = cfg.data.seq_len
    hw = dataclasses.replace(HARDWARE["h200"])
    big = search.evaluate(md, load_rules("dp"), {"data": 8}, n, seq, "none", 1, hw)
    small = search.evaluate(md, load_rules("fsdp"), {"fsdp": 8}, n, seq, "full", 1, hw)
    assert big.mem_bytes > 1.5 * small.mem_bytes
    budget = (big.mem_bytes * small.mem_bytes) ** 0.5
    hw = hw.with_memory(budget / search.USABLE)
    good, bad = search.search(cfg.model, 8, n, seq, hw, rule_names=["dp", "fsdp"], policies=("none", "full"),
                              max_microbatches=1)
    chosen = good[0]
    rejected = next(p for p in bad if p.rules == "dp" and p.remat == "none" and p.mesh.get("data") == 8)
    assert "needs" in rejected.reason
    m_bad = compiled.measure(small_config("dp", MESH_FOR["dp"]), grads=False)
    mesh = chosen.mesh_string
    m_good = compiled.measure(small_config(chosen.rules, mesh, extra=[f"model.remat={chosen.remat}"]), grads=False)
    print(f"\nbudget {budget:.0f} B: rejected dp/none compiles to {_compiled_total(m_bad)} B; chosen "
          f"{chosen.rules}/{chosen.remat} on {mesh} to {_compiled_total(m_good)} B (planner {chosen.mem_bytes:.0f})")
    assert _compiled_total(m_bad) > budget
    assert _compiled_total(m_good) <= budget


def test_residuals_read_the_same_through_the_public_printer():
    """The activation estimate reads autodiff's saved residuals; where the private function is gone
    (a later jax), the public print_saved_residuals is parsed instead: both must agree."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def f(x, w):
        return jnp.sum(jnp.sin(x @ w) * 2)
    args = (jax.ShapeDtypeStruct((3, 5), jnp.float32), jax.ShapeDtypeStruct((5, 7), jnp.bfloat16))
    a = [(tuple(v.shape), np.dtype(v.dtype).itemsize, d) for v, d in memory._saved_residuals(f, *args)]
    b = [(tuple(v.shape), v.dtype.itemsize, d) for v, d in memory._from_printed(f, *args)]
    assert a == b and ((3, 7), 4) in [x[:2] for x in a]


def test_pipeline_plans_of_a_moe_are_rejected_with_the_trainers_reason():
    """Training refuses a mixture of experts on stage > 1 (its router losses do not cross stages); the
    planner ranked such plans first for moe_tiny, and explain drew their stage table."""
    good, bad = search.search(models.preset("moe_tiny"), 8, 16, 128, HARDWARE["h100"], rule_names=["pp_dp", "ep"],
                              policies=("none",), max_microbatches=1)
    assert good and all(p.rules == "ep" for p in good)
    assert {p.reason for p in bad if p.rules == "pp_dp" and p.mesh["stage"] == 2} == {
        "model 'moe_tiny' does not run as a pipeline (its router losses do not cross stages); use a mesh with "
        "stage=1, for a mixture of experts ep, fsdp_ep or fsdp_tp_ep"}
    from meshlab.plan.explain import describe
    with pytest.raises(ValueError, match="does not run as a pipeline"):
        describe(model_def(models.preset("moe_tiny")), load_rules("pp_dp"), search.PlanMesh({"data": 4, "stage": 2}))


def test_long_rejections_drop_trailing_advice_not_half_a_word():
    reason = ("rule `layers` splits dimension 0 of params['layers']['attn']['wk'] " + "x" * 60 + " into 8 shards; "
              "change the mesh (--mesh with stage dividing 2) or the rule")
    assert search._short(reason) == reason.split("; ")[0]
    assert search._short("word " * 50).endswith("word ...") and len(search._short("word " * 50)) <= 164


def test_plan_script_header_counts_parameters_at_their_scale():
    """plan.py's first line: a small model's count is not 0.00B, and a mixture of experts names the
    weights one token uses beside all of them."""
    from tests.helpers import script_module
    plan = script_module("plan")
    assert plan._param_line(models.preset("tiny")).endswith("M matmul params")
    assert plan._param_line(models.preset("llama3_1b")) == "1.24B matmul params"
    assert plan._param_line(models.preset("moe_1b_8e")) == "1.24B matmul params active per token (3.65B in all)"
