"""Mixture of experts on 8 simulated CPU devices: the layer against a dense reference that runs every
token through its top-k experts (forward and gradients, both dispatch modes, local and expert/tensor
parallel), capacity drops exactly where the rule says, 3 training steps under each EP rule file
equal one device, the compiled all-to-alls equal the planner's, bad configs give one clear error,
and the model decodes through the serving engine."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import models
from meshlab.mesh import make_mesh
from meshlab.parallel import experts
from meshlab.rules import RulesError, load_rules, use_rules
from models import moe
from pallas_kernels import grouped_matmul as gm
from tests.helpers import EP_MESH, one_device, small_config

CFG = dataclasses.replace(models.preset("moe_tiny"), d_model=32, dtype="float32", expert_mlp_dim=16,
                          shared_mlp_dim=0)
B, S = 8, 8                                # 8 rows: one per device under ep on 8 devices
MESHES = {"local": None, "ep": "expert=8", "fsdp_tp_ep": "fsdp=2,tensor=2,expert=2"}
# One xdist worker runs the whole file: the dense `reference` and the `single_device` run are compiled once, not once per worker
# (make test: --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("moe"), pytest.mark.cheap_codegen]


@pytest.fixture(scope="module")
def inputs():
    ks = jax.random.split(jax.random.key(1), 6)
    E, d, f = CFG.n_experts, CFG.d_model, CFG.expert_mlp_dim
    x = jax.random.normal(ks[0], (B, S, d))
    router = jax.random.normal(ks[1], (d, E))            # large logits: decisive, well-separated top-k
    w = [jax.random.normal(ks[2], (E, d, f)) / d ** 0.5, jax.random.normal(ks[3], (E, d, f)) / d ** 0.5,
         jax.random.normal(ks[4], (E, f, d)) / f ** 0.5]
    ct = jax.random.normal(ks[5], (B, S, d))
    return (x, router, *w), ct


def dense_reference(x, router, wg, wu, wd, keep_fn=None):
    """Every expert on every token, then each token's top-k outputs weighted (and masked by keep)."""
    _, _, top_w, top_i = moe.route(CFG, x, router)
    h = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x, wg)) * jnp.einsum("bsd,edf->bsef", x, wu)   # [b, s, E, f]
    y_all = jnp.einsum("bsef,efd->bsed", h, wd)                                               # [b, s, E, d]
    picked = jnp.take_along_axis(y_all, top_i[..., None], axis=2)                             # [b, s, k, d]
    if keep_fn is not None:
        top_w = top_w * keep_fn(top_i)
    return jnp.sum(picked * top_w[..., None], axis=2)


def layer(x, router, wg, wu, wd, dispatch="dropless", factor=None, chunks=1):
    _, _, top_w, top_i = moe.route(CFG, x, router)
    pos = experts.queue_positions(top_i, CFG.n_experts)
    cap = experts.row_capacity(S, CFG.top_k, CFG.n_experts, factor or CFG.n_experts / CFG.top_k)
    keep = pos < cap if dispatch == "capacity" else jnp.ones_like(pos, bool)
    return experts.moe_ffn(x, (top_i, top_w, keep, pos), (wg, wu, wd), dispatch=dispatch, capacity=cap,
                           backend="xla", chunks=chunks)


def _in_mesh(name, fn):
    if MESHES[name] is None:
        return fn()
    rules = load_rules(name)
    mesh = make_mesh(MESHES[name])
    with use_rules(rules, mesh):
        return fn()


def _loss_grads(f, args, ct):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * ct), argnums=tuple(range(5))))(*args)


@pytest.fixture(scope="module")
def reference(inputs):
    args, ct = inputs
    return jax.jit(dense_reference)(*args), _loss_grads(dense_reference, args, ct)


@pytest.mark.parametrize("dispatch", experts.DISPATCH)
@pytest.mark.parametrize("where", sorted(MESHES))
def test_layer_equals_dense_reference(inputs, reference, dispatch, where):
    """Forward and the gradients of input, router and the three expert weights."""
    args, ct = inputs
    want_y, (want_l, want_g) = reference
    y, (l, g) = _in_mesh(where, lambda: (jax.jit(lambda *a: layer(*a, dispatch=dispatch))(*args),
                                         _loss_grads(lambda *a: layer(*a, dispatch=dispatch), args, ct)))
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    scale = float(jnp.sum(jnp.abs(want_y * ct)))            # the loss is a sum of terms of both signs
    assert abs(float(l) - float(want_l)) <= 1e-6 * scale
    for name, a, b in zip(("x", "router", "w_gate", "w_up", "w_down"), g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def _all_to_alls(compiled):
    from meshlab.plan import hlo
    return [c for c in hlo.collectives(compiled.as_text()) if c.kind == "all-to-all"]


@pytest.mark.parametrize("dispatch", experts.DISPATCH)
@pytest.mark.parametrize("where,chunks", [("ep", 2), ("local", 3)])
def test_chunked_dispatch_equals_unchunked(inputs, dispatch, where, chunks):
    """Cutting the dispatch into pieces changes no number (forward, loss, the five gradients; capacity
    mode with drops), and under ep the compiled forward+backward holds `chunks` times the dispatch and
    return all-to-alls, each 1/chunks of the bytes (the [E] counts exchange stays one). local: 3 pieces
    of uneven size (no exchange; capacity's last piece padded)."""
    args, ct = inputs
    factor = 1.0 if dispatch == "capacity" else None               # capacity binds: tokens are dropped
    fn = {n: jax.value_and_grad(lambda *a, n=n: jnp.sum(layer(*a, dispatch=dispatch, factor=factor, chunks=n) * ct),
                                argnums=tuple(range(5))) for n in (1, chunks)}
    compiled = {n: _in_mesh(where, lambda n=n: jax.jit(fn[n]).lower(*args).compile()) for n in fn}
    (l1, g1), (ln, gn) = (compiled[n](*args) for n in (1, chunks))
    assert float(ln) == pytest.approx(float(l1), rel=1e-5)
    for name, a, b in zip(("x", "router", "w_gate", "w_up", "w_down"), gn, g1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))), err_msg=name)
    if where == "local":
        return
    one, cut = (_all_to_alls(compiled[n]) for n in (1, chunks))
    counts_bytes = CFG.n_experts * 4                                # dropless: the [E] int32 counts
    big1 = [c.bytes for c in one if c.bytes != counts_bytes]
    bign = [c.bytes for c in cut if c.bytes != counts_bytes]
    assert len(big1) == 4 and len(set(big1)) == 1                   # out + back, forward and backward
    assert len(bign) == 4 * chunks and set(bign) == {big1[0] // chunks}
    assert len(cut) - len(bign) == len(one) - len(big1) == (dispatch == "dropless")


def _queue_by_hand(top_i, cap):
    """keep[b, s, k] by the capacity rule, written as a loop: first choices of the row in order, then
    second choices; an assignment is kept while its expert has had fewer than `cap` in this row."""
    top_i = np.asarray(top_i)
    keep = np.zeros(top_i.shape, bool)
    for r in range(top_i.shape[0]):
        taken = np.zeros(CFG.n_experts, int)
        for slot in range(top_i.shape[2]):
            for t in range(top_i.shape[1]):
                e = top_i[r, t, slot]
                keep[r, t, slot] = taken[e] < cap
                taken[e] += 1
    return keep


@pytest.mark.parametrize("where", ["local", "ep"])
def test_capacity_overflow_drops_exactly_the_rule(inputs, where):
    args, _ = inputs
    factor = 1.0
    cap = experts.row_capacity(S, CFG.top_k, CFG.n_experts, factor)            # 2 per expert per row
    logits, probs, _, top_i = moe.route(CFG, args[0], args[1])
    want_keep = _queue_by_hand(top_i, cap)
    assert 0 < (~want_keep).sum() < want_keep.size / 2                          # some, not most, dropped
    pos = experts.queue_positions(top_i, CFG.n_experts)
    np.testing.assert_array_equal(np.asarray(pos < cap), want_keep)
    stats = moe.router_stats(CFG, logits, probs, top_i, pos < cap)
    assert int(stats["dropped"]) == int((~want_keep).sum())                      # the count the step reports
    want = dense_reference(*args, keep_fn=lambda _: jnp.asarray(want_keep, jnp.float32))
    y = _in_mesh(where, lambda: jax.jit(lambda *a: layer(*a, dispatch="capacity", factor=factor))(*args))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


# -- training under each EP rule file ------------------------------------------------------------
MOE_RUN = ["model.name=moe_tiny", "model.aux_loss_weight=0.1", "model.z_loss_weight=0.01"]
# Parameters after 3 Adam steps at lr 1e-2: the step-1 gradients agree to ~1e-6 of their largest
# entry (measured under fsdp_tp_ep), but Adam's normalised update moves entries whose gradient is
# near zero by ~lr whatever its size, so fp32 reduction-order noise there reaches ~4e-5 (tensor-
# parallel shared expert); 1e-4 is 1% of one step's update. Losses, gradient norms and router
# statistics are held to 1e-5 relative.
PARAM_ATOL = 1e-4


def _capacity_file(tmp_path_factory, name, factor=1.0, chunks=1):
    """The shipped rule file with capacity dispatch at a factor low enough to drop tokens."""
    raw = yaml.safe_load(open(load_rules(name).path).read())
    raw["strategies"]["experts"] = {"dispatch": "capacity", "capacity_factor": factor, "chunks": chunks}
    path = tmp_path_factory.mktemp("rules") / f"{name}_capacity{chunks}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    from meshlab.train.loop import train
    cfg = small_config(_capacity_file(tmp_path_factory, "ep"), mesh="data=1", extra=MOE_RUN)
    out = train(cfg, devices=one_device(), progress=False, write=False)
    return out["losses"], jax.device_get(out["state"]["params"]), out["rows"]


def _compiled_run(cfg):
    """3 steps through the step compiled once (what train() runs), keeping its HLO: (rows, params, text)."""
    from meshlab.train.compiled import abstract_batch
    from meshlab.train.loop import build_trainer, device_batch
    from meshlab.train.state import abstract_state, init_state
    tr = build_trainer(cfg)
    step = tr.step_fn.lower(abstract_state(tr.md, tr.tx, tr.shardings, False), abstract_batch(tr)).compile()
    state = init_state(tr.md, tr.tx, tr.shardings, cfg.seed, False)
    rows = []
    for i in range(cfg.steps):
        state, m = step(state, device_batch(tr, tr.batches.batch(i, tr.rows)))
        rows.append({"step": i + 1, **{k: float(v) for k, v in jax.device_get(m).items()}})
    return rows, jax.device_get(state["params"]), step.as_text(), tr


def _check_parity(name, rows, params, single_device):
    ref_losses, ref_params, ref_rows = single_device
    assert all(r["moe_dropped_frac"] > 0 for r in ref_rows)                    # the capacity really binds
    np.testing.assert_allclose([r["loss"] for r in rows], ref_losses, rtol=1e-5)
    for row, ref in zip(rows, ref_rows):
        for key in ("grad_norm", "moe_dropped_frac", "moe_balance_loss", "moe_z_loss", "moe_tokens_cv"):
            assert row[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (row["step"], key)
    diff = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params, ref_params))
    assert max(diff) < PARAM_ATOL, f"{name}: max param difference {max(diff):.2e}"


@pytest.mark.parametrize("name", ["fsdp_ep", "fsdp_tp_ep"])
def test_ep_rule_file_matches_single_device(name, single_device, tmp_path_factory):
    from meshlab.train.loop import train
    cfg = small_config(_capacity_file(tmp_path_factory, name), mesh=EP_MESH[name], extra=MOE_RUN)
    out = train(cfg, progress=False, write=False)
    assert out["trainer"].mesh.devices.size == 8
    _check_parity(name, out["rows"], jax.device_get(out["state"]["params"]), single_device)


@pytest.mark.parametrize("case, edits", [
    # embed off fsdp: one use of it per weight
    ("mlp on fsdp, a batch axis", dict(mlp="fsdp", embed=None)),
    # tensor Auto in the step, the tokens split over it by act_batch in the experts' shard_map
    ("mlp on tensor, the rows too", dict(act_batch=["data", "fsdp", "expert", "tensor"], act_heads=None,
                                         act_kv_heads=None, act_mlp=None, act_vocab=None))])
def test_expert_width_on_an_axis_that_splits_the_rows_matches_single_device(case, edits, single_device,
                                                                             tmp_path_factory):
    """`mlp` on an axis the rows are split over (a manual batch axis, or an Auto one act_batch names): its
    ranks hold different rows and the whole width (gathered), so the down projection is not summed over it
    (it was: 5e-4 and 1e-4 off in the loss)."""
    from meshlab.train.loop import train
    path = _capacity_file(tmp_path_factory, "fsdp_tp_ep")
    raw = yaml.safe_load(open(path).read())
    raw["rules"].update(edits)
    open(path, "w").write(yaml.safe_dump(raw))
    out = train(small_config(path, mesh=EP_MESH["fsdp_tp_ep"], extra=MOE_RUN), progress=False, write=False)
    _check_parity(case, out["rows"], jax.device_get(out["state"]["params"]), single_device)


def test_ep_matches_single_device_and_its_all_to_alls_equal_the_planner(single_device, tmp_path_factory):
    """ep.yaml with capacity dispatch cut into 2 pieces (`chunks: 2`): parity with the unchunked single
    device as above, and in the same compiled step the all-to-alls the header promises (per MoE layer
    2 x 2 pieces of [E, rows*C/2, d] forward, the same backward) with the planner's bytes (HLO loop body
    x layers), whose total equals the unchunked plan's."""
    from meshlab.plan import comm, hlo
    cfg = small_config(_capacity_file(tmp_path_factory, "ep", chunks=2), mesh=EP_MESH["ep"], extra=MOE_RUN)
    rows, params, text, tr = _compiled_run(cfg)
    assert tr.mesh.devices.size == 8
    _check_parity("ep", rows, params, single_device)
    colls = [c for c in hlo.collectives(text) if c.kind == "all-to-all"]
    got = sum(c.bytes * (cfg.model.n_layers if c.in_loop else 1) for c in colls)
    plan = lambda rules: comm.step_collectives(tr.md, rules, tr.mesh, cfg.data.global_batch, cfg.data.seq_len)  # noqa: E731
    chunked, whole = plan(tr.rules), plan(load_rules(_capacity_file(tmp_path_factory, "ep", chunks=1)))
    assert len(colls) == 8 and all(c.in_loop for c in colls)
    assert {c.bytes for c in colls} == {x.nbytes for x in chunked if x.kind == "all-to-all"}
    assert got == comm.cpu_view(chunked)["all-to-all"] == comm.cpu_view(whole)["all-to-all"] > 0


# -- errors ----------------------------------------------------------------------------------------
def test_top_k_larger_than_experts_is_one_clear_error():
    from meshlab.train.config import ConfigError
    with pytest.raises(ConfigError, match=r"top_k=9 must be between 1 and model.n_experts=8"):
        small_config("ep", extra=MOE_RUN + ["model.top_k=9"])


def test_experts_not_divisible_by_expert_axis_is_one_clear_error():
    from meshlab.train.loop import build_trainer
    cfg = small_config("ep", mesh="expert=8", extra=MOE_RUN + ["model.n_experts=4", "model.top_k=2"])
    with pytest.raises(RulesError, match=r"rule `experts: \['expert'\]` splits dimension 1 .* into 8 shards, "
                                         r"which does not divide 4"):
        build_trainer(cfg)


def test_bad_experts_strategy_is_one_clear_error(tmp_path):
    raw = yaml.safe_load(open(load_rules("ep").path).read())
    raw["strategies"]["experts"] = {"dispatch": "dropful"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RulesError, match="strategies.experts.dispatch: dropful` must be one of dropless, capacity"):
        load_rules(str(path))
    raw["strategies"]["experts"] = {"dispatch": "capacity", "chunks": 0}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RulesError, match=r"strategies.experts.chunks: 0` must be a whole number >= 1"):
        load_rules(str(path))


# -- counts and serving ------------------------------------------------------------------------------
def test_float8_runs_the_shared_expert_in_fp8_and_the_routed_experts_in_the_compute_dtype():
    """Under model.matmul_dtype=float8 the shared expert is a dense MLP and runs its three GEMMs in FP8,
    as the dense model's do; the routed experts' grouped GEMMs stay in the compute dtype (the start-up
    warning says so). Counted in the lowered MoE layer: e4m3 dots with and without the shared expert."""
    from flax import nnx

    def fp8_dots(shared):
        cfg = dataclasses.replace(CFG, shared_mlp_dim=shared, matmul_dtype="float8", dtype="bfloat16")
        block = moe.MoeBlock(cfg, nnx.Rngs(0))
        x = jnp.ones((2, 8, cfg.d_model), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
        text = jax.jit(lambda x: block(x, pos, None)[0]).lower(x).as_text()
        return sum("dot_general" in line and "f8E4M3FN" in line for line in text.splitlines())
    assert fp8_dots(32) - fp8_dots(0) == 3


def test_active_and_total_counts_follow_the_config():
    from models import model_def
    cfg = models.preset("moe_tiny")
    assert cfg.param_count()["total"] == model_def(cfg).param_count()   # stored = counted
    dense = dataclasses.replace(models.preset("tiny"), n_layers=cfg.n_layers, mlp_dim=cfg.active_mlp_dim)
    # active matmul weights = a dense model of the active width + the router
    assert cfg.matmul_param_count() == dense.matmul_param_count() + cfg.n_layers * cfg.d_model * cfg.n_experts
    # FLOPs: 6 per active matmul weight more than the dense model's, the attention term unchanged
    assert cfg.train_flops_per_token(128) - dense.train_flops_per_token(128) == \
        6 * (cfg.matmul_param_count() - dense.matmul_param_count())


@pytest.mark.parametrize("layers", ["auto", "fused", "kernels"])
def test_greedy_decode_through_the_engine_equals_uncached_forward(layers):
    """The paged engine (KV cache, continuous batching; layers auto -> split for MoE on the CPU, fused:
    q|k|v in one GEMM, or kernels: a one-row decode step through the Pallas attention and the expert
    kernels in interpret mode, three rows through XLA's projections and the expert kernels, a padding row
    routed nowhere, prompt chunks through the grouped GEMM) with greedy sampling gives the argmax of
    a full no-cache forward at every step."""
    from flax import nnx
    from meshlab.infer.engine import Engine
    from meshlab.infer.sampler import SamplingParams
    from models import model_def
    cfg = dataclasses.replace(models.preset("moe_tiny"), dtype="float32", init_std=0.2)
    md = model_def(cfg)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    kw = dict(impl="pallas", interpret=True) if layers == "kernels" else {}
    engine = Engine(md, params, max_len=32, max_seqs=4, page_size=4, chunk=8, steps_per_call=4, layers=layers, **kw)
    # all in flight (continuous batching); three rows decode in the bucket of four: one padding row
    prompts = [[5, 6, 7], list(range(40, 52)), [9, 3, 3, 1, 2]]
    outs = [r.output for r in engine.generate(prompts, SamplingParams(max_tokens=6))]
    if layers == "kernels":                 # alone: one-row decode steps, through the expert kernels
        assert [engine.generate([p], SamplingParams(max_tokens=6))[0].output for p in prompts] == outs
    fwd = jax.jit(lambda p, x: md.bind(p)(x)[..., :cfg.vocab_size])
    for p, o in zip(prompts, outs):
        seq = list(p) + list(o)
        logits = np.asarray(fwd(params, jnp.asarray([seq], jnp.int32)))[0]
        assert o == logits[len(p) - 1:len(seq) - 1].argmax(-1).tolist()


def test_serving_over_an_expert_split_is_one_clear_error():
    """The engine serves its rows together (act_batch whole), so expert parallelism has nothing to exchange:
    a mixture of experts under a rule file that splits `experts` is refused at construction, in one line
    naming the file and what to serve with; the same file serves a dense model."""
    from flax import nnx
    from meshlab.infer.engine import Engine
    from meshlab.mesh import make_mesh
    from models import model_def
    mesh = make_mesh("expert=8", jax.devices())
    for name, refused in (("moe_tiny", True), ("tiny", False)):
        cfg = dataclasses.replace(models.preset(name), dtype="float32")
        md = model_def(cfg)
        params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
        if refused:
            with pytest.raises(ValueError, match=r"ep.yaml: serving keeps the batch whole .* split over \['expert'\]"):
                Engine(md, params, max_len=16, max_seqs=1, page_size=4, chunk=8, rules=load_rules("ep"), mesh=mesh)
        else:
            Engine(md, params, max_len=16, max_seqs=1, page_size=4, chunk=8, rules=load_rules("ep"), mesh=mesh)


@pytest.mark.parametrize("name,sizes", [("ep", "expert=8"), ("fsdp_ep", "fsdp=2,expert=4"),
                                        ("fsdp_tp_ep", "fsdp=2,tensor=2,expert=2")])
def test_explain_splits_the_expert_banks_over_eight_devices(name, sizes):
    """Each EP file on 8 devices leaves 1/8 of every expert bank per device (params, grads, Adam)."""
    from meshlab.mesh import resolve_sizes
    from meshlab.plan import account
    from meshlab.plan.explain import describe
    from meshlab.plan.search import PlanMesh
    from models import model_def
    md, rules, mesh = model_def(models.preset("moe_tiny")), load_rules(name), PlanMesh(resolve_sizes(sizes, 8))
    for kind in ("params", "grads", "optimizer"):
        banks = [r for r in account.param_table(md, rules, mesh, kind) if "experts" in r.names]
        assert len(banks) == 3
        assert all(r.bytes_per_device * 8 == 4 * np.prod(r.shape) for r in banks), kind
    text = describe(md, rules, mesh, 16, 32)
    assert "experts split over" in text and "all-to-all over expert per MoE layer" in text


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mosaic", "triton"])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("dispatch", experts.DISPATCH)
def test_layer_on_gpu_kernels_equal_xla(dispatch, chunks, backend):
    """The MoE layer with a grouped GEMM kernel (Mosaic on Hopper, Triton on any GPU; bf16) against
    lax.ragged_dot, forward and grads; with 3 pieces (uneven slices of the sorted rows) against the
    unchunked ragged_dot layer."""
    if backend == "mosaic" and not gm.on_hopper():
        pytest.skip("the Mosaic grouped GEMM needs a Hopper GPU")
    cfg = dataclasses.replace(CFG, d_model=256, expert_mlp_dim=384, dtype="bfloat16")
    ks = jax.random.split(jax.random.key(0), 6)
    E, d, f = cfg.n_experts, cfg.d_model, cfg.expert_mlp_dim
    x = jax.random.normal(ks[0], (4, 256, d), jnp.bfloat16)
    router = jax.random.normal(ks[1], (d, E)) / d ** 0.5
    ws = [(jax.random.normal(k, shape) / shape[1] ** 0.5).astype(jnp.bfloat16)
          for k, shape in zip(ks[2:5], [(E, d, f), (E, d, f), (E, f, d)])]
    ct = jax.random.normal(ks[5], x.shape, jnp.bfloat16)

    def run(backend, n=1):
        def f(x, router, *ws):
            _, _, top_w, top_i = moe.route(cfg, x, router)
            pos = experts.queue_positions(top_i, E)
            cap = experts.row_capacity(x.shape[1], cfg.top_k, E, 1.0)
            keep = pos < cap if dispatch == "capacity" else jnp.ones_like(pos, bool)
            y = experts.moe_ffn(x, (top_i, top_w, keep, pos), ws, dispatch=dispatch, capacity=cap, backend=backend,
                                chunks=n)
            return jnp.sum(y.astype(jnp.float32) * ct)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 2, 3, 4)))(x, router, *ws)

    (l_m, g_m), (l_x, g_x) = run(backend, chunks), run("xla")
    assert abs(float(l_m) - float(l_x)) <= 2e-2 * abs(float(l_x)) + 1e-2
    for a, b in zip(g_m, g_x):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all() and np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
