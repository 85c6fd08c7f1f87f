"""Hardware the planner prices plans on: a small datasheet table, or a measured profile.

Datasheet values are labelled so (`source`); the latencies (alpha) are not on any datasheet:
they are typical NCCL figures and marked `assumed`. A profile written by
scripts/bench_collectives.py replaces alpha and bandwidth per mesh axis with measured fits.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Link:
    alpha_s: float          # start-up latency of one message
    bw_Bps: float           # bytes/s one device can push in one direction (the BW of T = alpha + n/BW)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    flops: float            # dense bf16 matmul FLOP/s per device
    memory_bytes: float     # device memory the planner budgets against
    hbm_Bps: float          # device memory bandwidth
    intra: Link             # inside one host (NVLink/NVSwitch)
    inter: Link             # across hosts (InfiniBand / RoCE, per GPU)
    devices_per_host: int = 8
    efficiency: float = 0.55  # fraction of peak a well-tuned step reaches (the training MFU goal); stated, not measured
    source: str = "datasheet"
    axes: dict = dataclasses.field(default_factory=dict)   # measured per-axis Link, from a profile

    def link(self, axis: str, crosses_hosts: bool) -> Link:
        if axis in self.axes:
            return self.axes[axis]
        return self.inter if crosses_hosts else self.intra

    def with_memory(self, nbytes: float) -> "Hardware":
        return dataclasses.replace(self, memory_bytes=float(nbytes))


GiB = 1024 ** 3
# NVLink figures are per direction (the 900/600 GB/s on datasheets count both directions);
# inter-host is one 400 (H100/H200) or 200 (A100) Gb/s NIC per GPU. Alphas: assumed typical NCCL.
HARDWARE = {
    "h200": Hardware("h200 (datasheet: 989 TF bf16, 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s, NDR 400 Gb/s)",
                     989e12, 141e9, 4.8e12, Link(5e-6, 450e9), Link(12e-6, 50e9)),
    "h100": Hardware("h100 (datasheet: 989 TF bf16, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s, NDR 400 Gb/s)",
                     989e12, 80e9, 3.35e12, Link(5e-6, 450e9), Link(12e-6, 50e9)),
    "a100": Hardware("a100 (datasheet: 312 TF bf16, 80 GB HBM2e 2.0 TB/s, NVLink 600 GB/s, HDR 200 Gb/s)",
                     312e12, 80e9, 2.0e12, Link(8e-6, 300e9), Link(15e-6, 25e9)),
}


class HardwareError(ValueError):
    pass


def load_profile(path: str | Path, base: Hardware | None = None) -> Hardware:
    """A profile JSON from bench_collectives.py: {"device", "flops"?, "memory_bytes"?, "axes": {axis: {alpha_s, bw_Bps}}}."""
    try:
        raw = json.loads(Path(path).read_text())
        # An axis of size 1 (one GPU) measured only dispatch and copy overheads, not a link: skipped.
        axes = {a: Link(float(v["alpha_s"]), float(v["bw_Bps"])) for a, v in raw["axes"].items() if v.get("p", 2) > 1}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HardwareError(f"hardware profile {path}: unreadable ({e}); write one with scripts/bench_collectives.py") from None
    base = base or HARDWARE["h200"]
    return dataclasses.replace(base, name=f"{raw.get('device', 'measured')} (measured profile {Path(path).name})",
                               flops=float(raw.get("flops", base.flops)),
                               memory_bytes=float(raw.get("memory_bytes", base.memory_bytes)),
                               source="measured", axes=axes)


def get_hardware(name_or_path: str) -> Hardware:
    if name_or_path in HARDWARE:
        return HARDWARE[name_or_path]
    if name_or_path.endswith(".json"):
        return load_profile(name_or_path)
    raise HardwareError(f"unknown hardware {name_or_path!r}; use one of {', '.join(HARDWARE)} or a profile .json "
                        "written by scripts/bench_collectives.py")
