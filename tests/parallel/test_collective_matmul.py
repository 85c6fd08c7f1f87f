"""Collective matmul (sharding_rules/fsdp_tp_sp_cm.yaml, meshlab/parallel/collective_matmul.py) against
plain sequence parallelism (fsdp_tp_sp) and one device, on fsdp=2 x tensor=4 (4 kv heads, so that the
ring has 4 stops: a chunk written at the wrong offset or a partial sum sent the wrong way shows, which
tensor=2 could hide). One compiled loss-and-gradients program per rule file, run once and read twice:
its values (parity) and its optimized HLO (which collectives). The 3-step training parity of the
shipped file at its default tensor=2 is tests/parallel/test_parity.py's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import one_device, small_config
from meshlab.plan import comm, hlo
from meshlab.rules import RulesError, load_rules

# One xdist worker runs the whole file: the three compiled programs of `runs` are built once, not once
# per worker (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("collective_matmul")
MESH = "fsdp=2,tensor=4"
EXTRA = ["model.n_kv_heads=4"]
T, L = 4, 2                      # tensor shards, layers (tests/helpers.SMALL)
CHUNK = 8 * 8 * 32 * 4           # one [b, s/t, d] chunk in fp32: 8 local rows, 32/4 positions, d=32


def _loss_and_grads(rules, mesh, devices=None):
    from meshlab.train.loop import build_trainer, device_batch
    from meshlab.train.state import init_state
    from meshlab.train.step import make_loss_and_grads
    cfg = small_config(rules, mesh=mesh, extra=EXTRA)
    tr = build_trainer(cfg, devices=devices)
    state = init_state(tr.md, tr.tx, tr.shardings, 0, False)
    batch = device_batch(tr, tr.batches.batch(0))
    fn = make_loss_and_grads(tr.md, tr.rules, tr.mesh, 1, layout=tr.layout)
    # LLVM's cheapest code generation: a tiny program run once (as compiled.measure; ~25% off the compile)
    compiled = tr.layout.jit(fn).lower(state["params"], batch, jnp.float32(1.0)).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    loss, grads, *_ = compiled(state["params"], batch, jnp.float32(1.0))
    comms = comm.step_collectives(tr.md, tr.rules, tr.mesh, cfg.data.global_batch, cfg.data.seq_len, 1, cfg.model.remat)
    return {"loss": float(loss), "grads": jax.device_get(grads), "hlo": hlo.collectives(compiled.as_text()),
            "plan": comms, "tr": tr}


@pytest.fixture(scope="module")
def runs():
    return {"one": _loss_and_grads("dp", "data=1", one_device()), "cm": _loss_and_grads("fsdp_tp_sp_cm", MESH),
            "plain": _loss_and_grads("fsdp_tp_sp", MESH)}


@pytest.mark.parametrize("other", ["one", "plain"])
def test_loss_and_gradients_match(runs, other):
    """float32: the same loss and gradients as one device and as the plain gathers and scatters."""
    cm, ref = runs["cm"], runs[other]
    assert cm["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    errs = jax.tree.map(lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b)), cm["grads"], ref["grads"])
    worst = max(jax.tree.leaves(errs))
    assert worst < 1e-5, errs


def _in_loop(colls, kind, nbytes=None):
    return [c for c in colls if c.kind == kind and c.in_loop and (nbytes is None or c.bytes == nbytes)]


def test_permutes_replace_the_sequence_gathers_and_scatters(runs):
    """Per layer (the loop body): plain sequence parallelism gathers the whole [b, s, d] stream 6 times
    and reduces it 7 times (on CPU a reduce-scatter is an all-reduce + slice: 2 forward, 5 backward);
    collective matmul has none of those and 8 x (t-1) collective-permutes of one chunk instead
    (2 gathers + 2 scatters forward, their 4 transposes backward)."""
    whole = CHUNK * T
    plain, cm = runs["plain"]["hlo"], runs["cm"]["hlo"]
    assert len(_in_loop(plain, "all-gather", whole)) == 6
    assert sum(c.bytes for c in _in_loop(plain, "all-reduce") if c.bytes >= whole) == 7 * whole
    assert not [c for c in plain if c.kind == "collective-permute"]
    assert not _in_loop(cm, "all-gather", whole)
    assert not [c for c in _in_loop(cm, "all-reduce") if c.bytes >= whole]
    permutes = [c for c in cm if c.kind == "collective-permute"]
    assert len(permutes) == 8 * (T - 1) and all(c.in_loop and c.bytes == CHUNK for c in permutes)
    # Everything else (fsdp weight gathers and gradient scatters, embedding and head) is unchanged.
    rest = lambda colls: sorted((c.kind, c.bytes, c.in_loop) for c in colls  # noqa: E731
                                if c.kind != "collective-permute" and c.bytes < whole)
    assert rest(cm) == rest(plain)


def test_planner_counts_the_permutes(runs):
    """The planner's account equals the HLO's collective-permute bytes, marks them overlappable (per
    layer: priced against one layer's compute), and on the wire moves the plain account's sequence
    bytes less its 2 backward re-gathers and 3 of its 5 backward scatters per layer."""
    cm, plain = runs["cm"], runs["plain"]
    permutes = [x for x in cm["plan"] if x.kind == "collective-permute"]
    assert sum(x.total for x in permutes) == sum(c.bytes * L for c in cm["hlo"] if c.kind == "collective-permute")
    assert permutes and all(x.overlappable and x.count % L == 0 for x in permutes)
    over = comm.layer_overlap([(x, 1.0) for x in permutes], compute_s=1e9, n_layers=L, microbatches=1)
    assert over["exposed"] == 0.0
    wire = lambda comms: sum(comm.wire_bytes(x.kind, x.nbytes * (x.group if x.kind == "reduce-scatter" else 1),  # noqa: E731
                                             x.group) * x.count for x in comms if x.axes == ("tensor",))
    whole = CHUNK * T
    regather_and_scatters = L * (2 * comm.wire_bytes("all-gather", whole, T) + 3 * comm.wire_bytes("reduce-scatter", whole, T))
    assert wire(cm["plan"]) == pytest.approx(wire(plain["plan"]) - regather_and_scatters, rel=1e-9)
    # and per kind, the planner's CPU view is what the compiled program moves (within 10%)
    got = {k: sum(c.bytes * (L if c.in_loop else 1) for c in cm["hlo"] if c.kind == k) for k in comm.KINDS}
    want = comm.cpu_view(cm["plan"])
    for kind in comm.KINDS:
        assert got[kind] == pytest.approx(want[kind], rel=0.10, abs=256), (kind, got, want)


def test_bad_rule_files_are_refused(tmp_path):
    text = open(load_rules("fsdp_tp_sp_cm").path).read()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("collective_matmul: true", "collective_matmul: sometimes"))
    with pytest.raises(RulesError, match="collective_matmul: sometimes` must be true or false"):
        load_rules(bad)
    no_sp = tmp_path / "no_sp.yaml"
    no_sp.write_text(text.replace("act_seq: tensor", "act_seq: null"))
    with pytest.raises(RulesError, match="needs `act_seq: tensor`.*act_seq: \\[\\]"):
        load_rules(no_sp)
    # tensor=1: nothing to decompose; refused when the step is traced on such a mesh
    from meshlab.train.step import make_loss_and_grads
    from meshlab.train.loop import build_trainer
    from meshlab.train.state import abstract_state
    from meshlab.train.compiled import abstract_batch
    tr = build_trainer(small_config("fsdp_tp_sp_cm", mesh="fsdp=8,tensor=1", extra=EXTRA))
    st = abstract_state(tr.md, tr.tx, tr.shardings, False)
    fn = make_loss_and_grads(tr.md, tr.rules, tr.mesh, 1, layout=tr.layout)
    with pytest.raises(RulesError, match="tensor=1: there is no tensor collective to decompose"):
        tr.layout.jit(fn).trace(st["params"], abstract_batch(tr), jnp.float32(1.0))
    # a pipeline: the stage branches' permutes over tensor would meet other stages' in XLA's rendezvous
    # (wrong losses on CPU); refused where the file names one, and where a pipeline is forced over it
    piped = text.replace("layers: null", "layers: stage")
    both = tmp_path / "pipelined.yaml"
    both.write_text(piped.replace("pipeline: null", "pipeline: {schedule: 1f1b, virtual: 1}"))
    with pytest.raises(RulesError, match="collective_matmul: true` with `strategies.pipeline: .* is not supported"):
        load_rules(both)
    staged = tmp_path / "staged.yaml"
    staged.write_text(piped)
    from meshlab.layout import Layout
    from meshlab.mesh import make_mesh
    md, rules = tr.md, load_rules(staged)
    lay = Layout.build(md, rules, make_mesh("stage=2,fsdp=2,tensor=2"))
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), md.abstract,
                          lay.shardings("params"))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=lay.batch_sharding) for k, v in abstract_batch(tr).items()}
    fn = make_loss_and_grads(md, rules, lay.mesh, 2, pipeline={"schedule": "1f1b", "virtual": 1}, layout=lay)
    with pytest.raises(RulesError, match="collective_matmul: true` under a pipeline over stage=2"):
        lay.jit(fn).trace(params, batch, jnp.float32(1.0))
