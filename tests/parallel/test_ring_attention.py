"""Ring attention over `context`: equals single-device attention (output and gradients), zig-zag
load balance from the schedule the code runs, collectives and memory from the compiled program."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from meshlab.parallel import ring_attention as ra
from meshlab.parallel.context import context_attention, uses_zigzag, zigzag_batch, zigzag_reorder, zigzag_restore
from pallas_kernels.attention import xla_attention

# Compiling dominates (tiny shapes, many small programs): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen
COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(-start)?\(")


def make_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def inputs(b=2, s=32, h=4, kvh=2, d=8, seg=False, seed=0):
    rng = np.random.default_rng(seed)  # numpy: no compile per shape, unlike jax.random
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v = f32(b, s, h, d), f32(b, s, kvh, d), f32(b, s, kvh, d)
    sid = jnp.asarray(np.cumsum(rng.random((b, s)) < 0.15, 1), jnp.int32) if seg else None
    w = f32(b, s, h, d)  # cotangent weights: loss = sum(out * w)
    return q, k, v, sid, w


def check_against_reference(attn, q, k, v, sid, w, causal, n, sm_scale=None, zigzag=True, tol=2e-5):
    """attn runs on the (possibly zig-zag reordered) global arrays; compare in the original order."""
    zz = zigzag and causal

    def ours(q, k, v):
        re_ = (lambda x: zigzag_reorder(x, n)) if zz else (lambda x: x)
        o = attn(re_(q), re_(k), re_(v), None if sid is None else re_(sid))
        return zigzag_restore(o, n) if zz else o

    def ref(q, k, v):
        return xla_attention(q, k, v, causal=causal, segment_ids=sid, sm_scale=sm_scale)

    def out_and_grads(f):  # one compiled program per side: compile time dominates these tests
        def g(q, k, v):
            o, vjp = jax.vjp(f, q, k, v)
            return o, vjp(w.astype(o.dtype))
        return jax.jit(g)(q, k, v)

    (o1, g1), (o2, g2) = out_and_grads(ours), out_and_grads(ref)
    np.testing.assert_allclose(o1, o2, atol=tol, rtol=tol)
    for name, a, b in zip("qkv", g1, g2):
        np.testing.assert_allclose(a, b, atol=tol * 5, rtol=tol * 5, err_msg=f"d{name}")


# Pairwise cover of context size x causal x GQA x segment ids (every pair of values appears).
# zigzag=False (plain contiguous shards, exact but unbalanced) and a custom scale ride along on
# one causal case; block_k 4/8 makes the jnp block tile its keys (the scan path) and, with
# block_k 4 at n=2, split its causal diagonal blocks (_split_diagonal).
PAIRWISE = [  # n, causal, kv heads (of 4), segment ids, block_k, zigzag, sm_scale
    (2, True, 2, True, 4, True, None),
    (2, False, 4, False, 8, True, None),
    (4, True, 4, True, 4, False, 0.3),
    (4, False, 2, False, 512, True, None),
    (8, True, 1, False, 512, True, None),
    (8, False, 4, True, 512, True, None),
]


@pytest.mark.parametrize("n,causal,kvh,seg,block_k,zigzag,sm_scale", PAIRWISE)
def test_ring_matches_single_device(n, causal, kvh, seg, block_k, zigzag, sm_scale):
    mesh = make_mesh((n,), ("context",))
    q, k, v, sid, w = inputs(kvh=kvh, seg=seg)
    attn = lambda q, k, v, s: ra.ring_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=s,  # noqa: E731
                                                block_k=block_k, zigzag=zigzag, sm_scale=sm_scale)
    check_against_reference(attn, q, k, v, sid, w, causal, n, sm_scale=sm_scale, zigzag=zigzag)


def in_manual_region(mesh, axis, fn):
    """Run fn(q, k, v, s) inside a shard_map manual over `axis`, as the training step does."""
    from jax.sharding import PartitionSpec as P

    def run(q, k, v, s):
        args = (q, k, v) + (() if s is None else (s,))
        body = lambda q, k, v, *s: fn(q, k, v, s[0] if s else None)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), axis_names={axis},
                             check_vma=False)(*args)
    return run


@pytest.mark.parametrize("nested", [False, True])
def test_ring_composes_with_fsdp_and_tensor(nested):
    """Batch over fsdp, heads over tensor, sequence over context, through context_attention;
    nested: called inside a shard_map already manual over fsdp (the train step's region)."""
    mesh = make_mesh((2, 2, 2), ("fsdp", "context", "tensor"))
    q, k, v, sid, w = inputs(kvh=2, seg=True, seed=2)
    attn = lambda q, k, v, s: context_attention(q, k, v, strategy="ring", mesh=mesh, causal=True,  # noqa: E731
                                                segment_ids=s, batch_axes="fsdp", head_axes="tensor")
    check_against_reference(in_manual_region(mesh, "fsdp", attn) if nested else attn, q, k, v, sid, w, True, 2)


def test_zigzag_helpers():
    n, s = 4, 16
    x = jnp.arange(2 * s).reshape(2, s)
    z = zigzag_reorder(x, n)
    np.testing.assert_array_equal(zigzag_restore(z, n), x)
    c = s // (2 * n)
    for i in range(n):  # device i's shard holds chunks i and 2n-1-i
        shard = np.asarray(z[0, i * 2 * c:(i + 1) * 2 * c])
        np.testing.assert_array_equal(shard, np.r_[i * c:(i + 1) * c, (2 * n - 1 - i) * c:(2 * n - i) * c])
    assert uses_zigzag("ring", True, 4) and not uses_zigzag("ring", False, 4) and not uses_zigzag("ulysses", True, 4)
    with pytest.raises(ValueError, match="divisible by 2 x"):
        ra.zigzag_permutation(12, 4)
    tokens = np.arange(2 * s).reshape(2, s)
    zb = zigzag_batch({"tokens": tokens, "labels": tokens + 1, "step": np.int32(3)}, n)
    np.testing.assert_array_equal(zb["tokens"], z)  # numpy in, numpy out, same order as jnp
    np.testing.assert_array_equal(zb["labels"], zb["tokens"] + 1)  # pairs stay aligned
    np.testing.assert_array_equal(zb["positions"][1], z[0])  # original positions travel along


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_zigzag_load_balance(n):
    counts = ra.blocks_per_device(ra.ring_schedule(n, causal=True, zigzag=True))
    plain = ra.blocks_per_device(ra.ring_schedule(n, causal=True, zigzag=False))
    print(f"n={n}: blocks per device zig-zag {counts}, contiguous {plain}")
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == sum(plain) == n * (2 * n + 1)  # every unmasked half-block exactly once
    if n > 1:
        assert max(plain) - min(plain) > 1  # what zig-zag fixes
    # The traced code is generated from the schedule: its calls cover exactly the scheduled pairs.
    cfg = ra._Cfg(n, "context", True, True, 1.0, "jnp", 512)
    sched = ra.ring_schedule(n)
    for t, (plans, table) in enumerate(cfg.steps):
        for i in range(n):
            covered = sum(len(c.q_halves) * len(c.kv_halves) for c in plans[table[i]])
            assert covered == len(sched[i][t])


def test_pallas_block_impl_missing_is_clear(monkeypatch):
    import sys
    import pallas_kernels
    monkeypatch.setitem(sys.modules, "pallas_kernels.flash_attention", None)
    # Once imported, `from pallas_kernels import flash_attention` finds the package attribute:
    # hide it too, or the test depends on which tests ran before it.
    monkeypatch.delattr(pallas_kernels, "flash_attention", raising=False)
    mesh = make_mesh((2,), ("context",))
    q, k, v, _, _ = inputs()
    with pytest.raises(RuntimeError, match="block_impl='jnp'"):
        ra.ring_attention(q, k, v, mesh=mesh, block_impl="pallas")
    with pytest.raises(ValueError, match="unknown block_impl"):
        ra.ring_attention(q, k, v, mesh=mesh, block_impl="cuda")
    with pytest.raises(ValueError, match="divisible by 2 x"):
        ra.ring_attention(q[:, :30], k[:, :30], v[:, :30], mesh=make_mesh((4,), ("context",)))


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, line) for each collective in the HLO text, matched line by line."""
    out = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            out.append((m.group(1), line.strip()))
    return out


def _compiled_grad(mesh, s, block_k, b=1, h=2, kvh=2, d=16):
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.float32)
    f = lambda q, k, v: jnp.sum(ra.ring_attention(q, k, v, mesh=mesh, causal=True, block_k=block_k))  # noqa: E731
    return jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kv, kv).compile()


def test_ring_compiled_collectives_and_temp_memory():
    """From the compiled forward+backward: k/v move only by collective-permute (never an
    all-gather or all-to-all), and per-device temp bytes grow ~ (S / context) x block_k, not S^2."""
    n, block_k = 4, 64
    mesh = make_mesh((n,), ("context",))
    temps = {}
    for s in (512, 2048):
        compiled = _compiled_grad(mesh, s, block_k)
        ops = collectives(compiled.as_text())
        kinds = {op for op, _ in ops}
        assert "collective-permute" in kinds, ops
        assert not kinds & {"all-gather", "all-to-all"}, [o for o in ops if o[0] != "collective-permute"]
        temps[s] = compiled.memory_analysis().temp_size_in_bytes
        sxs = s * s // n * 2 * 4  # one fp32 S x S/context score matrix for the 2 heads, for scale
        print(f"ring S={s} context={n} block_k={block_k}: temp {temps[s] / 2**20:.2f} MiB "
              f"(an S x S/context fp32 score matrix: {sxs / 2**20:.1f} MiB)")
    assert temps[2048] / temps[512] < 4 * 1.5  # linear: x4 when S x4 (quadratic would be x16)
    assert temps[2048] < 2048 * 2048 // n * 2 * 4 / 2


def test_save_dots_attn_keeps_the_ring_forward():
    """Under a layer's remat, "full" runs the ring forward's blocks again in the backward; under
    "save_dots_attn" the ring's output and lse are kept (named residuals) and the backward runs only its
    own ring: the compiled program computes as many exponentials as without remat, fewer than "full",
    with the same gradients. (The forward's k/v hops cost nothing twice either way: XLA merges them with
    the backward ring's identical ones.)"""
    from models.remat import remat_policy
    mesh = make_mesh((4,), ("context",))
    q, k, v, _, w = inputs(s=64)

    def layer(q, k, v):
        return jnp.sum(ra.ring_attention(jnp.tanh(q), k, v, mesh=mesh, causal=True, block_k=16) * w)

    def run(policy):
        f = layer if policy == "none" else jax.checkpoint(layer, policy=remat_policy(policy), prevent_cse=True)
        # value_and_grad: the loss needs the first forward (with grad alone it is dead code)
        compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).lower(q, k, v).compile()
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["transcendentals"], compiled(q, k, v)

    (plain, _), (full, want), (kept, got) = run("none"), run("full"), run("save_dots_attn")
    assert kept == plain < full, (plain, kept, full)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ring_with_pallas_block_kernels_interpreted():
    """block_impl='pallas': the Pallas block fwd/bwd (interpret mode on CPU, ~20 s) in the ring."""
    mesh = make_mesh((2,), ("context",))
    q, k, v, sid, w = inputs(d=16, kvh=2, seg=True)
    attn = lambda q, k, v, s: ra.ring_attention(q, k, v, mesh=mesh, causal=True, segment_ids=s,  # noqa: E731
                                                block_impl="pallas")
    check_against_reference(attn, q, k, v, sid, w, True, 2)


@pytest.mark.gpu
def test_ring_pallas_on_gpu_context_one():
    """On the GPU: block_impl='auto' picks the Pallas kernels; the ring at context 1 is exact."""
    assert ra.resolve_block_impl("auto", 64) == "pallas"
    mesh = make_mesh((1,), ("context",))
    q, k, v, sid, w = inputs(s=256, h=4, kvh=2, d=64, seg=True)
    attn = lambda q, k, v, s: ra.ring_attention(q, k, v, mesh=mesh, causal=True, segment_ids=s,  # noqa: E731
                                                block_impl="auto")
    check_against_reference(attn, q, k, v, sid, w, True, 1, tol=1e-2)  # TF32 matmuls


@pytest.mark.slow
@pytest.mark.parametrize("rule_file", ["fsdp_cp", "cp_ring"])
def test_tiny_model_with_cp_rules_matches_single_device(rule_file):
    """The pipeline contract end to end (~30 s): zig-zag the batch with its original positions,
    run the tiny model under the rule file, restore the order: hidden states equal one device's."""
    import dataclasses

    from flax import nnx

    models = pytest.importorskip("models")
    from meshlab import rules as R

    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 200, (2, 32)).astype(np.int32)
    seg = np.cumsum(rng.random((2, 32)) < 0.05, 1).astype(np.int32)
    hidden = lambda m, t, p, s: m.hidden(t, positions=p, segment_ids=s)  # noqa: E731
    ref = nnx.jit(hidden)(models.build(cfg, nnx.Rngs(0)), tokens, None, seg)
    mesh = make_mesh((1, 2, 2), ("data", "fsdp", "context"))
    zb = zigzag_batch({"tokens": tokens, "segment_ids": seg}, 2)
    with R.use_rules(R.load_rules(rule_file), mesh):
        out = nnx.jit(hidden)(models.build(cfg, nnx.Rngs(0)), zb["tokens"], zb["positions"], zb["segment_ids"])
    np.testing.assert_allclose(zigzag_restore(out, 2), ref, atol=1e-5, rtol=1e-5)
