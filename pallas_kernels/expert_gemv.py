"""One-token GEMVs over a mixture of experts' chosen experts (Pallas Triton), weights stored [E, n, k].

    expert_gemv(x [1, k], w [E, 2, f, k], experts [K], swiglu=True)      -> [K, f]
        row j: silu(x @ w[e_j, 0].T) * (x @ w[e_j, 1].T)          each chosen expert's gate|up
    expert_gemv(h [K, k], w [E, n, k], experts [K], combine=[K])         -> [1, n]
        sum_j combine[j] * (h[j] @ w[e_j].T)  (+ residual [1, n])  the down projections, weighted and summed
    route_one(x [1, d], norm_scale [d], w_router [d, E], top_k=K)        -> (normed [1, d], experts, combine)
        the RMSNorm, the router and its top k, in one program

Why: at one token the dropless dispatch (meshlab/parallel/experts.py) is about twenty small launches a
layer, and the grouped GEMM's 256-column tiles run a 2-row step on a few dozen programs. Here the expert
ids are scalars read before the weight loads, and a program's tiles are `block_n` output rows of the
chosen experts' [n, k] matrices: decode_gemv's grid and bytes per program at the same width. Down walks
the K experts' rows in one program, so their weighted sum needs no second launch; each expert's output is
rounded to x's dtype before its weight, as the model's grouped GEMM writes it.
Limits: K <= MAX_CHOICES, n % block_n == 0 (k in power-of-two chunks <= block_k), no fp8, Triton or
interpret=True. Tiles: decode_gemv's (`default_block_sizes`; `rolled` walks unrolled here, the same sums).
Speed: docs/benchmarks.md#decode-and-serving.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
from pallas_kernels import decode_gemv
from pallas_kernels.decode_gemv import F32, BlockSizes, decode_gemv_reference

MAX_CHOICES = 8    # the down kernel unrolls the K experts' tiles: top-8 (fine-grained experts) at most


def _steps(tiles, choices, chunks):
    """The unrolled (tile, expert, k chunk) order a program walks."""
    return [(t, j, c) for t in range(tiles) for j in range(choices) for c in range(chunks)]


def _walk(steps, load, use, ahead):
    """use(step, tiles) in order, each step's weight tiles loaded `ahead` steps before its sums:
    straight-line code, so the next loads are in flight while the vector units reduce these."""
    loads = {}
    for i in range(len(steps)):
        for s in range(i, min(i + ahead + 1, len(steps))):
            if s not in loads:
                loads[s] = load(steps[s])
        use(steps[i], loads.pop(i))


def _expert(e_ref, j, w_ref):
    """Chosen expert j's id, clamped to the bank here (an id out of range would read past it), where an
    XLA clamp would be one more launch a call."""
    return jnp.clip(e_ref[j], 0, w_ref.shape[0] - 1)


def _swiglu_kernel(e_ref, x_ref, w_ref, o_ref, *, k, bn, bk, tpp, ahead):
    """Program (j, p): chosen expert j's gate and up rows for the column blocks p, p + P, ..."""
    j, pid = pl.program_id(0), pl.program_id(1)
    programs, e, chunks, dt = o_ref.shape[1] // (bn * tpp), _expert(e_ref, j, w_ref), k // bk, o_ref.dtype
    col = lambda t: (pid + t * programs) * bn   # noqa: E731 - strided: programs running at once read neighbouring rows
    xs = [plgpu.load(x_ref.at[pl.ds(0, 1), pl.ds(c * bk, bk)]).astype(F32) for c in range(chunks)]   # [1, bk] each
    acc = {}

    def load(step):
        t, _, c = step
        return [plgpu.load(w_ref.at[pl.ds(e, 1), pl.ds(g, 1), pl.ds(col(t), bn), pl.ds(c * bk, bk)]).reshape(bn, bk)
                for g in range(2)]                                                    # gate, up: [bn, bk] x2

    def use(step, tiles):
        t, _, c = step
        sums = [jnp.sum(w.astype(F32) * xs[c], axis=1) for w in tiles]               # [bn] x2
        acc[t] = sums if c == 0 else [a + s for a, s in zip(acc[t], sums)]
        if c == chunks - 1:
            gate, up = (a.astype(dt).astype(F32) for a in acc.pop(t))                 # the GEMM's rounding
            y = gate * jax.nn.sigmoid(gate) * up
            plgpu.store(o_ref.at[pl.ds(j, 1), pl.ds(col(t), bn)], y[None, :].astype(dt))
    _walk(_steps(tpp, 1, chunks), load, use, ahead)


def _combine_kernel(e_ref, c_ref, x_ref, w_ref, *refs, k, bn, bk, tpp, ahead, choices, residual):
    """Program p: the column blocks p, p + P, ... of sum_j c_j * (h_j @ w[e_j].T), j over the choices."""
    res_ref, o_ref = refs if residual else (None, refs[0])
    pid = pl.program_id(0)
    programs, chunks, dt = o_ref.shape[1] // (bn * tpp), k // bk, o_ref.dtype
    col = lambda t: (pid + t * programs) * bn   # noqa: E731
    es = [_expert(e_ref, j, w_ref) for j in range(choices)]
    acc, out = {}, {}

    def load(step):
        t, j, c = step
        return plgpu.load(w_ref.at[pl.ds(es[j], 1), pl.ds(col(t), bn), pl.ds(c * bk, bk)]).reshape(bn, bk)

    def use(step, w):
        t, j, c = step
        x = plgpu.load(x_ref.at[pl.ds(j, 1), pl.ds(c * bk, bk)]).astype(F32)         # [1, bk]
        s = jnp.sum(w.astype(F32) * x, axis=1)                                        # [bn]
        acc[t] = s if c == 0 else acc[t] + s
        if c < chunks - 1:
            return
        y = acc.pop(t).astype(dt).astype(F32) * c_ref[j]                             # expert j's output, weighted
        out[t] = y if j == 0 else out[t] + y
        if j == choices - 1:
            o = out.pop(t).astype(dt)                                                 # the weighted sum, rounded
            if residual:
                r = plgpu.load(res_ref.at[pl.ds(0, 1), pl.ds(col(t), bn)]).reshape(bn)                  # [bn]
                o = (r.astype(F32) + o.astype(F32)).astype(dt)
            plgpu.store(o_ref.at[pl.ds(0, 1), pl.ds(col(t), bn)], o[None, :])
    _walk(_steps(tpp, choices, chunks), load, use, ahead)


def _route_kernel(x_ref, scale_ref, w_ref, normed_ref, ids_ref, comb_ref, *, eps, top_k, e_pad, chunk, sigmoid,
                  norm_topk):
    """One program: RMSNorm of the token, its router logits in fp32 over `chunk`-row slices of the
    router (all loads issued up front), the scores, the top k (lowest id first on ties, as lax.top_k)."""
    d, dt = x_ref.shape[1], normed_ref.dtype
    live = jnp.arange(e_pad) < w_ref.shape[1]              # the bank read as a power of two wide, the rest masked
    ws = [plgpu.load(w_ref.at[pl.ds(c, chunk), pl.ds(0, e_pad)], mask=live[None, :], other=0.0).astype(F32)
          for c in range(0, d, chunk)]                                                # [chunk, e_pad] each
    xf = plgpu.load(x_ref.at[pl.ds(0, 1), :]).astype(F32)                            # [1, d]
    inv = jax.lax.rsqrt(jnp.sum(xf * xf) / d + eps)
    normed = (xf * inv * plgpu.load(scale_ref.at[pl.ds(0, d)]).astype(F32)[None, :]).astype(dt)   # the model's RMSNorm rounding
    plgpu.store(normed_ref.at[pl.ds(0, 1), :], normed)
    logits = 0.0
    for i, c in enumerate(range(0, d, chunk)):                    # Triton has no slice: each chunk's x reloaded
        xc = plgpu.load(x_ref.at[pl.ds(0, 1), pl.ds(c, chunk)]).astype(F32)
        nc = (xc * inv * plgpu.load(scale_ref.at[pl.ds(c, chunk)]).astype(F32)[None, :]).astype(dt).astype(F32)   # [1, chunk]
        logits = logits + jnp.sum(jnp.reshape(nc, (chunk, 1)) * ws[i], axis=0)       # [e_pad]
    if sigmoid:
        scores = 1.0 / (1.0 + jnp.exp(-logits))
    else:
        z = jnp.exp(logits - jnp.max(jnp.where(live, logits, -jnp.inf)))
        scores = z / jnp.sum(jnp.where(live, z, 0.0))
    pick, idx, slot = jnp.where(live, scores, -1.0), jnp.arange(e_pad), jnp.arange(top_k)   # scores >= 0
    ids, top = jnp.zeros((top_k,), jnp.int32), jnp.zeros((top_k,), F32)
    for j in range(top_k):
        best = jnp.max(pick)
        i = jnp.min(jnp.where(pick == best, idx, e_pad))
        ids, top = jnp.where(slot == j, i, ids), jnp.where(slot == j, best, top)
        pick = jnp.where(idx == i, -2.0, pick)
    if norm_topk:
        top = top / jnp.sum(top)
    plgpu.store(ids_ref.at[pl.ds(0, top_k)], ids)
    plgpu.store(comb_ref.at[pl.ds(0, top_k)], top)


def route_one(x, norm_scale, w_router, *, top_k: int, eps: float = 1e-5, score: str = "softmax",
              norm_topk: bool = True, interpret: bool = False):
    """One token's routing in one launch: x [1, d] (the residual stream), norm_scale [d] (as stored:
    widened after its load, as the router), w_router
    [d, E] (widened to fp32 after its load: serving stores it in the compute dtype, and a convert
    would be one more launch) -> (RMSNorm(x) * scale [1, d] in x's dtype, expert ids [top_k] int32, their weights
    [top_k] fp32), models/moe.py `route`'s math with the logits summed in fp32 (the XLA path's fp32
    dot may run in TF32 on a GPU). In XLA it is about seven small launches a layer (the norm, the
    router's dot, softmax, the top-k sort, converts). Limits: d and top_k powers of two."""
    (_, d), experts = x.shape, w_router.shape[1]
    if x.shape[0] != 1 or w_router.shape[0] != d or norm_scale.shape != (d,) or d & (d - 1) or top_k & (top_k - 1) \
            or not 1 <= top_k <= experts or score not in ("softmax", "sigmoid"):
        raise ValueError(f"route_one: x {x.shape} must be one token [1, d] with d a power of two, norm_scale [d], "
                         f"w_router [d, E] (got {norm_scale.shape}, {w_router.shape}), top_k={top_k} a power of two "
                         f"<= E and score={score!r} softmax or sigmoid")
    e_pad = 1 << (experts - 1).bit_length()
    chunk = min(d, max(16, 4096 // e_pad))                      # 16 KiB of fp32 router a load
    kernel = functools.partial(_route_kernel, eps=eps, top_k=top_k, e_pad=e_pad, chunk=chunk,
                               sigmoid=score == "sigmoid", norm_topk=norm_topk)
    args = (x, norm_scale, w_router)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(1,), in_specs=[whole(a.shape) for a in args],
        out_specs=[whole((1, d)), whole((top_k,)), whole((top_k,))],
        out_shape=[jax.ShapeDtypeStruct((1, d), x.dtype), jax.ShapeDtypeStruct((top_k,), jnp.int32),
                   jax.ShapeDtypeStruct((top_k,), F32)],
        interpret=interpret, compiler_params=_CompilerParams(num_warps=4, num_stages=1), name="expert_route",
    )(*args)


def expert_gemv(x, w, experts, *, combine=None, residual=None, swiglu: bool = False,
                block_sizes: BlockSizes | None = None, interpret: bool = False):
    """See the module doc. swiglu: x [1, k] (the normed token), w [E, 2, f, k] -> [K, f]; else x [K, k]
    (row j for experts[j]), w [E, n, k], combine [K] fp32 -> [1, n] in x's dtype."""
    n, k = w.shape[-2], x.shape[-1]
    return _expert_gemv(x, w, experts, combine=combine, residual=residual, swiglu=swiglu,
                        block_sizes=block_sizes or decode_gemv.default_block_sizes(n, k, swiglu),
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("swiglu", "block_sizes", "interpret"))
def _expert_gemv(x, w, experts, *, combine, residual, swiglu, block_sizes, interpret):
    (m, k), (choices,) = x.shape, experts.shape
    n = w.shape[-2]
    if w.ndim != (4 if swiglu else 3) or w.shape[-1] != k or w.dtype != x.dtype or (swiglu and w.shape[1] != 2):
        raise ValueError(f"expert_gemv: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must share k and dtype, "
                         f"w [E, n, k] or with swiglu [E, 2, f, k]")
    if not 1 <= choices <= MAX_CHOICES or not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"expert_gemv: experts {experts.shape} {experts.dtype} must be integer ids of 1..{MAX_CHOICES} "
                         "chosen experts")
    if m != (1 if swiglu else choices):
        raise ValueError(f"expert_gemv: x {x.shape} must have " + ("one row (the token)" if swiglu else
                         f"one row per chosen expert ({choices})"))
    if swiglu != (combine is None):
        raise ValueError("expert_gemv: swiglu=True (gate|up) takes no combine; the down projection needs combine [K]")
    if combine is not None and combine.shape != (choices,):
        raise ValueError(f"expert_gemv: combine {combine.shape} must be [{choices}], one weight per chosen expert")
    if residual is not None and (swiglu or residual.shape != (1, n)):
        raise ValueError(f"expert_gemv: residual {residual.shape} must be [1, {n}], and not with swiglu")
    bs = block_sizes
    bk = bs.validate(n, k)
    kw = dict(k=k, bn=bs.block_n, bk=bk, tpp=bs.tiles_per_program, ahead=bs.prefetch)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - pointers, tiles picked in-kernel
    experts = experts.astype(jnp.int32)
    if swiglu:
        kernel, grid, out = functools.partial(_swiglu_kernel, **kw), (choices, n // bs.block_n // bs.tiles_per_program), \
            (choices, n)
        args = [experts, x, w]
    else:
        kernel = functools.partial(_combine_kernel, choices=choices, residual=residual is not None, **kw)
        grid, out = (n // bs.block_n // bs.tiles_per_program,), (1, n)
        args = [experts, combine.astype(F32), x, w] + ([residual] if residual is not None else [])
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[whole(a) for a in args], out_specs=pl.BlockSpec(out, lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct(out, x.dtype), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name="expert_gemv" + ("_swiglu" if swiglu else "_combine") + "_residual" * (residual is not None),
    )(*args)


def expert_gemv_reference(x, w, experts, *, combine=None, residual=None, swiglu: bool = False):
    """Pure jnp, the model's roundings: each expert's GEMM output in x's dtype, then SwiGLU (gate|up), or
    the outputs times combine summed in fp32 and rounded, then the residual add (down)."""
    ws = w[experts]                                                                   # [K, (2,) n, k]
    if swiglu:
        return jnp.concatenate([decode_gemv_reference(x, ws[j], swiglu=True) for j in range(experts.shape[0])])  # [K, f]
    ys = [decode_gemv_reference(x[j:j + 1], ws[j]).astype(F32) * combine[j] for j in range(experts.shape[0])]  # [1, n] each
    y = sum(ys).astype(x.dtype)
    return y if residual is None else (residual.astype(F32) + y.astype(F32)).astype(x.dtype)
