"""Attention dispatch: one call site for every implementation the model can ask for.

`impl` is one of:
  xla     the reference: einsum + softmax in fp32, materialises [b, h, q, k] scores.
  cudnn   `jax.nn.dot_product_attention(implementation="cudnn")` (GPU only).
  pallas  Pallas FlashAttention: on Hopper (sm_90) the Mosaic GPU kernel (flash_attention_mgpu.py)
          for the shapes it takes (`mgpu_supports`), else the Triton kernel (flash_attention.py).
  auto    the fastest measured on this platform (`auto_order`), logged once; a shape the kernel
          refuses (e.g. head_dim 96) steps down to cudnn/xla for that call.
An explicit choice that cannot run here is an error, never a silent fallback.
Layout everywhere: q [b, q_len, heads, d], k/v [b, kv_len, kv_heads, d].
Why this order: docs/benchmarks.md#attention.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from pallas_kernels import flash_attention, flash_attention_mgpu

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
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def _triton_gpu_available() -> bool:
    """The Pallas kernel lowers through Triton: it needs a CUDA GPU with bf16 tensor cores (sm_80+)."""
    try:
        devices = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return False
    for d in devices:
        cc = getattr(d, "compute_capability", None)
        try:
            if cc is not None and float(cc) >= 8.0:
                return True
        except (TypeError, ValueError):
            continue
    return False


def on_hopper() -> bool:
    """A Hopper GPU (sm_90: H100, H200, GH200) among the devices: where the Mosaic GPU kernels (wgmma) run."""
    try:
        return any(d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")
                   for d in jax.devices())
    except RuntimeError:
        return False


def mgpu_supports(q, k, *, segment_ids=None) -> bool:
    """Shapes the Mosaic GPU kernel takes (its make_config errors), given a Hopper GPU."""
    bs = flash_attention_mgpu.default_block_sizes(q.shape[-1])
    blocks = (bs.block_q, bs.block_kv, bs.block_q_dq, bs.block_kv_dq, bs.block_kv_dkv, bs.block_q_dkv)
    return (segment_ids is None and q.shape[1] == k.shape[1] and q.shape[-1] in (64, 128)
            and q.dtype in (jnp.bfloat16, jnp.float16) and q.dtype == k.dtype
            and q.shape[2] % k.shape[2] == 0 and all(q.shape[1] % b == 0 for b in blocks))


def pallas_supports(q, k, *, causal: bool) -> bool:
    """Shapes the kernel takes (see flash_attention's errors); `auto` steps past pallas otherwise."""
    d = q.shape[-1]
    return (d in (16, 32, 64, 128, 256) and q.dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
            and q.shape[2] % k.shape[2] == 0 and (not causal or q.shape[1] <= k.shape[1]))


def available(impl: str) -> bool:
    if impl == "xla" or impl == "auto":
        return True
    if impl == "cudnn":
        return _gpu_available()
    if impl == "pallas":
        return _triton_gpu_available()
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")


_auto_choice: str | None = None


def auto_order() -> tuple[str, ...]:
    """`auto`'s order on this platform, fastest first (docs/benchmarks.md#attention): Hopper runs the
    Mosaic kernel ahead of cuDNN; other GPUs cuDNN first, since there "pallas" is the Triton kernel,
    which ran fwd+bwd slower than cuDNN; CPU xla."""
    if on_hopper():
        return ("pallas", "cudnn", "xla")
    if _gpu_available():
        return ("cudnn", "pallas", "xla")
    return ("xla",)


def resolve(impl: str) -> str:
    """The implementation that will run: `auto` picked once and logged; unavailable explicit choices raise."""
    global _auto_choice
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        if _auto_choice is None:
            _auto_choice = next(i for i in auto_order() if available(i))
            log.info("attention: auto chose %s", _auto_choice)
        return _auto_choice
    if not available(impl):
        raise RuntimeError(
            f"attention implementation {impl!r} is not available on {jax.default_backend()}; "
            "use attention=xla (or auto to pick the best available)")
    return impl


_logged_fallback: set = set()


def dot_product_attention(q, k, v, *, impl: str = "xla", causal: bool = True, segment_ids=None, sm_scale=None):
    asked = impl
    impl = resolve(impl)
    if asked == "auto" and impl == "pallas" and not pallas_supports(q, k, causal=causal):
        # auto promises something that runs: step down the order for shapes the kernel refuses
        cudnn_ok = segment_ids is None and not (causal and q.shape[1] != k.shape[1])
        impl = "cudnn" if available("cudnn") and cudnn_ok else "xla"
        key = (q.shape[-1], str(q.dtype), impl)
        if key not in _logged_fallback:
            _logged_fallback.add(key)
            log.info("attention: auto uses %s for head_dim=%d dtype=%s (pallas kernel does not take it)",
                     impl, q.shape[-1], q.dtype)
    if impl == "xla":
        return xla_attention(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)
    if impl == "cudnn":
        if segment_ids is not None:
            raise NotImplementedError("cudnn attention through jax.nn.dot_product_attention takes no segment ids "
                                      "here; use attention=pallas or xla for packed sequences")
        if causal and q.shape[1] != k.shape[1]:
            # jax.nn's is_causal aligns queries to the start of the keys; ours aligns them to the end
            raise NotImplementedError(f"cudnn causal attention here needs q_len == kv_len (got {q.shape[1]} "
                                      f"and {k.shape[1]}); use attention=pallas or xla for chunked prefill")
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, implementation="cudnn")
    if on_hopper() and mgpu_supports(q, k, segment_ids=segment_ids):
        return flash_attention_mgpu.flash_attention_mgpu(q, k, v, causal=causal, sm_scale=sm_scale)
    return flash_attention.flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)
