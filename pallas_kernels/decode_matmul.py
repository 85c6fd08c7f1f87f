"""The decode step's matmuls with their neighbours folded in (Pallas Triton): few rows, whole weights.

    decode_matmul(x [m, k], w [k, n])                          -> x @ w                  [m, n]
        norm_scale=[k]:  RMSNorm(x) * norm_scale  @ w         (the pre-attention / pre-MLP norm)
        swiglu=True:     w = gate | up [k, 2f] -> silu(x @ gate) * (x @ up)             [m, f]
        residual=[m, n]: residual + x @ w                       (the block's residual adds)

Why: at decode batch 1..16 a layer is four weight reads and the rest is vectors, which XLA runs as
small kernels of their own; here a layer is four launches plus attention, the epilogues in registers.
Limits: for few rows (m <= 16: the norm prologue re-reads x in every program); the step is bound
by HBM bandwidth, so the kernel (`_kernel`) is about keeping weight tiles in flight. Serving uses it
only with layers="kernels" (meshlab/infer), not by default. Numerics follow the model's XLA path
(models/llama.py): fp32 accumulation, the normed x and the matmul output rounded to x's dtype.
Speed against XLA's path (currently slower): docs/benchmarks.md#decode-and-serving.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
from pallas_kernels.triton_tiles import load_tile, store_tile

ROWS = 16   # rows per program: Triton's smallest tensor-core M; also the most rows this is for
F32 = jnp.float32


SMEM_BYTES = 200 * 1024   # the pipeline's buffers must fit the H100/H200's 227 KiB of shared memory


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_n: int = 32     # output columns per program: n / block_n programs (wo at d=2048: 64)
    block_k: int = 256    # contraction chunk per loop iteration ([block_k, block_n] weight tile)
    num_warps: int = 4
    num_stages: int = 4   # weight tiles in flight per program; at most, see stages()

    def stages(self, itemsize: int, tiles: int) -> int:
        """num_stages capped so that the pipeline's buffers (an x chunk and `tiles` weight tiles per
        stage) fit in shared memory: fp32 weights (the GPU correctness gate) or SwiGLU's two tiles
        would otherwise fail to launch at the bf16 defaults."""
        per_stage = (ROWS + tiles * self.block_n) * self.block_k * itemsize
        return max(1, min(self.num_stages, SMEM_BYTES // per_stage))

    def validate(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"decode_matmul: BlockSizes.{name}={v} must be a power of two >= 16")


def decode_matmul_reference(x, w, *, norm_scale=None, eps=1e-5, residual=None, swiglu=False):
    """Pure jnp, the model's op order and roundings (models/llama.py RMSNorm, _mm, MLP)."""
    dt = x.dtype
    if norm_scale is not None:
        xf = x.astype(F32)
        x = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * norm_scale.astype(F32)).astype(dt)
    y = jnp.dot(x, w, preferred_element_type=F32).astype(dt)                     # [m, n]
    if swiglu:
        gate, up = jnp.split(y, 2, axis=-1)                                      # [m, f] x2
        return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(dt)
    if residual is not None:
        return (residual.astype(F32) + y.astype(F32)).astype(dt)
    return y


def _rstd(x_ref, *, m, k, bk, eps, mask_k):
    """[ROWS] 1/rms of x's rows (fp32), summed over k in bk chunks; padded rows get rsqrt(eps)."""
    def body(i, ss):
        xk = load_tile(x_ref, 0, ROWS, m, i * bk, bk, k, mask_r=True, mask_c=mask_k).astype(F32)   # [ROWS, bk]
        return ss + jnp.sum(xk * xk, axis=1)
    ss = lax.fori_loop(0, pl.cdiv(k, bk), body, jnp.zeros((ROWS,), F32))
    return lax.rsqrt(ss / k + eps)


def _weight_tile(w_ref, k0, bk, k, c0, bn, *, nk, mask_k, mask_n):
    """The [bk, bn] weight tile at (k0, c0); nk: w stored [n, k] (each output's weights contiguous),
    loaded as [bn, bk] and fed transposed to the dot (Triton folds the transpose into the MMA)."""
    if nk:
        return load_tile(w_ref, c0, bn, w_ref.shape[0], k0, bk, k, mask_r=mask_n, mask_c=mask_k).T
    return load_tile(w_ref, k0, bk, k, c0, bn, w_ref.shape[1], mask_r=mask_k, mask_c=mask_n)


def _kernel(*refs, m, k, n_out, bn, bk, eps, norm, swiglu, residual, mask_k, mask_n, nk):
    """One program per `block_n` output columns (per gate and up column block with swiglu): a loop
    over k in `block_k` chunks, a tensor-core dot of the rows padded to 16 (Triton's smallest M; the
    padded rows are masked loads of nothing) against the [block_k, block_n] weight tile. Every weight
    byte is read once and the loop is software-pipelined (`num_stages` tiles in flight). XLA's own
    GEMMs split K across programs where this does not (down: 64-128 programs for 132 SMs), which is
    where this kernel loses; w_layout="nk" reads [n, k] weights (contiguous per output column)."""
    x_ref, w_ref, *refs = refs
    scale_ref = refs.pop(0) if norm else None
    res_ref = refs.pop(0) if residual else None
    (o_ref,) = refs
    c0 = pl.program_id(0) * bn
    rstd = _rstd(x_ref, m=m, k=k, bk=bk, eps=eps, mask_k=mask_k) if norm else None
    # gate and up columns; with f % bn != 0 the last gate tile reads into up, masked at the store
    col_starts = (c0, n_out + c0) if swiglu else (c0,)

    # fp32 weights (the GPU correctness gate): full-precision dots, where Triton would default to tf32
    precision = lax.Precision.HIGHEST if w_ref.dtype == F32 else None

    def body(i, accs):
        xk = load_tile(x_ref, 0, ROWS, m, i * bk, bk, k, mask_r=True, mask_c=mask_k)                 # [ROWS, bk]
        if norm:
            scale = plgpu.load(scale_ref.at[pl.ds(i * bk, bk)], **(
                dict(mask=i * bk + jnp.arange(bk) < k, other=0) if mask_k else {})).astype(F32)  # [bk]
            xk = (xk.astype(F32) * rstd[:, None] * scale[None, :]).astype(x_ref.dtype)
        return tuple(acc + jnp.dot(xk, _weight_tile(w_ref, i * bk, bk, k, s, bn, nk=nk, mask_k=mask_k,
                                                    mask_n=mask_n), precision=precision,
                                     preferred_element_type=F32)                                 # [ROWS, bn]
                     for acc, s in zip(accs, col_starts))

    zero = jnp.zeros((ROWS, bn), F32)
    accs = lax.fori_loop(0, pl.cdiv(k, bk), body, (zero,) * len(col_starts))
    dt = o_ref.dtype
    y = accs[0].astype(dt).astype(F32)                                           # the GEMM's rounding
    if swiglu:
        up = accs[1].astype(dt).astype(F32)
        y = y * jax.nn.sigmoid(y) * up
    if residual:
        y = y + load_tile(res_ref, 0, ROWS, m, c0, bn, n_out, mask_r=True, mask_c=mask_n).astype(F32)
    store_tile(o_ref, 0, ROWS, m, c0, bn, n_out, y.astype(dt), mask_r=True, mask_c=mask_n)


def default_block_sizes(k: int, n_out: int, swiglu: bool) -> BlockSizes:
    """The tiles a call gets when it names none."""
    return BlockSizes()


def decode_matmul(x, w, *, norm_scale=None, eps: float = 1e-5, residual=None, swiglu: bool = False,
                  w_layout: str = "kn", block_sizes: BlockSizes | None = None, interpret: bool = False):
    """See the module doc. x [m, k] with m <= 16 rows, w [k, n] ("kn") or [n, k] ("nk") in x's
    dtype; output in x's dtype."""
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"decode_matmul: {w_layout=} must be 'kn' (w [k, n]) or 'nk' (w [n, k])")
    if block_sizes is None:   # resolved outside the jit, so the benchmark can swap the defaults
        n = w.shape[0 if w_layout == "nk" else 1]
        block_sizes = default_block_sizes(x.shape[-1], n // (2 if swiglu else 1), swiglu)
    return _decode_matmul(x, w, norm_scale=norm_scale, eps=eps, residual=residual, swiglu=swiglu,
                          nk=w_layout == "nk", block_sizes=block_sizes, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "nk", "block_sizes", "interpret"))
def _decode_matmul(x, w, *, norm_scale, eps, residual, swiglu, nk, block_sizes, interpret):
    bs = block_sizes
    bs.validate()
    (m, k), (kw, n) = x.shape, (w.shape[::-1] if nk else w.shape)
    if kw != k or w.dtype != x.dtype:
        raise ValueError(f"decode_matmul: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must share k and dtype")
    if not 1 <= m <= ROWS:
        raise ValueError(f"decode_matmul: {m=} rows must be in 1..{ROWS} (decode batch); use a GEMM for more")
    if swiglu and n % 2:
        raise ValueError(f"decode_matmul: swiglu needs w = gate | up with an even column count, not {n=}")
    n_out = n // 2 if swiglu else n
    if norm_scale is not None and norm_scale.shape != (k,):
        raise ValueError(f"decode_matmul: norm_scale {norm_scale.shape} must be [{k}]")
    if residual is not None and (swiglu or residual.shape != (m, n_out)):
        raise ValueError(f"decode_matmul: residual {residual.shape} must be [{m}, {n_out}], and not with swiglu")
    args = [x, w] + ([norm_scale] if norm_scale is not None else []) + ([residual] if residual is not None else [])
    kernel = functools.partial(_kernel, m=m, k=k, n_out=n_out, bn=bs.block_n, bk=bs.block_k, eps=eps,
                               norm=norm_scale is not None, swiglu=swiglu, residual=residual is not None,
                               mask_k=k % bs.block_k != 0, mask_n=n_out % bs.block_n != 0, nk=nk)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)  # noqa: E731 - pointers, tiles picked in-kernel
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(n_out, bs.block_n),), in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((m, n_out), lambda j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n_out), x.dtype), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps,
                                        num_stages=bs.stages(x.dtype.itemsize, 2 if swiglu else 1)),
        # one name per variant, so that profiles tell the layer's four launches apart
        name="decode_matmul" + "_norm" * (norm_scale is not None) + "_swiglu" * swiglu + "_residual" * (residual is not None),
    )(*args)
