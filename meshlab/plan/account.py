"""The one account of memory, FLOPs and bytes per device: explain, MFU and the planner read it.

Everything here works on abstract shapes (no allocation): a ModelDef's abstract params and
logical names, a rule file and a mesh.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from meshlab.train.state import ModelDef, is_names, leaf_specs, tree_paths

DATASHEET_BF16_FLOPS = {"h200": 989e12, "h100": 989e12, "a100": 312e12}


def shard_count(spec, mesh) -> int:
    n = 1
    for entry in spec:
        if entry is None:
            continue
        for a in (entry,) if isinstance(entry, str) else entry:
            n *= mesh.shape[a]
    return n


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
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: x.__class__.__name__ == "PartitionSpec")
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


def param_count(md: ModelDef) -> int:
    return int(sum(math.prod(a.shape) for a in jax.tree.leaves(md.abstract)))


def matmul_param_count(cfg) -> int:
    """N of the 6N rule: every matmul weight, the LM head included (counted again when tied,
    since the tied embedding is used as a matmul there), norms and the lookup excluded. A config
    that counts its own (a mixture of experts: the active weights) is asked."""
    if hasattr(cfg, "matmul_param_count"):
        return cfg.matmul_param_count()
    d, hd = cfg.d_model, cfg.head_dim
    per_layer = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.mlp_dim
    return cfg.n_layers * per_layer + d * cfg.padded_vocab


def train_flops_per_token(cfg, seq_len: int) -> float:
    """6N + causal attention 6*L*S*d_model (DESIGN.md, Measuring); a config's own count first."""
    if hasattr(cfg, "train_flops_per_token"):
        return cfg.train_flops_per_token(seq_len)
    return 6.0 * matmul_param_count(cfg) + 6.0 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim


def mfu_formula(cfg, seq_len: int) -> str:
    n = matmul_param_count(cfg)
    what = "active matmul params" if hasattr(cfg, "active_mlp_dim") else "matmul params"
    return (f"MFU = tokens/s x (6N + 6*L*S*d) / peak;  N={n:,} {what}, L={cfg.n_layers}, "
            f"S={seq_len}, d={cfg.n_heads * cfg.head_dim}  ->  {train_flops_per_token(cfg, seq_len):,.0f} FLOP/token")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
