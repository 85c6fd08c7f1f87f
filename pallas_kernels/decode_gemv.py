"""One-token matrix-vector products for decode (Pallas Triton): weights stored [n, k], every load issued at once.

    decode_gemv(x [m, k], w [n, k])                          -> x @ w.T                  [m, n]
        norm_scale=[k]:  RMSNorm(x) * norm_scale  @ w.T       (the pre-attention / pre-MLP norm)
        swiglu=True:     w = [2, f, k] (gate, up)  -> silu(x @ gate.T) * (x @ up.T)     [m, f]
        residual=[m, n]: residual + x @ w.T                    (the block's residual adds)
        w_scale=[n]:     w in float8_e4m3fn (quantize_rows): widened after its load, each sum times its row's scale

Why: at batch 1 a decode layer's matmuls are small (llama3_1b: 12.6 MB q|k|v, 8.4 MB wo) and the
XLA GEMMs before and after them (split-K partials, their reduce, the norm, SwiGLU's product)
are separate launches of a few microseconds each, most of it latency. Here a tile is `block_n`
output columns, their weights contiguous rows of the [n, k] layout (4 KB per row at k = 2048): a
program loads its whole [block_n, block_k] weight tile and its rows of x in one go, with no
loop-carried dependence between them, then multiplies and sums along k on the vector units (a
tensor-core dot would pad the 1-4 rows to 16), so every byte of the launch is in flight after
one memory latency. k > block_k loops (`num_stages`) or unrolls (`prefetch`); a program may walk
several tiles (`tiles_per_program`, `rolled`); defaults by shape (`shape_block_sizes`).
Limits: at most MAX_ROWS rows, n % block_n == 0 (k split into power-of-two chunks <= block_k), Triton (fp8: sm89+)
or interpret=True. Numerics: the model's XLA path (models/llama.py), fp32 products and sums, the normed x and the
matmul output rounded to x's dtype before the epilogue (with fp8, after the scale: the dequantized weights' sums).
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

MAX_ROWS = 4       # the FMAs grow with the rows; past a few, a tensor-core GEMM is the tool
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_n: int = 4        # output columns per tile: q|k|v 3072 / 4 = 768 tiles; 8 and 16 ran slower
    block_k: int = 2048     # contraction per load: all of k = d_model in one, down's 8192 in four
    num_warps: int = 4
    num_stages: int = 2     # weight tiles in flight per program when k > block_k (Triton's pipelining; prefetch=0)
    # A program's tiles, in turn (column blocks pid, pid + programs, ...): the grid shrinks to
    # n / block_n / tiles_per_program programs that stay resident, so no weight stream stops at a
    # program's end while the next program starts (its loads a memory latency away), and the
    # norm of x is computed once per program instead of once per tile.
    tiles_per_program: int = 1
    # Weight tiles (tile, k chunk) loaded ahead of the one being summed, in an unrolled sequence:
    # the next loads are in flight while the vector units reduce the current tile. 0: one tile's
    # loads at a time, k chunks in a loop pipelined by Triton.
    prefetch: int = 0
    # With tiles_per_program > 1, k in one chunk and prefetch=1: the tiles in a loop (not unrolled),
    # the next tile's weights carried as the loop's state, loaded before the current tile is summed.
    rolled: bool = False

    def validate(self, n: int, k: int) -> int:
        """Checks the tiles against [n, k]; returns the contraction chunk: the largest power of two
        <= block_k dividing k (Triton's tiles are powers of two)."""
        for name, v in (("block_n", self.block_n), ("block_k", self.block_k)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"decode_gemv: BlockSizes.{name}={v} must be a power of two")
        if n % self.block_n:
            raise ValueError(f"decode_gemv: {n=} output columns must be a multiple of block_n={self.block_n}")
        if self.tiles_per_program < 1 or (n // self.block_n) % self.tiles_per_program:
            raise ValueError(f"decode_gemv: the {n // self.block_n} column blocks of {n=} / block_n={self.block_n} "
                             f"must be a multiple of tiles_per_program={self.tiles_per_program}")
        if self.prefetch < 0:
            raise ValueError(f"decode_gemv: BlockSizes.prefetch={self.prefetch} must be >= 0")
        bk = self.block_k
        while k % bk:
            bk //= 2
        if self.rolled and (self.prefetch != 1 or bk != k):
            raise ValueError(f"decode_gemv: rolled=True needs prefetch=1 and {k=} in one chunk: a power of two "
                             f"<= block_k={self.block_k}")
        return bk


def shape_block_sizes(n: int, k: int, swiglu: bool) -> BlockSizes:
    """Tiles by the matmul's role, told apart by its shape (gate|up: swiglu; down: k > n; wo: n == k;
    q|k|v: n > k), from sweeps of `bench_decode.py --jobs matmul,engine_gemv` (docs/benchmarks.md):
    at llama3_1b's k = 2048 on an H200, 1,119 decode tokens/s against 1,072 with block_n 4 everywhere;
    at llama3_8b's k = 4096 on an H100, 180 against 160 where the k = 2048 tiles ran (gate|up's resident
    programs over two k chunks streamed at 70% of the copy rate; one 4,096-wide chunk a column, 89%).
    A tile that does not divide n falls back to one column per program."""
    if swiglu:      # gate|up, two rows a column: resident programs with the next tiles in flight at k = 2048
        bs = (BlockSizes(block_n=2, num_warps=2, tiles_per_program=4, prefetch=1) if k <= 2048
              else BlockSizes(block_n=2, block_k=8192, prefetch=1))
    elif k > n:     # down: a column's whole row in one load (or chunks of it), 8 warps over llama3_8b's 14,336
        bs = BlockSizes(block_n=2, block_k=8192, prefetch=1, num_warps=8 if k > 8192 else 4)
    elif n == k:    # wo: one column per single-warp program (2,048 of them) beats wider tiles at k = 2048
        bs = BlockSizes(block_n=1, num_warps=1) if k <= 2048 else BlockSizes(block_n=2, block_k=8192, prefetch=1)
    else:           # q|k|v
        bs = BlockSizes()
    if n % bs.block_n or (n // bs.block_n) % bs.tiles_per_program:
        bs = dataclasses.replace(bs, block_n=1, tiles_per_program=1)
    return bs


def default_block_sizes(n: int, k: int, swiglu: bool) -> BlockSizes:
    """The tiles a call gets when it names none (module-level, so a benchmark can swap it)."""
    return shape_block_sizes(n, k, swiglu)


FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0    # e4m3's largest finite value


def quantize_rows(w):
    """w [..., n, k] -> (float8_e4m3fn [..., n, k], fp32 scale [..., n]): each output row scaled so its
    largest |w| is FP8_MAX (an all-zero row gets scale 1), w ~= q * scale[..., None]."""
    wf = w.astype(F32)
    amax = jnp.max(jnp.abs(wf), axis=-1)                                                       # [..., n]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (wf / scale[..., None]).astype(FP8), scale


def decode_gemv_reference(x, w, *, norm_scale=None, eps=1e-5, residual=None, swiglu=False, w_scale=None):
    """Pure jnp, the model's op order and roundings (models/llama.py RMSNorm, _mm, MLP); w [n, k]
    or, with swiglu, [2, f, k]; fp8 w with w_scale [n] (or [2, f]): the fp32 sums times the scale."""
    dt = x.dtype
    if norm_scale is not None:
        xf = x.astype(F32)
        x = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * norm_scale.astype(F32)).astype(dt)

    def mm(w_rows, scale):                                                                      # [m, n] in dt
        if scale is None:
            return jnp.dot(x, w_rows.T, preferred_element_type=F32).astype(dt)
        return (jnp.dot(x.astype(F32), w_rows.astype(F32).T, precision="highest") * scale).astype(dt)
    if swiglu:
        gate, up = (mm(w[i], None if w_scale is None else w_scale[i]) for i in range(2))        # [m, f] x2
        return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(dt)
    y = mm(w, w_scale)                                                                         # [m, n]
    if residual is not None:
        return (residual.astype(F32) + y.astype(F32)).astype(dt)
    return y


def _row_sums(w_tiles, xs):
    """[(bn,) fp32 per (tile, row)]: each weight tile [bn, bk] times each x row [1, bk], summed over k."""
    return [[jnp.sum(w.astype(F32) * x, axis=1) for x in xs] for w in w_tiles]


def _kernel(*refs, m, k, bn, bk, tpp, ahead, rolled, eps, norm, swiglu, residual, fp8):
    """A program per `tpp` column blocks of `bn` outputs (per gate and up column block with swiglu);
    see the module doc and BlockSizes."""
    x_ref, w_ref, *refs = refs
    wscale_ref = refs.pop(0) if fp8 else None
    scale_ref = refs.pop(0) if norm else None
    res_ref = refs.pop(0) if residual else None
    (o_ref,) = refs
    pid, programs = pl.program_id(0), o_ref.shape[1] // (bn * tpp)
    col = lambda t: (pid + t * programs) * bn   # noqa: E731 - tile t of this program: strided, so
    #                                                          the programs running at once read neighbouring rows
    dt = o_ref.dtype
    chunks = k // bk

    def norms():
        """[m] 1/rms of x's rows, read in chunks (the rows' whole width, so the pass before the loop)."""
        out = []
        for r in range(m):
            ss = sum(jnp.sum(jnp.square(plgpu.load(x_ref.at[pl.ds(r, 1), pl.ds(c * bk, bk)]).astype(F32)))  # [1, bk]
                     for c in range(chunks))
            out.append(lax.rsqrt(ss / k + eps))
        return out
    rstd = norms() if norm and chunks > 1 else None

    def x_rows(k0):
        xs = []
        for r in range(m):
            xr = plgpu.load(x_ref.at[pl.ds(r, 1), pl.ds(k0, bk)])                           # [1, bk]
            if norm:
                xf = xr.astype(F32)
                inv = lax.rsqrt(jnp.sum(xf * xf) / k + eps) if chunks == 1 else rstd[r]     # one chunk: the whole row
                scale = plgpu.load(scale_ref.at[pl.ds(k0, bk)]).astype(F32)[None, :]
                xr = (xf * inv * scale).astype(x_ref.dtype)                                 # the model's rounding
            xs.append(xr.astype(F32))
        return xs

    def tiles(c0, k0):
        if swiglu:
            return [plgpu.load(w_ref.at[pl.ds(g, 1), pl.ds(c0, bn), pl.ds(k0, bk)]).reshape(bn, bk)
                    for g in range(2)]                                                       # [bn, bk] x2
        return [plgpu.load(w_ref.at[pl.ds(c0, bn), pl.ds(k0, bk)])]                          # [bn, bk]

    def store(c0, accs):
        if fp8:                                   # a column's sum times its row's scale, before the rounding
            if swiglu:
                sg, su = (plgpu.load(wscale_ref.at[pl.ds(g, 1), pl.ds(c0, bn)]).reshape(bn) for g in range(2))
                accs = [a * (sg if i < m else su) for i, a in enumerate(accs)]
            else:
                sc = plgpu.load(wscale_ref.at[pl.ds(c0, bn)])                               # [bn]
                accs = [a * sc for a in accs]
        for r in range(m):
            y = accs[r].astype(dt).astype(F32)                                              # the GEMM's rounding
            if swiglu:
                up = accs[m + r].astype(dt).astype(F32)
                y = y * jax.nn.sigmoid(y) * up
            y = y[None, :]                                                                   # [1, bn]
            if residual:
                y = y + plgpu.load(res_ref.at[pl.ds(r, 1), pl.ds(c0, bn)]).astype(F32)
            plgpu.store(o_ref.at[pl.ds(r, 1), pl.ds(c0, bn)], y.astype(dt))

    flat = lambda sums: [s for per_tile in sums for s in per_tile]   # noqa: E731 - [gate rows..., up rows...]
    if ahead == 0 and tpp == 1 and chunks > 1:     # k chunks in a loop, pipelined by Triton (num_stages)
        def body(i, accs):
            w = tiles(col(0), i * bk)  # issued first: the weight loads do not wait for x or its norm
            return tuple(a + s for a, s in zip(accs, flat(_row_sums(w, x_rows(i * bk)))))
        accs = tuple(jnp.zeros((bn,), F32) for _ in range((2 if swiglu else 1) * m))
        store(col(0), lax.fori_loop(0, chunks, body, accs))
        return
    if rolled:                                     # one chunk: tile t + 1's loads carried into iteration t + 1
        xs = x_rows(0)

        def tile_step(t, w):
            # issued before tile t's sums; the last iteration reloads its own tile (1 / tpp more bytes)
            ahead_w = tiles(col(jnp.minimum(t + 1, tpp - 1)), 0)
            store(col(t), flat(_row_sums(w, xs)))
            return ahead_w
        lax.fori_loop(0, tpp, tile_step, tiles(col(0), 0))
        return
    # Unrolled (tile, chunk) steps, each step's weight loads issued `ahead` steps before its sums:
    # straight-line code, so no loop-carried register has to wait for a load at a back edge.
    steps = [(t, c) for t in range(tpp) for c in range(chunks)]
    loads, xs_once = {}, (x_rows(0) if chunks == 1 else None)   # one chunk: x (and its norm) for every tile
    for i in range(len(steps)):
        for j in range(i, min(i + ahead + 1, len(steps))):
            if j not in loads:
                loads[j] = tiles(col(steps[j][0]), steps[j][1] * bk)
        t, c = steps[i]
        sums = flat(_row_sums(loads.pop(i), xs_once if chunks == 1 else x_rows(c * bk)))
        accs = sums if c == 0 else [a + s for a, s in zip(accs, sums)]
        if c == chunks - 1:
            store(col(t), accs)


def decode_gemv(x, w, *, norm_scale=None, eps: float = 1e-5, residual=None, swiglu: bool = False,
                w_scale=None, block_sizes: BlockSizes | None = None, interpret: bool = False):
    """See the module doc. x [m, k] (m <= MAX_ROWS), w [n, k] (or [2, f, k] with swiglu) in x's dtype,
    or float8_e4m3fn with w_scale [n] (or [2, f]) from quantize_rows."""
    return _decode_gemv(x, w, norm_scale=norm_scale, eps=eps, residual=residual, swiglu=swiglu, w_scale=w_scale,
                        block_sizes=block_sizes or default_block_sizes(w.shape[-2], x.shape[-1], swiglu),
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "block_sizes", "interpret"))
def _decode_gemv(x, w, *, norm_scale, eps, residual, swiglu, w_scale, block_sizes, interpret):
    (m, k), n = x.shape, w.shape[-2]
    if w.shape[-1] != k or w.dtype != (x.dtype if w_scale is None else FP8) or w.ndim != (3 if swiglu else 2) \
            or (swiglu and w.shape[0] != 2):
        raise ValueError(f"decode_gemv: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must share k and dtype (or w "
                         f"float8_e4m3fn with w_scale), w [n, k] or with swiglu [2, f, k]")
    if w_scale is not None and (w_scale.shape != w.shape[:-1] or w_scale.dtype != F32):
        raise ValueError(f"decode_gemv: w_scale {w_scale.shape} {w_scale.dtype} must be fp32 {w.shape[:-1]}, one per "
                         f"output row (quantize_rows)")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"decode_gemv: {m=} rows must be in 1..{MAX_ROWS} (decode batch); use a GEMM for more")
    if norm_scale is not None and norm_scale.shape != (k,):
        raise ValueError(f"decode_gemv: norm_scale {norm_scale.shape} must be [{k}]")
    if residual is not None and (swiglu or residual.shape != (m, n)):
        raise ValueError(f"decode_gemv: residual {residual.shape} must be [{m}, {n}], and not with swiglu")
    bs = block_sizes
    bk = bs.validate(n, k)
    args = [x, w] + [a for a in (w_scale, norm_scale, residual) if a is not None]
    kernel = functools.partial(_kernel, m=m, k=k, bn=bs.block_n, bk=bk, tpp=bs.tiles_per_program, ahead=bs.prefetch,
                               rolled=bs.rolled, eps=eps, norm=norm_scale is not None, swiglu=swiglu,
                               residual=residual is not None, fp8=w_scale is not None)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)  # noqa: E731 - pointers, tiles picked in-kernel
    return pl.pallas_call(
        kernel, grid=(n // bs.block_n // bs.tiles_per_program,), in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((m, n), lambda j: (0, 0)), out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        interpret=interpret, compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        # one name per variant, so that profiles tell the layer's four launches apart
        name="decode_gemv" + "_fp8" * (w_scale is not None) + "_norm" * (norm_scale is not None) + "_swiglu" * swiglu
        + "_residual" * (residual is not None),
    )(*args)
