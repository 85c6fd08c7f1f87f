"""Rule files: logical axis names -> mesh axes, strictly checked, and the helpers the model uses.

A rule file is the whole parallelism strategy (DESIGN.md, "Rule files"). The model only ever
names logical axes; `constrain` places activations and `materialize` makes a stored parameter
ready for compute (cast to the compute dtype, then, inside a manual data-parallel region,
all-gathered over the axes it is stored sharded on: ZeRO-3's per-layer gather, whose
autodiff transpose is the reduce-scatter of its gradient).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.resources
import math
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import yaml
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from meshlab import compat
from meshlab.mesh import AXES, MeshError, entry_axes, parse_mesh_spec

PARAM_NAMES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "layers")
ACT_NAMES = ("act_batch", "act_seq", "act_attn_seq", "act_embed", "act_heads", "act_kv_heads", "act_mlp",
             "act_vocab", "act_experts")
CACHE_NAMES = ("cache_batch", "cache_seq", "cache_kv_heads", "cache_pages")
LOGICAL_NAMES = PARAM_NAMES + ACT_NAMES + CACHE_NAMES
TOP_KEYS = ("mesh", "batch", "rules", "state", "strategies")
STATE_KINDS = ("params", "grads", "optimizer")
STRATEGY_KEYS = {"attention": ("plain", "ring", "ulysses"), "pipeline": None,
                 "fsdp_gather": ("per_layer", "per_step", "keep"), "experts": None, "collective_matmul": None}
EXPERT_DISPATCH = ("dropless", "capacity")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
# per_layer: each layer's weights gathered at use and dropped after its forward, gathered again in
# its backward (FSDP's reshard-after-forward: one layer's gathered weights live at a time, one more
# all-gather per layer under remat=none); keep: the forward's gathered weights saved for the backward
# (no second gather, L layers' gathered weights live at the peak); per_step: every weight gathered
# whole (fp32) once per step before the micro-batches, its gradient accumulated whole and
# reduce-scattered once after them (bytes independent of the micro-batch count; the whole fp32
# weights and gradients live for the step). Not with a pipeline or expert parallelism (refused).
FSDP_GATHER_IMPLEMENTED = ("per_layer", "per_step", "keep")
GATHERED = "fsdp_gathered"   # checkpoint name of a gathered weight (models/remat.py saves or drops it)


class RulesError(ValueError):
    pass


def _near(word, options) -> str:
    close = difflib.get_close_matches(str(word), options, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def shipped_rules() -> list[str]:
    files = importlib.resources.files("sharding_rules")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def _find_file(name_or_path: str | os.PathLike) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in str(name_or_path):
        if not path.exists():
            raise RulesError(f"rule file {str(path)!r} does not exist")
        return path
    candidate = importlib.resources.files("sharding_rules") / f"{name_or_path}.yaml"
    if not candidate.is_file():
        raise RulesError(f"no shipped rule file named {str(name_or_path)!r}{_near(str(name_or_path), shipped_rules())}; "
                         f"shipped: {', '.join(shipped_rules())}; or pass a path to a .yaml file")
    return Path(str(candidate))


def _axes(value, where: str) -> tuple[str, ...]:
    """A rule value -> tuple of mesh axes; `null` and `replicate` both mean replicated."""
    if value is None or value == "replicate":
        return ()
    vals = [value] if isinstance(value, str) else value
    if not isinstance(vals, (list, tuple)):
        raise RulesError(f"{where}: value {value!r} must be a mesh axis, a list of them, null or replicate")
    for v in vals:
        if v not in AXES:
            raise RulesError(f"{where}: unknown mesh axis {v!r}{_near(str(v), AXES)}; mesh axes: {', '.join(AXES)}")
    if len(set(vals)) != len(vals):
        raise RulesError(f"{where}: mesh axis listed twice in {list(vals)}")
    return tuple(vals)


@dataclasses.dataclass(frozen=True)
class Rules:
    name: str
    path: str
    mesh: dict
    batch: tuple[str, ...]
    rules: dict[str, tuple[str, ...]]
    state: dict[str, str]
    strategies: dict[str, Any]
    header: str = ""

    # -- logical -> mesh ------------------------------------------------------------------
    def axes(self, logical: str | None, mesh=None) -> tuple[str, ...]:
        """Mesh axes for a logical name, size-1 axes dropped when a mesh is given."""
        if logical is None:
            return ()
        if logical not in self.rules:
            if logical not in LOGICAL_NAMES:
                raise RulesError(f"{self.path}: the program uses logical name {logical!r}, which is not one of the "
                                 f"known names{_near(logical, LOGICAL_NAMES)}")
            raise RulesError(f"{self.path}: no rule for logical name {logical!r}; add `{logical}: <axis or null>` "
                             "under `rules:` (nothing is replicated unless the file says so)")
        axes = self.rules[logical]
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
        return axes

    def spec(self, names: Sequence[str | None], shape=None, mesh=None, *, path: str = "",
             drop: Sequence[str] = ()) -> P:
        """PartitionSpec for an array with these logical names; checks reuse and divisibility."""
        if shape is not None and len(shape) != len(names):
            raise RulesError(f"{path or 'array'}: {len(names)} logical names {tuple(names)} for shape {tuple(shape)}")
        used: dict[str, str] = {}
        parts = []
        for i, name in enumerate(names):
            axes = tuple(a for a in self.axes(name, mesh) if a not in drop)
            for a in axes:
                if a in used:
                    raise RulesError(f"{self.path}: mesh axis {a!r} is used twice in one spec, by {used[a]!r} and "
                                     f"{name!r} (array {path or '?'} with names {tuple(names)}); map one of them elsewhere")
                used[a] = name
            if shape is not None and mesh is not None and axes:
                n = math.prod(mesh.shape[a] for a in axes)
                if shape[i] % n:
                    raise RulesError(f"{self.path}: rule `{name}: {list(axes)}` splits dimension {i} of {path or 'array'} "
                                     f"(shape {tuple(shape)}) into {n} shards, which does not divide {shape[i]}; "
                                     f"change the mesh (--mesh with {'x'.join(axes)} dividing {shape[i]}"
                                     + (f", e.g. {axes[0]}={math.gcd(n, shape[i])} with another axis at -1 to fill the "
                                        "devices" if len(axes) == 1 else "") + ") or the rule")
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while parts and parts[-1] is None:
            parts.pop()
        return P(*parts)

    # -- ZeRO stages ----------------------------------------------------------------------
    def batch_axes(self, mesh) -> tuple[str, ...]:
        return tuple(a for a in self.batch if mesh.shape[a] > 1)

    def state_spec(self, kind: str, names, shape, mesh, path: str = "") -> P:
        """Storage spec of a params/grads/optimizer leaf: `replicated` drops the batch axes."""
        drop = self.batch if self.state[kind] == "replicated" else ()
        if "experts" in names:   # expert parallelism: each rank keeps its own experts at every ZeRO stage
            drop = tuple(a for a in drop if a not in self.rules.get("experts", ()))
        return self.spec(names, shape, mesh, path=path, drop=drop)

    def data_parallel_size(self, mesh) -> int:
        return math.prod(mesh.shape[a] for a in self.batch)

    def check_batch(self, global_batch: int, mesh, microbatches: int = 1):
        n = self.data_parallel_size(mesh)
        if global_batch < n:
            raise RulesError(f"global batch {global_batch} is smaller than the data-parallel size {n} "
                             f"({'x'.join(f'{a}={mesh.shape[a]}' for a in self.batch)}); raise data.global_batch to a "
                             f"multiple of {n}")
        if global_batch % (n * microbatches):
            raise RulesError(f"global batch {global_batch} is not divisible by data-parallel size {n} x "
                             f"{microbatches} micro-batches; use a multiple of {n * microbatches}")


def load_rules(name_or_path: str | os.PathLike) -> Rules:
    path = _find_file(name_or_path)
    text = path.read_text()
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise RulesError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RulesError(f"{path}: expected a mapping with keys {', '.join(TOP_KEYS)}")
    for key in raw:
        if key not in TOP_KEYS:
            raise RulesError(f"{path}: unknown top-level key {key!r}{_near(key, TOP_KEYS)}; allowed: {', '.join(TOP_KEYS)}")
    if "rules" not in raw or not isinstance(raw["rules"], dict):
        raise RulesError(f"{path}: missing `rules:` mapping of logical name -> mesh axis")
    rules = {}
    for logical, value in raw["rules"].items():
        if logical not in LOGICAL_NAMES:
            raise RulesError(f"{path}: unknown logical name {logical!r}{_near(str(logical), LOGICAL_NAMES)} in rule "
                             f"`{logical}: {value}`")
        rules[logical] = _axes(value, f"{path}: rule `{logical}`")
    mesh = raw.get("mesh") or {}
    if not isinstance(mesh, dict):
        raise RulesError(f"{path}: `mesh:` must be a mapping like {{data: 1, fsdp: -1}}")
    for a in mesh:
        if a not in AXES:
            raise RulesError(f"{path}: unknown mesh axis {a!r} in `mesh:`{_near(str(a), AXES)}")
    try:
        parse_mesh_spec(mesh)                  # sizes: whole numbers >= 1, or one -1
    except MeshError as e:
        raise RulesError(f"{path}: `mesh:` {e}") from None
    for key in ("state", "strategies"):
        if not isinstance(raw.get(key) or {}, dict):
            raise RulesError(f"{path}: `{key}:` must be a mapping (as in the shipped rule files), not {raw[key]!r}")
    batch = _axes(raw.get("batch", []), f"{path}: `batch`")
    state = {k: "replicated" for k in STATE_KINDS}
    for k, v in (raw.get("state") or {}).items():
        if k not in STATE_KINDS:
            raise RulesError(f"{path}: unknown key {k!r} under `state:`{_near(str(k), STATE_KINDS)}")
        if v not in ("sharded", "replicated"):
            raise RulesError(f"{path}: `state.{k}: {v}` must be `sharded` or `replicated`")
        state[k] = v
    order = {"replicated": 0, "sharded": 1}
    if not order[state["params"]] <= order[state["grads"]] <= order[state["optimizer"]]:
        raise RulesError(f"{path}: state {state} is not a ZeRO stage: sharding goes optimizer -> grads -> params")
    strategies = {"attention": "plain", "pipeline": None, "fsdp_gather": "per_layer", "collective_matmul": False}
    for k, v in (raw.get("strategies") or {}).items():
        if k not in STRATEGY_KEYS:
            raise RulesError(f"{path}: unknown strategy {k!r}{_near(str(k), STRATEGY_KEYS)}")
        if STRATEGY_KEYS[k] and v not in STRATEGY_KEYS[k]:
            raise RulesError(f"{path}: `strategies.{k}: {v}` must be one of {STRATEGY_KEYS[k]}")
        strategies[k] = v
    strategies["pipeline"] = _pipeline(strategies["pipeline"], path)
    strategies["experts"] = _experts(strategies.get("experts"), path)
    _collective_matmul(strategies["collective_matmul"], rules, strategies["pipeline"], path)
    if strategies["attention"] != "plain":
        for name, axes in (("batch", batch), ("rules.act_batch", rules.get("act_batch", ())),
                           ("rules.act_heads", rules.get("act_heads", ()))):
            if "context" in axes:
                raise RulesError(f"{path}: `{name}` lists context, but `strategies.attention: {strategies['attention']}` "
                                 "splits each sequence over context; take context out of it")
    if strategies["fsdp_gather"] not in FSDP_GATHER_IMPLEMENTED:
        raise RulesError(f"{path}: `strategies.fsdp_gather: {strategies['fsdp_gather']}` is not implemented yet; "
                         f"use {' or '.join(FSDP_GATHER_IMPLEMENTED)} (each layer's weights gathered where used)")
    header = "\n".join(line[1:].strip() for line in text.splitlines() if line.startswith("#"))
    return Rules(name=path.stem, path=str(path), mesh=mesh, batch=batch, rules=rules, state=state,
                 strategies=strategies, header=header)


def _pipeline(value, path) -> dict | None:
    """`strategies.pipeline`: null, or {schedule: gpipe | 1f1b | interleaved | zb, virtual: N}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RulesError(f"{path}: `strategies.pipeline: {value}` must be null or a mapping like "
                         "{schedule: 1f1b, virtual: 1} (the micro-batch count is data.microbatches)")
    for k in value:
        if k not in ("schedule", "virtual"):
            raise RulesError(f"{path}: unknown key {k!r} under `strategies.pipeline`{_near(str(k), ('schedule', 'virtual'))}; "
                             "allowed: schedule, virtual (the micro-batch count is data.microbatches)")
    schedule, virtual = value.get("schedule", "1f1b"), value.get("virtual", 1)
    if schedule not in PIPELINE_SCHEDULES:
        raise RulesError(f"{path}: `strategies.pipeline.schedule: {schedule}` must be one of "
                         f"{', '.join(PIPELINE_SCHEDULES)}{_near(str(schedule), PIPELINE_SCHEDULES)}")
    if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1:
        raise RulesError(f"{path}: `strategies.pipeline.virtual: {virtual}` must be a positive integer")
    if (schedule == "interleaved") != (virtual > 1) and schedule != "gpipe":
        raise RulesError(f"{path}: schedule {schedule} with virtual {virtual}: `interleaved` takes virtual >= 2, "
                         "`1f1b` and `zb` take virtual: 1 (gpipe takes either)")
    return {"schedule": schedule, "virtual": virtual}


def _experts(value, path) -> dict | None:
    """`strategies.experts`: null, or {dispatch: dropless | capacity, capacity_factor: 1.25, chunks: 1}."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"dispatch", "capacity_factor", "chunks"}:
        raise RulesError(f"{path}: `strategies.experts: {value}` must be null or a mapping with keys dispatch "
                         f"({' | '.join(EXPERT_DISPATCH)}), capacity_factor (> 0) and chunks (>= 1), e.g. "
                         "{dispatch: capacity, capacity_factor: 1.25, chunks: 2}")
    chunks = value.get("chunks", 1)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise RulesError(f"{path}: `strategies.experts.chunks: {chunks}` must be a whole number >= 1 (the pieces "
                         "each device's expert all-to-all is cut into, to overlap it with the expert GEMMs; "
                         "1 = one exchange)")
    dispatch, factor = value.get("dispatch", "dropless"), value.get("capacity_factor", 1.25)
    if dispatch not in EXPERT_DISPATCH:
        raise RulesError(f"{path}: `strategies.experts.dispatch: {dispatch}` must be one of {', '.join(EXPERT_DISPATCH)}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise RulesError(f"{path}: `strategies.experts.capacity_factor: {factor}` must be a number > 0")
    return {"dispatch": dispatch, "capacity_factor": float(factor), "chunks": chunks}


def _collective_matmul(value, rules, pipeline, path) -> None:
    """`strategies.collective_matmul: true` (meshlab/parallel/collective_matmul.py) decomposes sequence
    parallelism's gathers and scatters: it needs the sequence split over tensor and Megatron's splits, and
    no pipeline. The pipeline executor runs a stage's layers in branches that only that stage takes, and
    the decomposition's `ppermute` over tensor lowers to one collective-permute whose pairs span every
    stage's tensor group: XLA waits for all of them in one rendezvous, which the other stages, in other
    branches, join with their own permutes (XLA:CPU hands one stage's chunks to the other: wrong losses)
    or never (a hang)."""
    if not isinstance(value, bool):
        raise RulesError(f"{path}: `strategies.collective_matmul: {value}` must be true or false")
    if value and pipeline:
        raise RulesError(f"{path}: `strategies.collective_matmul: true` with `strategies.pipeline: {pipeline}` is "
                         "not supported: the pipeline runs each stage's layers in branches only that stage takes, "
                         "and collective matmul's ppermutes over tensor are collectives of every stage's devices; "
                         "set `collective_matmul: false` (sequence parallelism with its plain gathers, as "
                         "fsdp_tp_sp) or `pipeline: null`")
    need = {"act_seq": ("tensor",), "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "act_heads": "tensor",
            "act_kv_heads": "tensor", "act_mlp": "tensor"}
    bad = [f"{k}: {list(rules.get(k, ()))}" for k, v in need.items()
           if (rules.get(k, ()) != v if isinstance(v, tuple) else v not in rules.get(k, ()))]
    if value and bad:
        raise RulesError(f"{path}: `strategies.collective_matmul: true` decomposes sequence parallelism's tensor "
                         f"gathers and scatters, so it needs `act_seq: tensor` and heads, kv_heads, mlp (and their "
                         f"act_ names) split over tensor; here {', '.join(bad)} (see sharding_rules/fsdp_tp_sp_cm.yaml)")


# -- the active rules: set by the engines, read by the model's helpers ----------------------
@dataclasses.dataclass
class _Active:
    rules: Rules
    mesh: Any
    manual: tuple[str, ...] = ()
    whole: bool = False         # parameters already gathered whole (fsdp_gather: per_step)


_STACK: list[_Active] = []


@contextlib.contextmanager
def use_rules(rules: Rules, mesh) -> Iterator[None]:
    """Make `rules` and `mesh` the ones `constrain`/`materialize` read (and the context mesh)."""
    _STACK.append(_Active(rules, mesh))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _STACK.pop()


@contextlib.contextmanager
def manual_axes(axes: Sequence[str], rules: Rules, mesh) -> Iterator[None]:
    """Inside a shard_map over `axes`: constraints drop them and parameters are gathered over them.
    Takes the rules explicitly: a step traced outside `use_rules` must still gather (ZeRO-3)."""
    _STACK.append(_Active(rules, mesh, tuple(axes)))
    try:
        yield
    finally:
        _STACK.pop()


@contextlib.contextmanager
def whole_params() -> Iterator[None]:
    """Inside the manual region, with the parameters already gathered whole (fsdp_gather: per_step):
    `materialize` only casts."""
    a = active()
    _STACK.append(dataclasses.replace(a, whole=True))
    try:
        yield
    finally:
        _STACK.pop()


def active() -> _Active | None:
    return _STACK[-1] if _STACK else None


def is_local() -> bool:
    """Whether code traced here sees whole arrays: no rules active, or every mesh axis of size > 1 is
    manual here (the data-parallel step's shard_map, one device). A per-device kernel is safe then;
    elsewhere GSPMD would gather its operands around it."""
    a = active()
    return a is None or all(size == 1 or name in a.manual for name, size in dict(a.mesh.shape).items())


def auto_axes(name: str) -> set[str]:
    """The mesh axes of size > 1 that logical `name` maps to and that are still Auto here (GSPMD partitions
    ops along them); empty outside `use_rules`."""
    a = active()
    if a is None:
        return set()
    return {ax for ax in a.rules.axes(name, a.mesh) if a.mesh.shape[ax] > 1 and ax not in a.manual}


def is_split(name: str) -> bool:
    """Whether arrays traced here are split over logical `name` across devices the code sees as one
    array (`auto_axes`)."""
    return bool(auto_axes(name))


def shares_axis(name: str, other: str) -> bool:
    """Whether logical `name` and `other` are split over a common `auto_axes` axis: an op whose output takes
    one dimension from each cannot keep both splits."""
    return bool(auto_axes(name) & auto_axes(other))


def gathers_weights() -> bool:
    """Whether `materialize` all-gathers parameters here (ZeRO-3 inside a manual data-parallel region)."""
    a = active()
    return a is not None and bool(a.manual) and a.rules.state["params"] == "sharded" and not a.whole


def strategy(key: str):
    a = active()
    return None if a is None else a.rules.strategies.get(key)


def constrain(x, names: Sequence[str | None]):
    """Place an activation by logical names (a no-op outside `use_rules`)."""
    a = active()
    if a is None:
        return x
    spec = a.rules.spec(names, x.shape, a.mesh, drop=a.manual)
    return jax.lax.with_sharding_constraint(x, spec)


def materialize(w, names: Sequence[str | None], dtype=None):
    """A stored parameter ready for compute: cast (before any gather: half the bytes in bf16),
    then all-gathered over the manual axes it is stored sharded on (ZeRO-3)."""
    if dtype is not None and w.dtype != dtype:
        w = w.astype(dtype)
    if not gathers_weights():
        return w
    return checkpoint_name(gather_manual(w, names), GATHERED)


def gather_manual(w, names: Sequence[str | None]):
    """w all-gathered over the manual axes it is stored sharded on (an `experts` dim stays split)."""
    a = active()
    # An `experts` dim stays split: expert parallelism moves tokens to the experts, not the weights.
    gathered = [(dim, tuple(ax for ax in a.rules.axes(name, a.mesh) if ax in a.manual))
                for dim, name in enumerate(names) if name != "experts"]
    gathered = [(dim, axes) for dim, axes in gathered if axes]
    if not gathered:
        return w

    def gather(w):
        for dim, axes in gathered:
            w = compat.all_gather(w, axes if len(axes) > 1 else axes[0], dim)
        return w

    # Auto axes (e.g. tensor) on other dims: gather inside a nested shard_map that makes them
    # manual too, so each device gathers only its tensor slice. Left to propagation, XLA
    # gathered the whole weight over `tensor` as well (5x the bytes under fsdp_tp, and no TP
    # saving in the gathered weights). A dim split over manual and auto axes at once keeps the
    # plain path: its gathered order would not be the auto axis' contiguous split.
    auto_spec = a.rules.spec(names, None, a.mesh, drop=a.manual)
    auto_axes = {ax for entry in auto_spec for ax in entry_axes(entry)}
    mixed = any(auto_spec[dim] if dim < len(auto_spec) else None for dim, _ in gathered)
    if auto_axes and not mixed:
        gather = compat.shard_map(gather, mesh=jax.sharding.get_abstract_mesh(), in_specs=auto_spec,
                                  out_specs=auto_spec, axis_names=auto_axes)
    with jax.named_scope("collectives"):
        return gather(w)


def named_sharding(mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)
