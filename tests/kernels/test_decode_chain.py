"""pallas_kernels/decode_chain.py against four decode_gemv references (interpret mode), its counters, errors, CUDA lowering."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_chain import ChainTiles, decode_mlp_chain, decode_mlp_chain_reference, sync_counters
from pallas_kernels.decode_gemv import BlockSizes

pytestmark = pytest.mark.cheap_codegen

SMALL = ChainTiles(wo=BlockSizes(block_n=8, block_k=32), gate_up=BlockSizes(block_n=8, tiles_per_program=2, prefetch=1),
                   down=BlockSizes(block_n=4, block_k=64, prefetch=1), qkv=BlockSizes(block_n=16, rolled=True,
                                                                                         tiles_per_program=2, prefetch=1))


def _layer(seed, m, d=64, hhd=96, f=128, n_qkv=160, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    arr = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, dtype)   # noqa: E731
    return dict(o=arr(m, hhd), x=arr(m, d), wo=arr(d, hhd, scale=hhd ** -0.5),
                s_mlp=jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32), w_gate_up=arr(2, f, d, scale=d ** -0.5),
                w_down=arr(d, f, scale=f ** -0.5)), (arr(n_qkv, d, scale=d ** -0.5),
                                                     jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32))


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_qkv", [False, True])
def test_matches_reference_and_leaves_the_counters_zeroed(m, with_qkv):
    # wo's k = 96 in three chunks of 32 (a loop), gate|up two tiles a program, down k = 128 in two
    # unrolled chunks, q|k|v rolled tiles: every gemv_program path behind a wait
    args, qkv_w = _layer(m, m)
    nq = qkv_w if with_qkv else None
    sync = sync_counters()
    for _ in range(2):                               # the second launch starts from the first's counters
        x2, qkv, sync = decode_mlp_chain(**args, sync=sync, next_qkv=nq, tiles=SMALL, interpret=True)
        np.testing.assert_array_equal(np.asarray(sync), 0)
    want_x2, want_qkv = decode_mlp_chain_reference(**args, next_qkv=nq)
    np.testing.assert_allclose(np.asarray(x2), np.asarray(want_x2), atol=2e-5, rtol=2e-5)
    if with_qkv:
        np.testing.assert_allclose(np.asarray(qkv), np.asarray(want_qkv), atol=2e-5, rtol=2e-5)
    else:
        assert qkv is None


def test_bf16_matches_reference():
    args, qkv_w = _layer(5, 1, dtype=jnp.bfloat16)
    x2, qkv, _ = decode_mlp_chain(**args, sync=sync_counters(), next_qkv=qkv_w, tiles=SMALL, interpret=True)
    want_x2, want_qkv = decode_mlp_chain_reference(**args, next_qkv=qkv_w)
    np.testing.assert_allclose(np.asarray(x2, np.float32), np.asarray(want_x2, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(qkv, np.float32), np.asarray(want_qkv, np.float32), atol=2e-2, rtol=2e-2)


def test_errors_name_the_fix():
    args, _ = _layer(0, 1)
    with pytest.raises(ValueError, match=r"down weights .* must be \(64, 128\)"):
        decode_mlp_chain(**dict(args, w_down=args["w_down"].T), sync=sync_counters(), tiles=SMALL, interpret=True)
    with pytest.raises(ValueError, match="sync_counters"):
        decode_mlp_chain(**args, sync=jnp.zeros((2,), jnp.int32), tiles=SMALL, interpret=True)
    with pytest.raises(ValueError, match="multiple of block_n"):
        decode_mlp_chain(**args, sync=sync_counters(), tiles=ChainTiles(wo=BlockSizes(block_n=128)), interpret=True)


@pytest.mark.parametrize("tiles", [ChainTiles(), ChainTiles(num_warps=4)])
def test_lowers_for_cuda_at_llama3_1b_shapes(tiles):
    # the Triton lowering of the shipped tiles at llama3_1b's shapes (no GPU needed to lower)
    d, f, hhd, nq, dt = 2048, 8192, 2048, 3072, jnp.bfloat16
    s = lambda *shape, dtype=dt: jax.ShapeDtypeStruct(shape, dtype)   # noqa: E731
    f32 = jnp.float32
    lowered = jax.jit(lambda *a: decode_mlp_chain(*a[:7], next_qkv=a[7:], tiles=tiles)).trace(
        s(1, hhd), s(1, d), s(d, hhd), s(d, dtype=f32), s(2, f, d), s(d, f), s(4, dtype=jnp.int32), s(nq, d),
        s(d, dtype=f32)).lower(lowering_platforms=("cuda",))
    assert "decode_mlp_chain_qkv" in lowered.as_text()


def test_polling_by_atomics_matches_and_bad_options_are_named():
    args, _ = _layer(2, 2)
    x2, _, sync = decode_mlp_chain(**args, sync=sync_counters(), tiles=dataclasses.replace(SMALL, poll="atomic"),
                                   interpret=True)
    np.testing.assert_allclose(np.asarray(x2), np.asarray(decode_mlp_chain_reference(**args)[0]), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(sync), 0)
    with pytest.raises(ValueError, match="poll='spin' must be 'load' or 'atomic'"):
        ChainTiles(poll="spin")
