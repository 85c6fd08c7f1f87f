"""model.gate_up=stacked: gate and up as one GEMM over the [d, f, 2] pair with a one-pass SwiGLU backward.
Same loss and gradients as the two-GEMM default; less compiled temp memory (one [b, s, f] activation
fewer saved per layer); under tensor parallelism one input-gradient all-reduce fewer per layer, as the
planner counts it."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MESH_FOR, small_config
from meshlab.plan import comm
from meshlab.train import compiled
from meshlab.train.loop import build_trainer

pytestmark = pytest.mark.cheap_codegen


def test_swiglu_pair_matches_autodiff():
    """The hand-written backward equals autodiff of silu(gate) * up (fp32, awkward f)."""
    from models.vjp_ops import swiglu_pair
    gu = jax.random.normal(jax.random.key(0), (3, 5, 37, 2), jnp.float32) * 3
    dh = jax.random.normal(jax.random.key(1), (3, 5, 37), jnp.float32)
    ref = lambda g: jax.nn.silu(g[..., 0]) * g[..., 1]      # noqa: E731
    np.testing.assert_allclose(swiglu_pair(gu), ref(gu), rtol=1e-6, atol=1e-6)
    got, want = jax.vjp(swiglu_pair, gu)[1](dh)[0], jax.vjp(ref, gu)[1](dh)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_stacked_equals_split():
    """tiny, fp32, one device: the same loss and parameter gradients (same parameters either way)."""
    from flax import nnx

    import models
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 200)
    out = {}
    for mode in ("split", "stacked"):
        cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", gate_up=mode, n_layers=2)
        graph, params = nnx.split(models.build(cfg, nnx.Rngs(0)), nnx.Param)
        loss = lambda p: jnp.sum(nnx.merge(graph, p).hidden(tokens).astype(jnp.float32) ** 2)  # noqa: E731
        out[mode] = jax.jit(jax.value_and_grad(loss))(params)
    (v_split, g_split), (v_stacked, g_stacked) = out["split"], out["stacked"]
    assert float(v_stacked) == pytest.approx(float(v_split), rel=1e-6)
    errs = jax.tree.map(lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)), g_stacked, g_split)
    assert max(jax.tree.leaves(errs)) < 1e-5, errs


@pytest.mark.parametrize("rules", ["dp", "tp"])
def test_stacked_saves_memory_and_an_all_reduce(rules):
    """Compiled (never run): less temp than split; under tp the all-reduced bytes fall by one [b, s, d]
    input gradient per layer, and the planner's account follows within 1%."""
    m, plans = {}, {}
    for mode in ("split", "stacked"):
        cfg = small_config(rules, MESH_FOR.get(rules), extra=[f"model.gate_up={mode}"])
        m[mode] = compiled.measure(cfg, grads=False)
        tr = build_trainer(cfg)
        plans[mode] = comm.cpu_view(comm.step_collectives(tr.md, tr.rules, tr.mesh, cfg.data.global_batch,
                                                           cfg.data.seq_len, 1, cfg.model.remat))
    assert m["stacked"].temp < m["split"].temp
    got, want = m["stacked"].per_step["all-reduce"], plans["stacked"]["all-reduce"]
    assert got == pytest.approx(want, rel=0.01)
    if rules == "tp":
        assert m["stacked"].per_step["all-reduce"] < m["split"].per_step["all-reduce"]


def test_bad_value_and_fp8():
    """A misspelt mode is one clear error; FP8 matmuls run the stacked GEMM too (one scale for the pair)."""
    from flax import nnx

    import models
    from meshlab.train.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="model.gate_up='fused' must be split or stacked"):
        load_config("default", ["model.gate_up=fused"])
    cfg = dataclasses.replace(models.preset("tiny"), dtype="bfloat16", gate_up="stacked", matmul_dtype="float8",
                              n_layers=1)
    graph, params = nnx.split(models.build(cfg, nnx.Rngs(0)), nnx.Param)
    tokens = jnp.zeros((1, 8), jnp.int32)
    grads = jax.grad(lambda p: jnp.sum(nnx.merge(graph, p).hidden(tokens).astype(jnp.float32) ** 2))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
