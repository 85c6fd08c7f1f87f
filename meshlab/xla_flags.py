"""XLA:GPU flags that let collectives overlap compute, set in one place, on GPU only.

XLA reads XLA_FLAGS once, when the first backend starts, and aborts the process on a flag it does not
know, so `apply()` must run before anything touches a device and sets only flags that exist in the
jaxlib versions meshlab runs on (checked: jaxlib 0.10.2 here, 0.11.2 on the GPU machine; the
existence and defaults of these flags are jaxlib-version dependent).

  --xla_gpu_enable_latency_hiding_scheduler=true
      schedule each async collective's start early and its done late, around independent compute
      (the next layer's backward, the next layer's forward under FSDP), instead of back to back.
      Collectives are asynchronous by default on XLA:GPU (`xla_gpu_disable_async_collectives` turns
      them off); without this scheduler their start/done pairs sit next to each other and nothing
      overlaps.
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
      inside a while loop (the layer scan), move a collective one iteration ahead (all-gather: the
      next layer's FSDP weights prefetched while this layer computes) or behind (reduce-scatter /
      all-reduce: this layer's gradients reduced while the previous layer's backward runs). Costs one
      more layer's buffers live.

On one GPU there are no collectives and these flags change nothing but the schedule's search.
MESHLAB_XLA_OVERLAP=0 leaves XLA_FLAGS alone (to measure without them); a flag the user already set
in XLA_FLAGS is never overridden.
"""
from __future__ import annotations

import importlib.util
import os

OVERLAP_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
}


def on_gpu() -> bool:
    """A CUDA plugin is installed and JAX_PLATFORMS (if set) allows it: decided without starting JAX."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def merged(existing: str, flags: dict) -> str:
    """`existing` XLA_FLAGS plus `flags`, a flag already named there kept as the user set it."""
    have = {f.lstrip("-").split("=", 1)[0] for f in existing.split()}
    extra = [f"--{k}={v}" for k, v in flags.items() if k not in have]
    return " ".join([existing.strip(), *extra]).strip()


def apply(force: bool = False) -> str:
    """Add the overlap flags to XLA_FLAGS (GPU only, unless `force`); returns XLA_FLAGS. Call before
    the first JAX computation: after the backend has started, XLA no longer reads them."""
    if os.environ.get("MESHLAB_XLA_OVERLAP", "1") == "0" or not (force or on_gpu()):
        return os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = merged(os.environ.get("XLA_FLAGS", ""), OVERLAP_FLAGS)
    return os.environ["XLA_FLAGS"]
