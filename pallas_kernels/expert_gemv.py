"""Few-token GEMVs over a mixture of experts' chosen experts (Pallas Triton), weights stored [E, n, k].

    expert_gemv(x [b, k], w [E, 2, f, k], experts [b, K], swiglu=True)       -> [b K, f]
        row i K + j: silu(x_i @ w[e_ij, 0].T) * (x_i @ w[e_ij, 1].T)   each chosen expert's gate|up
    expert_gemv(h [b K, k], w [E, n, k], experts [b, K], combine=[b, K])     -> [b, n]
        row i: sum_j combine_ij * (h_iK+j @ w[e_ij].T)  (+ residual [b, n])   the down projections, summed
    route_rows(x [b, d], norm_scale [d], w_router [d, E], top_k=K, live=)  -> (normed [b, d], experts, combine)
        each row's RMSNorm, router and top k, in one program a row; a row not live gets ids -1

Why: at a few tokens the dropless dispatch (meshlab/parallel/experts.py) is about twenty small launches a
layer, and the grouped GEMM's 256-column tiles run a 2-row step on a few dozen programs. Here expert ids
are scalars read before the weight loads, a program's tiles are `block_n` output rows of one chosen
expert's [n, k] matrix (decode_gemv's grid and bytes per program), and the pairs of one column block
launch side by side, so rows that share an expert read its tiles from L2. Down walks a row's K experts
in one program: the weighted sum needs no second launch. Each expert's output is rounded to x's dtype
before its weight, as the model's grouped GEMM writes it. An id < 0 (a padding row's) reads nothing.
Limits: K <= MAX_CHOICES, n % block_n == 0 (k in power-of-two chunks <= block_k), no fp8, Triton or
interpret=True. Tiles: decode_gemv's (`default_block_sizes`, walked unrolled). Speed: docs/benchmarks.md#decode-and-serving.
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


def _expert(e_ref, i, w_ref):
    """Pair i's expert id, clamped to the bank here (an id out of range would read past it; a negative one,
    a padding row's, reads nothing: the loads are masked), where an XLA clamp would be one more launch."""
    return jnp.clip(e_ref[i], 0, w_ref.shape[0] - 1)


def _live(e_ref, i, masked):
    """Whether pair i's id is a real expert's (None: unmasked, every pair is)."""
    return e_ref[i] >= 0 if masked else None


def _load_tile(ref, live):
    """A weight tile, its load masked off for a pair that is not live (no bytes move; zeros)."""
    if live is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=jnp.broadcast_to(live, ref.shape), other=0.0)


def _swiglu_kernel(e_ref, x_ref, w_ref, o_ref, *, k, bn, bk, tpp, ahead, choices, masked):
    """Program (i, p): pair i's (row i // K, its expert) gate and up rows for the column blocks p, p + P, ..."""
    i, pid = pl.program_id(0), pl.program_id(1)
    programs, e, chunks, dt = o_ref.shape[1] // (bn * tpp), _expert(e_ref, i, w_ref), k // bk, o_ref.dtype
    live, row = _live(e_ref, i, masked), i // choices
    col = lambda t: (pid + t * programs) * bn   # noqa: E731 - strided: programs running at once read neighbouring rows
    xs = [plgpu.load(x_ref.at[pl.ds(row, 1), pl.ds(c * bk, bk)]).astype(F32) for c in range(chunks)]   # [1, bk] each
    acc = {}

    def load(step):
        t, _, c = step
        return [_load_tile(w_ref.at[pl.ds(e, 1), pl.ds(g, 1), pl.ds(col(t), bn), pl.ds(c * bk, bk)], live).reshape(bn, bk)
                for g in range(2)]                                                    # gate, up: [bn, bk] x2

    def use(step, tiles):
        t, _, c = step
        sums = [jnp.sum(w.astype(F32) * xs[c], axis=1) for w in tiles]               # [bn] x2
        acc[t] = sums if c == 0 else [a + s for a, s in zip(acc[t], sums)]
        if c == chunks - 1:
            gate, up = (a.astype(dt).astype(F32) for a in acc.pop(t))                 # the GEMM's rounding
            y = gate * jax.nn.sigmoid(gate) * up                                      # a pair that reads nothing: 0
            plgpu.store(o_ref.at[pl.ds(i, 1), pl.ds(col(t), bn)], y[None, :].astype(dt))
    _walk(_steps(tpp, 1, chunks), load, use, ahead)


def _combine_kernel(e_ref, c_ref, x_ref, w_ref, *refs, k, bn, bk, tpp, ahead, choices, residual, masked):
    """Program (r, p): row r's column blocks p, p + P, ... of sum_j c_rj * (h_rK+j @ w[e_rj].T)."""
    res_ref, o_ref = refs if residual else (None, refs[0])
    r, pid = pl.program_id(0), pl.program_id(1)
    programs, chunks, dt = o_ref.shape[1] // (bn * tpp), k // bk, o_ref.dtype
    col = lambda t: (pid + t * programs) * bn   # noqa: E731
    pairs = [r * choices + j for j in range(choices)]
    es, lives = [_expert(e_ref, i, w_ref) for i in pairs], [_live(e_ref, i, masked) for i in pairs]
    acc, out = {}, {}

    def load(step):
        t, j, c = step
        return _load_tile(w_ref.at[pl.ds(es[j], 1), pl.ds(col(t), bn), pl.ds(c * bk, bk)], lives[j]).reshape(bn, bk)

    def use(step, w):
        t, j, c = step
        x = plgpu.load(x_ref.at[pl.ds(pairs[j], 1), pl.ds(c * bk, bk)]).astype(F32)  # [1, bk]
        s = jnp.sum(w.astype(F32) * x, axis=1)                                        # [bn]
        acc[t] = s if c == 0 else acc[t] + s
        if c < chunks - 1:
            return
        y = acc.pop(t).astype(dt).astype(F32) * c_ref[pairs[j]]                      # expert j's output, weighted
        out[t] = y if j == 0 else out[t] + y
        if j == choices - 1:
            o = out.pop(t).astype(dt)                                                 # the weighted sum, rounded
            if residual:
                res = plgpu.load(res_ref.at[pl.ds(r, 1), pl.ds(col(t), bn)]).reshape(bn)                # [bn]
                o = (res.astype(F32) + o.astype(F32)).astype(dt)
            plgpu.store(o_ref.at[pl.ds(r, 1), pl.ds(col(t), bn)], o[None, :])
    _walk(_steps(tpp, choices, chunks), load, use, ahead)


def _route_kernel(x_ref, scale_ref, w_ref, *refs, eps, top_k, e_pad, chunk, sigmoid, norm_topk):
    """Program r: row r's RMSNorm, its router logits in fp32 over `chunk`-row slices of the router (all
    loads issued up front), the scores, the top k (lowest id first on ties, as lax.top_k); with a live
    mask, a row not live gets ids -1 and weights 0."""
    live_ref, (normed_ref, ids_ref, comb_ref) = (refs[0], refs[1:]) if len(refs) == 4 else (None, refs)
    r, (d, dt) = pl.program_id(0), (x_ref.shape[1], normed_ref.dtype)
    live = jnp.arange(e_pad) < w_ref.shape[1]              # the bank read as a power of two wide, the rest masked
    ws = [plgpu.load(w_ref.at[pl.ds(c, chunk), pl.ds(0, e_pad)], mask=live[None, :], other=0.0).astype(F32)
          for c in range(0, d, chunk)]                                                # [chunk, e_pad] each
    xf = plgpu.load(x_ref.at[pl.ds(r, 1), :]).astype(F32)                            # [1, d]
    inv = jax.lax.rsqrt(jnp.sum(xf * xf) / d + eps)
    normed = (xf * inv * plgpu.load(scale_ref.at[pl.ds(0, d)]).astype(F32)[None, :]).astype(dt)   # the model's RMSNorm rounding
    plgpu.store(normed_ref.at[pl.ds(r, 1), :], normed)
    logits = 0.0
    for i, c in enumerate(range(0, d, chunk)):                    # Triton has no slice: each chunk's x reloaded
        xc = plgpu.load(x_ref.at[pl.ds(r, 1), pl.ds(c, chunk)]).astype(F32)
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
    if live_ref is not None:
        row_live = live_ref[r] != 0
        ids, top = jnp.where(row_live, ids, -1), jnp.where(row_live, top, 0.0)
    plgpu.store(ids_ref.at[pl.ds(r * top_k, top_k)], ids)
    plgpu.store(comb_ref.at[pl.ds(r * top_k, top_k)], top)


def route_rows(x, norm_scale, w_router, *, top_k: int, live=None, eps: float = 1e-5, score: str = "softmax",
               norm_topk: bool = True, interpret: bool = False):
    """Each token's routing in one launch, a program a row: x [b, d] (the residual stream), norm_scale
    [d] and w_router [d, E] as stored (widened after their loads: serving stores them in the compute
    dtype, and a convert would be one more launch), live [b] (None: every row) -> (RMSNorm(x) *
    scale [b, d] in x's dtype, expert ids [b, top_k] int32 (-1 in a row not live: the expert kernels
    read nothing for it), their weights [b, top_k] fp32 (0 there)): models/moe.py `route`'s math with
    the logits summed in fp32 (the XLA path's fp32 dot may run in TF32 on a GPU). In XLA it is about
    seven small launches a layer (the norm, the router's dot, softmax, the top-k sort, converts).
    Limits: d and top_k powers of two."""
    (b, d), experts = x.shape, w_router.shape[1]
    if w_router.shape[0] != d or norm_scale.shape != (d,) or d & (d - 1) or top_k & (top_k - 1) \
            or not 1 <= top_k <= experts or score not in ("softmax", "sigmoid") or (live is not None and live.shape != (b,)):
        raise ValueError(f"route_rows: x {x.shape} must be [b, d] with d a power of two, norm_scale [d], w_router "
                         f"[d, E] (got {norm_scale.shape}, {w_router.shape}), live [b] or None, top_k={top_k} a power "
                         f"of two <= E and score={score!r} softmax or sigmoid")
    e_pad = 1 << (experts - 1).bit_length()
    chunk = min(d, max(16, 4096 // e_pad))                      # 16 KiB of fp32 router a load
    kernel = functools.partial(_route_kernel, eps=eps, top_k=top_k, e_pad=e_pad, chunk=chunk,
                               sigmoid=score == "sigmoid", norm_topk=norm_topk)
    args = (x, norm_scale, w_router) + (() if live is None else (live.astype(jnp.int32),))
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    normed, ids, weights = pl.pallas_call(
        kernel, grid=(b,), in_specs=[whole(a.shape) for a in args],
        out_specs=[whole((b, d)), whole((b * top_k,)), whole((b * top_k,))],
        out_shape=[jax.ShapeDtypeStruct((b, d), x.dtype), jax.ShapeDtypeStruct((b * top_k,), jnp.int32),
                   jax.ShapeDtypeStruct((b * top_k,), F32)],
        interpret=interpret, compiler_params=_CompilerParams(num_warps=4, num_stages=1), name="expert_route",
    )(*args)
    return normed, ids.reshape(b, top_k), weights.reshape(b, top_k)


def expert_gemv(x, w, experts, *, combine=None, residual=None, swiglu: bool = False, masked: bool = False,
                block_sizes: BlockSizes | None = None, interpret: bool = False):
    """See the module doc. swiglu: x [b, k] (the normed tokens), w [E, 2, f, k] -> [b K, f]; else x [b K, k]
    (row i K + j for experts[i, j]), w [E, n, k], combine [b, K] fp32 -> [b, n] in x's dtype. masked: ids
    may be negative (`route_rows`' rows not live): each pair's weight loads are predicated on its id
    (those pairs read nothing and give 0); unmasked, a negative id reads expert 0."""
    n, k = w.shape[-2], x.shape[-1]
    return _expert_gemv(x, w, experts, combine=combine, residual=residual, swiglu=swiglu, masked=masked,
                        block_sizes=block_sizes or decode_gemv.default_block_sizes(n, k, swiglu),
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("swiglu", "masked", "block_sizes", "interpret"))
def _expert_gemv(x, w, experts, *, combine, residual, swiglu, masked, block_sizes, interpret):
    (m, k), n = x.shape, w.shape[-2]
    if w.ndim != (4 if swiglu else 3) or w.shape[-1] != k or w.dtype != x.dtype or (swiglu and w.shape[1] != 2):
        raise ValueError(f"expert_gemv: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must share k and dtype, "
                         f"w [E, n, k] or with swiglu [E, 2, f, k]")
    if experts.ndim != 2 or not 1 <= experts.shape[1] <= MAX_CHOICES or not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"expert_gemv: experts {experts.shape} {experts.dtype} must be integer ids [b, K], each row's "
                         f"1..{MAX_CHOICES} chosen experts")
    (b, choices), pairs = experts.shape, experts.size
    if m != (b if swiglu else pairs):
        raise ValueError(f"expert_gemv: x {x.shape} must have " + (f"a row per token ({b})" if swiglu else
                         f"a row per chosen expert ({b} x {choices})"))
    if swiglu != (combine is None):
        raise ValueError("expert_gemv: swiglu=True (gate|up) takes no combine; the down projection needs combine [b, K]")
    if combine is not None and combine.shape != experts.shape:
        raise ValueError(f"expert_gemv: combine {combine.shape} must be {experts.shape}, one weight per chosen expert")
    if residual is not None and (swiglu or residual.shape != (b, n)):
        raise ValueError(f"expert_gemv: residual {residual.shape} must be [{b}, {n}], and not with swiglu")
    bs = block_sizes
    bk = bs.validate(n, k)
    kw = dict(k=k, bn=bs.block_n, bk=bk, tpp=bs.tiles_per_program, ahead=bs.prefetch, choices=choices, masked=masked)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - pointers, tiles picked in-kernel
    ids = experts.astype(jnp.int32).reshape(pairs)                     # pair i K + j: row i's j-th choice
    col_programs = n // bs.block_n // bs.tiles_per_program
    # Grid axis 0 runs fastest: a column block's pairs (or rows) launch side by side, so pairs that share
    # an expert meet its tiles in L2.
    if swiglu:
        kernel, grid, out = functools.partial(_swiglu_kernel, **kw), (pairs, col_programs), (pairs, n)
        args = [ids, x, w]
    else:
        kernel = functools.partial(_combine_kernel, residual=residual is not None, **kw)
        grid, out = (b, col_programs), (b, n)
        args = [ids, combine.astype(F32).reshape(pairs), x, w] + ([residual] if residual is not None else [])
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[whole(a) for a in args], out_specs=pl.BlockSpec(out, lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct(out, x.dtype), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name="expert_gemv" + ("_swiglu" if swiglu else "_combine") + "_residual" * (residual is not None),
    )(*args)


def expert_gemv_reference(x, w, experts, *, combine=None, residual=None, swiglu: bool = False):
    """Pure jnp, the model's roundings: each expert's GEMM output in x's dtype, then SwiGLU (gate|up), or
    the outputs times combine summed in fp32 and rounded, then the residual add (down). A negative id
    gives 0 (its pair reads nothing)."""
    b, choices = experts.shape
    live = (experts >= 0).reshape(-1)
    ws = w[jnp.maximum(experts, 0).reshape(-1)]                                       # [b K, (2,) n, k]
    if swiglu:
        rows = [decode_gemv_reference(x[i // choices][None], ws[i], swiglu=True) for i in range(b * choices)]
        return jnp.where(live[:, None], jnp.concatenate(rows), 0).astype(x.dtype)   # [b K, f]
    c = combine.reshape(-1)
    out = []
    for r in range(b):
        ys = [jnp.where(live[i], decode_gemv_reference(x[i][None], ws[i]).astype(F32) * c[i], 0.0)
              for i in range(r * choices, (r + 1) * choices)]                          # [1, n] each
        out.append(sum(ys).astype(x.dtype))
    y = jnp.concatenate(out)                                                          # [b, n]
    return y if residual is None else (residual.astype(F32) + y.astype(F32)).astype(x.dtype)
