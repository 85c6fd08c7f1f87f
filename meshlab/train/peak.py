"""The matmul rate measured in the run itself: the denominator of MFU (DESIGN.md, Measuring)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def measured_matmul_flops(mesh, dtype=None, n: int | None = None, repeats: int = 5) -> float:
    """Aggregate FLOP/s of one large matmul per device, all devices at once (bf16 on GPU)."""
    platform = mesh.devices.flat[0].platform
    dtype = dtype or (jnp.bfloat16 if platform == "gpu" else jnp.float32)
    n = n or (8192 if platform == "gpu" else 256)
    ndev = mesh.devices.size
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    keys = jax.random.split(jax.random.key(0), 2)
    a = jax.device_put(jax.random.normal(keys[0], (ndev, n, n), dtype), sharding)
    b = jax.device_put(jax.random.normal(keys[1], (ndev, n, n), dtype), sharding)
    f = jax.jit(lambda a, b: jnp.einsum("eij,ejk->eik", a, b, preferred_element_type=jnp.float32).astype(dtype))
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    times.sort()
    return 2.0 * ndev * n ** 3 / times[len(times) // 2]
