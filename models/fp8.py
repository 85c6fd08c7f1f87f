"""FP8 projection matmuls for training (`model.matmul_dtype=float8`): e4m3 activations and weights in
the forward, e5m2 output gradient in the backward, one scale per tensor.

Scaling: *current* (the amax of each operand in this step), not delayed (an amax history carried from
earlier steps). Current scaling is stateless: the train step stays a pure function of (params,
optimizer state, batch), nothing new goes into the train state, the checkpoint or its sharding, and a
resumed or re-sharded run quantizes exactly as before; it cannot overflow on a step whose amax jumped
(delayed scaling clips then). Its cost is one extra read of each operand for the amax reduction (XLA
fuses it into the operand's producer where it can) and, for a sharded operand, a scalar all-reduce
(max) per operand and matmul that GSPMD inserts: 3 tensors x 7 projections per layer, each a few
microseconds of latency, no bandwidth. Inside the manual data-parallel region (meshlab/train/step.py)
the reduction is local: each device scales its own rows, which only makes the scales finer. torchao's
float8 training defaults to the same (tensorwise dynamic scaling).

Scales are powers of two (the largest 2^k with amax * 2^k <= the format's max): multiplying and
dividing by them is exact in every float format, and a scale costs at most a factor 2 of the format's
range (e4m3 keeps its 3-bit mantissa whatever the exponent). An all-zero operand (amax 0) gets scale 1
and quantizes to zeros; a non-finite one turns into NaN (e4m3fn has no infinity; nothing is clipped),
so the trainer's non-finite check still fires.

The op is a `jax.custom_vjp` around an einsum whose three GEMMs (forward, input gradient, weight
gradient) each read two FP8 operands directly (`einsum(..., preferred_element_type=dtype)` on
float8_e4m3fn / float8_e5m2 arrays), their output times the product of the two inverse scales. XLA:GPU
rewrites an FP8-operand dot into a cuBLASLt FP8 GEMM (custom call `__cublas$lt$matmul$f8`, in a pass
that runs before Triton's GEMM fusion; on Hopper it adds the FP8 operand transposes cuBLASLt's layout
needs) and fuses the scalar multiply into the output's consumer. flax's current fp8 ops use this
direct form (their older quantize-dequantize form, bf16 dots on `convert(fp8) * scale` operands, is
deprecated); it also lets each GEMM pick its accumulation (FWD_PRECISION, BWD_PRECISION). Where no
FP8 GEMM exists (XLA:CPU) the dot runs on the exact FP8 values with fp32 accumulation, so CPU tests
check FP8 numerics. Being an einsum with the model's logical-axis constraints around it, the op
shards as `_mm` does. The residuals saved for the backward are the FP8 operands (half the bytes of
bf16 ones) and two scalars.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn      # activations and weights: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2        # output gradients: 2 mantissa bits, max 57344 (gradients span more range)
# An FP8 GEMM's precision picks its accumulation on Hopper: DEFAULT lets cuBLASLt accumulate in the
# tensor cores' reduced precision (fast accumulation), HIGHEST promotes partial sums to fp32 as it
# goes. The forward takes the fast mode; both gradient GEMMs the precise one, dW summing over every
# token of the batch (16k at llama3_1b): torchao's and Transformer Engine's defaults, and flax's fp8 ops.
FWD_PRECISION = jax.lax.Precision.DEFAULT
BWD_PRECISION = jax.lax.Precision.HIGHEST


def pow2_scale(x, fp8_dtype):
    """The scalar 2^k (fp32) with amax(|x|) * 2^k <= fp8_dtype's max, k as large as that allows;
    1 for an all-zero x. A non-finite amax gives a NaN scale: the quantized tensor is NaN.
    Integer exponent arithmetic (frexp), so the scale is an exact power of two (exp2 lowers to exp)."""
    amax = jnp.max(jnp.abs(x)).astype(F32)                  # sharded x: a global max (one scalar all-reduce)
    fmax_m, fmax_e = np.frexp(float(jnp.finfo(fp8_dtype).max))   # 448 = 0.875 * 2^9; 57344 = 0.875 * 2^16
    m, e = jnp.frexp(amax)                                  # amax = m * 2^e, m in [0.5, 1)
    k = jnp.int32(fmax_e) - e - (m > fmax_m).astype(jnp.int32)
    k = jnp.clip(k, -126, 127)                              # a normal fp32 power of two
    scale = jax.lax.bitcast_convert_type((k + 127) << 23, F32)   # 2^k from its exponent bits
    return jnp.where(amax == 0, 1.0, jnp.where(jnp.isfinite(amax), scale, jnp.nan))


def quantize(x, fp8_dtype):
    """x -> (x * scale rounded to fp8_dtype, 1 / scale): q * inv_scale is x within fp8_dtype's rounding."""
    scale = pow2_scale(x, fp8_dtype)
    q = (x.astype(F32) * scale).astype(fp8_dtype)          # |x * scale| <= max: no overflow, no clip
    return q, 1.0 / scale


def dequantize(q, inv_scale, dtype):
    """q * inv_scale in dtype (the reference's round trip). Exact: every e4m3/e5m2 value times a power of
    two is representable in bf16/fp32 here."""
    return q.astype(dtype) * inv_scale.astype(dtype)


def _parse(spec: str):
    """'A,B->C' -> (A, B, C), checked: the backward einsums `C,B->A` and `A,C->B` need every index of
    each operand to appear in one of the other two terms (no index summed out of a single operand)."""
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    for name, term, others in (("lhs", a, b + out), ("rhs", b, a + out), ("output", out, a + b)):
        if len(set(term)) != len(term) or any(c not in others for c in term):
            raise ValueError(f"fp8_einsum spec {spec!r}: every {name} index must appear once, and in another "
                             "term (a projection like 'bsd,df->bsf'); reductions of one operand are not supported")
    return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x, w):
    """einsum(spec, x, w) through FP8: x and w quantized to e4m3 (per-tensor current scaling), the
    output in x's dtype (the GEMM accumulates in fp32). The backward quantizes the output gradient to
    e5m2 and runs both gradient GEMMs in FP8 too; gradients come back in the operands' dtypes."""
    return _fp8_fwd(spec, x, w)[0]


def _fp8_dot(spec, a, a_inv, b, b_inv, dt, precision):
    """einsum of two FP8 operands, output in dt, times the product of their inverse scales: the dot
    reads FP8 directly (XLA:GPU: one cuBLASLt FP8 GEMM), the scalar multiply fuses into its consumer."""
    out = jnp.einsum(spec, a, b, preferred_element_type=dt, precision=precision)
    return out * (a_inv * b_inv).astype(dt)                # a power of two: exact


def _fp8_fwd(spec, x, w):
    _parse(spec)
    dt = x.dtype
    xq, x_inv = quantize(x, E4M3)
    wq, w_inv = quantize(w, E4M3)
    y = _fp8_dot(spec, xq, x_inv, wq, w_inv, dt, FWD_PRECISION)
    # The FP8 residuals travel as their uint8 bits (a free bitcast): a remat policy that saves them
    # (e.g. FSDP's per-layer gather under remat=none, models/remat.py) has jax.checkpoint round every
    # saved float residual with reduce_precision(finfo's exponent and mantissa bits), whose IEEE
    # rounding turns e4m3fn's top binade (256..448) into inf, and the next convert into NaN.
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    return y, (bits(xq), x_inv, bits(wq), w_inv, jnp.zeros((), w.dtype))   # the last: w's dtype


def _fp8_bwd(spec, res, g):
    xbits, x_inv, wbits, w_inv, w_like = res
    xq, wq = (jax.lax.bitcast_convert_type(b, E4M3) for b in (xbits, wbits))
    a, b, c = _parse(spec)
    dt = g.dtype
    gq, g_inv = quantize(g, E5M2)
    dx = _fp8_dot(f"{c},{b}->{a}", gq, g_inv, wq, w_inv, dt, BWD_PRECISION)      # e5m2 x e4m3 GEMM
    dw = _fp8_dot(f"{a},{c}->{b}", xq, x_inv, gq, g_inv, dt, BWD_PRECISION)      # e4m3 x e5m2 GEMM
    return dx, dw.astype(w_like.dtype)


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_einsum_reference(spec: str, x, w):
    """The same numerics without custom_vjp, in fp32: einsum of the two e4m3 round trips (tests)."""
    xq, x_inv = quantize(x, E4M3)
    wq, w_inv = quantize(w, E4M3)
    return jnp.einsum(spec, dequantize(xq, x_inv, F32), dequantize(wq, w_inv, F32))
