"""Device meshes over the six axes, from a spec string or dict.

Axis order in the mesh puts the fast-changing axes last, so that neighbouring devices
(one host, NVLink) carry `tensor`, then `expert` and `context`, and `data`/`fsdp` span hosts.
"""
from __future__ import annotations

import math
import numbers
from typing import Mapping

import jax
import numpy as np

from meshlab import compat

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
_HOST_LOCAL = ("context", "expert", "tensor")  # kept inside one host on a hybrid mesh


class MeshError(ValueError):
    pass


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """'data=1,fsdp=-1,tensor=2' or a dict -> {axis: size}; unnamed axes get size 1."""
    if spec is None or spec == "":
        items: dict = {}
    elif isinstance(spec, str):
        items = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise MeshError(f"mesh spec part {part!r} is not AXIS=SIZE; write e.g. 'data=1,fsdp=-1,tensor=2'")
            name, _, size = part.partition("=")
            if name.strip() in items:       # else the later size silently wins
                raise MeshError(f"mesh spec {spec!r} names axis {name.strip()!r} twice; give each axis one size")
            try:
                items[name.strip()] = int(size)
            except ValueError:
                raise MeshError(f"mesh spec {spec!r}: size {size!r} of axis {name!r} is not an integer") from None
    else:
        items = dict(spec)
    unknown = [a for a in items if a not in AXES]
    if unknown:
        raise MeshError(f"unknown mesh axis {unknown[0]!r} in {spec!r}; the axes are {', '.join(AXES)}")
    for a, size in items.items():
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise MeshError(f"mesh axis {a!r} has size {size!r}; sizes are whole numbers, or -1 (fill)")
    sizes = {a: int(items.get(a, 1)) for a in AXES}
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise MeshError(f"mesh axis {bad[0]!r} has size {sizes[bad[0]]}; sizes are positive or -1 (fill)")
    if sum(s == -1 for s in sizes.values()) > 1:
        raise MeshError(f"mesh spec {spec!r} has more than one -1; only one axis can fill the remaining devices")
    return sizes


def resolve_sizes(spec, num_devices: int, count_flag: str | None = None) -> dict[str, int]:
    """Axis sizes for `num_devices`, the one -1 filled. `count_flag` names the flag that sets the device
    count where the caller has one (a sizes-only tool's --devices); else, on a CPU, --cpu-devices."""
    sizes = parse_mesh_spec(spec)
    if num_devices < 1:         # a -1 axis would fill to 0 and the mesh would hold no device
        raise MeshError(f"{num_devices} devices: a mesh needs at least 1" + (f" ({count_flag})" if count_flag else ""))
    known = math.prod(s for s in sizes.values() if s != -1)
    fill = [a for a, s in sizes.items() if s == -1]
    if fill:
        if num_devices % known:
            raise MeshError(f"mesh {format_sizes(sizes)}: the fixed axes multiply to {known}, which does not divide "
                            f"the {num_devices} devices; change the sizes or the device count"
                            f"{_count_hint(known * max(1, -(-num_devices // known)), count_flag)}")
        sizes[fill[0]] = num_devices // known
    total = math.prod(sizes.values())
    if total != num_devices:
        raise MeshError(f"mesh {format_sizes(sizes)} needs {total} devices but {num_devices} are present; "
                        f"make the sizes multiply to {num_devices} (or use -1 on one axis to fill)"
                        f"{_count_hint(total, count_flag)}")
    return sizes


def _count_hint(devices: int, count_flag: str | None) -> str:
    """Where the device count is a flag (a CPU's simulated devices, a sizes-only tool's count): the
    flag that gives this mesh its `devices`."""
    if count_flag:
        return f"; or {count_flag} {devices}"
    if jax.default_backend() != "cpu":
        return ""
    return f"; or, on a CPU, --cpu-devices {devices} to simulate {devices} devices"


def format_sizes(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "single device"


def allocator_limit(device) -> int | None:
    """Bytes the device's allocator may hand out (`memory_stats()["bytes_limit"]`); None where the backend
    reports none (CPU devices)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:   # noqa: BLE001 - backends without allocator statistics
        stats = {}
    return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def make_mesh(spec=None, devices=None) -> jax.sharding.Mesh:
    """A Mesh with all six axes (size-1 ones included, they drop out of PartitionSpecs)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_sizes(spec, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    num_hosts = len({d.process_index for d in devices})
    if num_hosts > 1 and devices[0].platform != "cpu":
        dev_array = _hybrid_device_array(sizes, devices, num_hosts)
    else:
        try:
            from jax.experimental import mesh_utils
            dev_array = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        except Exception:  # CPU and unknown topologies: process-major order is already host-local
            dev_array = np.asarray(devices, dtype=object).reshape(shape)
    return compat.make_mesh(dev_array, AXES)


def _hybrid_device_array(sizes, devices, num_hosts):
    """Host-local axes within a host, data/fsdp/stage across hosts (ICI vs DCN split)."""
    from jax.experimental import mesh_utils
    per_host = len(devices) // num_hosts
    local = [sizes[a] if a in _HOST_LOCAL else 1 for a in AXES]
    rest = per_host // math.prod(local)
    # Give the leftover in-host devices to the innermost cross-host axis that needs them.
    for i, a in reversed(list(enumerate(AXES))):
        if a not in _HOST_LOCAL and rest > 1 and sizes[a] % rest == 0:
            local[i] = rest
            rest = 1
    if rest != 1:
        raise MeshError(f"mesh {format_sizes(sizes)} cannot keep tensor/expert/context inside one host of {per_host} devices")
    across = [sizes[a] // local[i] for i, a in enumerate(AXES)]
    return mesh_utils.create_hybrid_device_mesh(local, across, devices=devices, process_is_granule=True)


def axis_size(mesh, axes) -> int:
    """Devices along a spec entry's axes (1 for None)."""
    return math.prod(mesh.shape[a] for a in entry_axes(axes))



def entry_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry (None, "fsdp" or ("data", "fsdp")) as a tuple of mesh axis names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axes_entry(axes):
    """The inverse: a tuple of axis names as a PartitionSpec entry (None, one name, or the tuple)."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes
