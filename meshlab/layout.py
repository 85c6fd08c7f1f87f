"""Where every leaf of a step lives: PartitionSpec trees built from a rule file and a mesh.

Sits under the models and the engines: it knows a model only as its logical names and abstract
shapes (`names`, `abstract` of models.ModelDef), and the rule file only through `Rules.state_spec`.
`Layout` is all of it for one program, built once per step build and passed down; `Layout.jit`
traces and runs a program under its rules and mesh (`rules.use_rules`), so no caller installs them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from meshlab import rules as rules_mod
from meshlab.mesh import axes_entry, entry_axes


def is_names(x) -> bool:
    """A leaf of a ModelDef's `names` tree: a tuple of logical axis names (or None)."""
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def is_spec(x) -> bool:
    return isinstance(x, P)


def tree_paths(tree) -> dict:
    return jax.tree_util.tree_map_with_path(lambda p, _: jax.tree_util.keystr(p), tree)


def leaf_specs(md, rules, mesh, kind: str) -> dict:
    """PartitionSpec per parameter leaf of `md` (a models.ModelDef) for `kind` in params | grads | optimizer."""
    return jax.tree.map(
        lambda names, a, path: rules.state_spec(kind, names, a.shape, mesh, path=f"params{path}"),
        md.names, md.abstract, tree_paths(md.abstract), is_leaf=is_names)


def only_axes(spec: P, axes) -> P:
    """Keep only `axes` in a spec (the manual ones of a shard_map region)."""
    return P(*(axes_entry(a for a in entry_axes(e) if a in axes) for e in spec))


def to_shardings(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def batch_spec(rules, mesh) -> P:
    """Global [B, S] batch arrays: rows over the batch axes, sequence over act_seq's axes."""
    rows = rules.batch_axes(mesh)
    seq = tuple(a for a in rules.axes("act_seq", mesh) if a not in rows and a == "context")
    return P(axes_entry(rows), seq[0] if seq else None)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One program's placement: the rule file, the mesh, the parameter / gradient-accumulator /
    optimizer spec trees (`Rules.state_spec` per leaf), the batch spec and the manual (data-parallel)
    axes of the step's shard_map. Frozen: every consumer reads the same trees."""
    rules: Any
    mesh: Any
    params: dict
    grads: dict
    optimizer: dict          # Adam moments' spec per parameter, and the reduced gradient's
    batch: P
    manual: tuple[str, ...]  # the rule file's batch axes
    # The stored order of the stacked layers (row k holds model layer layer_order[k]); None: model
    # order. An interleaved pipeline's chunk order (meshlab/parallel/pipeline/layout.py).
    layer_order: tuple[int, ...] | None = None

    @classmethod
    def build(cls, md, rules, mesh) -> "Layout":
        from meshlab.parallel.pipeline.layout import stored_order
        order = stored_order(rules, mesh, md.cfg.n_layers)   # first: a stage count that splits no layers says so
        return cls(rules, mesh, *(leaf_specs(md, rules, mesh, k) for k in ("params", "grads", "optimizer")),
                   batch_spec(rules, mesh), rules.batch_axes(mesh), order)

    def shardings(self, kind: str) -> dict:
        """NamedShardings of the `kind` tree (params | grads | optimizer)."""
        return to_shardings(self.mesh, getattr(self, kind))

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch)

    def active(self):
        """The context the model's `constrain` / `materialize` read while a program is traced."""
        return rules_mod.use_rules(self.rules, self.mesh)

    def jit(self, fn, **jit_kwargs) -> "Traced":
        """`jax.jit(fn)` whose every trace (a call, `.lower`, `.trace`, `.eval_shape`) runs under
        `active()`: the program carries its own rules and mesh."""
        return Traced(jax.jit(fn, **jit_kwargs), self)


class Traced:
    """A jitted function bound to its Layout (see Layout.jit). Entering the rules per call costs
    microseconds; jax.set_mesh cannot be entered inside the trace itself."""

    def __init__(self, jitted, layout: Layout):
        self.jitted, self.layout = jitted, layout

    def __call__(self, *args, **kwargs):
        with self.layout.active():
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self.layout.active():
            return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with self.layout.active():
            return self.jitted.trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        with self.layout.active():
            return self.jitted.eval_shape(*args, **kwargs)
