"""Grouped matmul: the CPU path (jax.lax.ragged_dot) against the pure-jnp reference, forward and
gradients, empty groups and padding rows included; the triton kernels in interpret mode with tiny
tiles (ragged M, K, N, empty and sub-tile groups, padding rows holding NaN) and lowered for CUDA at a
llama-MoE shape; on a GPU the compiled triton path (`MESHLAB_TEST_GPU=1 python3 -m pytest -m gpu
tests/kernels/test_grouped_matmul.py`), on a Hopper GPU the Mosaic path against ragged_dot, and the
ragged all-to-all against the padded one on a one-device expert axis. FP8 operands (the kernels
models/fp8.py's grouped op calls): the three GEMMs in interpret mode against the product of the same
FP8 values in fp32, lowered for CUDA, and compiled on a GPU."""
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
# FP8: the contraction tiles (block_k, dw_block_m) at an FP8 MMA's least k, 32
TINY_FP8 = gmt.TritonTiles(block_m=16, block_n=16, block_k=32, dw_block_m=32, dw_block_k=16, dw_block_n=16)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


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


@pytest.fixture
def verified_triton_modules(monkeypatch):
    """A list that fills with the assembly of every Triton module lowered while the test runs, each
    verified first as Triton's parser on the GPU does (jax serialises modules unverified: a loop bound
    of the wrong type lowered on the CPU and failed only on the GPU)."""
    from jax._src.pallas.triton import lowering as triton_lowering
    lower, verified = triton_lowering.lower_jaxpr_to_triton_module, []

    def lower_and_verify(*args, **kw):
        result = lower(*args, **kw)
        assert result.module.operation.verify()
        verified.append(result.module.operation.get_asm())
        return result
    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return verified


def test_triton_lowers_for_cuda_at_a_llama_moe_shape(verified_triton_modules, monkeypatch):
    """The compiled path without a GPU: forward, dX and dW kernels lowered to Triton IR (masks, the
    dynamic loop bounds, the transposed weight read) at bf16 2048 x 1024 x 1536 with 8 experts and
    the default tiles, and in fp32 at ragged sizes (683 x 1000 x 1500, 16 experts), each module
    verified."""
    verified = verified_triton_modules
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


# -- FP8 operands -----------------------------------------------------------------------------------
def _fp8_operands(m, k, n, sizes, pad_nan=True, seed=0):
    """x [M, K] and w [G, K, N] in e4m3, dy [M, N] in e5m2, spread over their formats' ranges (|x| up to
    ~40, w ~4, dy ~4000), rows past sum(sizes) NaN (pad_nan). The GEMMs read them as FP8 bits."""
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    total = sum(sizes)
    x = (10 * jax.random.normal(kx, (m, k))).astype(E4M3)
    w = jax.random.normal(kw, (len(sizes), k, n)).astype(E4M3)
    dy = (1000 * jax.random.normal(kd, (m, n))).astype(E5M2)
    if pad_nan:
        x, dy = x.at[total:].set(jnp.nan), dy.at[total:].set(jnp.nan)
    return x, w, dy, jnp.asarray(sizes, jnp.int32)


def _fp8_gemms(backend, tiles=None, interpret=True):
    """jit of the three GEMMs of the FP8 op on FP8 operands, each scaled by 2^-3 (an inverse-scale
    product): forward x . w (bf16 out, fast accumulation), dX dy . w^T and dW x^T dy (fp32 out)."""
    def run(x, w, dy, gs):
        kw = dict(backend=backend, triton_tiles=tiles, interpret=interpret)
        y = gm.grouped_matmul_fp8(x, jnp.swapaxes(w, 1, 2), gs, 0.125, out_dtype=jnp.bfloat16, fast=True, **kw)
        dx = gm.grouped_matmul_fp8(dy, w, gs, 0.125, out_dtype=jnp.float32, **kw)
        dw = gm.grouped_matmul_fp8_dw(x.T, dy.T, gs, 0.125, out_dtype=jnp.float32, **kw)
        return y, dx, dw
    return jax.jit(run)


def _fp8_exact(x, w, dy, gs, ragged_dot=False):
    """The same products of the same FP8 values in fp32, times 2^-3: the pure-jnp reference (per row
    einsum), or lax.ragged_dot in fp32 (ragged_dot=True: the GPU's, the reference's [M, K, N] would
    take 13 GB at the llama-MoE shape). Padding rows are zero first (their NaN in no product)."""
    real = (jnp.arange(x.shape[0]) < jnp.sum(gs))[:, None]
    xf, dyf = (jnp.where(real, a.astype(jnp.float32), 0.0) for a in (x, dy))
    wf = w.astype(jnp.float32)
    if ragged_dot:
        mm = functools.partial(jax.lax.ragged_dot, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    else:
        mm = gm.grouped_matmul_reference
    y = mm(xf, wf, gs) * 0.125
    dx = mm(dyf, jnp.swapaxes(wf, 1, 2), gs) * 0.125
    _, vjp = jax.vjp(lambda v: mm(xf, v, gs), wf)
    return y, dx, vjp(dyf)[0] * 0.125


def _assert_fp8_results(got, want, total, empty, rtol):
    """Near-exact: fp32 sums of exact products differ by summation order only (bf16's output: its
    rounding, 2^-8); padding rows and an empty group's dW exactly zero; no NaN from the padding."""
    for name, a, b, dt in zip(("y", "dx", "dw"), got, want, (jnp.bfloat16, jnp.float32, jnp.float32)):
        assert a.dtype == dt, (name, a.dtype)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), name
        tol = max(rtol, 2.0 ** -8) if dt == jnp.bfloat16 else rtol
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
    assert not np.asarray(got[0][total:], np.float32).any() and not np.asarray(got[1][total:]).any()
    assert not np.asarray(got[2][empty]).any()


FP8_CASE = (50, 40, 24, [0, 7, 17, 3, 0, 15])   # ragged M, K (a 32-chunk and a tail), N; 8 padding rows


def test_triton_fp8_interpret_matches_the_same_fp8_values_in_fp32():
    """The Pallas interpreter runs the kernels' FP8 dots on the exact e4m3/e5m2 values with fp32 sums
    (its rule for the FP8 primitive: lax.dot_general of the FP8 arrays, which XLA:CPU widens to fp32
    first): the forward (e4m3 . e4m3), dX (e5m2 . e4m3^T) and dW (e4m3^T . e5m2), tiny tiles (group
    edges inside tiles, ragged tail chunks), an empty group first, padding rows of NaN. The xla
    backend, the CPU's path, gives the same numbers."""
    m, k, n, sizes = FP8_CASE
    x, w, dy, gs = _fp8_operands(m, k, n, sizes)
    want = _fp8_exact(x, w, dy, gs)
    got = _fp8_gemms("triton", TINY_FP8)(x, w, dy, gs)
    _assert_fp8_results(got, want, sum(sizes), sizes.index(0), 1e-5)
    _assert_fp8_results(_fp8_gemms("xla")(x, w, dy, gs), want, sum(sizes), sizes.index(0), 1e-5)


def test_triton_fp8_refuses_what_it_cannot_run():
    x, w, dy, gs = _fp8_operands(*FP8_CASE, pad_nan=False)
    tiles = gmt.TritonTiles.default(E4M3)
    with pytest.raises(ValueError, match="contraction-major"):       # the forward's w as stored: [G, K, N]
        gmt.gmm_call(x, w, gs, tiles, True, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="contraction-major"):
        gmt.dw_call(x, dy, gs, tiles, True, jnp.float32)
    with pytest.raises(ValueError, match="go in pairs"):
        gmt.gmm_call(x, w.astype(jnp.bfloat16), gs, tiles, True, trans_rhs=True, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="need out_dtype"):
        gmt.gmm_call(x, jnp.swapaxes(w, 1, 2), gs, tiles, True, trans_rhs=True)
    with pytest.raises(ValueError, match=r"must be >= 32 for FP8"):
        gm.grouped_matmul_fp8(x, jnp.swapaxes(w, 1, 2), gs, 1.0, out_dtype=jnp.bfloat16, backend="triton",
                              triton_tiles=TINY, interpret=True)
    with pytest.raises(ValueError, match="no FP8 path"):
        gm.grouped_matmul_fp8(x, jnp.swapaxes(w, 1, 2), gs, 1.0, out_dtype=jnp.bfloat16, backend="mosaic")
    # defaults: twice bf16's contraction chunk (1-byte operands, the same shared memory); Hopper's own
    assert gmt.TritonTiles.default(E5M2) == gmt.FP8_TILES and gmt.FP8_TILES.block_k == 2 * gmt.TritonTiles().block_k
    assert gm.resolve_fp8_backend("auto") == ("triton" if jax.default_backend() == "gpu" else "xla")


def test_fp8_takes_the_triton_kernels_on_hopper_too(monkeypatch):
    """auto resolves to mosaic on Hopper for 16-bit operands; FP8 has no Mosaic kernel and takes triton."""
    monkeypatch.setattr(gm, "_on_gpu", lambda: True)
    monkeypatch.setattr(gm, "on_hopper", lambda: True)
    assert gm.resolve_backend("auto") == "mosaic" and gm.resolve_fp8_backend("auto") == "triton"
    assert gm.resolve_fp8_backend("auto", interpret=True) == "xla" and gm.resolve_fp8_backend("xla") == "xla"


def test_triton_fp8_lowers_for_cuda_at_a_llama_moe_shape(verified_triton_modules, monkeypatch):
    """The FP8 op's forward, dX and dW kernels (models/fp8.py: quantization, transposed copies, scales)
    lowered to Triton IR and verified as Triton's parser on the GPU does (the approach of the bf16 test
    above), at bf16 2048 x 1024 x 1536 with 8 experts (the default FP8 tiles and Hopper's) and at ragged
    683 x 1000 x 1500 with 16 experts (masks, tail chunks). Every dot reads two FP8 operands, the
    second through a transpose (contraction-major), with its pair of formats and accumulation mode."""
    from models.fp8 import fp8_grouped_matmul
    verified = verified_triton_modules
    monkeypatch.setattr(gm, "_on_gpu", lambda: True)
    cases = ((2048, 1024, 1536, 8, False), (2048, 1024, 1536, 8, True), (683, 1000, 1500, 16, False))
    for m, k, n, g, hopper in cases:
        monkeypatch.setattr(gmt, "on_hopper", lambda hopper=hopper: hopper)
        s = lambda *shape, d=jnp.bfloat16: jax.ShapeDtypeStruct(shape, d)  # noqa: E731
        f = lambda x, w, gs: fp8_grouped_matmul(x, w, gs, backend="triton")  # noqa: E731
        text = _with_grads(f).trace(s(m, k), s(g, k, n), s(g, d=jnp.int32), s(m, n)).lower(
            lowering_platforms=("cuda",)).as_text()
        for name in ("grouped_matmul_fp8", "grouped_matmul_fp8_dx", "grouped_matmul_fp8_dw"):
            assert f'name = "{name}"' in text, name
    assert len(verified) == 9
    dots = [line for text in verified for line in text.splitlines() if "tt.dot " in line]
    assert len(dots) >= 9
    kinds = set()
    for line in dots:
        a, b = line.rsplit(" : ", 1)[1].split(" -> ")[0].split(" * ")
        assert "xf8E" in a and "xf8E" in b and line.endswith("xf32>"), line
        acc = int(line.split("maxNumImpreciseAcc = ")[1].split(" ")[0])
        kinds.add((a.split("x")[-1].rstrip(">"), b.split("x")[-1].rstrip(">"), acc))
    # forward e4m3 . e4m3 with fast accumulation; dX e5m2 . e4m3 and dW e4m3 . e5m2 promoting to fp32
    # once per contraction tile (64 at the default tiles, 128 at Hopper's)
    assert {(a, b) for a, b, _ in kinds} == {("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")}
    assert all((acc == 1 << 30) == (a == b) for a, b, acc in kinds), kinds
    assert {acc for a, b, acc in kinds if a != b} == {64, 128}
    transposes = [line for text in verified for line in text.splitlines() if "tt.trans" in line]
    assert len(transposes) == len(dots) and all("xf8E" in line for line in transposes)


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [0, 100])
def test_triton_fp8_compiled_matches_the_same_fp8_values_on_gpu(pad):
    """The compiled FP8 kernels at the default tiles (Hopper's on an H100/H200), llama-MoE shape 2048 x
    1024 x 1536 with 8 skewed groups (one empty), `pad` padding rows of NaN, memory poisoned with NaN
    first, against the exact fp32 products of the same FP8 values: the forward's fast accumulation and
    the gradients' per-tile promotion both within 1e-2 (the bf16 output alone rounds by 2^-9)."""
    m, k, n, experts = 2048, 1024, 1536, 8
    rng = np.random.default_rng(experts + pad)
    sizes = rng.multinomial(m - pad, rng.dirichlet(np.full(experts, 2.0))).tolist()
    sizes[0], sizes[1] = sizes[0] + sizes[1], 0
    x, w, dy, gs = _fp8_operands(m, k, n, sizes, pad_nan=pad > 0)
    f = _fp8_gemms("auto", interpret=False)
    f.lower(x, w, dy, gs).compile()
    poison = [jnp.full((64 << 20,), jnp.nan, jnp.float32) for _ in range(4)]
    jax.block_until_ready(poison)
    del poison
    got = f(x, w, dy, gs)
    want = jax.jit(functools.partial(_fp8_exact, ragged_dot=True))(x, w, dy, gs)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))
    assert not np.asarray(got[0][m - pad:], np.float32).any() and not np.asarray(got[1][m - pad:]).any()
    assert not np.asarray(got[2][1]).any()                                        # the empty group
