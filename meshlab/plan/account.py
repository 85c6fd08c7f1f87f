"""The one account of memory, FLOPs and bytes per device: explain, MFU and the planner read it.

Everything here works on abstract shapes (no allocation): a ModelDef's abstract params and
logical names, a rule file and a mesh.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from meshlab.layout import is_names, is_spec, leaf_specs, tree_paths
from meshlab.mesh import entry_axes
from meshlab.peak import datasheet_tflops
from models import ModelDef

# Dense bf16 FLOP/s per device, from the one datasheet table (meshlab/peak.py).
DATASHEET_BF16_FLOPS = {k: datasheet_tflops(k) * 1e12 for k in ("h200", "h100", "a100")}


def shard_count(spec, mesh) -> int:
    n = 1
    for entry in spec:
        for a in entry_axes(entry):
            n *= mesh.shape[a]
    return n


def logical_shards(rules, mesh, name: str) -> int:
    """Shards of a dimension whose logical name is `name` under `rules` on `mesh`."""
    return math.prod(mesh.shape[a] for a in rules.axes(name, mesh))


def bytes_per_device(shape, dtype, spec, mesh) -> int:
    return int(math.prod(shape) * np.dtype(dtype).itemsize // shard_count(spec, mesh))


@dataclasses.dataclass
class ParamRow:
    path: str
    shape: tuple
    names: tuple
    spec: object
    bytes_per_device: int


def param_table(md: ModelDef, rules, mesh, kind: str = "params") -> list[ParamRow]:
    specs = leaf_specs(md, rules, mesh, kind)
    rows = []
    flat_names = jax.tree.leaves(md.names, is_leaf=is_names)
    flat_abs = jax.tree.leaves(md.abstract)
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    flat_paths = jax.tree.leaves(tree_paths(md.abstract))
    for path, a, names, spec in zip(flat_paths, flat_abs, flat_names, flat_specs):
        rows.append(ParamRow(path, tuple(a.shape), names, spec, bytes_per_device(a.shape, a.dtype, spec, mesh)))
    return rows


def state_bytes(md: ModelDef, rules, mesh, tx=None) -> dict:
    """Bytes per device of fp32 params, the fp32 gradient accumulator and Adam's two moments,
    as meshlab stores them (the source material's 16 bytes/parameter: 4 + 4 + 8)."""
    params = sum(r.bytes_per_device for r in param_table(md, rules, mesh, "params"))
    grads = sum(r.bytes_per_device for r in param_table(md, rules, mesh, "grads"))
    moments = 2 * sum(r.bytes_per_device for r in param_table(md, rules, mesh, "optimizer"))
    return {"params": params, "grads": grads, "optimizer": moments, "total": params + grads + moments}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
