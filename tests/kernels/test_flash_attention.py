"""FlashAttention kernel vs the float32 reference: forward, dq/dk/dv, lse, block pieces, errors.

Each check runs twice: on CPU in interpret mode with tiny tiles (many tiles per sequence, so loop
bounds, causal skipping and ragged-edge masking are all exercised), and marked `gpu` compiled on the
GPU with the default tiles (`MESHLAB_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels/test_flash_attention.py`).
Cases are pairwise combinations, not a full product, so the CPU file stays fast.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import (BlockSizes, flash_attention, flash_attention_block_bwd,
                                            flash_attention_block_fwd, flash_attention_reference)
from tests.helpers import attention_inputs as _inputs, rel_err as _rel

# Compiling dominates (interpret mode, tiny shapes): cheap_codegen, CPU only (the GPU cases are unaffected).
pytestmark = pytest.mark.cheap_codegen
TINY = BlockSizes(block_q=32, block_k=16, num_warps=4, block_q_dq=16, block_k_dq=32,
                  block_q_dkv=16, block_k_dkv=32, num_warps_bwd=4)
MODES = [pytest.param("cpu", id="interpret"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _kw(mode):
    return dict(block_sizes=TINY, interpret=True) if mode == "cpu" else dict(block_sizes=None, interpret=False)


def _jit(mode, f):
    # interpret-mode kernels become large XLA CPU programs; LLVM's optimiser is most of their compile
    # time and buys nothing for a correctness check, so the CPU runs skip it
    return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0} if mode == "cpu" else None)


def _scale_len(mode, n):
    # GPU tiles are 64-128 long: stretch lengths so that there, too, several tiles and ragged ends occur
    return n if mode == "cpu" else n * 8






def _segments(seed, b, n, n_docs=3):
    # sorted random ids: packed documents of random lengths
    return jnp.sort(jax.random.randint(jax.random.key(seed), (b, n), 0, n_docs), axis=1).astype(jnp.int32)


# (b, q_len, kv_len, heads, kv_heads, head_dim, causal, segments, dtype): pairwise coverage of
# causal/full x GQA 1/4/8 x block-multiple/ragged x q_len<kv_len x segments x bf16/fp16 x d 64/128
CASES = [
    (2, 64, 64, 2, 2, 64, False, None, jnp.bfloat16),       # full, MHA, multiples
    (1, 50, 50, 4, 1, 64, True, None, jnp.bfloat16),        # causal, GQA 4, ragged
    (1, 24, 72, 8, 1, 64, True, None, jnp.float16),         # causal, GQA 8 (MQA), q_len < kv_len, fp16
    (2, 46, 46, 4, 1, 128, False, "one", jnp.bfloat16),     # full, GQA 4, ragged, one segment array, d=128
    (1, 40, 72, 2, 2, 64, True, "pair", jnp.float16),       # causal, q_len < kv_len, (q_ids, kv_ids)
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'causal' if c[6] else 'full'}-g{c[3] // c[4]}-"
                         f"{c[1]}x{c[2]}-d{c[5]}-{c[7] or 'noseg'}-{jnp.dtype(c[8]).name}")
def test_forward_and_grads_match_reference(mode, case):
    b, sq, sk, h, kvh, d, causal, seg, dtype = case
    sq, sk = _scale_len(mode, sq), _scale_len(mode, sk)
    q, k, v, do = _inputs(sq * 7 + sk + h, b, sq, sk, h, kvh, d, dtype)
    segs = None
    if seg == "one":
        segs = _segments(1, b, sq)
    elif seg == "pair":  # kv ids cover every q id, so no query row is left with nothing to see
        segs = (_segments(2, b, sq), _segments(3, b, sk))
    kw = _kw(mode)

    def ours(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segs, **kw), q, k, v)
        return o, vjp(do)

    def ref(q, k, v, do):
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        o, vjp = jax.vjp(lambda q, k, v: flash_attention_reference(q, k, v, causal=causal, segment_ids=segs),
                         f32(q), f32(k), f32(v))
        return o, vjp(f32(do))

    # interpret mode starts outputs as NaN, so _rel's finiteness check doubles as the poison check
    (o, grads), (ro, rgrads) = _jit(mode, ours)(q, k, v, do), jax.jit(ref)(q, k, v, do)
    assert o.dtype == dtype and o.shape == q.shape
    assert _rel(o, ro) < 1e-2
    for name, g, rg in zip("qkv", grads, rgrads):
        assert g.shape == rg.shape
        assert _rel(g, rg) < 2e-2, f"d{name}"


@pytest.mark.parametrize("mode", MODES)
def test_lse_and_its_gradient(mode):
    """return_lse gives the natural-log lse, and a loss that uses it differentiates correctly."""
    sq = _scale_len(mode, 40)
    q, k, v, _ = _inputs(11, 1, sq, sq, 4, 2, 64, jnp.bfloat16)
    kw = _kw(mode)

    def run(fn, q, k, v):
        def loss(q, k, v):
            o, lse = fn(q, k, v)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(lse)), lse
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    ours = lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True, **kw)  # noqa: E731
    ref = lambda q, k, v: flash_attention_reference(q, k, v, causal=True, return_lse=True)  # noqa: E731
    g, lse = _jit(mode, lambda *a: run(ours, *a))(q, k, v)
    rg, rlse = jax.jit(lambda *a: run(ref, *a))(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert lse.shape == (1, 4, sq) and lse.dtype == jnp.float32
    assert _rel(lse, rlse) < 1e-3
    for a, b in zip(g, rg):
        assert _rel(a, b) < 2e-2


@pytest.mark.parametrize("mode", MODES)
def test_block_pieces_compose_with_lse_merge(mode):
    """Two kv blocks through the block forward, merged by the lse rule, equal the whole; the block
    backward with the global lse and delta gives gradients that add up to the whole's."""
    n = _scale_len(mode, 32)
    q, k, v, do = _inputs(5, 1, n, 2 * n, 2, 1, 64, jnp.bfloat16)
    kw = _kw(mode)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def pieces(q, k, v, do):
        # the queries are the last n positions of 2n: kv block 0 is fully visible, block 1 the diagonal
        ka, kb, va, vb = k[:, :n], k[:, n:], v[:, :n], v[:, n:]
        o1, l1 = flash_attention_block_fwd(q, ka, va, causal_offset=n, out_dtype=jnp.float32, **kw)
        o2, l2 = flash_attention_block_fwd(q, kb, vb, causal_offset=0, out_dtype=jnp.float32, **kw)
        lse = jnp.logaddexp(l1, l2)
        w = lambda l: jnp.exp(l - lse).transpose(0, 2, 1)[..., None]  # noqa: E731
        o = w(l1) * o1 + w(l2) * o2
        delta = jnp.einsum("bqhd,bqhd->bhq", f32(do), o)
        g1 = flash_attention_block_bwd(q, ka, va, do, lse, delta, causal_offset=n, **kw)
        g2 = flash_attention_block_bwd(q, kb, vb, do, lse, delta, causal_offset=0, **kw)
        return o, lse, g1, g2

    def whole(q, k, v, do):
        (ro, rlse), vjp = jax.vjp(lambda *a: flash_attention_reference(*a, causal=True, return_lse=True),
                                  f32(q), f32(k), f32(v))
        return ro, rlse, vjp((f32(do), jnp.zeros_like(rlse)))

    o, lse, g1, g2 = _jit(mode, pieces)(q, k, v, do)
    ro, rlse, (rdq, rdk, rdv) = jax.jit(whole)(q, k, v, do)
    assert _rel(o, ro) < 1e-2 and _rel(lse, rlse) < 1e-3
    assert all(x.dtype == jnp.float32 for x in g1 + g2)
    assert _rel(g1[0] + g2[0], rdq) < 2e-2
    assert _rel(jnp.concatenate([g1[1], g2[1]], 1), rdk) < 2e-2
    assert _rel(jnp.concatenate([g1[2], g2[2]], 1), rdv) < 2e-2


@pytest.mark.gpu
def test_every_output_element_written_on_gpu_poisoned_memory():
    """Fill the allocator's memory with NaN, free it, then run: the outputs likely land in the
    poisoned buffers, so an element nothing wrote shows up as NaN."""
    q, k, v, do = _inputs(9, 2, 1000, 1100, 8, 2, 128, jnp.bfloat16)
    f = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: flash_attention(*a, causal=True), q, k, v)[1](do)
                + (flash_attention(q, k, v, causal=True, return_lse=True),))
    f.lower(q, k, v, do).compile()
    poison = [jnp.full((64 << 20,), jnp.nan, jnp.float32) for _ in range(4)]
    jax.block_until_ready(poison)
    del poison
    dq, dk, dv, (out, lse) = f(q, k, v, do)
    for x in (dq, dk, dv, out, lse):
        assert np.isfinite(np.asarray(x, np.float32)).all()
    ro = flash_attention_reference(q, k, v, causal=True)
    assert _rel(out, ro) < 1e-2


def test_rows_with_no_visible_key_give_zero():
    q, k, v, _ = _inputs(3, 1, 16, 16, 2, 2, 64, jnp.bfloat16)
    q_ids = jnp.zeros((1, 16), jnp.int32).at[:, 8:].set(7)   # id 7 exists in no key
    kv_ids = jnp.zeros((1, 16), jnp.int32)
    out, lse = _jit("cpu", lambda q, k, v: flash_attention(q, k, v, segment_ids=(q_ids, kv_ids), return_lse=True,
                                                          block_sizes=TINY, interpret=True))(q, k, v)
    assert np.all(np.asarray(out[:, 8:], np.float32) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, 8:])))
    assert _rel(out[:, :8], flash_attention_reference(q, k, v, segment_ids=(q_ids, kv_ids))[:, :8]) < 1e-2


@pytest.mark.parametrize("kwargs, shapes, match", [
    ({}, ((1, 16, 3, 64), (1, 16, 2, 64)), r"query heads h=3 must be a multiple of kv heads kvh=2"),
    ({}, ((1, 16, 2, 48), (1, 16, 2, 48)), r"d=48 \(head_dim\) must be one of"),
    ({"causal": True}, ((1, 32, 2, 64), (1, 16, 2, 64)), r"causal with q_len=32 > kv_len=16"),
    ({"segment_ids": "one"}, ((1, 16, 2, 64), (1, 32, 2, 64)), r"one segment_ids array needs q_len=16 == kv_len=32"),
    ({"block_sizes": BlockSizes(block_q=48)}, ((1, 16, 2, 64), (1, 16, 2, 64)), r"block_q=48 must be a power of two"),
    ({"sm_scale": -1.0}, ((1, 16, 2, 64), (1, 16, 2, 64)), r"sm_scale=-1.0 must be positive"),
])
def test_bad_input_errors(kwargs, shapes, match):
    q = jnp.zeros(shapes[0], jnp.bfloat16)
    k = jnp.zeros(shapes[1], jnp.bfloat16)
    if kwargs.get("segment_ids") == "one":
        kwargs = dict(kwargs, segment_ids=jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k, interpret=True, **kwargs)


def test_dtype_mismatch_error():
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="must share one dtype"):
        flash_attention(q, q.astype(jnp.float16), q, interpret=True)
