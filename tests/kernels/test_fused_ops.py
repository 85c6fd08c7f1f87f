"""Fused ops (pallas_kernels/): forward and gradients against the jnp references.

CPU: Pallas interpret mode, float32, awkward sizes (no dimension a multiple of its tile).
GPU (`MESHLAB_TEST_GPU=1 python3 -m pytest -m gpu tests/kernels/test_fused_ops.py`): compiled Triton
kernels in fp32 (TF32 dots) and bf16, at tolerances for those precisions.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cross_entropy_onepass as onepass
from pallas_kernels import fused_cross_entropy as ce
from pallas_kernels import fused_rmsnorm as rn
from pallas_kernels import rope
from pallas_kernels import softmax_rows as sr
from pallas_kernels import swiglu as sg

# Compiling dominates (interpret mode, tiny shapes): cheap_codegen, CPU only (the GPU cases are unaffected).
pytestmark = pytest.mark.cheap_codegen
LLAMA3_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a)), "non-finite values"
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def _rand(seed, *shapes, scale=1.0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [(jax.random.normal(k, s) * scale).astype(dtype) for k, s in zip(keys, shapes)]


# ------------------------------------------------------------------ cross-entropy

def _ce_case(seed, t, d, v, dtype=jnp.float32):
    h, w = _rand(seed, (t, d), (d, v), dtype=dtype)
    w = (w * 0.3).astype(dtype)
    y = jax.random.randint(jax.random.key(seed + 1), (t,), 0, v)
    y = y.at[::7].set(-100)  # ignored tokens
    cot = jax.random.uniform(jax.random.key(seed + 2), (t,), minval=0.5, maxval=1.5)
    return h, w, y, cot


def _ce_loss_and_grads(fn, h, w, y, cot, **kw):
    """Per-token loss and (dh, dW) of sum(loss * cot), traced once under jit (much faster in
    interpret mode than op-by-op dispatch)."""
    def f(h, w):
        loss = fn(h, w, y, ignore_index=-100, **kw)
        return jnp.sum(loss * cot), loss
    (_, loss), g = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(h, w)
    return loss, g


CE_TILES = ce.BlockSizes(fwd_t=16, fwd_v=64, fwd_splits=2, bwd_t=16, bwd_v=64, block_d=16, dw_t=32, dw_v=32,
                         bwd_chunk=0)
CE_SLABS = ce.BlockSizes(fwd_t=16, fwd_v=64, bwd_t=16, bwd_v=64, block_d=16, bwd_chunk=16)


@pytest.mark.parametrize("z_loss,blocks", [(0.0, CE_TILES), (1e-2, CE_SLABS)], ids=["tiles", "slabs_zloss"])
def test_cross_entropy_matches_reference(z_loss, blocks):
    h, w, y, cot = _ce_case(0, 37, 40, 300)  # 37 % 16, 40 % 16, 300 % 64 all nonzero
    ref, gref = _ce_loss_and_grads(ce.cross_entropy_reference, h, w, y, cot, z_loss=z_loss)
    out, gout = _ce_loss_and_grads(ce.fused_cross_entropy, h, w, y, cot, z_loss=z_loss,
                                   block_sizes=blocks, interpret=True)
    chk, gchk = _ce_loss_and_grads(ce.chunked_cross_entropy, h, w, y, cot, z_loss=z_loss, chunk_size=16)
    for o, g in ((out, gout), (chk, gchk)):
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
        _close(g[0], gref[0], 1e-5)
        _close(g[1], gref[1], 1e-5)
    ignored = np.asarray(y) == -100
    assert np.all(np.asarray(out)[ignored] == 0.0) and np.all(np.asarray(out)[~ignored] > 0)
    assert np.all(np.asarray(gout[0])[ignored] == 0.0)  # ignored tokens get no gradient


def test_cross_entropy_z_loss_adds_lse_squared():
    h, w, y, _ = _ce_case(3, 20, 16, 70)
    base = ce.cross_entropy_reference(h, w, y, ignore_index=-100)
    z = ce.cross_entropy_reference(h, w, y, ignore_index=-100, z_loss=1e-2)
    lse = jax.nn.logsumexp(h @ w, axis=-1)
    expect = np.where(np.asarray(y) == -100, 0.0, base + 1e-2 * lse**2)
    np.testing.assert_allclose(z, expect, rtol=1e-5, atol=1e-6)


def _txv_lines(text, t, v):
    """HLO lines whose shapes hold a [t, v] (or [v, t]) array, matched line by line."""
    pat = re.compile(rf"\[(?:{t},{v}|{v},{t})\]")
    return [ln for ln in text.splitlines() if pat.search(ln)]


def test_cross_entropy_never_holds_tokens_x_vocab():
    t, d, v = 1024, 32, 2048  # logits would be 8 MiB in fp32; everything else here is < 1 MiB
    h, w, y, cot = _ce_case(5, t, d, v)
    blocks = ce.BlockSizes(fwd_t=128, fwd_v=512, bwd_t=128, bwd_v=512, block_d=32, bwd_chunk=0)  # pure tiles
    slabs = dataclasses.replace(blocks, bwd_chunk=256)

    def train(fn, **kw):
        return jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(fn(h, w, y, ignore_index=-100, **kw) * cot), (0, 1)))

    ref = train(ce.cross_entropy_reference).lower(h, w).compile()
    assert _txv_lines(ref.as_text(), t, v), "the check must see the reference's logits"
    for name, kw in (("fused", dict(block_sizes=blocks, interpret=True)),
                     ("fused_slabs", dict(block_sizes=slabs, interpret=True)), ("chunked", dict(chunk_size=128))):
        fn = ce.chunked_cross_entropy if name == "chunked" else ce.fused_cross_entropy
        comp = train(fn, **kw).lower(h, w).compile()
        assert not _txv_lines(comp.as_text(), t, v), f"{name}: a [T, V] buffer in the HLO"
        mem = comp.memory_analysis()
        if mem is not None:
            assert mem.temp_size_in_bytes < t * v * 4, f"{name}: temp {mem.temp_size_in_bytes} >= T*V*4"


@pytest.mark.parametrize("z_loss,chunk", [(0.0, 16), (1e-2, 7)], ids=["chunk16", "chunk7_zloss"])
def test_onepass_cross_entropy_matches_reference(z_loss, chunk):
    h, w, y, _ = _ce_case(0, 37, 40, 301)  # 37 tokens: full chunks + a tail; odd V; every 7th ignored
    kw = dict(ignore_index=-100, z_loss=z_loss)

    def ref(h, w):
        return jnp.sum(ce.cross_entropy_reference(h, w, y, **kw))
    ours = lambda h, w: onepass.onepass_cross_entropy_sum(h, w, y, chunk_size=chunk, **kw)  # noqa: E731
    # a non-1 cotangent: the backward scales the gradients saved by the forward
    (want, gwant), (got, ggot) = (jax.jit(jax.value_and_grad(lambda h, w, f=f: 0.37 * f(h, w), (0, 1)))(h, w)
                                  for f in (ref, ours))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(ggot[0], gwant[0], 1e-5)
    _close(ggot[1], gwant[1], 1e-5)
    assert np.all(np.asarray(ggot[0])[np.asarray(y) == -100] == 0.0)  # ignored tokens get no gradient
    np.testing.assert_allclose(jax.jit(ours)(h, w), want / 0.37, rtol=1e-5)  # primal only: the loss path


ROW_TILES = sr.RowBlocks(stats_rows=4, stats_cols=64, grad_rows=4, grad_cols=64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_rows_match_reference(dtype):
    """One-pass statistics and gradient kernels against jnp: 13 rows (not a multiple of 4), 301 columns
    (4 full tiles of 64 and a masked tail), ignored labels, labels on the first and last column."""
    n, v = 13, 301
    x = (_rand(21, (n, v), scale=4.0)[0]).astype(dtype)
    y = jax.random.randint(jax.random.key(22), (n,), 0, v).at[0].set(0).at[1].set(v - 1).at[::5].set(-100)
    lse, ll = jax.jit(functools.partial(sr.softmax_stats, blocks=ROW_TILES, interpret=True))(x, y)
    lse_ref, ll_ref = sr.softmax_stats_reference(x, y)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)
    np.testing.assert_array_equal(ll, ll_ref)                     # a selected logit: exact
    assert np.all(np.asarray(ll)[np.asarray(y) == -100] == 0.0)
    cp = jnp.where(y >= 0, 1.3, 0.0)
    cy = (y >= 0).astype(jnp.float32)
    for out in (jnp.float32, jnp.bfloat16):
        got = jax.jit(functools.partial(sr.softmax_grad, out_dtype=out, blocks=ROW_TILES, interpret=True))(
            x, lse_ref, y, cp, cy)
        want = sr.softmax_grad_reference(x, lse_ref, y, cp, cy, out)
        assert got.dtype == out
        # the same fp32 math rounded once: bf16 outputs may differ by one ulp where exp's last bit differs
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-6 if out == jnp.float32 else 8e-3, atol=1e-7)
    with pytest.raises(ValueError, match="stats_cols=100 must be a power of two"):
        sr.softmax_stats(x, y, blocks=sr.RowBlocks(stats_cols=100))
    with pytest.raises(ValueError, match="lse.shape"):
        sr.softmax_grad(x, lse[:5], y, cp, cy, out_dtype=jnp.float32)


def test_onepass_pallas_softmax_matches_xla():
    """softmax="pallas" (the slab's passes as kernels, interpreted here) against the jnp passes: the same
    loss and gradients, with chunks, a tail chunk, z-loss and ignored tokens."""
    h, w, y, _ = _ce_case(4, 37, 40, 301)
    run = {sm: jax.jit(jax.value_and_grad(lambda h, w, sm=sm: 0.37 * onepass.onepass_cross_entropy_sum(
        h, w, y, ignore_index=-100, z_loss=1e-2, chunk_size=16, softmax=sm, interpret=True), (0, 1)))(h, w)
        for sm in ("xla", "pallas")}
    (want, gwant), (got, ggot) = run["xla"], run["pallas"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    _close(ggot[0], gwant[0], 1e-6)
    _close(ggot[1], gwant[1], 1e-6)
    with pytest.raises(ValueError, match="softmax='triton' must be"):
        onepass.onepass_cross_entropy_sum(h, w, y, softmax="triton")


def test_onepass_vocab_major_weight():
    """A tied head passed as the embedding [V, d] (vocab_major): the same loss and dh, and dW in [V, d]
    made by the GEMM itself (no transpose of a weight-sized array in the program)."""
    h, w, y, _ = _ce_case(6, 37, 40, 301)
    grads = lambda w_, vm: jax.jit(jax.value_and_grad(lambda h, w_: onepass.onepass_cross_entropy_sum(  # noqa: E731
        h, w_, y, ignore_index=-100, chunk_size=16, vocab_major=vm), (0, 1)))
    (want, (dh_want, dw_want)), (got, (dh_got, dw_got)) = grads(w, False)(h, w), grads(w.T, True)(h, w.T)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    _close(dh_got, dh_want, 1e-6)
    assert dw_got.shape == (301, 40)
    _close(dw_got, dw_want.T, 1e-6)
    hlo = grads(w.T, True).lower(h, w.T).as_text()
    assert not re.search(r"stablehlo.transpose .*tensor<(301x40|40x301)x", hlo), "a weight-sized transpose"
    with pytest.raises(ValueError, match="weight"):
        onepass.onepass_cross_entropy_sum(h, w, y, vocab_major=True)      # [d, V] passed as [V, d]


def test_loss_softmax_choice_follows_the_rules(monkeypatch):
    """model.loss_softmax: auto is xla off the GPU; on a Triton GPU (stood in for here) pallas exactly where
    the loss is local; an explicit pallas is refused where GSPMD would gather the slab."""
    from meshlab import rules as R
    from meshlab.mesh import make_mesh
    from meshlab.train.config import ConfigError, load_config
    from models import llama
    assert llama._loss_softmax("auto") == "xla" and llama._loss_softmax("pallas") == "pallas"   # CPU, no rules
    monkeypatch.setattr(llama, "kernel_available", lambda impl: impl == "pallas")   # the GPU's answer
    assert llama._loss_softmax("auto") == "pallas"                   # no rules: local
    mesh = make_mesh("data=4,tensor=2")
    rules = R.load_rules("dp")
    with R.use_rules(rules, mesh):
        assert llama._loss_softmax("auto") == "xla"                  # GSPMD over data and tensor
        with pytest.raises(ValueError, match="loss_softmax=pallas runs per device"):
            llama._loss_softmax("pallas")
        with R.manual_axes(("data",), rules, mesh):                  # tensor=2 still automatic
            assert not R.is_local() and llama._loss_softmax("auto") == "xla"
        with R.manual_axes(("data", "tensor"), rules, mesh):
            assert R.is_local() and llama._loss_softmax("auto") == "pallas"
            assert llama._loss_softmax("pallas") == "pallas"
    with pytest.raises(ConfigError, match="model.loss_softmax='triton' must be one of auto, xla, pallas"):
        load_config("default", ["model.loss_softmax=triton"])


def test_onepass_bf16_logits_slab():
    """logits_dtype=bfloat16: the head GEMM writes a bf16 slab (XLA:CPU may keep the excess precision,
    so the rounding itself is seen on the GPU); loss and gradients within bf16 rounding of fp32's."""
    h, w, y, _ = _ce_case(3, 37, 40, 301, dtype=jnp.bfloat16)
    f = {dt: jax.jit(jax.value_and_grad(lambda h, w, dt=dt: onepass.onepass_cross_entropy_sum(
        h, w, y, ignore_index=-100, chunk_size=16, logits_dtype=dt), (0, 1))) for dt in ("bfloat16", "float32")}
    hlo = {dt: fn.lower(h, w).as_text() for dt, fn in f.items()}
    head = "(tensor<16x40xbf16>, tensor<40x301xbf16>) -> tensor<16x301x"   # the head GEMM of a chunk
    assert head + "bf16>" in hlo["bfloat16"] and head + "f32>" in hlo["float32"]
    assert head + "f32>" not in hlo["bfloat16"]
    (got, g16), (full, g32) = f["bfloat16"](h, w), f["float32"](h, w)
    np.testing.assert_allclose(got, full, rtol=1e-3)
    _close(g16[0], g32[0], 2e-2)
    _close(g16[1], g32[1], 2e-2)
    with pytest.raises(ValueError, match="logits_dtype='float16' must be"):
        onepass.onepass_cross_entropy_sum(h, w, y, logits_dtype="float16")


def test_onepass_cross_entropy_never_holds_tokens_x_vocab():
    t, d, v = 1024, 32, 2048  # as the test above: logits would be 8 MiB in fp32
    h, w, y, _ = _ce_case(5, t, d, v)
    grads = lambda chunk: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda h, w: onepass.onepass_cross_entropy_sum(h, w, y, ignore_index=-100, chunk_size=chunk), (0, 1)))
    comp = grads(128).lower(h, w).compile()
    assert not _txv_lines(comp.as_text(), t, v), "a [T, V] buffer in the HLO"
    mem = comp.memory_analysis()
    if mem is not None:
        assert mem.temp_size_in_bytes < t * v * 4 // 2, f"temp {mem.temp_size_in_bytes} >= T*V*2"
    # Forward and backward do three logits-sized GEMMs (2TdV each), not four. One chunk: XLA's cost
    # analysis counts a loop body once, so the chunked program would under-count.
    cost = grads(t).lower(h, w).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost and cost.get("flops"):
        assert cost["flops"] < 3.5 * 2 * t * d * v, f"{cost['flops']=} is more than 3 logits-sized GEMMs"


def test_cross_entropy_errors():
    h, w, y, _ = _ce_case(0, 32, 16, 64)
    with pytest.raises(ValueError, match="chunk_size=0 must be"):
        onepass.onepass_cross_entropy_sum(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="must be"):
        onepass.onepass_cross_entropy_sum(h, w[:8], y)
    with pytest.raises(ValueError, match="must be"):
        ce.fused_cross_entropy(h, w[:8], y)
    with pytest.raises(ValueError, match="must be"):
        ce.fused_cross_entropy(h, w, y[:5])
    with pytest.raises(ValueError, match="must be"):
        ce.fused_cross_entropy(h, w, y, block_sizes=ce.BlockSizes(fwd_v=100))


# ------------------------------------------------------------------ rmsnorm, swiglu, rope

@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(with_residual):
    x, r, cy, cs = _rand(1, (3, 7, 48), (3, 7, 48), (3, 7, 48), (3, 7, 48))
    w = 1.0 + 0.1 * _rand(2, (48,))[0]
    res = r if with_residual else None

    def loss(fn, **kw):
        def f(x, r, w):
            out = fn(x, w, eps=1e-6, residual=r if with_residual else None, **kw)
            return jnp.sum(out[0] * cy) + jnp.sum(out[1] * cs) if with_residual else jnp.sum(out * cy)
        return f

    out = jax.jit(lambda x, r, w: rn.rms_norm(x, w, eps=1e-6, residual=r, interpret=True))(x, res, w)
    ref = rn.rms_norm_reference(x, w, eps=1e-6, residual=res)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        _close(a, b, 1e-6)
    g = jax.jit(jax.grad(loss(rn.rms_norm, interpret=True), (0, 1, 2)))(x, r, w)
    gr = jax.grad(loss(rn.rms_norm_reference), (0, 1, 2))(x, r, w)
    for a, b in zip(g, gr):
        if with_residual or np.any(np.asarray(b)):
            _close(a, b, 1e-5)


def test_swiglu_matches_reference():
    x, wg, wu, cy = _rand(3, (37, 40), (40, 72), (40, 72), (37, 72))
    wg, wu = wg * 0.2, wu * 0.2
    bs = sg.BlockSizes(block_m=16, block_n=32, block_k=16)
    f = lambda *a: sg.swiglu(*a, interpret=True, block_sizes=bs)
    _close(jax.jit(f)(x, wg, wu), sg.swiglu_reference(x, wg, wu), 1e-6)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cy), (0, 1, 2)))(x, wg, wu)
    gr = jax.grad(lambda *a: jnp.sum(sg.swiglu_reference(*a) * cy), (0, 1, 2))(x, wg, wu)
    for a, b in zip(g, gr):
        _close(a, b, 1e-5)


def test_silu_mul_grads_match_autodiff_and_save_only_its_inputs():
    """silu_mul's hand-written backward against autodiff of the same fp32 expression (fp32 inputs: to
    1e-6; bf16 inputs: to bf16 rounding), and what it costs under a layer scan at remat=none: its
    residuals are gate and up, where autodiff saves fp32 intermediates that the scan stacks (the
    compiled value-and-grad's temporaries, CPU)."""
    plain = lambda g, u: (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)  # noqa: E731
    g, u, dy = _rand(4, (37, 72), (37, 72), (37, 72))
    g = g * 4.0                                                   # both tails of the sigmoid
    for dt, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        args = (g.astype(dt), u.astype(dt))
        np.testing.assert_array_equal(np.asarray(sg.silu_mul(*args), np.float32), np.asarray(plain(*args), np.float32))
        ours = jax.grad(lambda *a: jnp.sum(sg.silu_mul(*a).astype(jnp.float32) * dy), (0, 1))(*args)
        ref = jax.grad(lambda *a: jnp.sum(plain(*a).astype(jnp.float32) * dy), (0, 1))(*args)
        for a, b in zip(ours, ref):
            assert a.dtype == dt
            _close(a, b, tol)

    def scanned(act):
        def loss(ws, x):                                          # 4 layers of x -> act(x wg, x wu) wd
            def layer(h, w):
                return (act(h @ w[0], h @ w[1]) @ w[2].T).astype(h.dtype), None
            return jnp.sum(jax.lax.scan(layer, x, ws)[0].astype(jnp.float32))
        ws = jax.ShapeDtypeStruct((4, 3, 64, 256), jnp.bfloat16)
        x = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16)
        return jax.jit(jax.value_and_grad(loss)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes
    saved_by_autodiff, saved_here = scanned(plain), scanned(sg.silu_mul)
    two_inputs = 4 * 2 * 512 * 256 * 2                            # layers x (gate, up) x [T, f] bf16
    assert saved_here < saved_by_autodiff - 2 * two_inputs, (saved_here, saved_by_autodiff)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_rope_matches_reference(scaling):
    q, k, cq, ck = _rand(4, (2, 13, 6, 24), (2, 13, 3, 24), (2, 13, 6, 24), (2, 13, 3, 24))  # 6/3 heads: padded path
    pos = jax.random.randint(jax.random.key(9), (2, 13), 0, 20000)
    out = jax.jit(lambda q, k: rope.apply_rope(q, k, pos, theta=500000.0, scaling=scaling, interpret=True))(q, k)
    ref = jax.jit(lambda q, k: rope.apply_rope_reference(q, k, pos, theta=500000.0, scaling=scaling))(q, k)
    for a, b in zip(out, ref):  # angles reach 2e4 rad: sin/cos of fp32 args differ by ~1e-5 across fusions
        _close(a, b, 1e-4)

    def loss(fn, **kw):
        def f(q, k):
            a, b = fn(q, k, pos, theta=500000.0, scaling=scaling, **kw)
            return jnp.sum(a * cq) + jnp.sum(b * ck)
        return f

    for a, b in zip(jax.jit(jax.grad(loss(rope.apply_rope, interpret=True), (0, 1)))(q, k),
                    jax.jit(jax.grad(loss(rope.apply_rope_reference), (0, 1)))(q, k)):
        _close(a, b, 1e-4)


def test_rope_rotate_half_and_llama3_scaling():
    d = 64
    inv = np.asarray(rope.rope_frequencies(d, 500000.0, None))
    np.testing.assert_allclose(inv, 1.0 / 500000.0 ** (np.arange(0, d, 2) / d), rtol=1e-6)
    scaled = np.asarray(rope.rope_frequencies(d, 500000.0, LLAMA3_SCALING))
    wavelen = 2 * np.pi / inv
    hi = wavelen < 8192 / 4.0   # short wavelengths: untouched
    lo = wavelen > 8192 / 1.0   # long wavelengths: divided by factor
    np.testing.assert_allclose(scaled[hi], inv[hi], rtol=1e-6)
    np.testing.assert_allclose(scaled[lo], inv[lo] / 32.0, rtol=1e-6)
    mid = ~hi & ~lo
    assert np.all(scaled[mid] <= inv[mid]) and np.all(scaled[mid] >= inv[mid] / 32.0)
    # rotate-half: pair (i, i + d/2) rotates by position * inv[i]
    x = np.zeros((1, 1, 1, d), np.float32)
    x[..., 0] = 1.0
    pos = jnp.array([[3]])
    q, _ = rope.apply_rope_reference(jnp.asarray(x), jnp.asarray(x), pos, theta=500000.0)
    assert np.isclose(q[0, 0, 0, 0], np.cos(3 * inv[0])) and np.isclose(q[0, 0, 0, d // 2], np.sin(3 * inv[0]))


def test_small_ops_errors():
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="must"):
        rn.rms_norm(x, jnp.ones((7,)), eps=1e-6)
    with pytest.raises(ValueError, match="must"):
        sg.swiglu(x, jnp.ones((8, 16)), jnp.ones((8, 32)))
    with pytest.raises(ValueError, match="must"):
        rope.apply_rope(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 2, 6)), jnp.zeros((1, 2), jnp.int32), theta=1e4)
    with pytest.raises(ValueError, match="must have keys"):
        rope.rope_frequencies(8, 1e4, {"factor": 8.0})


# ------------------------------------------------------------------ GPU: compiled kernels

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 5e-3), (jnp.bfloat16, 2e-2)])
def test_gpu_cross_entropy(dtype, tol):
    h, w, y, cot = _ce_case(11, 1000, 256, 5000, dtype)  # ragged tokens and vocab
    ref, gref = _ce_loss_and_grads(ce.cross_entropy_reference, h, w, y, cot, z_loss=1e-4)
    slabs = lambda *a, **k: ce.fused_cross_entropy(*a, block_sizes=ce.BlockSizes(bwd_chunk=256), **k)
    tiles = lambda *a, **k: ce.fused_cross_entropy(*a, block_sizes=ce.BlockSizes(bwd_chunk=0), **k)
    for fn in (ce.fused_cross_entropy, slabs, tiles, ce.chunked_cross_entropy):
        out, g = _ce_loss_and_grads(fn, h, w, y, cot, z_loss=1e-4)
        _close(out, ref, tol)
        _close(g[0], gref[0], tol)
        _close(g[1], gref[1], tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)])
def test_gpu_rmsnorm_rope(dtype, tol):
    x, r = _rand(12, (1000, 2048), (1000, 2048), dtype=dtype)
    w = (1.0 + 0.1 * _rand(13, (2048,))[0]).astype(dtype)
    for a, b in zip(rn.rms_norm(x, w, eps=1e-5, residual=r), rn.rms_norm_reference(x, w, eps=1e-5, residual=r)):
        _close(a, b, tol)
    gk = lambda fn: jax.grad(lambda x, r: jnp.sum(fn(x, w, eps=1e-5, residual=r)[0].astype(jnp.float32) ** 2),
                             (0, 1))(x, r)
    for a, b in zip(gk(rn.rms_norm), gk(rn.rms_norm_reference)):
        _close(a, b, 2 * tol)
    q, k = _rand(14, (2, 300, 32, 64), (2, 300, 8, 64), dtype=dtype)
    pos = jnp.broadcast_to(jnp.arange(300), (2, 300))
    for a, b in zip(rope.apply_rope(q, k, pos, theta=5e5, scaling=LLAMA3_SCALING),
                    rope.apply_rope_reference(q, k, pos, theta=5e5, scaling=LLAMA3_SCALING)):
        _close(a, b, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 5e-3), (jnp.bfloat16, 2e-2)])
def test_gpu_swiglu(dtype, tol):
    x, wg, wu, cy = _rand(15, (1000, 512), (512, 1000), (512, 1000), (1000, 1000), dtype=dtype)
    wg, wu = (wg * 0.05).astype(dtype), (wu * 0.05).astype(dtype)
    _close(sg.swiglu(x, wg, wu), sg.swiglu_reference(x, wg, wu), tol)
    g = jax.grad(lambda *a: jnp.sum(sg.swiglu(*a).astype(jnp.float32) * cy), (0, 1, 2))(x, wg, wu)
    gr = jax.grad(lambda *a: jnp.sum(sg.swiglu_reference(*a).astype(jnp.float32) * cy), (0, 1, 2))(x, wg, wu)
    for a, b in zip(g, gr):
        _close(a, b, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("softmax", ["xla", "pallas"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 5e-3), (jnp.bfloat16, 2e-2)])
def test_gpu_onepass_cross_entropy(dtype, tol, softmax):
    h, w, y, _ = _ce_case(11, 5000, 256, 5000, dtype)  # 2 chunks of 2048 + a 904-token tail
    grads = lambda f: jax.jit(jax.value_and_grad(lambda h, w: 0.37 * f(h, w), (0, 1)))(h, w)  # noqa: E731
    want = grads(lambda h, w: jnp.sum(ce.cross_entropy_reference(h, w, y, ignore_index=-100, z_loss=1e-4)))
    got = grads(lambda h, w: onepass.onepass_cross_entropy_sum(h, w, y, ignore_index=-100, z_loss=1e-4,
                                                               chunk_size=2048, softmax=softmax))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(a, b, tol)
