"""The one place that knows about differences between JAX versions (CPU: 0.10.x, GPU: 0.11.x)."""
from __future__ import annotations

import os

import jax
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


def set_cpu_devices(n: int) -> None:
    """Simulate `n` CPU devices. Must run before JAX initialises its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in (f"--xla_force_host_platform_device_count={n}", CPU_FAST_COMPILE, CPU_COLLECTIVE_ORDER):
        if flag.split("=")[0] not in flags:          # a flag the user set keeps the user's value
            flags = f"{flags} {flag}"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except (AttributeError, RuntimeError):  # older jax, or backend already up: XLA_FLAGS covers it
        pass


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
