"""MFU's denominator: the device's datasheet dense bf16 peak (DESIGN.md, Measuring), as MaxText,
torchtitan and Megatron report it; and a measured GEMM rate, a figure of its own, never the denominator.

MFU = tokens/s x model FLOPs per token / (datasheet peak per device x devices); no clamp, so a
wrong FLOP count or peak shows up as an MFU that cannot be."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s from NVIDIA's datasheets, matched against
# `device.device_kind` in this order (the first key it contains wins: "GH200" before "H200",
# "H100 PCIe" before "H100").
DATASHEET_BF16_TFLOPS = (
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("H800", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
)


def datasheet_tflops(device_kind: str) -> float | None:
    """Dense bf16 TFLOP/s of a device kind from the table, None when it is not listed."""
    kind = device_kind.upper()
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key.upper() in kind:
            return tflops
    return None


def peak_flops(device, override_tflops: float = 0.0) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, how it was chosen). `override_tflops` (--peak-tflops) wins;
    a device kind not in the table (every CPU) gives None: MFU is then reported as n/a."""
    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s per device (peak_tflops)"
    tflops = datasheet_tflops(device.device_kind)
    if tflops is None:
        return None, (f"no datasheet peak for {device.device_kind!r} ({device.platform}): MFU n/a; "
                      "pass --peak-tflops T (dense bf16 TFLOP/s per device) to report it")
    return tflops * 1e12, f"{device.device_kind} datasheet dense bf16 {tflops:g} TFLOP/s per device"


def mfu(tokens_per_s: float, flops_per_token: float, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs per second over the devices' summed peak; None when the peak is unknown."""
    if not peak_per_device:
        return None
    return tokens_per_s * flops_per_token / (peak_per_device * devices)


def measured_gemm_flops(device=None, n: int = 8192, dtype=jnp.bfloat16, iters: int = 10,
                        repeats: int = 5) -> float:
    """FLOP/s of one device on square `n` x `n` GEMMs in `dtype` (bf16 output), measured as torch's
    GEMM benchmarks do: warmed up, `iters` launches back to back per timing (launch overhead
    amortised), median of `repeats` timings. Every launch is a program of its own whose result is
    returned, so none is dead code; the timing ends when the last one is done (one stream, in order).
    A figure of its own beside MFU: it says how far the GEMM library gets on this card."""
    device = device or jax.devices()[0]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (n, n), dtype), device)
    b = jax.device_put(jax.random.normal(kb, (n, n), dtype), device)
    f = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(a, b)
        out.block_until_ready()
        times.append((time.perf_counter() - t) / iters)
    return 2.0 * n ** 3 / float(np.median(times))


def measured_matmul_flops(mesh, dtype=None, n: int | None = None, repeats: int = 5) -> float:
    """The measured GEMM rate of the mesh (one device's rate x devices; bf16 8192^3 on GPU, fp32 256^3
    elsewhere). Kept for callers that show a measured figure; MFU uses `peak_flops`."""
    dev = mesh.devices.flat[0]
    gpu = dev.platform == "gpu"
    rate = measured_gemm_flops(dev, n or (8192 if gpu else 256), dtype or (jnp.bfloat16 if gpu else jnp.float32),
                               repeats=repeats)
    return rate * mesh.devices.size
