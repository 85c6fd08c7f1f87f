"""Per-block attention pieces shared by ring attention and local (Ulysses) attention.

A block function computes one query block against one k/v block and returns (out, lse), so the
caller can merge partial results with the log-sum-exp rule; the backward takes the *global* lse
and delta = rowsum(dO * O), so per-block gradients simply add up. Two implementations:
"jnp" here (tiled over `block_k` keys: temporaries ~ q_len x block_k, never q_len x kv_len) and
"pallas", an adapter over `pallas_kernels.flash_attention`'s block kernels (GPU).
Causal masks are bottom-right aligned: the queries are the last q_len of the keys.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.flash_attention import output_grad_rowsum

NEG = -1e30  # finite "minus infinity": exp(NEG - NEG) stays 1 instead of NaN for empty rows

# ----------------------------------------------------------------------------- jnp blocks
def _tile(ck: int, block_k: int) -> int:
    return block_k if ck > block_k and ck % block_k == 0 else ck


def _scan(body, init, xs):
    """lax.scan, but a single tile is traced straight (no while loop: faster to compile and run)."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        carry, y = body(init, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda x: x[None], y)
    return lax.scan(body, init, xs)


def _mask(q_pos, kv_pos, q_seg, kv_seg, causal):
    """[b or 1, cq, bk] boolean mask or None."""
    m = None
    if causal:
        m = (q_pos[:, None] >= kv_pos[None, :])[None]
    if q_seg is not None:
        s = q_seg[:, :, None] == kv_seg[:, None, :]
        m = s if m is None else m & s
    return m


def _split_kv(x, nt, bk):
    """[b, ck, ...] -> [nt, b, bk, ...] for a scan over key tiles."""
    return jnp.moveaxis(x.reshape(x.shape[0], nt, bk, *x.shape[2:]), 1, 0)


MAX_SPLITS = 2  # diagonal waste c^2/2 -> c^2/8; deeper costs more calls and compile time than it saves


def _split_diagonal(causal, cq, ck, block_k, depth):
    """A square causal block is split in two along the queries: the first half is again a square
    causal block (recursing), the second half sees all keys up to its diagonal. Without this a
    jnp causal block computes (and throws away) its whole upper triangle; each split halves that."""
    return causal and cq == ck and cq % 2 == 0 and cq // 2 >= block_k and depth < MAX_SPLITS


def _seg_half(seg, lo, hi):
    return None if seg is None else seg[:, lo:hi]


def jnp_block_fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_k=512, _depth=0):
    """Attention of one query block against one k/v block, tiled over keys with an online
    softmax. Returns (out fp32 [b, cq, h, d], lse fp32 [b, h, cq]); rows with no visible key get
    out 0 and lse NEG. `causal` is aligned to the bottom-right (queries are the last cq keys)."""
    if _split_diagonal(causal, q.shape[1], k.shape[1], block_k, _depth):
        hq = q.shape[1] // 2
        kw = dict(causal=True, scale=scale, block_k=block_k, _depth=_depth + 1)
        o0, l0 = jnp_block_fwd(q[:, :hq], k[:, :hq], v[:, :hq], _seg_half(q_seg, 0, hq), _seg_half(kv_seg, 0, hq), **kw)
        o1, l1 = jnp_block_fwd(q[:, hq:], k, v, _seg_half(q_seg, hq, None), kv_seg, **kw)
        return jnp.concatenate([o0, o1], 1), jnp.concatenate([l0, l1], 2)
    b, cq, h, d = q.shape
    ck, kvh = k.shape[1], k.shape[2]
    g, bk = h // kvh, _tile(ck, block_k)
    nt = ck // bk
    qg = q.reshape(b, cq, kvh, g, d)
    q_pos = jnp.arange(cq) + (ck - cq)
    xs = (_split_kv(k, nt, bk), _split_kv(v, nt, bk),
          None if kv_seg is None else _split_kv(kv_seg, nt, bk), jnp.arange(nt) * bk)

    def body(carry, x):
        o, m, l = carry
        kt, vt, st, start = x
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, kt, preferred_element_type=jnp.float32) * scale
        mask = _mask(q_pos, start + jnp.arange(bk), q_seg, st, causal)
        if mask is not None:
            s = jnp.where(mask[:, None, None], s, NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        if mask is not None:  # a fully masked row has s == m_new == NEG: zero it explicitly
            p = jnp.where(mask[:, None, None], p, 0.0)
        alpha = jnp.exp(m - m_new)  # rescale what was accumulated under the old max
        l = l * alpha + p.sum(-1)
        o = o * alpha[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vt,
                                              preferred_element_type=jnp.float32)
        return (o, m_new, l), None

    init = (jnp.zeros((b, kvh, g, cq, d), jnp.float32), jnp.full((b, kvh, g, cq), NEG, jnp.float32),
            jnp.zeros((b, kvh, g, cq), jnp.float32))
    (o, m, l), _ = _scan(body, init, xs)
    ok = l > 0
    lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), NEG)
    o = o / jnp.where(ok, l, 1.0)[..., None]
    return o.transpose(0, 3, 1, 2, 4).reshape(b, cq, h, d), lse.reshape(b, h, cq)


def jnp_block_bwd(q, k, v, do, lse, delta, q_seg, kv_seg, *, causal, scale, block_k=512, _depth=0):
    """Gradients of one block from the *global* lse and delta = rowsum(dO * O).
    Returns fp32 (dq [b, cq, h, d], dk, dv [b, ck, kvh, d]); tiled over keys like the forward."""
    if _split_diagonal(causal, q.shape[1], k.shape[1], block_k, _depth):
        hq = q.shape[1] // 2
        kw = dict(causal=True, scale=scale, block_k=block_k, _depth=_depth + 1)
        dq0, dk0, dv0 = jnp_block_bwd(q[:, :hq], k[:, :hq], v[:, :hq], do[:, :hq], lse[..., :hq], delta[..., :hq],
                                      _seg_half(q_seg, 0, hq), _seg_half(kv_seg, 0, hq), **kw)
        dq1, dk1, dv1 = jnp_block_bwd(q[:, hq:], k, v, do[:, hq:], lse[..., hq:], delta[..., hq:],
                                      _seg_half(q_seg, hq, None), kv_seg, **kw)
        return jnp.concatenate([dq0, dq1], 1), dk1.at[:, :hq].add(dk0), dv1.at[:, :hq].add(dv0)
    b, cq, h, d = q.shape
    ck, kvh = k.shape[1], k.shape[2]
    g, bk = h // kvh, _tile(ck, block_k)
    nt = ck // bk
    qg, dog = q.reshape(b, cq, kvh, g, d), do.reshape(b, cq, kvh, g, d)
    lse, delta = lse.reshape(b, kvh, g, cq), delta.reshape(b, kvh, g, cq)
    q_pos = jnp.arange(cq) + (ck - cq)
    xs = (_split_kv(k, nt, bk), _split_kv(v, nt, bk),
          None if kv_seg is None else _split_kv(kv_seg, nt, bk), jnp.arange(nt) * bk)

    def body(dq, x):
        kt, vt, st, start = x
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, kt, preferred_element_type=jnp.float32) * scale
        p = jnp.exp(s - lse[..., None])
        mask = _mask(q_pos, start + jnp.arange(bk), q_seg, st, causal)
        if mask is not None:
            p = jnp.where(mask[:, None, None], p, 0.0)
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), dog, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, vt, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kt, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg, preferred_element_type=jnp.float32)
        return dq, (dk, dv)

    dq, (dk, dv) = _scan(body, jnp.zeros((b, cq, kvh, g, d), jnp.float32), xs)
    unsplit = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, ck, kvh, d)  # noqa: E731
    return dq.reshape(b, cq, h, d), unsplit(dk), unsplit(dv)


def _block_fns(block_impl: str, block_k: int):
    if block_impl == "jnp":
        return (functools.partial(jnp_block_fwd, block_k=block_k),
                functools.partial(jnp_block_bwd, block_k=block_k))
    if block_impl == "pallas":
        try:
            from pallas_kernels import flash_attention as fa
            fwd, bwd = fa.flash_attention_block_fwd, fa.flash_attention_block_bwd
        except (ImportError, AttributeError) as e:
            raise RuntimeError(
                "ring_attention(block_impl='pallas') needs pallas_kernels.flash_attention to provide "
                f"flash_attention_block_fwd/_bwd ({e}); use block_impl='jnp'") from None

        # Adapter: the one place that knows the kernel's calling convention. Our `causal` is
        # bottom-right aligned, i.e. the kernel's causal_offset = kv_len - q_len. Off GPU the
        # kernel runs in interpret mode (slow; tests only).
        interpret = jax.default_backend() != "gpu"

        def _kw(q, k, q_seg, kv_seg, causal, scale):
            return dict(causal_offset=(k.shape[1] - q.shape[1]) if causal else None, sm_scale=scale,
                        segment_ids=None if q_seg is None else (q_seg, kv_seg), interpret=interpret)

        def pfwd(q, k, v, q_seg, kv_seg, *, causal, scale):
            return fwd(q, k, v, out_dtype=jnp.float32, **_kw(q, k, q_seg, kv_seg, causal, scale))

        def pbwd(q, k, v, do, lse, delta, q_seg, kv_seg, *, causal, scale):
            return bwd(q, k, v, do, lse, delta, grad_dtype=jnp.float32, **_kw(q, k, q_seg, kv_seg, causal, scale))
        return pfwd, pbwd
    raise ValueError(f"unknown block_impl {block_impl!r}; choose 'jnp', 'pallas' or 'auto'")


def resolve_block_impl(block_impl: str, head_dim: int) -> str:
    """'auto': the Pallas block kernels on GPU when present and the head dim suits them, else jnp."""
    if block_impl != "auto":
        return block_impl
    if jax.default_backend() != "gpu" or head_dim not in (16, 32, 64, 128, 256):
        return "jnp"
    try:
        from pallas_kernels import flash_attention as fa
        return "pallas" if hasattr(fa, "flash_attention_block_fwd") else "jnp"
    except ImportError:
        return "jnp"


# ----------------------------------------------------------------------------- local flash (jnp)
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _jnp_flash(q, k, v, q_seg, kv_seg, causal, scale, block_k):
    return jnp_block_fwd(q, k, v, q_seg, kv_seg, causal=causal, scale=scale, block_k=block_k)[0].astype(q.dtype)


def _jnp_flash_fwd(q, k, v, q_seg, kv_seg, causal, scale, block_k):
    o, lse = jnp_block_fwd(q, k, v, q_seg, kv_seg, causal=causal, scale=scale, block_k=block_k)
    o = o.astype(q.dtype)
    return o, (q, k, v, q_seg, kv_seg, o, lse)


def _jnp_flash_bwd(causal, scale, block_k, res, do):
    q, k, v, q_seg, kv_seg, o, lse = res
    delta = output_grad_rowsum(o, do)                                       # [b, h, s]
    dq, dk, dv = jnp_block_bwd(q, k, v, do, lse, delta, q_seg, kv_seg, causal=causal, scale=scale, block_k=block_k)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_jnp_flash.defvjp(_jnp_flash_fwd, _jnp_flash_bwd)


def jnp_flash_attention(q, k, v, *, causal: bool, segment_ids=None, sm_scale=None, block_k: int = 512):
    """Single-device attention in jnp with memory ~ s x block_k (not s x s), forward and backward:
    the ring's block pieces on one block. A portable `attention_fn` for Ulysses at long S."""
    scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5
    q_ids, kv_ids = (segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids))
    return _jnp_flash(q, k, v, q_ids, kv_ids, bool(causal), scale, int(block_k))
