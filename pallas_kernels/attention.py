"""Attention dispatch: one call site for every implementation the model can ask for.

`impl` is one of:
  xla     the reference: einsum + softmax in fp32, materialises [b, h, q, k] scores.
  cudnn   `jax.nn.dot_product_attention(implementation="cudnn")` (GPU only).
  pallas  `pallas_kernels.flash_attention` (tiled, online softmax).
  auto    the first available of pallas -> cudnn -> xla, logged once.
An explicit choice that cannot run here is an error, never a silent fallback.
Layout everywhere: q [b, q_len, heads, d], k/v [b, kv_len, kv_heads, d].
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

IMPLS = ("xla", "cudnn", "pallas", "auto")
log = logging.getLogger(__name__)


def xla_attention(q, k, v, *, causal: bool, segment_ids=None, sm_scale=None):
    """Plain attention with fp32 softmax; GQA by grouping query heads (KV never repeated)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if h % kvh:
        raise ValueError(f"query heads {h=} must be a multiple of kv heads {kvh=}")
    g = h // kvh
    scale = sm_scale if sm_scale is not None else d ** -0.5
    qg = q.reshape(b, sq, kvh, g, d)  # [b, q, kvh, g, d]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale  # [b, kvh, g, q, s]
    mask = _mask(sq, sk, causal, segment_ids)
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [b, q, kvh, g, d]
    return o.reshape(b, sq, h, d).astype(q.dtype)


def _mask(sq, sk, causal, segment_ids):
    """[b or 1, q, k] boolean mask; causal aligns queries to the end of the keys."""
    mask = None
    if causal:
        qi = jnp.arange(sq)[:, None] + (sk - sq)
        mask = (qi >= jnp.arange(sk)[None, :])[None]
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        seg = q_ids[:, :, None] == kv_ids[:, None, :]
        mask = seg if mask is None else mask & seg
    return mask


def _gpu_available() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def available(impl: str) -> bool:
    if impl == "xla" or impl == "auto":
        return True
    if impl == "cudnn":
        return _gpu_available()
    if impl == "pallas":
        try:
            from pallas_kernels import flash_attention  # noqa: F401
        except ImportError:
            return False
        return _gpu_available()
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")


_auto_choice: str | None = None


def resolve(impl: str) -> str:
    """The implementation that will run: `auto` picked once and logged; unavailable explicit choices raise."""
    global _auto_choice
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        if _auto_choice is None:
            _auto_choice = next(i for i in ("pallas", "cudnn", "xla") if available(i))
            log.info("attention: auto chose %s", _auto_choice)
        return _auto_choice
    if not available(impl):
        raise RuntimeError(
            f"attention implementation {impl!r} is not available on {jax.default_backend()}; "
            "use attention=xla (or auto to pick the best available)")
    return impl


def dot_product_attention(q, k, v, *, impl: str = "xla", causal: bool = True, segment_ids=None, sm_scale=None):
    impl = resolve(impl)
    if impl == "xla":
        return xla_attention(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)
    if impl == "cudnn":
        if segment_ids is not None:
            raise NotImplementedError("cudnn attention through jax.nn.dot_product_attention takes no segment ids "
                                      "here; use attention=pallas or xla for packed sequences")
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, implementation="cudnn")
    from pallas_kernels.flash_attention import flash_attention
    return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)
