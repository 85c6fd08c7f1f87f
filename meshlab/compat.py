"""The one place that knows about differences between JAX versions (CPU: 0.10.x, GPU: 0.11.x)."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import AxisType


# XLA's CPU backend at its default -O3 spends 20-30 s compiling a small sharded train step;
# -O1 compiles ~5x faster and ran the step no slower on 2 cores (measured, tiny model).
CPU_FAST_COMPILE = "--xla_backend_optimization_level=1"
# JAX lowers every shard_map collective with channel id 1, so the step's FSDP gathers, reduce-scatters
# and all-reduces over one device group share one rendezvous key on XLA's CPU backend. With its
# concurrency-optimized schedule, `train.py --cpu-devices 8` (fsdp_tp) aborted on a 40 s rendezvous
# timeout after its first step in 3 of 6 runs on 2 cores, its devices' threads waiting in an all-gather
# and an all-reduce under one key. With that scheduler off: 9 of 9 ran, same losses, ~20% faster.
CPU_COLLECTIVE_ORDER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def unique_collective_channels() -> None:
    """Give each collective JAX lowers a channel id of its own (this JAX gives every one id 1).

    XLA's CPU backend keys a collective's rendezvous on (run, device group, channel id) and orders a
    device's collectives by their start only, so a collective outside the layer scan (the final norm's
    FSDP gather, the step's token count) may run while the scan's gathers over the same group do: with
    one id they met in one rendezvous (4 arrivals for 2 devices: an abort, a hang or a segfault;
    `train.py --rules fsdp_ep --cpu-devices 8` cold, 4 of 4). Ids restart at 2^20 in each lowered module,
    so a program's HLO, and its compile-cache key, are the same every run. The cost: XLA no longer merges
    equal collectives (CSE), so the tiny fsdp step gathers ~25% more bytes on the CPU; the tests, which
    check the compiled collectives against the planner, lower as JAX does. JAX internals: where they
    differ (another JAX), nothing is patched."""
    import contextvars
    import itertools
    import types
    try:
        from jax._src import core as _core
        from jax._src.interpreters import mlir as _mlir
        from jax._src.lax import parallel as _parallel
        lower, uncacheable = _mlir.lower_jaxpr_to_module, _mlir._uncacheable_primitives
        _ = _mlir.COLLECTIVE_CHANNEL_ID
    except (ImportError, AttributeError):
        return
    if getattr(_mlir, "_meshlab_unique_channels", False):
        return
    ids = contextvars.ContextVar("meshlab_channel_ids", default=None)

    def lower_jaxpr_to_module(*args, **kwargs):
        token = ids.set(itertools.count(1 << 20))       # above the module's own (host callback) channels
        try:
            return lower(*args, **kwargs)
        finally:
            ids.reset(token)

    class UniqueChannels(types.ModuleType):
        _meshlab_unique_channels = True

        @property
        def COLLECTIVE_CHANNEL_ID(self):                # noqa: N802 (read by lax.parallel per collective)
            counter = ids.get()
            return next(counter) if counter is not None else 1

    # JAX reuses one lowering for equal equations, which would copy one id onto several collectives
    uncacheable.update(v for v in vars(_parallel).values() if isinstance(v, _core.Primitive))
    _mlir.lower_jaxpr_to_module = lower_jaxpr_to_module
    _mlir.__class__ = UniqueChannels


def count_arg(low: int, note: str = ""):
    """An argparse type: a whole number >= low (note: what the floor means, e.g. " (0: off)")."""
    import argparse

    def parse(text: str) -> int:
        n = int(text)              # ValueError: argparse's "invalid int value"
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} must be >= {low}{note}")
        return n
    parse.__name__ = "int"
    return parse


# the scripts' --cpu-devices N: 0 would silently run on one device, a negative count stop inside JAX's backend set-up
cpu_devices_arg = count_arg(1, " (simulated CPU devices, e.g. --cpu-devices 8; leave the flag out for one)")


def set_cpu_devices(n: int) -> None:
    """Simulate `n` CPU devices. Must run before JAX initialises its backends."""
    unique_collective_channels()
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in (f"--xla_force_host_platform_device_count={n}", CPU_FAST_COMPILE, CPU_COLLECTIVE_ORDER):
        if flag.split("=")[0] not in flags:          # a flag the user set keeps the user's value
            flags = f"{flags} {flag}"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # XLA:CPU orders a device's collectives by start only (a collective after a layer-scan loop may run
    # during it) and each waits in its rendezvous on a thread of a pool as large as the device count, so
    # waiting collectives could hold every thread the loops needed: 4 threads a device.
    os.environ.setdefault("PJRT_NPROC", str(4 * n))
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except AttributeError:                  # older jax: XLA_FLAGS covers it
        pass
    except RuntimeError:                    # the backends are up: nothing set now reaches them
        have = len(jax.devices("cpu"))
        if have != n:
            raise RuntimeError(f"set_cpu_devices({n}): JAX has already started with {have} CPU device(s), and the "
                               "count is fixed when JAX starts. Call it before anything runs on JAX (in a notebook: "
                               "restart the kernel and run the cell that calls it first)") from None


def make_mesh(devices_array, axis_names):
    """A Mesh with Auto axes: `jax.make_mesh` defaults to Explicit in these versions, we want GSPMD."""
    return jax.sharding.Mesh(devices_array, axis_names, axis_types=(AxisType.Auto,) * len(axis_names))


def shard_map(f, *, mesh, in_specs, out_specs, axis_names=None):
    """`jax.shard_map` over a subset of axes (the others stay Auto).

    check_vma is off: a Pallas call inside shard_map fails the check (JAX-NOTES), and the
    manual regions here differentiate inside, so no replication inference is needed.
    """
    kw = {}
    if axis_names is not None:
        kw["axis_names"] = set(axis_names)
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **kw)


def set_mesh(mesh):
    return jax.set_mesh(mesh)


def bf16_on_cpu(dtype) -> bool:
    """Whether a collective over `dtype` would meet XLA:CPU's bf16 reducer abort (`all_gather`'s note)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"


def all_gather(w, axis, dim: int):
    """jax.lax.all_gather(w, axis, axis=dim, tiled=True), whose transpose (a reduce-scatter) runs in
    fp32 for bf16 on XLA's CPU backend. There a bf16 reduce-scatter is widened by a pass that rebuilds
    its reducer as a binary op, and the reducers Shardy exports end in a copy: "Invalid binary
    instruction opcode copy", an abort, in every rule file that gathers weights (fsdp, fsdp_tp,
    pp_fsdp_tp, ...) under model.dtype=bfloat16. The GPU keeps the bf16 reduce-scatter (half the bytes)."""
    if not bf16_on_cpu(w.dtype):
        return jax.lax.all_gather(w, axis, axis=dim, tiled=True)
    return _gather_fp32_transpose(w, axis, dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_fp32_transpose(w, axis, dim):
    return jax.lax.all_gather(w, axis, axis=dim, tiled=True)


def _gather_fwd(w, axis, dim):
    return _gather_fp32_transpose(w, axis, dim), None


def _gather_bwd(axis, dim, _, g):
    return (jax.lax.psum_scatter(g.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True).astype(g.dtype),)


_gather_fp32_transpose.defvjp(_gather_fwd, _gather_bwd)


def psum(x, axes):
    """jax.lax.psum, over fp32 for bf16 on XLA's CPU backend (the reducer abort of `all_gather`'s note;
    its transpose, a copy of the cotangent, has no reducer). The GPU sums bf16 as it comes."""
    if not bf16_on_cpu(x.dtype):
        return jax.lax.psum(x, axes)
    return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
