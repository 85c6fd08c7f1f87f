"""Remat policies trade recomputation for memory: the compiled temporary memory of `tiny`
falls from `none` to `full` (read from the compiler's memory analysis, printed)."""
import jax
import pytest

# Compiling dominates (steps compiled to be read; the unroll test's also run a little): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen

POLICIES = ("none", "save_dots", "save_dots_no_batch", "full")


def compiled_temp_bytes(policy, extra=()):
    # imported here: the GPU machine (no omegaconf) collects this file for its GPU test
    from meshlab.train.loop import build_trainer, device_batch
    from meshlab.train.state import abstract_state
    from tests.helpers import one_device, small_config
    cfg = small_config("dp", mesh="data=1", extra=[f"model.remat={policy}", "model.n_layers=4", "model.d_model=64",
                                                   "model.mlp_dim=256", "data.seq_len=128", *extra])
    tr = build_trainer(cfg, devices=one_device())
    state = abstract_state(tr.md, tr.tx, tr.shardings, False)
    batch = device_batch(tr, tr.batches.batch(0))
    # read, never run: LLVM's cheapest code generation (buffers are assigned before it)
    compiled = tr.step_fn.lower(state, batch).compile(compiler_options={"xla_backend_optimization_level": 0})
    return compiled.memory_analysis().temp_size_in_bytes


def test_remat_policies_reduce_temporary_memory():
    temps = {p: compiled_temp_bytes(p) for p in POLICIES}
    print("\nremat policy -> compiled temp bytes: " + ", ".join(f"{p}={t:,}" for p, t in temps.items()))
    assert temps["full"] < temps["none"]
    assert temps["save_dots_no_batch"] <= temps["save_dots"] <= temps["none"] * 1.05
    assert temps["full"] <= min(temps.values()) * 1.05


def test_unrolled_layers_keep_the_remat_policy():
    """Unrolled (scan_layers=false), XLA would merge the backward's recomputation with the forward
    (CSE) and keep everything (equal memory); with the barriers `full` holds less than `none`. Less
    is saved than under the scan (the scheduler may hoist recomputation), which is why `remat=auto`
    prefers `none` unrolled and the compiled-memory check, not the planner, has the last word."""
    unrolled = ["model.scan_layers=false"]
    temps = {p: compiled_temp_bytes(p, unrolled) for p in ("none", "full")}
    print(f"\nunrolled: none={temps['none']:,} full={temps['full']:,} temp bytes")
    assert temps["full"] < temps["none"]


def test_unrolled_layers_equal_the_scan():
    """Same loss and gradients with the layer loop unrolled as scanned (float32, 2-layer tiny), and the
    same MoE forward with its per-layer router statistics stacked the same way (moe_tiny)."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import models
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 200)
    for name, grad in (("tiny", True), ("moe_tiny", False)):
        results = []
        for scan in (True, False):
            cfg = dataclasses.replace(models.preset(name), dtype="float32", scan_layers=scan, remat="save_dots_no_batch",
                                      n_layers=2)
            graph, params = nnx.split(models.build(cfg, nnx.Rngs(0)), nnx.Param)

            def loss(p):
                out = nnx.merge(graph, p).hidden(tokens)
                out = out[0] if isinstance(out, tuple) else out      # MoE: (hidden, aux)
                return jnp.sum(out.astype(jnp.float32) ** 2)
            # no rules installed: one device, no sharding constraints
            results.append(jax.jit(jax.value_and_grad(loss) if grad else lambda p: (loss(p), p))(params))
        (v_scan, g_scan), (v_unrolled, g_unrolled) = results
        np.testing.assert_allclose(v_unrolled, v_scan, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g_unrolled), jax.tree.leaves(g_scan)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def _mosaic_layer_scan_grad(policy):
    """(jitted grad of a 3-layer scan of checkpointed Mosaic-attention layers, its args, the layer)."""
    import jax.numpy as jnp

    from models.remat import remat_policy
    from pallas_kernels.flash_attention_mgpu import flash_attention_mgpu

    def layer(x, w):
        q = jnp.einsum("bshd,de->bshe", x, w).astype(jnp.bfloat16)                       # [b, s, h, d]
        return x + flash_attention_mgpu(q, q[:, :, :2], q[:, :, 2:], causal=True).astype(x.dtype)
    body = jax.checkpoint(layer, policy=remat_policy(policy))

    def loss(x, ws):
        return jnp.sum(jax.lax.scan(lambda c, w: (body(c, w), None), x, ws)[0] ** 2)
    args = (jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.float32), jax.ShapeDtypeStruct((3, 64, 64), jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1))), args, layer


def test_save_dots_attn_keeps_the_mosaic_forward():
    """The Mosaic kernel's forward runs outside its custom_vjp (attention_with_saved_forward), so its
    named output and lse are plain residuals the policy keeps: 3 Mosaic launches per layer's grad
    (forward, dQ, dK/dV) instead of 4, and the names show among the saved residuals."""
    import re

    from jax._src.ad_checkpoint import saved_residuals

    from models.remat import remat_policy

    def lowered(policy):
        f, args, _ = _mosaic_layer_scan_grad(policy)
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    text = lowered("save_dots_attn")
    assert lowered("save_dots_no_batch").count("custom_call @mosaic_gpu") == 4
    assert text.count("custom_call @mosaic_gpu") == 3
    # the forward kernel's (out, lse) go straight into an optimization barrier (named_residuals), which
    # keeps XLA:GPU's dynamic-slice fusion from cloning the call (the GPU test below)
    two_output_calls = re.findall(r"%(\d+):2 = stablehlo.custom_call @mosaic_gpu", text)   # forward, dK/dV
    assert any(f"stablehlo.optimization_barrier %{n}#0, %{n}#1" in text for n in two_output_calls)
    _, (x, ws), layer = _mosaic_layer_scan_grad("save_dots_attn")
    saved = [why for _, why in saved_residuals(jax.checkpoint(layer, policy=remat_policy("save_dots_attn")),
                                               x, ws.update(shape=(64, 64)))]
    assert any("attention_out" in w for w in saved) and any("attention_lse" in w for w in saved), saved


@pytest.mark.gpu
def test_save_dots_attn_compiles_one_mosaic_forward_gpu():
    """What XLA:GPU makes of it: its dynamic-slice fusion cloned the forward kernel's call into the
    update-slice that stacks the residuals, 4 calls in the compiled program (2 forwards per layer)
    until named_residuals put an optimization barrier between the call and its uses."""
    import re
    f, args, _ = _mosaic_layer_scan_grad("save_dots_attn")
    compiled = f.trace(*args).lower().compile().as_text()
    assert len(re.findall(r'custom_call_target="mosaic_gpu', compiled)) == 3


def test_save_dots_attn_keeps_the_attention_forward():
    # A layer scan with the flash kernel inside jax.checkpoint, lowered for CUDA (no GPU needed; the
    # Triton kernels stay custom calls): under save_dots_no_batch and save_dots (the kernel is no dot)
    # the backward runs the attention forward again (forward, its recompute, dQ, dK/dV: 4 kernels);
    # save_dots_attn keeps the forward's named output and lse (3). The planner counts the recompute
    # where the kernels run it and none under save_dots_attn (the H200 profiles: one forward launch
    # per layer, models/remat.py); for xla, the recompute of the batched dots save_dots alone keeps.
    import re

    import jax.numpy as jnp

    import models
    from meshlab.plan import compute
    from models.remat import remat_policy
    from pallas_kernels.flash_attention import flash_attention
    x0 = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))
    ws = 0.1 * jax.random.normal(jax.random.key(1), (3, 16, 16))

    def layer(x, w):
        q = jnp.einsum("bshd,de->bshe", x, w)
        return x + flash_attention(q, x, x, causal=True), None

    def kernels(policy):
        loss = lambda x, ws: jnp.sum(jax.lax.scan(jax.checkpoint(layer, policy=remat_policy(policy)), x, ws)[0] ** 2)  # noqa: E731
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x0, ws).lower(lowering_platforms=("cuda",)).as_text()
        return len(re.findall(r"custom_call @", text))
    assert kernels("save_dots_no_batch") == kernels("save_dots") == 4
    assert kernels("save_dots_attn") == 3
    cfg = models.preset("tiny")
    flops = {}
    for attention in ("cudnn", "pallas", "xla"):   # the planner follows the GPU profiles (models/remat.py)
        cfg.attention = attention
        flops[attention] = {p: compute.step_flops(cfg, 2, 64, p)["remat recompute"]
                            for p in ("save_dots_no_batch", "save_dots", "save_dots_attn")}
    for flash in ("cudnn", "pallas"):
        assert flops[flash]["save_dots_attn"] == 0 < flops[flash]["save_dots_no_batch"] == flops[flash]["save_dots"]
    assert flops["xla"]["save_dots_attn"] == flops["xla"]["save_dots_no_batch"] > 0 == flops["xla"]["save_dots"]


def test_unrolled_layer_gradients_are_one_concatenate():
    """Unrolled, each stacked leaf is split once: its gradient is one concatenate of the layers'
    gradients, never n_layers zero-padded copies summed (an add-of-pads fusion, slow on the GPU)."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    import models
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", scan_layers=False, remat="none", n_layers=3)
    graph, params = nnx.split(models.build(cfg, nnx.Rngs(0)), nnx.Param)
    tokens = jnp.zeros((1, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(nnx.merge(graph, p).hidden(tokens) ** 2)))(params)
    n = cfg.n_layers
    layer_pads = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pad"
                  and e.outvars[0].aval.shape[0] == n and e.invars[0].aval.shape[0] == 1]
    layer_concats = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "concatenate" and len(e.invars) == n]
    stacked = [x for x in jax.tree.leaves(params) if x.ndim and x.shape[0] == n]
    assert not layer_pads
    assert len(layer_concats) == len(stacked) > 0
