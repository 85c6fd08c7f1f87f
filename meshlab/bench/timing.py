"""Timing for the benchmarks: warm up (compilation, autotuning), then the median of synced runs."""
from __future__ import annotations

import statistics
import time

import jax


def median_time(f, *args, warmup: int = 2, reps: int = 10, inner: int = 1) -> float:
    """Median seconds of `f(*args)`, each run waited on with block_until_ready. inner > 1: each
    sample is `inner` calls back to back, waited on once (for ~1 ms calls: the host's sync gap and
    the clock ramp of a GPU that idled during compilation stay out of the number)."""
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner - 1):
            f(*args)
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)
