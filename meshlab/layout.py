"""Where every leaf of a step lives: PartitionSpec trees built from a rule file and a mesh.

Sits under the models and the engines: it knows a model only as its logical names and abstract
shapes (`names`, `abstract` of models.ModelDef), and the rule file only through `Rules.state_spec`.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

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
