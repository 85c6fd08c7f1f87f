"""pallas_kernels/decode_matmul.py against its jnp reference (interpret mode), its errors, its CUDA
lowering, and models/serving.py's decode_step against the block's XLA serving path."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_matmul import BlockSizes, decode_matmul, decode_matmul_reference

# Compiling dominates (interpret mode, tiny shapes): cheap_codegen, CPU only (the GPU cases are unaffected).
pytestmark = pytest.mark.cheap_codegen
MODES = {"plain": {}, "norm": {"norm": True}, "residual": {"residual": True}, "norm_swiglu": {"norm": True, "swiglu": True}}


def _case(seed, m, k, n, dtype, norm=False, residual=False, swiglu=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = (3.0 * jax.random.normal(ks[0], (m, k))).astype(dtype)       # rms far from 1: the norm matters
    w = (jax.random.normal(ks[1], (k, n)) / np.sqrt(k)).astype(dtype)
    kw = {}
    if norm:
        kw["norm_scale"] = 1.0 + 0.3 * jax.random.normal(ks[2], (k,))
    if residual:
        kw["residual"] = jax.random.normal(ks[3], (m, n)).astype(dtype)
    return x, w, dict(kw, swiglu=swiglu)


# Awkward sizes: k not a multiple of block_k (a masked last chunk), n (or f) not a multiple of
# block_n (a masked last column block; with swiglu the last gate tile straddles into up); 1, 3
# and 16 rows (the padded dot's row mask, and no padding at all).
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("m,k,n,layout", [(1, 200, 96, "kn"), (3, 64, 80, "nk"), (16, 96, 112, "kn"),
                                          (1, 200, 112, "nk")])
def test_matches_reference_fp32(mode, m, k, n, layout):
    x, w, kw = _case(0, m, k, n, jnp.float32, **MODES[mode])
    w_stored = w.T if layout == "nk" else w                          # "nk": each output's weights contiguous
    got = decode_matmul(x, w_stored, w_layout=layout, block_sizes=BlockSizes(block_n=32, block_k=64),
                        interpret=True, **kw)
    want = decode_matmul_reference(x, w, **kw)
    assert got.shape == want.shape == (m, n // 2 if kw["swiglu"] else n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mode", list(MODES))
def test_matches_reference_bf16(mode):
    # bf16: the same roundings as the reference (normed x, GEMM output, SwiGLU / residual in fp32)
    x, w, kw = _case(1, 2, 256, 192, jnp.bfloat16, **MODES[mode])
    got = decode_matmul(x, w, block_sizes=BlockSizes(block_n=64, block_k=128), interpret=True, **kw)
    want = decode_matmul_reference(x, w, **kw)
    assert got.dtype == jnp.bfloat16
    # one bf16 ulp where the fp32 sums round differently (different summation order)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


def test_errors():
    x, w = jnp.ones((2, 32), jnp.bfloat16), jnp.ones((32, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="m=17 rows"):
        decode_matmul(jnp.ones((17, 32), jnp.bfloat16), w, interpret=True)
    with pytest.raises(ValueError, match="share k and dtype"):
        decode_matmul(x, w.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="share k and dtype"):
        decode_matmul(x, w[:16], interpret=True)
    with pytest.raises(ValueError, match="residual"):
        decode_matmul(x, w, residual=jnp.ones((2, 24), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="norm_scale"):
        decode_matmul(x, w, norm_scale=jnp.ones((31,)), interpret=True)
    with pytest.raises(ValueError, match="w_layout='kk'"):
        decode_matmul(x, w, w_layout="kk", interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        decode_matmul(x, w, block_sizes=BlockSizes(block_n=24), interpret=True)


def test_lowers_for_cuda():
    # Interpret mode never builds the Triton kernel; lowering for CUDA does, at llama3_1b's shapes.
    b, d, f = 1, 2048, 8192
    for kw, (k, n) in ((dict(norm_scale=jax.ShapeDtypeStruct((d,), jnp.float32)), (d, 3072)),
                       (dict(residual=jax.ShapeDtypeStruct((b, d), jnp.bfloat16)), (f, d)),
                       (dict(norm_scale=jax.ShapeDtypeStruct((d,), jnp.float32), swiglu=True), (d, 2 * f))):
        swiglu = kw.pop("swiglu", False)
        for layout, w_shape in (("kn", (k, n)), ("nk", (n, k))):
            x, w = jax.ShapeDtypeStruct((b, k), jnp.bfloat16), jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)
            fn = jax.jit(lambda x, w, extra: decode_matmul(x, w, swiglu=swiglu, w_layout=layout, **extra))
            lowered = fn.trace(x, w, kw).lower(lowering_platforms=("cuda",))
            assert "decode_matmul" in lowered.as_text()


def test_block_decode_step_matches_block_cached():
    # The five-launch decode layer against the same block's XLA serving path (fused weights, the
    # same one-kernel attention): the kernels replace only the matmuls and their neighbours.
    from flax import nnx
    import models
    from meshlab.infer import kv_cache
    from meshlab.infer.engine import _fuse
    from models.serving import block_step
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=1)
    model = models.build(cfg, nnx.Rngs(0))
    block = nnx.merge(*nnx.split(model.layers))           # stacked params; take layer 0 below
    params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(nnx.state(block, nnx.Param)))
    _, fused = _fuse(params)
    one = nnx.merge(nnx.graphdef(block), jax.tree.map(lambda a: a[0], nnx.state(block)))
    b, page_size, pages = 3, 4, 4
    cache = kv_cache.init_paged(cfg, b * pages + 1, page_size)
    cache = jax.tree.map(lambda c: jax.random.normal(jax.random.PRNGKey(3), c.shape, c.dtype), cache)
    table = jnp.arange(1, b * pages + 1, dtype=jnp.int32).reshape(b, pages)
    positions = jnp.array([[0], [5], [13]], jnp.int32)
    attend = kv_cache.paged_attend(positions, jnp.ones((b, 1), bool), table, "pallas", interpret=True)
    x = jax.random.normal(jax.random.PRNGKey(4), (b, 1, cfg.d_model), jnp.float32)
    want, want_cache = block_step(one, x, positions, attend, 0, cache, fused=fused)
    got, got_cache = block_step(one, x, positions, attend, 0, cache, fused=fused, kernels=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    for name in ("k", "v"):   # the new k/v come from q|k|v sums in another order: fp32 rounding apart
        np.testing.assert_allclose(np.asarray(got_cache[name]), np.asarray(want_cache[name]), rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(lambda x: block_step(one, x, positions, attend, 0, cache, fused=fused,
                                                    kernels=True)[0])(x))
    assert jaxpr.count("pallas_call[") == 5 and "name=decode_matmul" in jaxpr   # 4 matmuls + the attention
