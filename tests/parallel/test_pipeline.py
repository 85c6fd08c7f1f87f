"""Pipeline schedules and their one executor against the single-device step (tiny, 8 layers, fp32).

Compiles are shared: the schedule table is an input of the compiled program, so GPipe, 1F1B and
the zero-bubble table of one (stages, micro-batches) shape run through one program (padded to a
common shape, `Schedule.padded`). The memory curves' programs (1F1B/ZB and GPipe at M = 2 and 6 on
2 stages) are checked for exact gradients too, and one of them for in-place buffers in its tick loop.
Seven programs in all (the reference, three on 2 stages, one on 4, two interleaved), compiled with
LLVM's cheapest codegen.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from meshlab import rules as R
from meshlab.mesh import make_mesh
from meshlab.parallel.pipeline import (LayoutError, ScheduleError, bubble, build, order_for, reorder, runner, schedules,
                                       theory_bubble)
from meshlab.plan import hlo
from meshlab.plan import pipeline as plan_pp
from meshlab.train import step as S
from meshlab.layout import Layout, leaf_specs
from models import model_def
from tests.helpers import rel_err

RTOL = 1e-5
# One xdist worker runs the whole file: its module fixtures (the single-device reference, the 2-stage
# programs of `curves`) are built once instead of once per worker (make test: --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("pipeline"), pytest.mark.cheap_codegen]
# Compiling dominates these tests: LLVM's cheapest codegen (the HLO, and so the buffers and numerics, unchanged).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
ROWS, SEQ, MB_ROWS = 12, 16, 2          # a micro-batch is MB_ROWS rows: M micro-batches take the first M x 2 rows
CFG = dataclasses.replace(models.preset("tiny"), n_layers=8, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                          mlp_dim=64, dtype="float32")
RULES_YAML = """mesh: {{stage: {p}}}
batch: [data]
rules: {{vocab: null, embed: null, heads: null, kv_heads: null, head_dim: null, mlp: null, act_batch: data,
  act_seq: null, act_heads: null, act_kv_heads: null, act_mlp: null, act_vocab: null, cache_batch: data,
  cache_kv_heads: null, experts: null, layers: stage, act_attn_seq: null, act_embed: null, act_experts: null,
  cache_seq: null, cache_pages: null}}
state: {{params: replicated, grads: replicated, optimizer: replicated}}
strategies: {{attention: plain, pipeline: {{schedule: {schedule}, virtual: {v}}}}}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The single-device reference per row (one compile): the loss sum of each row and its gradient,
    so the reference of any first-n-rows batch is a sum over rows divided by its valid tokens."""
    md = model_def(CFG)
    params = nnx.to_pure_dict(nnx.state(models.build(CFG, nnx.Rngs(0)), nnx.Param))
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 256, (ROWS, SEQ)).astype(np.int32)
    labels = np.roll(tok, -1, 1)
    labels[::2, -3:] = -1                                      # padding: the valid count matters
    batch = {"tokens": tok, "labels": labels, "segment_ids": np.ones_like(tok),
             "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), tok.shape).copy()}

    def row(params, r):
        def loss_sum(params):
            m = md.bind(params)
            return m.loss_sum(m.hidden(r["tokens"][None], r["positions"][None]), r["labels"][None])
        return jax.value_and_grad(loss_sum)(params)
    per_row = jax.device_get(jax.jit(jax.vmap(row, in_axes=(None, 0)), compiler_options=FAST_COMPILE)(params, batch))
    return {"md": md, "params": params, "batch": batch, "per_row": per_row, "dir": tmp_path_factory.mktemp("rules")}


def reference(setup, rows):
    (loss, grads), n = setup["per_row"], float((setup["batch"]["labels"][:rows] >= 0).sum())
    return loss[:rows].sum() / n, jax.tree.map(lambda g: g[:rows].sum(0) / n, grads)


def rules_file(setup, p, schedule="1f1b", v=1):
    path = setup["dir"] / f"pp_{p}_{schedule}_{v}.yaml"
    path.write_text(RULES_YAML.format(p=p, schedule=schedule, v=v))
    return R.load_rules(path)


class Program:
    """One compiled pipelined loss-and-grads for `names` schedules of one shape (their tables padded),
    on the first m x MB_ROWS rows. The parameters go in as the state stores them (chunk order when
    v > 1), the gradients are read back in model order."""

    def __init__(self, setup, p, m, names, v=1):
        md = setup["md"]
        self.rows = m * MB_ROWS
        self.scheds = {n: build(n, p, m, v) for n in names}
        ticks = max(s.ticks for s in self.scheds.values())
        slots = {k: max(s.slots[k] for s in self.scheds.values()) for k in ("res", "fin", "bin", "gch")}
        self.scheds = {n: s.padded(ticks, slots) for n, s in self.scheds.items()}
        self.rules, self.mesh = rules_file(setup, p, names[0], v), make_mesh(f"stage={p}", jax.devices()[:p])
        first = next(iter(self.scheds.values()))
        self.fn = runner.make_loss_and_grads(S.stage_fns(md), md.names, leaf_specs(md, self.rules, self.mesh, "params"),
                                             leaf_specs(md, self.rules, self.mesh, "grads"), self.rules, self.mesh,
                                             S.batch_spec(self.rules, self.mesh), m, first)
        batch = {k: v[:self.rows] for k, v in setup["batch"].items()}
        self.order = order_for(CFG.n_layers, p, v)
        self.args = (reorder(jax.device_get(setup["params"]), None, self.order), batch, jnp.float32(1.0),
                     jnp.asarray(first.table))
        self.compiled = jax.jit(self.fn).lower(*self.args).compile(FAST_COMPILE)

    def run(self, name):
        loss, grads, _ = self.compiled(*self.args[:3], jnp.asarray(self.scheds[name].table))
        loss, grads = jax.device_get((loss, grads))
        return loss, reorder(grads, self.order, None)

    @property
    def temp(self) -> int:
        return self.compiled.memory_analysis().temp_size_in_bytes


def assert_matches(setup, prog, name):
    (loss, grads), (ref_loss, ref_grads) = prog.run(name), reference(setup, prog.rows)
    what = f"{name} p={prog.mesh.shape['stage']} M={prog.scheds[name].microbatches}"
    assert float(loss) == pytest.approx(float(ref_loss), rel=RTOL), what
    errs = jax.tree.leaves(jax.tree.map(rel_err, grads, ref_grads))
    assert max(errs) < RTOL, f"{what}: gradient relative error {max(errs):.2e}"


# -- host: the tables -----------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 3), (4, 4), (4, 16), (8, 32)])
def test_gpipe_and_1f1b_tables_have_the_textbook_bubble_and_memory(p, m):
    for name in ("gpipe", "1f1b"):
        s = build(name, p, m)
        assert bubble(s)["idle"] == pytest.approx(theory_bubble(p, m)), name
    assert build("1f1b", p, m).slots["res"] == min(p, m)      # 1F1B: at most p micro-batches in flight
    assert build("gpipe", p, m).slots["res"] == m             # GPipe: all of them
    assert bubble(build("zb", p, m))["lockstep"] < bubble(build("1f1b", p, m))["lockstep"]
    if m % p == 0:                                             # interleaved: micro-batches in groups of p
        assert bubble(build("interleaved", p, m, 2))["idle"] == pytest.approx(theory_bubble(p, m, 2))


def test_a_broken_table_is_refused():
    s = build("1f1b", 4, 4)
    bad = s.table.copy()
    bad[[3, 4]] = bad[[4, 3]]                                  # stage 3 runs B0 before F0
    with pytest.raises(ScheduleError, match="before its input"):
        schedules.check(dataclasses.replace(s, table=bad))
    with pytest.raises(ScheduleError, match="multiple of 4"):
        build("interleaved", 4, 6, 2)


# -- device: every schedule against one device ----------------------------------------------------
@pytest.fixture(scope="module")
def curves(setup):
    """2 stages, micro-batches of 2 rows, M = 2 and 6: {M: (1F1B/ZB program, GPipe program)}. At M = 2
    GPipe's slots are 1F1B's, so one program runs all three tables."""
    both = Program(setup, 2, 2, ["1f1b", "zb", "gpipe"])
    return {2: (both, both), 6: (Program(setup, 2, 6, ["1f1b", "zb"]), Program(setup, 2, 6, ["gpipe"]))}


def test_two_stages_every_schedule_matches_one_device(setup, curves):
    for m, (flat, gpipe) in curves.items():
        for name in ("1f1b", "zb"):
            assert_matches(setup, flat, name)
        assert_matches(setup, gpipe, "gpipe")


def test_four_stages_every_schedule_matches_one_device(setup):
    """M = 3: fewer micro-batches than stages, not a multiple of them."""
    prog = Program(setup, 4, 3, ["gpipe", "1f1b", "zb"])
    for name in prog.scheds:
        assert_matches(setup, prog, name)
    assert not loop_copies(prog), "4 stages: the tick loop copies whole buffers"
    # The HLO's point-to-point bytes per step (loop body x ticks) are the planner's.
    colls = [c for c in hlo.collectives(prog.compiled.as_text()) if c.kind == "collective-permute"]
    assert colls and all(c.in_loop for c in colls)
    sched = prog.scheds["1f1b"]
    got = sum(c.bytes for c in colls) * sched.ticks
    want = plan_pp.p2p_bytes(CFG, prog.rules, prog.mesh, prog.rows, SEQ, sched)
    assert got == want.nbytes * want.count, (got, want)


@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_matches_one_device(setup, p):
    """The state stores the stack in chunk order, so the step reads it in place: no gather of the
    whole stack (a permutation on entry, its inverse on the gradients) anywhere in the program."""
    prog = Program(setup, p, 4, ["interleaved"], v=2)
    assert prog.order is not None and list(prog.order) != sorted(prog.order)
    assert_matches(setup, prog, "interleaved")
    assert not loop_copies(prog), "chunked layers: the tick loop copies whole buffers"
    stack = {a.shape[1:] for a in jax.tree.leaves(setup["params"]["layers"])}
    whole = [(e.primitive.name, e.invars[0].aval.shape) for e in _eqns(jax.make_jaxpr(prog.fn)(*prog.args).jaxpr)
             if e.primitive.name in ("gather", "transpose", "concatenate") and e.invars[0].aval.ndim >= 2
             and e.invars[0].aval.shape[1:] in stack and e.outvars[0].aval.shape == e.invars[0].aval.shape]
    assert not whole, f"the step permutes the whole layer stack: {whole[:4]}"


def _eqns(jx):
    for eqn in jx.eqns:
        yield eqn
        for sub in _subjaxprs(eqn.params):
            yield from _eqns(sub)


def test_temp_memory_flat_for_1f1b_and_zb_growing_for_gpipe(curves):
    """Micro-batches of one size, 3x as many: 1F1B/ZB keep p = 2 in flight, GPipe all of them."""
    flat = [curves[m][0].temp for m in sorted(curves)]
    grow = [curves[m][1].temp for m in sorted(curves)]
    print(f"\ncompiled temp bytes at M = {sorted(curves)}: 1F1B/ZB {flat}, GPipe {grow}")
    assert max(flat) <= 1.05 * min(flat), flat
    assert grow[1] > 1.5 * grow[0], grow


def test_the_tick_loop_copies_no_buffer_bigger_than_an_activation(curves):
    """The stash, the inboxes and the gradient accumulators stay in place from tick to tick: inside the
    loop (outside fusions) no copy is bigger than one micro-batch's activation. One lax.switch over
    the whole carry failed this: XLA copied every carried buffer every tick."""
    big = loop_copies(curves[2][0])                   # 2 stages, every op's cond (F, head, B, BI, W, embedding)
    assert not big, f"whole-buffer copies per tick: {big[:4]}"


def loop_copies(prog: Program) -> list:
    """Copies inside the compiled loops bigger than one micro-batch's activation [b, s, d]."""
    return plan_pp.loop_copies(prog.compiled.as_text(), MB_ROWS * SEQ * CFG.d_model * 4 + 1)


def test_no_collective_over_stage_inside_a_branch(setup):
    """Every ppermute over `stage` runs outside lax.cond/switch (a branch taken by only some stages would
    wait for the others forever); there are some, and they sit in the tick loop."""
    prog_rules, mesh = rules_file(setup, 2, "zb"), make_mesh("stage=2", jax.devices()[:2])
    md = setup["md"]
    sched = build("zb", 2, 2)
    fn = runner.make_loss_and_grads(S.stage_fns(md), md.names, leaf_specs(md, prog_rules, mesh, "params"),
                                    leaf_specs(md, prog_rules, mesh, "grads"), prog_rules, mesh,
                                    S.batch_spec(prog_rules, mesh), 2, sched)
    jaxpr = jax.make_jaxpr(fn)(setup["params"], setup["batch"], jnp.float32(1.0))
    found = {"outside": 0, "inside": 0}

    def walk(jx, in_branch):
        for eqn in jx.eqns:
            axes = eqn.params.get("axis_name", eqn.params.get("axes", ()))
            axes = axes if isinstance(axes, (tuple, list)) else (axes,)
            if eqn.primitive.name in ("ppermute", "psum", "all_gather", "psum_scatter", "all_to_all") \
                    and "stage" in axes:
                found["inside" if in_branch else "outside"] += 1
            branch = in_branch or eqn.primitive.name == "cond"
            for sub in _subjaxprs(eqn.params):
                walk(sub, branch)
    walk(jaxpr.jaxpr, False)
    assert found["outside"] >= 2 and found["inside"] == 0, found


def _subjaxprs(params):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def test_layers_that_do_not_divide_give_one_clear_error(setup):
    md = model_def(dataclasses.replace(CFG, n_layers=6))
    mesh = make_mesh("stage=4", jax.devices()[:4])
    with pytest.raises(LayoutError, match=r"n_layers divisible by 4.*has 6"):
        S.make_loss_and_grads(md, rules_file(setup, 4), mesh, 4)
    with pytest.raises(LayoutError, match=r"4 stages x 2 virtual stages needs model.n_layers divisible by 8"):
        S.make_loss_and_grads(md, rules_file(setup, 4, "interleaved", 2), mesh, 4)
    # the trainer's layout (built before any step) says it too, not a rule's split error naming one leaf
    with pytest.raises(LayoutError, match=r"4 stages x 1 virtual stages needs model.n_layers divisible by 4"):
        Layout.build(md, rules_file(setup, 4), mesh)


def test_a_schedule_that_reads_another_layer_order_is_refused(setup):
    """The state under an interleaved rule file stores chunk order; a schedule forced over it with
    other virtual stages would read the wrong layers: one error naming both orders."""
    mesh = make_mesh("stage=2", jax.devices()[:2])
    with pytest.raises(R.RulesError, match=r"stores its layers in chunk order \[0, 1, 4, 5.*1f1b pipeline over 2 "
                                           r"stages x 1 virtual stages reads them in model order"):
        S.make_loss_and_grads(setup["md"], rules_file(setup, 2, "interleaved", 2), mesh, 4,
                              pipeline={"schedule": "1f1b", "virtual": 1})


def test_rule_file_errors(setup, tmp_path):
    base = RULES_YAML.format(p=2, schedule="1f1b", v=1)
    for bad, match in ((("schedule: 1f1b", "schedule: 1f2b"), "must be one of gpipe, 1f1b"),
                       (("virtual: 1", "virtual: 2"), "`1f1b` and `zb` take virtual: 1")):
        path = tmp_path / "bad.yaml"
        path.write_text(base.replace(*bad))
        with pytest.raises(R.RulesError, match=match):
            R.load_rules(path)
    path = tmp_path / "none.yaml"
    path.write_text(base.replace("pipeline: {schedule: 1f1b, virtual: 1}", "pipeline: null"))
    with pytest.raises(R.RulesError, match="names no `strategies.pipeline`"):
        S.make_loss_and_grads(setup["md"], R.load_rules(path), make_mesh("stage=2", jax.devices()[:2]), 2)
    path = tmp_path / "per_step.yaml"
    path.write_text(base.replace("attention: plain,", "attention: plain, fsdp_gather: per_step,"))
    with pytest.raises(R.RulesError, match="pipeline with `fsdp_gather: per_step` is not implemented"):
        S.make_loss_and_grads(setup["md"], R.load_rules(path), make_mesh("stage=2", jax.devices()[:2]), 2)


def test_a_weight_and_its_activation_over_different_auto_axes_are_refused(setup, tmp_path):
    """Under a pipeline, `mlp: fsdp` beside `act_mlp: tensor` with the batch over data alone (fsdp and
    tensor Auto in the stages): the resharding between them was a collective-permute spanning both stages, which
    hung in XLA's rendezvous; the same dimension over one axis set trains (the random rule test's draws)."""
    import re
    text = open(R.load_rules("pp_fsdp_tp").path).read()
    for name, value in (("batch", "[data]"), ("mlp", "fsdp"), ("embed", "null")):
        text = re.sub(rf"^( *){name}: .*$", rf"\g<1>{name}: {value}", text, count=1, flags=re.M)
    path = tmp_path / "crossed.yaml"
    path.write_text(text)
    mesh = make_mesh("stage=2,fsdp=2,tensor=2")
    with pytest.raises(R.RulesError, match=r"`mlp: \['fsdp'\]` and `act_mlp: \['tensor'\]` split one dimension over "
                                           r"different axes"):
        S.make_loss_and_grads(setup["md"], R.load_rules(path), mesh, 2)
    path.write_text(text.replace("  act_mlp: tensor", "  act_mlp: fsdp"))
    S.make_loss_and_grads(setup["md"], R.load_rules(path), mesh, 2)          # one axis set: accepted


def test_planner_prices_pipelines_from_the_table(setup):
    from meshlab.plan import search
    from meshlab.plan.hardware import HARDWARE
    cfg = models.preset("llama3_1b")
    md = model_def(cfg)
    plans = {n: search.evaluate(md, rules_file(setup, 4, n), {"stage": 4}, 16, 4096, "full", 8, HARDWARE["h100"])
             for n in ("gpipe", "1f1b", "zb")}
    shipped = search.evaluate(md, R.load_rules("pp_dp"), {"stage": 4}, 16, 4096, "full", 8, HARDWARE["h100"])
    assert all(p.ok for p in plans.values()), {n: p.reason for n, p in plans.items()}
    assert plans["gpipe"].memory["activations"]["in flight"] == 8 and plans["1f1b"].memory["activations"]["in flight"] == 4
    assert plans["gpipe"].mem_bytes > plans["1f1b"].mem_bytes
    assert plans["zb"].compute_s < plans["1f1b"].compute_s          # even ticks: the smaller lockstep bubble
    assert any(c.kind == "collective-permute" and c.axes == ("stage",) for c in plans["1f1b"].comms)
    text = search.explain(shipped, cfg, HARDWARE["h100"])
    assert "stage 3: chunk 3: layers 12-15; final norm + LM head" in text and "imbalance" in text
