"""Grouped matmul: the CPU path (jax.lax.ragged_dot) against the pure-jnp reference, forward and
gradients, empty groups and padding rows included; on a Hopper GPU the Mosaic path against
ragged_dot, and the ragged all-to-all against the padded one on a one-device expert axis."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm

SIZES = [5, 0, 11, 3]                    # an empty group; 19 of 24 rows used: 5 padding rows


def _inputs(m=24, k=16, n=8, sizes=SIZES, dtype=jnp.float32):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32).astype(dtype)
    ct = jax.random.normal(kc, (m, n), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), ct


def _grads(f, x, w, gs, ct):
    return jax.grad(lambda x, w: jnp.sum(f(x, w, gs).astype(jnp.float32) * ct), argnums=(0, 1))(x, w)


def test_xla_path_matches_reference_forward_and_grads():
    x, w, gs, ct = _inputs()
    out = gm.grouped_matmul(x, w, gs, interpret=True)
    ref = gm.grouped_matmul_reference(x, w, gs)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not np.asarray(out[sum(SIZES):]).any()                       # padding rows are zero
    for a, b in zip(_grads(lambda *a: gm.grouped_matmul(*a, interpret=True), x, w, gs, ct),
                    _grads(gm.grouped_matmul_reference, x, w, gs, ct)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_shapes_and_backend_are_clear_errors():
    x, w, gs, _ = _inputs()
    with pytest.raises(ValueError, match="do not fit together"):
        gm.grouped_matmul(x[:, :3], w, gs)
    with pytest.raises(ValueError, match="must be one of"):
        gm.grouped_matmul(x, w, gs, backend="cublas")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            gm.grouped_matmul(x, w, gs, backend="mosaic")


def test_mosaic_path_lowers_any_row_count(monkeypatch):
    """The Mosaic kernels' TMA copies take rows in tiles of 8 (Mosaic GPU refuses 683 rows: 2,048 cut in
    3 pieces); grouped_matmul pads x to whole tiles. The forward (dx's kernel too) lowered for CUDA
    here; the dW kernel asks the device for its SM count, so only the GPU test runs it."""
    monkeypatch.setattr(gm, "resolve_backend", lambda backend, interpret=False: "mosaic")
    w = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32)
    for m in (683, 688):
        x = jax.ShapeDtypeStruct((m, 256), jnp.bfloat16)
        fwd = lambda x, w, gs: gm.grouped_matmul(x, w, gs, backend="mosaic", all_rows=True)  # noqa: E731
        text = jax.jit(fwd).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
        assert f"-> tensor<{m}x384xbf16>" in text                             # the rows it was given


@pytest.mark.gpu
@pytest.mark.parametrize("experts,pad,m", [(8, 100, 1024), (16, 100, 1024), (16, 0, 1024), (8, 0, 683)])
def test_mosaic_matches_ragged_dot_on_gpu(experts, pad, m):
    k, n = 256, 384
    rng = np.random.default_rng(experts)
    sizes = rng.multinomial(m - pad, np.full(experts, 1 / experts)).tolist()      # `pad` padding rows
    sizes[0], sizes[1] = sizes[0] + sizes[1], 0       # an empty group; the total stays m - pad
    x, w, gs, ct = _inputs(m, k, n, sizes, jnp.bfloat16)
    x = x.at[m - pad:].set(jnp.nan)          # padding rows are never read into a result
    full = pad == 0                          # every row real: the unmasked path
    ours = jax.jit(lambda x, w: gm.grouped_matmul(x, w, gs, backend="mosaic", all_rows=full))(x, w)
    ref = jax.lax.ragged_dot(jnp.nan_to_num(x), w, gs, preferred_element_type=jnp.float32)
    assert np.isfinite(np.asarray(ours, np.float32)).all()
    err = float(jnp.linalg.norm(ours.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert err < 1e-2
    x = jnp.nan_to_num(x)
    g_ours = jax.jit(lambda x, w: _grads(lambda *a: gm.grouped_matmul(*a, backend="mosaic", all_rows=full),
                                         x, w, gs, ct))(x, w)
    g_ref = jax.jit(lambda x, w: _grads(lambda *a: gm.grouped_matmul(*a, backend="xla"), x, w, gs, ct))(x, w)
    for name, a, b in zip(("dx", "dw"), g_ours, g_ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), name
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2, name


@pytest.mark.gpu
def test_ragged_all_to_all_agrees_with_padded_on_one_device():
    from jax.sharding import PartitionSpec as P
    from meshlab import compat
    from meshlab.mesh import make_mesh
    from meshlab.parallel.experts import exchange_rows
    mesh = make_mesh("expert=1", devices=jax.devices()[:1])
    buf = jnp.concatenate([jax.random.normal(jax.random.key(0), (1, 10, 64)), jnp.zeros((1, 6, 64))], axis=1)
    sizes = jnp.asarray([10], jnp.int32)

    def run(impl):
        f = lambda b: exchange_rows(b, sizes, sizes, ("expert",), impl=impl)  # noqa: E731
        return jax.jit(compat.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))(buf)

    np.testing.assert_array_equal(np.asarray(run("ragged")), np.asarray(run("padded")))
