"""Output projection + softmax cross-entropy without ever holding [tokens, vocab] logits.

Three implementations of the per-token loss (pallas_kernels/cross_entropy_common.py) of
logits = hidden [T, d] @ weight [d, V] (fp32 accumulation, optionally rounded to `logit_dtype`):
  cross_entropy_reference  plain jnp; materialises [T, V] logits. The ground truth and XLA's peer.
  chunked_cross_entropy    jnp, lax.map over token chunks under jax.checkpoint: one [chunk, V] tile
                           alive in either pass; runs on every backend.
  fused_cross_entropy      Pallas (Triton) kernels, custom_vjp. Forward: an online log-sum-exp over
                           [bt, bv] logits tiles (`_fwd_kernel`). Backward: by default "G slabs"
                           (`_backward_slabs`: dlogits for bwd_chunk tokens, dh and dW as cuBLAS
                           GEMMs); bwd_chunk=0 is the pure tile backward (`_backward`), O(T*d + d*V)
                           memory, slower. Vocab, token and d tails are masked in-kernel.
Speed and memory of each: docs/benchmarks.md#fused-ops.
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
from pallas_kernels.cross_entropy_common import check_args, token_loss
from pallas_kernels.triton_tiles import load_tile, load_vec, store_tile


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, Triton's requirement) and launch parameters.

    Defaults from the H200 sweep (docs/benchmarks.md#fused-ops): forward tiles 128 x 256 matched
    XLA's forward; the slab backward with 2048-token chunks beat XLA's fwd+bwd, the pure tile
    backward (bwd_chunk=0) was several times slower. fp32 operands halve block_d so shared memory
    stays the same.
    """
    fwd_t: int = 128        # tokens per forward program
    fwd_v: int = 256        # vocab columns per forward tile
    fwd_splits: int = 1     # vocab splits in the forward grid (more programs when T/fwd_t is small)
    bwd_t: int = 128        # tokens per backward tile
    bwd_v: int = 256        # vocab columns per backward tile
    block_d: int = 64       # contraction chunk over d
    dw_t: int = 0           # dweight kernel tiles (0: bwd_t / bwd_v); its RMW traffic goes as 1/dw_t
    dw_v: int = 0
    # bwd_chunk > 0: "G slab" backward, a Pallas kernel writes dlogits for bwd_chunk tokens at a
    # time ([min(T, bwd_chunk), V] in the weights' dtype, never [T, V] when T > bwd_chunk) and
    # cuBLAS does dh and dW. 0: pure tile backward, O(T*d + d*V) memory but slower.
    bwd_chunk: int = 2048
    num_warps: int = 8
    num_stages: int = 3

    def validate(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < (0 if f.name in ("dw_t", "dw_v", "bwd_chunk") else 1):
                raise ValueError(f"BlockSizes.{f.name}={v!r} must be a positive int")
        for name in ("fwd_t", "fwd_v", "bwd_t", "bwd_v", "block_d", "dw_t", "dw_v"):
            v = getattr(self, name)
            if name in ("dw_t", "dw_v") and v == 0:
                continue
            if v & (v - 1) or v < 16:
                raise ValueError(f"BlockSizes.{name}={v} must be a power of two >= 16 (Triton tiles and dot)")


# --------------------------------------------------------------------------- references

def cross_entropy_reference(hidden, weight, labels, *, ignore_index=-1, z_loss=0.0, logit_dtype=jnp.float32):
    """Plain jnp: full [T, V] logits. The ground truth and XLA's fusion peer."""
    check_args(hidden, weight, labels, ignore_index, z_loss)
    logits = jnp.dot(hidden, weight, preferred_element_type=jnp.float32).astype(logit_dtype).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe = jnp.clip(labels, 0, weight.shape[1] - 1)
    label_logit = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    return token_loss(lse, label_logit, labels, ignore_index, z_loss)


def chunked_cross_entropy(hidden, weight, labels, *, ignore_index=-1, z_loss=0.0, logit_dtype=jnp.float32,
                          chunk_size=2048):
    """lax.map over token chunks; jax.checkpoint makes the backward recompute each chunk's logits
    instead of saving them, so at most one [chunk_size, V] tile is alive in either pass."""
    check_args(hidden, weight, labels, ignore_index, z_loss)
    if chunk_size < 1:
        raise ValueError(f"{chunk_size=} must be >= 1")
    t, d = hidden.shape
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n, c, d)
    y = jnp.pad(labels, (0, pad), constant_values=ignore_index).reshape(n, c)

    @jax.checkpoint
    def one(args):
        hc, yc = args
        return cross_entropy_reference(hc, weight, yc, ignore_index=ignore_index, z_loss=z_loss,
                                       logit_dtype=logit_dtype)

    return lax.map(one, (h, y)).reshape(-1)[:t]


# --------------------------------------------------------------------------- kernels

def _logits_tile(h_ref, w_ref, r0, c0, *, bt, bv, bk, T, d, V, mt, mv, md, logit_dtype):
    """[bt, bv] fp32 logits tile = h[r0:r0+bt] @ W[:, c0:c0+bv], looping over d in bk chunks.
    Out-of-range vocab columns come back as -inf so they drop out of every softmax sum."""
    def body(k, acc):
        hk = load_tile(h_ref, r0, bt, T, k * bk, bk, d, mask_r=mt, mask_c=md)
        wk = load_tile(w_ref, k * bk, bk, d, c0, bv, V, mask_r=md, mask_c=mv)
        return acc + jnp.dot(hk, wk, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(d, bk), body, jnp.zeros((bt, bv), jnp.float32))
    if logit_dtype != "float32":  # model-faithful rounding of the logits (e.g. bf16), math stays fp32
        acc = acc.astype(jnp.dtype(logit_dtype)).astype(jnp.float32)
    if mv:
        acc = jnp.where((c0 + jnp.arange(bv))[None, :] < V, acc, -jnp.inf)
    return acc


def _fwd_kernel(h_ref, w_ref, lab_ref, m_ref, l_ref, ll_ref, *, T, d, V, bt, bv, bk, nvs, logit_dtype, mt, mv, md):
    s, i = pl.program_id(0), pl.program_id(1)
    r0 = i * bt
    lab = load_vec(lab_ref, r0, bt, T, -1, mt)
    cols0 = jnp.arange(bv)

    def body(jj, carry):
        m, l, ll = carry
        c0 = (s * nvs + jj) * bv
        x = _logits_tile(h_ref, w_ref, r0, c0, bt=bt, bv=bv, bk=bk, T=T, d=d, V=V, mt=mt, mv=mv, md=md,
                         logit_dtype=logit_dtype)
        # m starts finite (-1e30), so a fully masked tile (all -inf) leaves m, l unchanged, no NaN.
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
        hit = (c0 + cols0)[None, :] == lab[:, None]
        ll = ll + jnp.sum(jnp.where(hit, x, 0.0), axis=1)
        return m_new, l, ll

    init = (jnp.full((bt,), -1e30, jnp.float32), jnp.zeros((bt,), jnp.float32), jnp.zeros((bt,), jnp.float32))
    m, l, ll = lax.fori_loop(0, nvs, body, init)
    rmask = (r0 + jnp.arange(bt)) < T
    o0 = s * T + r0  # outputs are flat [S*T]: one 1-D masked store per program
    plgpu.store(m_ref.at[pl.ds(o0, bt)], m, mask=rmask)
    plgpu.store(l_ref.at[pl.ds(o0, bt)], l, mask=rmask)
    plgpu.store(ll_ref.at[pl.ds(o0, bt)], ll, mask=rmask)


def _grad_tile(h_ref, w_ref, vecs, r0, c0, *, bt, bv, bk, T, d, V, mt, mv, md, logit_dtype, out_dtype):
    """dloss/dlogits for one tile: c_p * softmax - c_y * onehot(label); 0 on masked rows/cols."""
    lse, cp, cy, lab = vecs
    x = _logits_tile(h_ref, w_ref, r0, c0, bt=bt, bv=bv, bk=bk, T=T, d=d, V=V, mt=mt, mv=mv, md=md,
                     logit_dtype=logit_dtype)
    p = jnp.exp(x - lse[:, None])
    hit = (c0 + jnp.arange(bv))[None, :] == lab[:, None]
    g = cp[:, None] * p - jnp.where(hit, cy[:, None], 0.0)
    return g.astype(out_dtype)  # bf16 operands for the tensor cores when the weights are bf16


def _row_vecs(lse_ref, cp_ref, cy_ref, lab_ref, r0, bt, T, mt):
    return (load_vec(lse_ref, r0, bt, T, 0.0, mt), load_vec(cp_ref, r0, bt, T, 0.0, mt),
            load_vec(cy_ref, r0, bt, T, 0.0, mt), load_vec(lab_ref, r0, bt, T, -1, mt))


_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_TN = (((0,), (0,)), ((), ()))  # a^T @ b


def _dh_kernel(h_ref, w_ref, lse_ref, cp_ref, cy_ref, lab_ref, dh_ref, *, T, d, V, bt, bv, bk, mt, mv, md,
               logit_dtype):
    r0 = pl.program_id(0) * bt
    nk = pl.cdiv(d, bk)
    vecs = _row_vecs(lse_ref, cp_ref, cy_ref, lab_ref, r0, bt, T, mt)

    @pl.loop(0, nk)
    def _(k):
        store_tile(dh_ref, r0, bt, T, k * bk, bk, d, jnp.zeros((bt, bk), jnp.float32), mask_r=mt, mask_c=md)

    @pl.loop(0, pl.cdiv(V, bv))
    def _(j):
        c0 = j * bv
        g = _grad_tile(h_ref, w_ref, vecs, r0, c0, bt=bt, bv=bv, bk=bk, T=T, d=d, V=V, mt=mt, mv=mv, md=md,
                       logit_dtype=logit_dtype, out_dtype=w_ref.dtype)

        @pl.loop(0, nk)
        def _(k):
            wk = load_tile(w_ref, k * bk, bk, d, c0, bv, V, mask_r=md, mask_c=mv)
            acc = load_tile(dh_ref, r0, bt, T, k * bk, bk, d, mask_r=mt, mask_c=md)
            acc = acc + lax.dot_general(g, wk, _NT, preferred_element_type=jnp.float32)
            store_tile(dh_ref, r0, bt, T, k * bk, bk, d, acc, mask_r=mt, mask_c=md)


def _dw_kernel(h_ref, w_ref, lse_ref, cp_ref, cy_ref, lab_ref, dw_ref, *, T, d, V, bt, bv, bk, mt, mv, md,
               logit_dtype):
    c0 = pl.program_id(0) * bv
    nk = pl.cdiv(d, bk)

    @pl.loop(0, nk)
    def _(k):
        store_tile(dw_ref, k * bk, bk, d, c0, bv, V, jnp.zeros((bk, bv), jnp.float32), mask_r=md, mask_c=mv)

    @pl.loop(0, pl.cdiv(T, bt))
    def _(i):
        r0 = i * bt
        vecs = _row_vecs(lse_ref, cp_ref, cy_ref, lab_ref, r0, bt, T, mt)
        g = _grad_tile(h_ref, w_ref, vecs, r0, c0, bt=bt, bv=bv, bk=bk, T=T, d=d, V=V, mt=mt, mv=mv, md=md,
                       logit_dtype=logit_dtype, out_dtype=h_ref.dtype)

        @pl.loop(0, nk)
        def _(k):
            hk = load_tile(h_ref, r0, bt, T, k * bk, bk, d, mask_r=mt, mask_c=md)
            acc = load_tile(dw_ref, k * bk, bk, d, c0, bv, V, mask_r=md, mask_c=mv)
            acc = acc + lax.dot_general(hk, g, _TN, preferred_element_type=jnp.float32)
            store_tile(dw_ref, k * bk, bk, d, c0, bv, V, acc, mask_r=md, mask_c=mv)


def _g_kernel(h_ref, w_ref, lse_ref, cp_ref, cy_ref, lab_ref, g_ref, *, T, d, V, bt, bv, bk, mt, mv, md,
              logit_dtype):
    """One [bt, bv] tile of dlogits for a chunk of tokens: a GEMM with a softmax-grad epilogue."""
    r0, c0 = pl.program_id(0) * bt, pl.program_id(1) * bv
    vecs = _row_vecs(lse_ref, cp_ref, cy_ref, lab_ref, r0, bt, T, mt)
    g = _grad_tile(h_ref, w_ref, vecs, r0, c0, bt=bt, bv=bv, bk=bk, T=T, d=d, V=V, mt=mt, mv=mv, md=md,
                   logit_dtype=logit_dtype, out_dtype=g_ref.dtype)
    store_tile(g_ref, r0, bt, T, c0, bv, V, g, mask_r=mt, mask_c=mv)


def _backward_slabs(hidden, weight, labels, lse, cp, cy, logit_dtype, bs, interpret):
    """Backward by token chunks: the Pallas kernel recomputes logits and writes dlogits for one
    chunk in the weights' dtype; dh and dW are then plain GEMMs (cuBLAS on GPU), which a Triton
    GEMM with a read-modify-write accumulator does not match. Memory: one [chunk, V] slab plus
    the fp32 dW accumulator; time: the recomputation at Triton speed + 2 GEMMs at cuBLAS speed."""
    t, d, v, bk = _dims(hidden, weight, bs)
    c = min(bs.bwd_chunk, t)
    n = -(-t // c)
    pad = n * c - t
    bt, bv = _fit(bs.bwd_t, c), _fit(bs.bwd_v, v)
    kern = functools.partial(_g_kernel, T=c, d=d, V=v, bt=bt, bv=bv, bk=bk, mt=c % bt != 0, mv=v % bv != 0,
                             md=d % bk != 0, logit_dtype=logit_dtype)
    call = pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((c, v), weight.dtype), grid=(pl.cdiv(c, bt), pl.cdiv(v, bv)),
        interpret=interpret, compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name="fused_ce_dlogits")
    chunks = lambda a, fill=0: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill).reshape(
        (n, c) + a.shape[1:])
    xs = (chunks(hidden), chunks(lse), chunks(cp), chunks(cy), chunks(labels.astype(jnp.int32), -1))

    def step(dw, x):
        hc, lc, pc, yc, labc = x
        g = call(hc, weight, lc, pc, yc, labc)
        dh = lax.dot_general(g, weight, _NT, preferred_element_type=jnp.float32)
        dw = dw + lax.dot_general(hc, g, _TN, preferred_element_type=jnp.float32)
        return dw, dh

    dw, dh = lax.scan(step, jnp.zeros((d, v), jnp.float32), xs)
    return dh.reshape(n * c, d)[:t], dw


# --------------------------------------------------------------------------- wrapper

def _fit(b, n):
    """Tile no larger than the dimension's largest power of two (>= 16): Pallas refuses a static
    slice longer than the array, so tiny test shapes shrink the tile instead of failing."""
    if n < 16:
        raise ValueError(f"dimension {n=} must be >= 16 for the fused kernel (use chunked_cross_entropy)")
    return min(b, 1 << (n.bit_length() - 1))


def _dims(hidden, weight, bs):
    t, d = hidden.shape
    v = weight.shape[1]
    bk = _fit(bs.block_d, d)
    if max(hidden.dtype.itemsize, weight.dtype.itemsize) >= 4:
        bk = max(16, bk // 2)  # fp32 tiles: same shared memory per pipeline stage as bf16
    return t, d, v, bk


def _forward(hidden, weight, labels, logit_dtype, bs, interpret):
    t, d, v, bk = _dims(hidden, weight, bs)
    bt, bv, S = _fit(bs.fwd_t, t), _fit(bs.fwd_v, v), bs.fwd_splits
    nv = pl.cdiv(v, bv)
    S = min(S, nv)
    nvs = pl.cdiv(nv, S)
    kern = functools.partial(_fwd_kernel, T=t, d=d, V=v, bt=bt, bv=bv, bk=bk, nvs=nvs, logit_dtype=logit_dtype,
                             mt=t % bt != 0, mv=nvs * S * bv != v, md=d % bk != 0)
    part = jax.ShapeDtypeStruct((S * t,), jnp.float32)
    m, l, ll = pl.pallas_call(
        kern, out_shape=(part, part, part), grid=(S, pl.cdiv(t, bt)), interpret=interpret,
        compiler_params=_CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name="fused_ce_fwd",
    )(hidden, weight, labels.astype(jnp.int32))
    m, l, ll = (a.reshape(S, t) for a in (m, l, ll))
    mx = jnp.max(m, axis=0)
    lse = mx + jnp.log(jnp.sum(l * jnp.exp(m - mx), axis=0))
    return lse, jnp.sum(ll, axis=0)


def _backward(hidden, weight, labels, lse, cp, cy, logit_dtype, bs, interpret):
    """The pure tile backward. dhidden: grid (token block i), recompute each logits tile,
    g = c_p * softmax - c_y * onehot, dh[i] += g @ W[:, j]^T; dweight: grid (vocab block j), the same
    recomputation, dW[:, j] += h[i]^T @ g. The fp32 accumulators are too large for registers at
    d=2048, so they live in the outputs and are read-modified-written per tile: T*V*d*8/bv (dh) and
    T*V*d*8/bt (dW) bytes, the main cost besides the recomputed matmul (4 logits-sized matmuls in
    all, against 2 for XLA)."""
    t, d, v, bk = _dims(hidden, weight, bs)
    bt, bv = _fit(bs.bwd_t, t), _fit(bs.bwd_v, v)
    common = dict(T=t, d=d, V=v, bt=bt, bv=bv, bk=bk, mt=t % bt != 0, mv=v % bv != 0, md=d % bk != 0,
                  logit_dtype=logit_dtype)
    params = _CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    args = (hidden, weight, lse, cp, cy, labels.astype(jnp.int32))
    dh = pl.pallas_call(
        functools.partial(_dh_kernel, **common), out_shape=jax.ShapeDtypeStruct((t, d), jnp.float32),
        grid=(pl.cdiv(t, bt),), interpret=interpret, compiler_params=params, name="fused_ce_dhidden",
    )(*args)
    bt, bv = _fit(bs.dw_t or bs.bwd_t, t), _fit(bs.dw_v or bs.bwd_v, v)
    common.update(bt=bt, bv=bv, mt=t % bt != 0, mv=v % bv != 0)
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, **common), out_shape=jax.ShapeDtypeStruct((d, v), jnp.float32),
        grid=(pl.cdiv(v, bv),), interpret=interpret, compiler_params=params, name="fused_ce_dweight",
    )(*args)
    return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fused_ce(hidden, weight, labels, ignore_index, z_loss, logit_dtype, bs, interpret):
    lse, ll = _forward(hidden, weight, labels, logit_dtype, bs, interpret)
    return token_loss(lse, ll, labels, ignore_index, z_loss)


def _fused_ce_fwd(hidden, weight, labels, ignore_index, z_loss, logit_dtype, bs, interpret):
    lse, ll = _forward(hidden, weight, labels, logit_dtype, bs, interpret)
    return token_loss(lse, ll, labels, ignore_index, z_loss), (hidden, weight, labels, lse)


def _fused_ce_bwd(ignore_index, z_loss, logit_dtype, bs, interpret, res, dloss):
    hidden, weight, labels, lse = res
    valid = labels != ignore_index
    dloss = jnp.where(valid, dloss.astype(jnp.float32), 0.0)
    # d(lse + z*lse^2)/dlogit = (1 + 2 z lse) * softmax; d(-logit[y])/dlogit = -onehot.
    cp = dloss * (1.0 + 2.0 * z_loss * lse)
    back = _backward_slabs if bs.bwd_chunk else _backward
    dh, dw = back(hidden, weight, labels, lse, cp, dloss, logit_dtype, bs, interpret)
    return dh.astype(hidden.dtype), dw.astype(weight.dtype), None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def fused_cross_entropy(hidden, weight, labels, *, ignore_index=-1, z_loss=0.0, logit_dtype=jnp.float32,
                        block_sizes=None, interpret=False):
    """Per-token loss [T] float32 of softmax(hidden @ weight) against labels, fused (see module doc).

    hidden [T, d] and weight [d, V] may be bf16 (tensor-core operands; fp32 accumulation) or fp32.
    """
    check_args(hidden, weight, labels, ignore_index, z_loss)
    bs = block_sizes or BlockSizes()
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"{block_sizes=} must be a BlockSizes or None")
    bs.validate()
    return _fused_ce(hidden, weight, labels, int(ignore_index), float(z_loss), jnp.dtype(logit_dtype).name, bs,
                     bool(interpret))
