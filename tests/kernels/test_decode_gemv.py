"""pallas_kernels/decode_gemv.py against its jnp reference (interpret mode), its errors, its CUDA lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemv import (FP8_MAX, MAX_ROWS, BlockSizes, decode_gemv, decode_gemv_reference, quantize_rows,
                                       shape_block_sizes)

pytestmark = pytest.mark.cheap_codegen


def _case(seed, m, k, n, swiglu=False, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=((2, n, k) if swiglu else (n, k))) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(rng.uniform(0.5, 1.5, size=k), jnp.float32), jnp.asarray(rng.normal(size=(m, n)), dtype)


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("op", ["plain", "norm", "residual", "swiglu", "norm_swiglu"])
def test_matches_reference(m, op):
    # k = 96: chunks of 32 (the largest power of two <= block_k dividing it), three of them;
    # n = 48 in blocks of 16 (gate and up each 48 wide with swiglu)
    swiglu = "swiglu" in op
    x, w, scale, res = _case(m * 7 + len(op), m, 96, 48, swiglu)
    kw = dict(norm_scale=scale if "norm" in op else None, residual=res if op == "residual" else None, swiglu=swiglu)
    got = decode_gemv(x, w, block_sizes=BlockSizes(block_n=16, block_k=64), interpret=True, **kw)
    want = decode_gemv_reference(x, w, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("op", ["plain", "norm", "residual", "norm_swiglu"])
@pytest.mark.parametrize("tiles", [BlockSizes(block_n=16, block_k=32),
                                   BlockSizes(block_n=8, block_k=32, tiles_per_program=3, prefetch=1)], ids=["loop", "ahead"])
def test_fp8_weights_match_the_dequantized_reference(m, op, tiles):
    # fp8 rows with one scale each: the kernel's sums times the scale equal the reference over the same
    # fp8 weights (up to fp32 order), and that is the fp32 matmul of the dequantized weights q * scale
    swiglu = "swiglu" in op
    x, w, scale, res = _case(m + len(op) + tiles.block_n, m, 96, 48, swiglu)
    w = w * jnp.linspace(0.1, 10.0, 48)[:, None]                 # rows of very different ranges: the scales matter
    q, w_scale = quantize_rows(w)
    assert q.dtype == jnp.float8_e4m3fn and w_scale.shape == w.shape[:-1]
    np.testing.assert_allclose(np.abs(np.asarray(q, np.float32)).max(axis=-1), FP8_MAX)
    kw = dict(norm_scale=scale if "norm" in op else None, residual=res if op == "residual" else None, swiglu=swiglu)
    got = decode_gemv(x, q, w_scale=w_scale, block_sizes=tiles, interpret=True, **kw)
    want = decode_gemv_reference(x, q, w_scale=w_scale, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    dequantized = (q.astype(jnp.float32) * w_scale[..., None]).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(want), np.asarray(decode_gemv_reference(x, dequantized, **kw)), atol=1e-4, rtol=1e-4)
    rel = np.abs(np.asarray(dequantized) - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
    assert rel < 2 ** -4                                         # e4m3's 3 mantissa bits, per row's range
    with pytest.raises(ValueError, match="w_scale"):
        decode_gemv(x, q, w_scale=w_scale[..., :-1], swiglu=swiglu, interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn with w_scale"):
        decode_gemv(x, q, swiglu=swiglu, interpret=True)


@pytest.mark.parametrize("tiles, k", [(BlockSizes(block_n=16, block_k=128, tiles_per_program=3, prefetch=1), 128),
                                      (BlockSizes(block_n=8, block_k=32, tiles_per_program=2, prefetch=2), 96),
                                      (BlockSizes(block_n=8, block_k=64, tiles_per_program=6, prefetch=0), 96),
                                      (BlockSizes(block_n=16, block_k=32, prefetch=1), 96)])
@pytest.mark.parametrize("op", ["norm", "residual", "norm_swiglu"])
def test_tiles_per_program_and_prefetch_match_reference(tiles, k, op):
    # a program's several column blocks (strided over the grid) and weight loads issued ahead, with
    # k in one chunk (128: x and its norm computed once for the program's tiles) or in three of 32
    swiglu = "swiglu" in op
    x, w, scale, res = _case(len(op) + tiles.block_n, 2, k, 48, swiglu)
    kw = dict(norm_scale=scale if "norm" in op else None, residual=res if op == "residual" else None, swiglu=swiglu)
    got = decode_gemv(x, w, block_sizes=tiles, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(decode_gemv_reference(x, w, **kw)), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("op", ["norm", "residual", "norm_swiglu"])
def test_rolled_tiles_match_reference(op):
    # the tiles in a loop with the next tile's weights carried (k = 128 in one chunk, 2 programs x 3 tiles)
    swiglu = "swiglu" in op
    x, w, scale, res = _case(len(op), 2, 128, 48, swiglu)
    kw = dict(norm_scale=scale if "norm" in op else None, residual=res if op == "residual" else None, swiglu=swiglu)
    tiles = BlockSizes(block_n=8, block_k=128, tiles_per_program=3, prefetch=1, rolled=True)
    got = decode_gemv(x, w, block_sizes=tiles, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(decode_gemv_reference(x, w, **kw)), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="one chunk"):
        decode_gemv(x[:, :96], w[..., :96], swiglu=swiglu, block_sizes=tiles, interpret=True)


def test_shape_tiles_divide_every_shape():
    # the per-shape defaults at llama3 widths, and a width they do not divide (falls back to one column)
    for n, k, swiglu in ((3072, 2048, False), (2048, 2048, False), (8192, 2048, True), (2048, 8192, False),
                         (14336, 4096, True), (4096, 14336, False), (6, 2048, True), (1000, 512, False)):
        shape_block_sizes(n, k, swiglu).validate(n, k)         # raises where a tile does not divide the shape
    assert shape_block_sizes(6, 2048, True).block_n == 1 and shape_block_sizes(8192, 2048, True).tiles_per_program == 4
    # roles by shape: at k = 2048 the llama3_1b tiles; wider, gate|up and wo a column's k in one load, down on 8 warps
    assert shape_block_sizes(2048, 2048, False) == BlockSizes(block_n=1, num_warps=1)
    assert shape_block_sizes(6144, 4096, False) == BlockSizes()
    assert shape_block_sizes(14336, 4096, True) == shape_block_sizes(4096, 4096, False) == \
        BlockSizes(block_n=2, block_k=8192, prefetch=1)
    assert shape_block_sizes(4096, 14336, False).num_warps == 8 and shape_block_sizes(2048, 8192, False).num_warps == 4


@pytest.mark.parametrize("shape, op", [((14336, 4096), "norm_swiglu"), ((4096, 4096), "residual"),
                                       ((6144, 4096), "norm"), ((4096, 14336), "residual")],
                         ids=["gate_up", "wo", "qkv", "down"])
def test_wide_shape_tiles_match_reference(shape, op):
    # the tiles llama3_8b's four shapes get, over 8 of their output columns at their k: 4,096 in one chunk,
    # or in two (q|k|v's loop); down's 14,336 in seven of 2,048
    (n8b, k), swiglu = shape, "swiglu" in op
    x, w, scale, res = _case(k + len(op), 1, k, 8, swiglu)
    kw = dict(norm_scale=scale if "norm" in op else None, residual=res if op == "residual" else None, swiglu=swiglu)
    got = decode_gemv(x, w, block_sizes=shape_block_sizes(n8b, k, swiglu), interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(decode_gemv_reference(x, w, **kw)), atol=2e-5, rtol=2e-5)


def test_bf16_one_chunk_and_rounding():
    # bf16 at k = 128 in one chunk, rounded where the model rounds (normed x, matmul output); the sum
    # order differs from XLA's, so an output may land one bf16 ulp away
    x, w, scale, res = _case(3, 1, 128, 64, dtype=jnp.bfloat16)
    for kw in (dict(norm_scale=scale), dict(residual=res)):
        got = decode_gemv(x, w, block_sizes=BlockSizes(block_n=8, block_k=2048), interpret=True, **kw)
        want = decode_gemv_reference(x, w, **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def test_errors_name_the_fix():
    x, w, scale, _ = _case(4, 2, 64, 32)
    with pytest.raises(ValueError, match="rows must be in"):
        decode_gemv(jnp.ones((5, 64)), w, interpret=True)
    with pytest.raises(ValueError, match="share k and dtype"):
        decode_gemv(x, w[:, :32], interpret=True)
    with pytest.raises(ValueError, match="block_n=16"):
        decode_gemv(x, w[:24], block_sizes=BlockSizes(block_n=16), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        decode_gemv(x, w, block_sizes=BlockSizes(block_n=12), interpret=True)
    with pytest.raises(ValueError, match="multiple of tiles_per_program=3"):
        decode_gemv(x, w, block_sizes=BlockSizes(block_n=8, tiles_per_program=3), interpret=True)
    with pytest.raises(ValueError, match="norm_scale"):
        decode_gemv(x, w, norm_scale=scale[:8], interpret=True)
    with pytest.raises(ValueError, match="residual"):
        decode_gemv(x, w, residual=jnp.ones((2, 8)), interpret=True)


@pytest.mark.parametrize("tiles", [None, BlockSizes(block_n=2, num_warps=2, tiles_per_program=8, prefetch=1,
                                                    rolled=True)], ids=["shape_defaults", "rolled"])
def test_lowers_for_cuda_at_llama3_1b_shapes(tiles):
    # the Triton path without a GPU, at the layer's four shapes (batch 1): the shipped per-shape tiles
    # (down's unrolled 8,192-wide rows, gate|up's resident programs) and the rolled loop (not down's:
    # its k is four chunks at block_k 2048)
    d, f, qkv = 2048, 8192, 3072
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    scale = jax.ShapeDtypeStruct((d,), jnp.float32)
    mv = lambda *a, **kw: decode_gemv(*a, block_sizes=tiles, **kw)  # noqa: E731
    cases = [(lambda x, w, g: mv(x, w, norm_scale=g), (s(1, d), s(qkv, d), scale)),
             (lambda x, w, r: mv(x, w, residual=r), (s(1, d), s(d, d), s(1, d))),
             (lambda x, w, g: mv(x, w, norm_scale=g, swiglu=True), (s(1, d), s(2, f, d), scale))]
    if tiles is None:
        cases.append((lambda x, w, r: mv(x, w, residual=r), (s(1, f), s(d, f), s(1, d))))
        q = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)  # noqa: E731 - fp8 weights, fp32 scales
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        cases += [(lambda x, w, ws, g: mv(x, w, w_scale=ws, norm_scale=g), (s(1, d), q(qkv, d), f32(qkv), scale)),
                  (lambda x, w, ws, g: mv(x, w, w_scale=ws, norm_scale=g, swiglu=True), (s(1, d), q(2, f, d), f32(2, f), scale)),
                  (lambda x, w, ws, r: mv(x, w, w_scale=ws, residual=r), (s(1, f), q(d, f), f32(d), s(1, d)))]
    for fn, args in cases:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "decode_gemv" in text


@pytest.mark.gpu
def test_gpu_compiled_matches_reference_at_llama3_1b_shapes():
    # Compiled Triton, bf16, batch 1 and 3, the layer's four matmuls and the default tiles
    d, f, qkv = 2048, 8192, 3072
    for m in (1, 3):
        for xs, n, kw in (((m, d), qkv, {"norm": True}), ((m, d), d, {"residual": True}),
                          ((m, d), f, {"norm": True, "swiglu": True}), ((m, f), d, {"residual": True})):
            x, w, scale, res = _case(m + n, m, xs[1], n, kw.get("swiglu", False), jnp.bfloat16)
            args = dict(norm_scale=scale if kw.get("norm") else None, residual=res if kw.get("residual") else None,
                        swiglu=kw.get("swiglu", False))
            got = np.asarray(decode_gemv(x, w, **args), np.float32)
            want = np.asarray(decode_gemv_reference(x, w, **args), np.float32)
            np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_compiled_fp8_matches_reference_at_llama3_1b_shapes():
    # Compiled Triton with fp8 weights (sm89+), bf16 activations, batch 1, the layer's four matmuls
    d, f, qkv = 2048, 8192, 3072
    for xs, n, kw in (((1, d), qkv, {"norm": True}), ((1, d), d, {"residual": True}),
                      ((1, d), f, {"norm": True, "swiglu": True}), ((1, f), d, {"residual": True})):
        x, w, scale, res = _case(n, 1, xs[1], n, kw.get("swiglu", False), jnp.bfloat16)
        q, w_scale = quantize_rows(w)
        args = dict(norm_scale=scale if kw.get("norm") else None, residual=res if kw.get("residual") else None,
                    swiglu=kw.get("swiglu", False), w_scale=w_scale)
        got = np.asarray(decode_gemv(x, q, **args), np.float32)
        want = np.asarray(decode_gemv_reference(x, q, **args), np.float32)
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_block_decode_step_matches_the_xla_block(monkeypatch, quantize):
    # The five-launch decode layer (kernels=True) and nk_step (the [n, k] weights through XLA) against
    # the same block with concatenated weights (layers="fused"): the kernels replace only the matmuls
    # and their neighbours; the jaxpr shows the four decode_gemv launches and the attention kernel.
    # Three rows: the kernels' multi-row form, with the row limit raised to the kernel's (the shipped
    # limit, one row, sends them through nk_step). fp8: both paths over the fp8 matrices, the fused
    # block over their dequantized values.
    import dataclasses
    from flax import nnx
    import models
    from meshlab.infer import kv_cache
    from meshlab.infer.programs import _fuse
    from models import serving
    from models.serving import block_step
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=1)
    block = nnx.merge(*nnx.split(models.build(cfg, nnx.Rngs(0)).layers))
    params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(nnx.state(block, nnx.Param)))
    (_, nk) = _fuse(params, decode=True, quantize=quantize)
    if quantize:           # the block's own matrices replaced by what the fp8 ones stand for
        mats = nk["decode"]
        deq = {n: mats[n].astype(jnp.float32) * mats[n + "_scale"][..., None] for n in mats if not n.endswith("_scale")}
        d = params["attn"]["wo"].shape[-1]
        widths = [params["attn"][n].reshape(d, -1).shape[1] for n in ("wq", "wk")]
        q, k, v = np.split(np.asarray(deq["wqkv_t"].T), np.cumsum(widths), 1)
        params = dict(params, attn=dict(params["attn"], **{n: jnp.asarray(a).reshape(params["attn"][n].shape) for n, a in
                                                            (("wq", q), ("wk", k), ("wv", v))},
                                        wo=deq["wo_t"].T.reshape(params["attn"]["wo"].shape)),
                      mlp=dict(params["mlp"], w_gate=deq["w_gate_up_t"][0].T, w_up=deq["w_gate_up_t"][1].T,
                               w_down=deq["w_down_t"].T))
    (_, fused) = _fuse(params)
    one = nnx.merge(nnx.graphdef(block), jax.tree.map(lambda a: a[0], nnx.state(block)))
    nnx.update(one, params)                                    # wo and w_down: the fused block reads the block's own
    b, page_size, pages = 3, 4, 4
    cache = kv_cache.init_paged(cfg, b * pages + 1, page_size)
    cache = jax.tree.map(lambda c: jax.random.normal(jax.random.PRNGKey(3), c.shape, c.dtype), cache)
    table = jnp.arange(1, b * pages + 1, dtype=jnp.int32).reshape(b, pages)
    positions = jnp.array([[0], [5], [13]], jnp.int32)
    attend = kv_cache.paged_attend(positions, jnp.ones((b, 1), bool), table, "pallas", interpret=True)
    x = jax.random.normal(jax.random.PRNGKey(4), (b, 1, cfg.d_model), jnp.float32)
    step = lambda x, kernels: block_step(one, x, positions, attend, 0, cache, fused=nk, kernels=kernels)  # noqa: E731
    assert "name=decode_gemv" not in str(jax.make_jaxpr(lambda x: step(x, True)[0])(x))   # 3 rows > KERNEL_ROWS
    monkeypatch.setattr(serving, "KERNEL_ROWS", MAX_ROWS)
    with jax.default_matmul_precision("highest"):     # fp32 dots on a GPU too (XLA's default there rounds to tf32)
        want, want_cache = block_step(one, x, positions, attend, 0, cache, fused=fused)
        outs = [step(x, kernels) for kernels in (True, False)]
    for got, got_cache in outs:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
        for name in ("k", "v"):   # the new k/v come from q|k|v sums in another order: fp32 rounding apart
            np.testing.assert_allclose(np.asarray(got_cache[name]), np.asarray(want_cache[name]), rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(lambda x: step(x, True)[0])(x))
    assert jaxpr.count("name=decode_gemv") == 4 and jaxpr.count("name=paged_attention") >= 1
