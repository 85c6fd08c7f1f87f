"""Timing for the benchmarks: warm up (compilation, autotuning), then the median of synced runs."""
from __future__ import annotations

import statistics
import time

import jax


def median_time(f, *args, warmup: int = 2, reps: int = 10) -> float:
    """Median seconds of `f(*args)`, each run waited on with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)
