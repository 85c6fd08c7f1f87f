"""FP8 projection matmuls (models/fp8.py, `model.matmul_dtype=float8`).

Error bounds: rounding to a format with m mantissa bits moves each element by at most its unit
roundoff u = 2^-(m+1) relative (e4m3: 2^-4, e5m2: 2^-3), and by u/sqrt(3) RMS for errors spread
evenly over the rounding interval. A GEMM's output sums many such independent errors, so its
relative (Frobenius) error is about the RMS of its operands' errors added in quadrature:
forward (e4m3 x e4m3) sqrt(2) u4 / sqrt(3) = 5.1%, gradients (e5m2 x e4m3) sqrt(u5^2 + u4^2) / sqrt(3)
= 8.1%. Those are the bounds; the measured errors are ~3.8% and ~6%. A lower bound (2^-7, five times
bf16's rounding) shows the values were really quantized.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.plan import hlo
from models.fp8 import E4M3, E5M2, dequantize, fp8_einsum, fp8_einsum_reference, pow2_scale, quantize
from tests.helpers import rel_err

# Compiling dominates (small GEMMs, a tiny model's steps): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen
U4, U5 = 2.0 ** -4, 2.0 ** -3
FWD_BOUND = math.sqrt(2) * U4 / math.sqrt(3)
BWD_BOUND = math.sqrt(U5 ** 2 + U4 ** 2) / math.sqrt(3)
QUANTIZED = 2.0 ** -7
LOSS_TOL = 0.02   # nats: the tolerance the 300-step GPU run is held to, here per step over 5 steps

SPECS = {"bsd,dhk->bshk": ((2, 16, 64), (64, 4, 16)),    # q|k|v
         "bshk,hkd->bsd": ((2, 16, 4, 16), (4, 16, 64)),  # o
         "bsd,df->bsf": ((2, 16, 64), (64, 96))}          # gate, up (down has the same form)


def _operands(spec, seed=0):
    xs, ws = SPECS[spec]
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], xs, jnp.float32)
    w = 0.02 * jax.random.normal(k[1], ws, jnp.float32)
    y_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), x, w).shape
    return x, w, jax.random.normal(k[2], y_shape, jnp.float32)


def _qdq(t, fmt):
    q, inv = quantize(t, fmt)
    return dequantize(q, inv, jnp.float32)


@pytest.mark.parametrize("spec", list(SPECS))
def test_forward_within_e4m3_rounding(spec):
    x, w, _ = _operands(spec)
    y = fp8_einsum(spec, x, w)
    err = rel_err(y, jnp.einsum(spec, x, w))
    assert QUANTIZED < err < FWD_BOUND, err
    # exactly the einsum of the two e4m3 round trips (what the FP8 GEMM computes)
    assert rel_err(y, fp8_einsum_reference(spec, x, w)) < 1e-6


@pytest.mark.parametrize("spec", list(SPECS))
def test_gradients_e5m2_output_gradient(spec):
    x, w, g = _operands(spec, seed=1)
    dx, dw = jax.grad(lambda a, b: jnp.sum(fp8_einsum(spec, a, b) * g), (0, 1))(x, w)
    dx32, dw32 = jax.grad(lambda a, b: jnp.sum(jnp.einsum(spec, a, b) * g), (0, 1))(x, w)
    for got, want in ((dx, dx32), (dw, dw32)):
        assert QUANTIZED < rel_err(got, want) < BWD_BOUND, rel_err(got, want)
    # the formats: g in e5m2, x and w in e4m3 (an e4m3 g would give other values)
    ins, c = spec.split("->")
    a, b = ins.split(",")
    gq, xq, wq = _qdq(g, E5M2), _qdq(x, E4M3), _qdq(w, E4M3)
    assert rel_err(dx, jnp.einsum(f"{c},{b}->{a}", gq, wq)) < 1e-6
    assert rel_err(dw, jnp.einsum(f"{a},{c}->{b}", xq, gq)) < 1e-6


def test_bf16_operands_keep_their_dtypes():
    x, w, g = _operands("bsd,df->bsf")
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y, vjp = jax.vjp(lambda a, b: fp8_einsum("bsd,df->bsf", a, b), xb, wb)
    dx, dw = vjp(g.astype(jnp.bfloat16))
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert rel_err(y, jnp.einsum("bsd,df->bsf", x, w)) < FWD_BOUND


def test_residuals_saved_by_remat_stay_exact():
    """A remat policy that saves the FP8 residuals: jax.checkpoint rounds saved float residuals with
    reduce_precision, which turns e4m3fn's top binade (256..448) into inf (NaN after the convert)."""
    x, w, g = _operands("bsd,df->bsf")
    x, w = x.at[0, 0, 0].set(400.0), w.at[0, 0].set(300.0)   # amax -> scale 1: a residual element of 400

    def loss(a, b):
        return jnp.sum(fp8_einsum("bsd,df->bsf", a, b) * g)
    saved = jax.checkpoint(loss, policy=jax.checkpoint_policies.everything_saveable)
    for got, want in zip(jax.grad(saved, (0, 1))(x, w), jax.grad(loss, (0, 1))(x, w)):
        assert np.isfinite(np.asarray(got)).all() and rel_err(got, want) < 1e-6


def test_zero_operand_gives_zeros_not_nan():
    x, w, g = _operands("bsd,df->bsf")
    zx = jnp.zeros_like(x)
    assert float(pow2_scale(zx, E4M3)) == 1.0
    y, vjp = jax.vjp(lambda a, b: fp8_einsum("bsd,df->bsf", a, b), zx, w)
    dx, dw = vjp(g)
    assert not np.asarray(y).any() and not np.asarray(dw).any()
    assert np.isfinite(np.asarray(dx)).all() and np.asarray(dx).any()
    dx0, dw0 = vjp(jnp.zeros_like(g))   # an all-zero output gradient (amax 0 in the backward)
    assert not np.asarray(dx0).any() and not np.asarray(dw0).any()


def test_scales_are_powers_of_two_that_never_overflow():
    for fmt in (E4M3, E5M2):
        fmax = float(jnp.finfo(fmt).max)
        for amax in (fmax, fmax * 0.999, fmax * 1.001, 1.0, 0.875, 0.876, 3.0e-3, 3.0e38):
            s = float(pow2_scale(jnp.array([amax, -amax / 3], jnp.float32), fmt))
            assert amax * s <= fmax < 2 * amax * s and math.log2(s) == round(math.log2(s)), (fmt, amax, s)


def test_non_finite_input_is_not_clipped():
    x, w, _ = _operands("bsd,df->bsf")
    y = fp8_einsum("bsd,df->bsf", x.at[0, 0, 0].set(jnp.inf), w)
    assert np.isnan(np.asarray(y)).any()   # the trainer's non-finite check then fires


def test_spec_with_a_single_operand_reduction_is_refused():
    with pytest.raises(ValueError, match="fp8_einsum spec"):
        fp8_einsum("bsd,df->bf", jnp.ones((2, 3, 4)), jnp.ones((4, 5)))


def test_config_validation():
    from meshlab.train.config import ConfigError
    from tests.helpers import small_config
    with pytest.raises(ConfigError, match=r"model.matmul_dtype='float9'.*float8"):
        small_config(extra=["model.matmul_dtype=float9"])
    with pytest.raises(ConfigError, match="fused_swiglu"):
        small_config(extra=["model.matmul_dtype=float8", "model.fused_swiglu=true"])
    with pytest.raises(ConfigError, match="float16"):
        small_config(extra=["model.matmul_dtype=float8", "model.dtype=float16"])


def _losses(matmul_dtype, steps=5, devices=None):
    """Per-step losses of the tiny trainer (bf16 compute) on the same batches, and its step's StableHLO."""
    from meshlab.train.loop import build_trainer, device_batch
    from meshlab.train.state import init_state
    from tests.helpers import small_config
    cfg = small_config("dp", mesh="data=1", steps=steps,
                       extra=[f"model.matmul_dtype={matmul_dtype}", "model.dtype=bfloat16", "data.global_batch=4",
                              "model.attention=xla"])   # head_dim 8: attention's kernels are not the point here
    tr = build_trainer(cfg, devices=devices or jax.devices()[:1])
    state = init_state(tr.md, tr.tx, tr.shardings, 0, False)
    batch = device_batch(tr, tr.batches.batch(0, tr.rows))
    text = tr.step_fn.lower(state, batch).as_text() if hasattr(tr.step_fn, "lower") else ""
    out = []
    for i in range(steps):
        state, m = tr.step_fn(state, device_batch(tr, tr.batches.batch(i, tr.rows)))
        out.append(float(m["loss"]))
    return np.array(out), text


@pytest.fixture(scope="module")
def bf16_losses():
    return _losses("bfloat16")[0]


def test_tiny_model_trains_close_to_bf16(bf16_losses):
    fp8_losses, text = _losses("float8")
    assert "f8E4M3FN" in text and "f8E5M2" in text        # the step quantizes (forward and backward)
    assert np.isfinite(fp8_losses).all() and fp8_losses[-1] < fp8_losses[0] - 0.5   # it trains
    assert np.abs(fp8_losses - bf16_losses).max() < LOSS_TOL, (fp8_losses, bf16_losses)


# -- GPU: the compiled program runs FP8 GEMMs -------------------------------------------------------
# A compiled GPU program's GEMMs, shortened from an H200 dump of the MLP below: two Triton GEMM fusions
# whose dots read float8 (gate|up merged by XLA; down with the scale multiply fused), a cuBLASLt FP8
# call, and a bf16 cuBLAS call and Triton fusion that must not count as FP8.
HLO_SAMPLE = """\
%gemm_fusion_dot.11_computation (parameter_0: f8e4m3fn[2048,1024], parameter_1: f8e4m3fn[2048,1024]) -> bf16[2048,4096] {
  %parameter_1 = f8e4m3fn[2048,1024]{1,0} parameter(1)
  %parameter_2 = f8e4m3fn[2048,1024]{1,0} parameter(2)
  %concatenate.3 = f8e4m3fn[4096,1024]{1,0} concatenate(%parameter_1, %parameter_2), dimensions={0}
  %bitcast.58 = f8e4m3fn[1024,4096]{0,1} bitcast(%concatenate.3)
  %parameter_0 = f8e4m3fn[2048,1024]{1,0} parameter(0)
  %dot.22 = bf16[4096,2048]{0,1} dot(%bitcast.58, %parameter_0), lhs_contracting_dims={0}, rhs_contracting_dims={1}
  ROOT %bitcast.88 = bf16[2048,4096]{1,0} bitcast(%dot.22)
}
%gemm_fusion_dot.5_computation (parameter_0: bf16[2048,1024], parameter_1: bf16[1024,1024]) -> bf16[2048,1024] {
  %parameter_0 = bf16[2048,1024]{1,0} parameter(0)
  %parameter_1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %dot.9 = bf16[2048,1024]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (p0: f8e4m3fn[2048,1024]) -> bf16[2048,4096] {
  %gemm_fusion_dot.11 = bf16[2048,4096]{1,0} fusion(%bitcast.74.0, %a, %b), kind=kCustom, calls=%gemm_fusion_dot.11_computation
  %gemm_fusion_dot.5 = bf16[2048,1024]{1,0} fusion(%c, %d), kind=kCustom, calls=%gemm_fusion_dot.5_computation
  %cublas-gemm.0 = (bf16[2048,1024]{1,0}, s8[33554432]{0}) custom-call(%e, %f, %g, %h), custom_call_target="__cublas$lt$matmul$f8"
  %cublas-gemm.7 = (bf16[2048,1024]{1,0}, s8[4194304]{0}) custom-call(%i, %j), custom_call_target="__cublas$gemm"
}
"""


def test_gemm_reader_finds_fp8_in_triton_fusions_and_cublaslt():
    found = {g.name: (g.kind, g.fp8) for g in hlo.gemms(HLO_SAMPLE)}
    assert found == {"gemm_fusion_dot.11": ("triton", True), "gemm_fusion_dot.5": ("triton", False),
                     "cublas-gemm.0": ("cublas", True), "cublas-gemm.7": ("cublas", False)}


@pytest.mark.gpu
def test_gpu_mlp_gemms_are_fp8():
    d, f = 1024, 2048
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (4, 512, d), jnp.bfloat16)
    wg, wu = (0.02 * jax.random.normal(kk, (d, f), jnp.float32).astype(jnp.bfloat16) for kk in k[1:3])
    wd = (0.02 * jax.random.normal(k[3], (f, d), jnp.float32)).astype(jnp.bfloat16)

    def mlp(x, wg, wu, wd):
        h = jax.nn.silu(fp8_einsum("bsd,df->bsf", x, wg).astype(jnp.float32)) * fp8_einsum("bsd,df->bsf", x, wu)
        return jnp.sum(fp8_einsum("bsf,fd->bsd", h.astype(jnp.bfloat16), wd).astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(mlp, (0, 1, 2, 3))).lower(x, wg, wu, wd).compile().as_text()
    found = hlo.gemms(text)
    # 3 projections x (forward, dx, dw), where XLA merges the GEMMs gate and up share (x, or dx's sum):
    # on the H200, 5 cuBLASLt FP8 calls and 2 Triton GEMM fusions that read FP8 (the forward's merged
    # x @ [w_gate | w_up], and down's forward). Every GEMM must be FP8, whichever backend runs it.
    print("\n" + "\n".join(f"{g.kind} fp8={g.fp8} {g.line[:200]}" for g in found))
    assert len(found) >= 5 and all(g.fp8 for g in found), [(g.name, g.kind, g.fp8) for g in found]


@pytest.mark.gpu
def test_gpu_tiny_model_fp8_loss_agrees(bf16_losses):
    fp8_losses, _ = _losses("float8")
    assert np.abs(fp8_losses - bf16_losses).max() < LOSS_TOL, (fp8_losses, bf16_losses)
