"""Grouped matmul: the CPU path (jax.lax.ragged_dot) against the pure-jnp reference, forward and
gradients, empty groups and padding rows included; the triton kernels in interpret mode with tiny
tiles (ragged M, K, N, empty and sub-tile groups, padding rows holding NaN) and lowered for CUDA at a
llama-MoE shape; on a GPU the compiled triton path (`MESHLAB_TEST_GPU=1 python3 -m pytest -m gpu
tests/kernels/test_grouped_matmul.py`), on a Hopper GPU the Mosaic path against ragged_dot, and the
ragged all-to-all against the padded one on a one-device expert axis."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm
from pallas_kernels import grouped_matmul_triton as gmt
from tests.helpers import rel_err

# Compiling dominates (interpret mode, tiny shapes): cheap_codegen, CPU only (the GPU cases are unaffected).
pytestmark = pytest.mark.cheap_codegen
SIZES = [5, 0, 11, 3]                    # an empty group; 19 of 24 rows used: 5 padding rows
# 16-row/column tiles in interpret mode: many tiles, so group edges inside tiles, tiles of the
# padding and the ragged last tiles of M, K and N all occur at small sizes
TINY = gmt.TritonTiles(block_m=16, block_n=16, block_k=16, dw_block_m=16, dw_block_k=16, dw_block_n=16)


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


def _with_grads(f):
    """jit of (x, w, gs, ct) -> (f(x, w, gs), dx, dw) under the cotangent ct: one program per case."""
    def run(x, w, gs, ct):
        out, vjp = jax.vjp(lambda x, w: f(x, w, gs), x, w)
        return (out, *vjp(ct.astype(out.dtype)))
    return jax.jit(run)


# (m, k, n, sizes, dtype, tiles): ragged everything with padding rows, in fp32 and bf16; then every
# dimension a whole number of tiles and every row in a group (the unmasked loads and stores), at the
# default tiles shrunk to the shapes
TRITON_CASES = [
    pytest.param(50, 40, 24, [0, 7, 17, 3, 0, 15], jnp.float32, TINY, id="ragged-fp32"),
    pytest.param(50, 40, 24, [0, 7, 17, 3, 0, 15], jnp.bfloat16, TINY, id="ragged-bf16"),
    pytest.param(64, 32, 32, [16, 0, 30, 18], jnp.float32, None, id="whole-tiles-fp32"),
]


@pytest.mark.parametrize("m,k,n,sizes,dtype,tiles", TRITON_CASES)
def test_triton_interpret_matches_reference_forward_and_grads(m, k, n, sizes, dtype, tiles):
    """Empty groups (the first among them), groups smaller than a tile and groups across tile edges;
    M, K, N not multiples of the tiles. Padding rows of x hold NaN: no result may read them, their
    outputs and dx rows are exactly zero."""
    x, w, gs, ct = _inputs(m, k, n, sizes, dtype)
    total = sum(sizes)
    x_nan = x.at[total:].set(jnp.nan)
    out, dx, dw = _with_grads(lambda x, w, gs: gm.grouped_matmul(x, w, gs, backend="triton", triton_tiles=tiles,
                                                                 interpret=True))(x_nan, w, gs, ct)
    ref, rdx, rdw = _with_grads(gm.grouped_matmul_reference)(x, w, gs, ct)
    assert out.dtype == dx.dtype == dw.dtype == dtype and out.shape == (m, n) and dw.shape == w.shape
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=2e-2, atol=1e-1)
    for name, a, b in (("out", out, ref), ("dx", dx, rdx), ("dw", dw, rdw)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, err_msg=name, **tol)
    assert not np.asarray(out[total:], np.float32).any() and not np.asarray(dx[total:], np.float32).any()
    assert not np.asarray(dw[sizes.index(0)], np.float32).any()                 # an empty group: dW = 0


@pytest.mark.parametrize("backend, interpret", [("xla", False), ("triton", True)])
def test_nk_layout_matches_the_kn_reference(backend, interpret):
    # grouped_matmul_nk: each group's matrix stored [N, K] (serving's expert copies), read transposed by the
    # triton kernels in place; rows past the groups' total come out zero, as grouped_matmul's
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(37, 48)), jnp.float32)
    w_nk = jnp.asarray(rng.normal(size=(5, 80, 48)), jnp.float32)
    sizes = jnp.array([7, 0, 12, 9, 6], jnp.int32)                                  # 34 of 37 rows
    got = gm.grouped_matmul_nk(x, w_nk, sizes, backend=backend, interpret=interpret)
    want = gm.grouped_matmul_reference(x, jnp.swapaxes(w_nk, 1, 2), sizes)
    assert rel_err(got, want) < 1e-6 and not np.asarray(got[34:]).any()
    with pytest.raises(ValueError, match=r"w_nk \(5, 80, 47\) \[G, N, K\]"):
        gm.grouped_matmul_nk(x, w_nk[..., :47], sizes, backend=backend, interpret=interpret)


def test_nk_tiles_by_rows_and_their_kernels_match_the_reference(monkeypatch):
    """Decode rows on Hopper take the few-row tile (16 rows, narrow columns), prompt chunks and 4-byte
    inputs the defaults; the few-row tile's transposed read matches the reference at ragged M, K and N
    (an empty group, padding rows) in interpret mode, and lowers for CUDA at moe_1b_8e's down shape."""
    monkeypatch.setattr(gm, "on_hopper", lambda: True)
    monkeypatch.setattr(gmt, "on_hopper", lambda: True)
    few, limit = gm.HOPPER_FEW_ROWS, gm.FEW_ROWS
    assert [gm.nk_tiles(m, jnp.bfloat16) for m in (1, limit, limit + 1, 4096)] == \
        [few, few, gmt.HOPPER_BF16, gmt.HOPPER_BF16]
    assert gm.nk_tiles(32, jnp.float32) == gmt.TritonTiles.default(jnp.float32)
    monkeypatch.setattr(gm, "on_hopper", lambda: False)
    monkeypatch.setattr(gmt, "on_hopper", lambda: False)
    assert gm.nk_tiles(32, jnp.bfloat16) == gmt.TritonTiles()
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(37, 300)), jnp.float32)                         # K: past one 256 chunk
    w_nk = jnp.asarray(rng.normal(size=(5, 80, 300)), jnp.float32)                   # N: past one 64 column tile
    sizes = jnp.array([9, 0, 17, 3, 5], jnp.int32)                                 # 34 of 37 rows
    want = gm.grouped_matmul_reference(x, jnp.swapaxes(w_nk, 1, 2), sizes)
    got = gmt.gmm_call(x, w_nk, sizes, few, True, trans_rhs=True)
    assert rel_err(got, want) < 1e-6 and not np.asarray(got[34:]).any()
    s = lambda *shape, d=jnp.bfloat16: jax.ShapeDtypeStruct(shape, d)  # noqa: E731
    text = jax.jit(lambda a, b, g: gmt.gmm_call(a, b, g, few, False, trans_rhs=True)).trace(
        s(32, 4096), s(8, 2048, 4096), s(8, d=jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert 'name = "grouped_matmul_triton_dx"' in text


def test_triton_row_tiles_cover_each_row_once_inside_its_group():
    """The forward's tile list: every row of [0, M) in exactly one used tile, whose group is the row's
    (G for the padding), inside one aligned block_m tile; never more than cdiv(M, block_m) + G tiles."""
    m = 70
    plan_of = jax.jit(gmt.row_tiles, static_argnums=(1, 2))
    for block_m, sizes in itertools.product((16, 32), ([0, 7, 20, 3, 0, 12], [70, 0, 0, 0, 0, 0], [0] * 6, [1] * 6,
                                                       [40, 50, 0, 0, 0, 0])):   # the last: > M, clipped
        plan = np.asarray(plan_of(jnp.asarray(sizes, jnp.int32), m, block_m))
        assert plan.shape == (4, -(-m // block_m) + len(sizes))
        ends = np.minimum(np.cumsum(sizes), m)
        owner = np.searchsorted(ends, np.arange(m), side="right")                  # len(sizes): padding
        hits = np.zeros(m, int)
        for g, r0, lo, hi in plan.T:
            assert r0 % block_m == 0 and r0 <= lo <= hi <= min(r0 + block_m, m), (sizes, plan.T)
            hits[lo:hi] += 1
            assert (owner[lo:hi] == g).all(), (sizes, g, lo, hi)
        assert (hits == 1).all(), (sizes, hits)


def test_triton_lowers_for_cuda_at_a_llama_moe_shape(monkeypatch):
    """The compiled path without a GPU: forward, dX and dW kernels lowered to Triton IR (masks, the
    dynamic loop bounds, the transposed weight read) at bf16 2048 x 1024 x 1536 with 8 experts and
    the default tiles, and in fp32 at ragged sizes (683 x 1000 x 1500, 16 experts). Each module is
    verified as Triton's parser on the GPU does (jax serialises it unverified: a loop bound of the
    wrong type lowered here and failed only there)."""
    from jax._src.pallas.triton import lowering as triton_lowering
    lower, verified = triton_lowering.lower_jaxpr_to_triton_module, []

    def lower_and_verify(*args, **kw):
        result = lower(*args, **kw)
        assert result.module.operation.verify()
        verified.append(result.module.operation.get_asm())
        return result
    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    cases = ((jnp.bfloat16, (2048, 1024, 1536, 8), None), (jnp.float32, (683, 1000, 1500, 16), None),
             (jnp.bfloat16, (2048, 1024, 1536, 8), gmt.HOPPER_BF16))
    for dt, (m, k, n, g), tiles in cases:
        s = lambda *shape, d=dt: jax.ShapeDtypeStruct(shape, d)  # noqa: E731
        f = functools.partial(gmt.grouped_matmul_triton, tiles=tiles)
        text = _with_grads(f).trace(s(m, k), s(g, k, n), s(g, d=jnp.int32), s(m, n)).lower(
            lowering_platforms=("cuda",)).as_text()
        for name in ("grouped_matmul_triton", "grouped_matmul_triton_dx", "grouped_matmul_triton_dw"):
            assert f'name = "{name}"' in text, (dt, name)
    assert len(verified) == 9
    # the defaults: Hopper's measured tile in bf16 only there; 4-byte inputs keep half the stages everywhere
    monkeypatch.setattr(gmt, "on_hopper", lambda: False)
    assert gmt.TritonTiles.default(jnp.bfloat16) == gmt.TritonTiles()
    monkeypatch.setattr(gmt, "on_hopper", lambda: True)
    assert gmt.TritonTiles.default(jnp.bfloat16) == gmt.HOPPER_BF16
    assert gmt.TritonTiles.default(jnp.float32).num_stages == 2
    # fp32 operands multiply exactly: Triton's default (tf32) rounds them (3e-4 off on an H100)
    f32_dots = [line for text in verified for line in text.splitlines() if "tt.dot " in line and "xf32> * tensor" in line]
    assert f32_dots and not any("inputPrecision" in line for line in f32_dots)     # IEEE is the unprinted default


def test_triton_backend_choice_and_errors():
    x, w, gs, _ = _inputs()
    assert gm.resolve_backend("triton", interpret=True) == "triton"
    assert gm.resolve_backend("auto", interpret=True) == "xla"
    if jax.default_backend() != "gpu":
        assert gm.resolve_backend("auto") == "xla"
        with pytest.raises(ValueError, match="backend='triton' needs a CUDA GPU, or interpret=True"):
            gm.grouped_matmul(x, w, gs, backend="triton")
    with pytest.raises(ValueError, match=r"TritonTiles.block_k=24 must be a power of two >= 16"):
        gmt.grouped_matmul_triton(x, w, gs, tiles=gmt.TritonTiles(block_k=24), interpret=True)
    with pytest.raises(ValueError, match=r"x.dtype=dtype\('int32'\) must be one of bfloat16, float16, float32"):
        gmt.grouped_matmul_triton(x.astype(jnp.int32), w.astype(jnp.int32), gs, interpret=True)
    with pytest.raises(ValueError, match="do not fit together"):
        gmt.grouped_matmul_triton(x, w[:, :3], gs, interpret=True)


@pytest.mark.parametrize("hopper", [True, False])
def test_auto_takes_triton_on_every_gpu(monkeypatch, hopper):
    """auto is triton on any GPU (faster than Mosaic on an H100: pallas_kernels/grouped_matmul.py);
    mosaic is still there when asked for on Hopper, and refused elsewhere with the fix named."""
    monkeypatch.setattr(gm, "_on_gpu", lambda: True)
    monkeypatch.setattr(gm, "on_hopper", lambda: hopper)
    assert gm.resolve_backend("auto") == "triton" and gm.resolve_backend("auto", interpret=True) == "xla"
    if hopper:
        assert gm.resolve_backend("mosaic") == "mosaic"
    else:
        with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU.*use backend='triton'"):
            gm.resolve_backend("mosaic")


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
@pytest.mark.parametrize("m,k,n,experts,pad,dtype", [
    pytest.param(2048, 1024, 1536, 8, 0, jnp.bfloat16, id="llama-moe-bf16"),      # every row in a group
    pytest.param(2048, 1024, 1536, 8, 100, jnp.bfloat16, id="llama-moe-padded-bf16"),
    pytest.param(683, 1000, 1500, 16, 37, jnp.float32, id="ragged-fp32"),         # M, K, N off the tiles
])
def test_triton_compiled_matches_reference_on_gpu(m, k, n, experts, pad, dtype):
    """The compiled Triton kernels at the default tiles against lax.ragged_dot (fp32 result) and the
    xla backend's gradients: uneven groups (a skewed multinomial), an empty group, `pad` padding rows
    holding NaN, and memory poisoned with NaN first so that an element nothing wrote shows."""
    rng = np.random.default_rng(experts + pad)
    sizes = rng.multinomial(m - pad, rng.dirichlet(np.full(experts, 2.0))).tolist()
    sizes[0], sizes[1] = sizes[0] + sizes[1], 0       # an empty group; the total stays m - pad
    x, w, gs, ct = _inputs(m, k, n, sizes, dtype)
    x_nan = x.at[m - pad:].set(jnp.nan)
    f = _with_grads(lambda x, w, gs: gm.grouped_matmul(x, w, gs, backend="triton"))
    f.lower(x_nan, w, gs, ct).compile()
    poison = [jnp.full((64 << 20,), jnp.nan, jnp.float32) for _ in range(4)]
    jax.block_until_ready(poison)
    del poison
    out, dx, dw = f(x_nan, w, gs, ct)
    ref = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    with jax.default_matmul_precision("highest"):
        _, rdx, rdw = _with_grads(lambda x, w, gs: gm.grouped_matmul(x, w, gs, backend="xla"))(x, w, gs, ct)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
    for name, a, b in (("out", out, ref), ("dx", dx, rdx), ("dw", dw, rdw)):
        assert a.dtype == dtype, name
        assert rel_err(a, b) < tol, name
    assert not np.asarray(out[m - pad:], np.float32).any() and not np.asarray(dx[m - pad:], np.float32).any()
    assert not np.asarray(dw[1], np.float32).any()                                # the empty group


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
