"""pallas_kernels/expert_gemv.py against its jnp reference (interpret mode), its errors, its CUDA lowering,
and a mixture of experts' decode layer through it against the XLA layer."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemv import BlockSizes
from pallas_kernels.expert_gemv import MAX_CHOICES, expert_gemv, expert_gemv_reference, route_rows

pytestmark = pytest.mark.cheap_codegen

E, K_IN, F = 5, 96, 48          # k = 96: chunks of 32 or 64 do not all divide it evenly -> the largest that does


def _case(seed, dtype=jnp.float32, choices=((3, 1, 4),)):
    """Tokens x [b, K_IN], experts [b, K] (rows of `choices`), h [b K, F], combine [b, K], residual [b, K_IN]."""
    rng = np.random.default_rng(seed)
    experts = jnp.asarray(choices, jnp.int32)
    b, k = experts.shape
    x = jnp.asarray(rng.normal(size=(b, K_IN)), dtype)
    w_gate_up = jnp.asarray(rng.normal(size=(E, 2, F, K_IN)) / np.sqrt(K_IN), dtype)
    h = jnp.asarray(rng.normal(size=(b * k, F)), dtype)
    w_down = jnp.asarray(rng.normal(size=(E, K_IN, F)) / np.sqrt(F), dtype)
    combine = jnp.asarray(rng.dirichlet(np.ones(k), size=b), jnp.float32)
    residual = jnp.asarray(rng.normal(size=(b, K_IN)), dtype)
    return x, w_gate_up, h, w_down, experts, combine, residual


TILES = [BlockSizes(block_n=16, block_k=32), BlockSizes(block_n=8, block_k=64, tiles_per_program=3, prefetch=1),
         BlockSizes(block_n=4, block_k=128, tiles_per_program=2, prefetch=3)]


@pytest.mark.parametrize("tiles", TILES, ids=["chunks", "ahead", "far_ahead"])
def test_gate_up_matches_reference(tiles):
    x, w, *_, experts, _, _ = _case(1)
    got = expert_gemv(x, w, experts, swiglu=True, block_sizes=tiles, interpret=True)
    want = expert_gemv_reference(x, w, experts, swiglu=True)
    assert got.shape == (3, F)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    # each row is its own expert's: a different choice changes only that row
    other = expert_gemv(x, w, experts.at[0, 1].set(0), swiglu=True, block_sizes=tiles, interpret=True)
    assert np.array_equal(np.asarray(other)[[0, 2]], np.asarray(got)[[0, 2]])
    assert not np.allclose(np.asarray(other)[1], np.asarray(got)[1])


@pytest.mark.parametrize("tiles", TILES, ids=["chunks", "ahead", "far_ahead"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_down_weighted_sum_matches_reference(tiles, with_residual):
    _, _, h, w, experts, combine, residual = _case(2)
    res = residual if with_residual else None
    got = expert_gemv(h, w, experts, combine=combine, residual=res, block_sizes=tiles, interpret=True)
    want = expert_gemv_reference(h, w, experts, combine=combine, residual=res)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    # the weighted sum, not its rows alone: with all the weight on one choice it is that expert's product
    one = expert_gemv(h, w, experts, combine=jnp.array([[0.0, 1.0, 0.0]]), block_sizes=tiles, interpret=True)
    np.testing.assert_allclose(np.asarray(one), np.asarray(h[1:2] @ w[experts[0, 1]].T), atol=2e-5, rtol=2e-5)


def test_bf16_rounds_each_expert_output_as_the_model():
    # bf16: each expert's sum rounded to bf16 before its weight, the weighted sum rounded, then the residual
    # add rounded (the grouped GEMM's output and the block's add): equal to the reference bit for bit here
    x, wgu, h, wd, experts, combine, residual = _case(3, jnp.bfloat16)
    tiles = BlockSizes(block_n=8, block_k=128)
    for got, want in ((expert_gemv(x, wgu, experts, swiglu=True, block_sizes=tiles, interpret=True),
                       expert_gemv_reference(x, wgu, experts, swiglu=True)),
                      (expert_gemv(h, wd, experts, combine=combine, residual=residual, block_sizes=tiles, interpret=True),
                       expert_gemv_reference(h, wd, experts, combine=combine, residual=residual))):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_errors_name_the_fix():
    x, wgu, h, wd, experts, combine, residual = _case(4)
    with pytest.raises(ValueError, match=r"a row per chosen expert \(1 x 3\)"):
        expert_gemv(h[:2], wd, experts, combine=combine, interpret=True)
    with pytest.raises(ValueError, match=r"a row per token \(1\)"):
        expert_gemv(jnp.concatenate([x, x]), wgu, experts, swiglu=True, interpret=True)
    with pytest.raises(ValueError, match=r"integer ids \[b, K\]"):
        expert_gemv(x, wgu, experts[0], swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="needs combine"):
        expert_gemv(h, wd, experts, interpret=True)
    with pytest.raises(ValueError, match="combine"):
        expert_gemv(h, wd, experts, combine=combine[:, :2], interpret=True)
    with pytest.raises(ValueError, match="share k and dtype"):
        expert_gemv(x, wgu[:, 0], experts, swiglu=True, interpret=True)
    with pytest.raises(ValueError, match=f"1..{MAX_CHOICES} chosen experts"):
        expert_gemv(x, wgu, jnp.zeros((1, MAX_CHOICES + 1), jnp.int32), swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="residual"):
        expert_gemv(h, wd, experts, combine=combine, residual=residual[:, :8], interpret=True)
    with pytest.raises(ValueError, match="block_n=16"):
        expert_gemv(h, wd[:, :40], experts, combine=combine, block_sizes=BlockSizes(block_n=16), interpret=True)


@pytest.mark.parametrize("experts, top_k, score, d", [(8, 2, "softmax", 64), (6, 2, "softmax", 64),
                                                      (64, 8, "sigmoid", 128), (8, 4, "softmax", 2048)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_route_rows_matches_the_models_router(experts, top_k, score, d, dtype):
    # each row's norm rounded as RMSNorm rounds it, then models/moe.py's route over the normed tokens: the
    # same ids (lowest first on ties), their weights to fp32 rounding; 6 experts: the bank padded to 8
    # inside; a row not live: ids -1 and weights 0, the other rows unchanged
    import models
    from models.moe import route
    rng = np.random.default_rng(experts + top_k + d)
    cfg = dataclasses.replace(models.preset("moe_tiny"), n_experts=experts, top_k=top_k, router_score=score, d_model=d)
    x = jnp.asarray(rng.normal(size=(3, d)), dtype)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, size=d), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, experts)) * 0.3, dtype)             # serving stores it in the compute dtype
    normed, ids, weights = route_rows(x, scale, w, top_k=top_k, score=score, interpret=True)
    xf = x.astype(jnp.float32)
    want_normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5) * scale).astype(dtype)
    _, _, want_w, want_i = route(cfg, want_normed[:, None], w.astype(jnp.float32))       # [3, 1, K] each
    # the sum of squares in another order: fp32 to its rounding, bf16 within one step of it
    tol = 1e-6 if dtype == jnp.float32 else 2.0 ** -8
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_i)[:, 0])
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w)[:, 0], atol=1e-6, rtol=1e-6)
    _, ids_live, w_live = route_rows(x, scale, w, top_k=top_k, score=score, live=jnp.array([True, False, True]),
                                     interpret=True)
    assert np.asarray(ids_live)[1].tolist() == [-1] * top_k and not np.asarray(w_live)[1].any()
    np.testing.assert_array_equal(np.asarray(ids_live)[[0, 2]], np.asarray(ids)[[0, 2]])
    # ties: equal logits go lowest id first, as lax.top_k
    _, tied, _ = route_rows(x[:1], scale, jnp.zeros((d, experts), dtype), top_k=top_k, score=score, interpret=True)
    assert np.asarray(tied).tolist() == [list(range(top_k))]
    with pytest.raises(ValueError, match="top_k=3 a power of two"):
        route_rows(x, scale, w, top_k=3, interpret=True)
    with pytest.raises(ValueError, match=r"live \[b\]"):
        route_rows(x, scale, w, top_k=top_k, live=jnp.ones(2, bool), interpret=True)
    if experts & (experts - 1):     # a bank not a power of two wide: read masked in place, no pad launch before
        text = jax.jit(lambda x, g, w: route_rows(x, g, w, top_k=top_k, score=score)).trace(x, scale, w).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "expert_route" in text and "stablehlo.pad" not in text


@pytest.mark.parametrize("tiles", TILES[:2], ids=["chunks", "ahead"])
def test_rows_share_experts_and_padding_rows_read_nothing(tiles):
    # Three tokens whose choices overlap (expert 3 in all of them), the middle one not live (ids -1, as
    # route_rows gives a padding row): each token's gate|up rows and weighted down sum equal the reference,
    # the dead row's pairs give 0 and its output is its residual; a dead pair's weights are never needed
    # (the bank's expert 0 NaN, which an unmasked -1 would read)
    x, wgu, h, wd, experts, combine, residual = _case(6, choices=((3, 1), (-1, -1), (4, 3)))
    combine = combine.at[1].set(0.0)
    got = expert_gemv(x, wgu, experts, swiglu=True, masked=True, block_sizes=tiles, interpret=True)    # [6, F]
    want = expert_gemv_reference(x, wgu, experts, swiglu=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[2:4].any()
    np.testing.assert_allclose(np.asarray(got)[0], np.asarray(expert_gemv_reference(x[:1], wgu, experts[:1, :1],
                                                                                      swiglu=True))[0], atol=2e-5)
    nan_bank = wd.at[0].set(jnp.nan)
    out = expert_gemv(got, nan_bank, experts, combine=combine, residual=residual, masked=True, block_sizes=tiles,
                      interpret=True)                                                                   # [3, K_IN]
    ref = expert_gemv_reference(got, wd, experts, combine=combine, residual=residual)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(out)[1], np.asarray(residual)[1])
    for r in (0, 2):          # a row's sum is its own choices' only
        alone = expert_gemv(got[2 * r:2 * r + 2], wd, experts[r:r + 1], combine=combine[r:r + 1],
                            block_sizes=tiles, interpret=True)
        np.testing.assert_allclose(np.asarray(out)[r] - np.asarray(residual)[r], np.asarray(alone)[0], atol=3e-5)


def test_default_tiles_are_decode_gemvs_as_a_benchmark_sets_them(monkeypatch):
    # the tiles a call names none of come from decode_gemv.default_block_sizes at call time (bench_decode's
    # tile variants swap it); a rolled tile runs unrolled, the same sums
    from pallas_kernels import decode_gemv
    rng = np.random.default_rng(5)
    x, w = jnp.asarray(rng.normal(size=(1, 64)), jnp.float32), jnp.asarray(rng.normal(size=(E, 2, F, 64)), jnp.float32)
    experts, seen = jnp.array([[4, 2]], jnp.int32), []

    def tiles(n, k, swiglu):
        seen.append((n, k, swiglu))
        return BlockSizes(block_n=8, block_k=128, tiles_per_program=2, prefetch=1, rolled=True)
    monkeypatch.setattr(decode_gemv, "default_block_sizes", tiles)
    got = expert_gemv(x, w, experts, swiglu=True, interpret=True)
    assert seen == [(F, 64, True)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expert_gemv_reference(x, w, experts, swiglu=True)),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("preset", ["moe_1b_8e", "moe_1b_64e"])
def test_lowers_for_cuda_at_the_presets_shapes(preset):
    # the Triton path without a GPU, with the default tiles: top-2 of 8 experts of 4,096, top-8 of 64 of 512
    import models
    cfg = models.preset(preset)
    d, f, e, k = cfg.d_model, cfg.expert_mlp_dim, cfg.n_experts, cfg.top_k
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    ids, f32 = jax.ShapeDtypeStruct((1, k), jnp.int32), jax.ShapeDtypeStruct((1, k), jnp.float32)
    for fn, args in ((lambda x, w, i: expert_gemv(x, w, i, swiglu=True), (s(1, d), s(e, 2, f, d), ids)),
                     (lambda h, w, i, c, r: expert_gemv(h, w, i, combine=c, residual=r), (s(k, f), s(e, d, f), ids, f32, s(1, d)))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "expert_gemv" in text
    # four rows with their loads masked (a decode bucket's padding rows): the predicated tiles lower too
    ids4, f32_4 = jax.ShapeDtypeStruct((4, k), jnp.int32), jax.ShapeDtypeStruct((4, k), jnp.float32)
    for fn, args in ((lambda x, w, i: expert_gemv(x, w, i, swiglu=True, masked=True), (s(4, d), s(e, 2, f, d), ids4)),
                     (lambda h, w, i, c, r: expert_gemv(h, w, i, combine=c, residual=r, masked=True),
                      (s(4 * k, f), s(e, d, f), ids4, f32_4, s(4, d)))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "expert_gemv" in text
    route = lambda x, g, w: route_rows(x, g, w, top_k=k, score=cfg.router_score)  # noqa: E731
    for scale in (jax.ShapeDtypeStruct((d,), jnp.float32), s(d)):
        text = jax.jit(route).trace(s(1, d), scale, s(d, e)).lower(lowering_platforms=("cuda",)).as_text()
        # the scale and the router as stored (serving's bf16): widened in the kernel, no convert launch before it
        assert "expert_route" in text and "stablehlo.convert" not in text
    live = jax.ShapeDtypeStruct((4,), jnp.bool_)
    text = jax.jit(lambda x, g, w, m: route_rows(x, g, w, top_k=k, live=m)).trace(s(4, d), s(d), s(d, e), live).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "expert_route" in text


@pytest.mark.gpu
def test_gpu_compiled_matches_reference_at_moe_1b_8e_shapes():
    d, f, e = 2048, 4096, 8
    rng = np.random.default_rng(0)
    bf = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, jnp.bfloat16)  # noqa: E731
    experts, combine = jnp.array([[6, 1]], jnp.int32), jnp.array([[0.7, 0.3]], jnp.float32)
    x, wgu, wd, res = bf(1, d), bf(e, 2, f, d, scale=d ** -0.5), bf(e, d, f, scale=f ** -0.5), bf(1, d)
    h = expert_gemv(x, wgu, experts, swiglu=True)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(expert_gemv_reference(x, wgu, experts, swiglu=True),
                                                                     np.float32), atol=3e-2, rtol=3e-2)
    got = expert_gemv(h, wd, experts, combine=combine, residual=res)
    want = expert_gemv_reference(h, wd, experts, combine=combine, residual=res)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
    # the routing launch: the normed token as RMSNorm rounds it, and the router's top 2 of a clear margin
    import models
    from models.moe import route
    scale, router = jnp.asarray(rng.uniform(0.5, 1.5, size=d), jnp.float32), bf(d, e, scale=0.3)
    normed, ids, weights = route_rows(x, scale, router, top_k=2)
    xf = x.astype(jnp.float32)
    want_normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5) * scale).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32), atol=1e-2, rtol=1e-2)
    _, _, want_w, want_i = route(models.preset("moe_1b_8e"), want_normed[None], router.astype(jnp.float32))
    assert np.asarray(ids).ravel().tolist() == np.asarray(want_i).ravel().tolist()
    np.testing.assert_allclose(np.asarray(weights).ravel(), np.asarray(want_w).ravel(), atol=1e-3, rtol=1e-3)
    # four tokens, one a padding row (ids -1: its loads masked off), two sharing expert 6
    experts, combine = jnp.array([[6, 1], [-1, -1], [6, 3], [2, 5]], jnp.int32), jnp.full((4, 2), 0.5, jnp.float32)
    x, res = bf(4, d), bf(4, d)
    h = expert_gemv(x, wgu, experts, swiglu=True, masked=True)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(expert_gemv_reference(x, wgu, experts, swiglu=True),
                                                                     np.float32), atol=3e-2, rtol=3e-2)
    got = expert_gemv(h, wd, experts, combine=combine.at[1].set(0.0), residual=res, masked=True)
    want = expert_gemv_reference(h, wd, experts, combine=combine.at[1].set(0.0), residual=res)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(res[1], np.float32))


@pytest.mark.parametrize("shared, top_k", [(0, 2), (32, 2), (0, 3)])
def test_moe_decode_step_matches_the_xla_block(shared, top_k):
    # A mixture of experts' decode layer through the kernels (q|k|v, attention, wo, then the routing launch
    # and the two expert launches, plus a shared expert's two) against the same block through XLA's
    # grouped GEMM dispatch (layers="fused"), in fp32; the jaxpr shows the launches. Top 3: the router in XLA
    from flax import nnx
    import models
    from meshlab.infer import kv_cache
    from meshlab.infer.programs import _fuse
    from models.serving import block_step
    cfg = dataclasses.replace(models.preset("moe_tiny"), dtype="float32", n_layers=1, shared_mlp_dim=shared,
                              top_k=top_k, init_std=0.2)
    block = nnx.merge(*nnx.split(models.build(cfg, nnx.Rngs(0)).layers))
    params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(nnx.state(block, nnx.Param)))
    (_, nk), (_, fused) = _fuse(params, decode=True), _fuse(params)
    one = nnx.merge(nnx.graphdef(block), jax.tree.map(lambda a: a[0], nnx.state(block)))
    page_size, pages = 4, 4
    cache = kv_cache.init_paged(cfg, pages + 1, page_size)
    cache = jax.tree.map(lambda c: jax.random.normal(jax.random.PRNGKey(3), c.shape, c.dtype), cache)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32).reshape(1, pages)
    positions = jnp.array([[9]], jnp.int32)
    attend = kv_cache.paged_attend(positions, jnp.ones((1, 1), bool), table, "pallas", interpret=True)
    x = jax.random.normal(jax.random.PRNGKey(4), (1, 1, cfg.d_model), jnp.float32)
    kernels = lambda x: block_step(one, x, positions, attend, 0, cache, fused=nk, kernels=True)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(lambda x: kernels(x)[0])(x))
    assert "name=expert_gemv_swiglu" in jaxpr and "name=expert_gemv_combine" in jaxpr
    assert ("name=decode_gemv_swiglu" in jaxpr) == bool(shared) and "grouped_matmul" not in jaxpr
    assert ("name=expert_route" in jaxpr) == (top_k == 2)
    got, got_cache = kernels(x)
    want, want_cache = block_step(one, x, positions, attend, 0, cache, fused=fused)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shared", [0, 32])
def test_moe_steps_past_one_token_read_the_nk_experts(shared, monkeypatch):
    # Three decode rows, the middle one padding (not valid), through nk_step with the experts in the expert
    # kernels (the attention's projections XLA's GEMMs), and a 4-token prompt chunk through the dropless
    # dispatch's grouped GEMMs over the experts' [n, k] matrices (read transposed): the live rows and the
    # chunk equal the XLA block over the experts' own; the layer's params no longer hold those (NaN
    # placeholders: never read). Past EXPERT_KERNEL_ROWS decode rows take the grouped GEMM
    from flax import nnx
    import models
    from meshlab.infer import kv_cache
    from meshlab.infer.programs import _fuse
    from models import serving
    cfg = dataclasses.replace(models.preset("moe_tiny"), dtype="float32", n_layers=1, shared_mlp_dim=shared,
                              init_std=0.2)
    block = nnx.merge(*nnx.split(models.build(cfg, nnx.Rngs(0)).layers))
    params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(nnx.state(block, nnx.Param)))
    (rest, nk), (_, fused) = _fuse(params, decode=True), _fuse(params)
    assert set(rest["moe"]) == {"router"}
    one = nnx.merge(nnx.graphdef(block), jax.tree.map(lambda a: a[0], nnx.state(block)))
    only_nk = nnx.merge(nnx.graphdef(block), jax.tree.map(lambda a: jnp.full(a.shape[1:], jnp.nan, a.dtype),
                                                          nnx.state(block)))
    nnx.update(only_nk, rest)                                  # the experts' own matrices NaN: must not be read
    page_size, pages = 4, 4
    for rows, t, start, valid in ((3, 1, 9, [True, False, True]), (1, 4, 5, [True])):
        cache = kv_cache.init_paged(cfg, rows * pages + 1, page_size)
        cache = jax.tree.map(lambda c: jax.random.normal(jax.random.PRNGKey(3), c.shape, c.dtype), cache)
        table = jnp.arange(1, rows * pages + 1, dtype=jnp.int32).reshape(rows, pages)
        positions = jnp.broadcast_to(start + jnp.arange(t), (rows, t)).astype(jnp.int32)
        live = jnp.broadcast_to(jnp.array(valid)[:, None], (rows, t))
        attend = kv_cache.paged_attend(positions, live, table, "pallas", interpret=True)
        x = jax.random.normal(jax.random.PRNGKey(4), (rows, t, cfg.d_model), jnp.float32)
        step = lambda x: serving.block_step(only_nk, x, positions, attend, 0, cache, fused=nk, kernels=True)  # noqa: E731
        jaxpr = str(jax.make_jaxpr(lambda x: step(x)[0])(x))
        assert ("name=expert_gemv" in jaxpr) == (t == 1) and _grouped(jaxpr) == (t > 1)
        got, _ = step(x)
        want, _ = serving.block_step(one, x, positions, attend, 0, cache, fused=fused)
        np.testing.assert_allclose(np.asarray(got)[np.array(valid)], np.asarray(want)[np.array(valid)],
                                   atol=2e-5, rtol=2e-5)
        assert np.isfinite(np.asarray(got)).all()
        if rows == 3:
            three = (positions, attend, cache)
            # the padding row reads no expert: other routed experts change the live rows only
            other = {**nk, "decode": {**nk["decode"], **{name: -nk["decode"][name] for name in
                                                         ("experts_gate_up_t", "experts_down_t")}}}
            moved, _ = serving.block_step(only_nk, x, positions, attend, 0, cache, fused=other, kernels=True)
            np.testing.assert_array_equal(np.asarray(moved)[1], np.asarray(got)[1])
            assert not np.allclose(np.asarray(moved)[[0, 2]], np.asarray(got)[[0, 2]])
    monkeypatch.setattr(serving, "EXPERT_KERNEL_ROWS", 2)
    positions, attend, cache = three
    jaxpr = str(jax.make_jaxpr(lambda x: serving.block_step(only_nk, x, positions, attend, 0, cache, fused=nk,
                                                             kernels=True)[0])(jnp.zeros((3, 1, cfg.d_model))))
    assert _grouped(jaxpr) and "name=expert_gemv" not in jaxpr


def _grouped(jaxpr: str) -> bool:
    """Whether a grouped GEMM runs (the Triton kernel on a GPU, lax.ragged_dot in XLA elsewhere)."""
    return "grouped_matmul" in jaxpr or "ragged_dot" in jaxpr
