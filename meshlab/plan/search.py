"""The planner: every mesh shape x shipped rule file x remat policy x micro-batch count, priced
without compiling, the ones that do not fit dropped with a reason, the rest ranked by step time.

A mesh here is only its axis sizes (`PlanMesh`), so a 512-device plan runs on a laptop.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path

import numpy as np

from meshlab.mesh import AXES, format_sizes
from meshlab.plan import account, comm, compute, memory
from meshlab.plan import pipeline as pipeline_plan
from meshlab.rules import RulesError, load_rules, shipped_rules
from models import model_def

POLICIES = ("none", "save_dots_no_batch", "save_dots", "full")
USABLE = 0.92   # of device memory: the runtime, NCCL buffers and fragmentation take the rest (stated, not measured)


class PlanMesh:
    """Stands in for a jax Mesh where only `.shape` is read."""
    def __init__(self, sizes: dict):
        self.shape = {a: int(sizes.get(a, 1)) for a in AXES}

    @property
    def size(self) -> int:
        return math.prod(self.shape.values())


@dataclasses.dataclass
class Plan:
    rules: str
    mesh: dict
    remat: str
    microbatches: int
    ok: bool = False
    reason: str = ""
    memory: dict = dataclasses.field(default_factory=dict)
    mem_bytes: float = 0.0
    flops: dict = dataclasses.field(default_factory=dict)
    compute_s: float = 0.0
    comm: dict = dataclasses.field(default_factory=dict)
    comms: list = dataclasses.field(default_factory=list)
    step_s: float = math.inf          # with overlap
    step_s_serial: float = math.inf   # compute + every collective, nothing hidden
    mfu: float = 0.0

    @property
    def mesh_string(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "data=1"


def factorizations(n: int, k: int):
    """Ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, k - 1):
                yield (d,) + rest


def rule_axes(rules) -> list[str]:
    used = set(rules.batch) | {a for axes in rules.rules.values() for a in axes}
    return [a for a in AXES if a in used]


def candidate_meshes(rules, devices: int) -> list[dict]:
    """Every split of the devices over the axes the rule file names. An axis the file never names
    would only replicate work (`stage` is named by the pipeline files' `layers: stage`), so it stays 1."""
    axes = rule_axes(rules)
    out = []
    for sizes in factorizations(devices, len(axes)):
        mesh = dict(zip(axes, sizes))
        if rules.strategies.get("attention") in ("ring", "ulysses") and mesh.get("context", 1) == 1:
            continue   # a context-parallel file without a context axis is plain dp: listed under dp
        if any(s == 1 for a, s in mesh.items() if a != "data") and len(axes) > 1 and devices > 1:
            continue   # the axis the file is about must be used; `data` may be 1
        out.append(mesh)
    return out


def evaluate(md, rules, sizes: dict, global_batch: int, seq: int, remat: str, k: int, hw, hosts: int = 1) -> Plan:
    plan = Plan(rules.name, {a: s for a, s in sizes.items()}, remat, k)
    mesh = PlanMesh(sizes)
    try:
        rules.check_batch(global_batch, mesh, k)
        account.state_bytes(md, rules, mesh)   # every parameter spec checked for divisibility
        for name, dim in (("act_heads", md.cfg.n_heads), ("act_kv_heads", md.cfg.n_kv_heads), ("act_mlp", md.cfg.mlp_dim),
                          ("act_seq", seq), ("act_attn_seq", seq)):
            n = account.logical_shards(rules, mesh, name)
            if dim % n:
                raise RulesError(f"{name} ({dim}) is not divisible by its {n} shards")
        sched = None
        if mesh.shape["stage"] > 1:
            pipeline_plan.check_model(md.cfg, rules)
            sched = pipeline_plan.schedule(rules, mesh, k, md.cfg.n_layers)
    except (RulesError, ValueError) as e:   # ValueError: a pipeline whose layers or micro-batches do not fit
        plan.reason = _short(str(e).split(": ", 1)[-1])
        return plan
    cfg = dataclasses.replace(md.cfg, remat=remat)
    view_md, view_mesh = _stage_view(md, sizes) if sched is not None else (md, mesh)
    mem = memory.plan_memory(view_md, rules, view_mesh, global_batch, seq, k, remat)
    if sched is not None:   # a stage's layers x the micro-batches in flight, not its layers x one
        mem = pipeline_plan.activation_memory(md, rules, mesh, global_batch, seq, sched, mem)
    plan.memory, plan.mem_bytes = mem, mem["total"]
    # ring attention keeps an lse and can keep its output whatever model.attention says (the memory account
    # asks the same of the rules: memory.local_sizes)
    flash = compute.is_flash(cfg.attention) or rules.strategies.get("attention") == "ring"
    plan.flops = compute.step_flops(cfg, global_batch, seq, remat, flash)
    bubble = pipeline_plan.relative_bubble(sched) if sched is not None else 0.0
    plan.compute_s = compute.compute_time(cfg, global_batch, seq, mesh.size, hw, remat, bubble, flash)
    plan.comms = comm.step_collectives(view_md, rules, view_mesh, global_batch, seq, k, remat)
    if sched is not None:
        plan.comms += pipeline_plan.collectives(md, rules, mesh, global_batch, seq, sched)
    plan.comm = comm.comm_time(plan.comms, mesh, hw, hosts)
    plan.comm["overlap"] = comm.layer_overlap(plan.comm["rows"], plan.compute_s, md.cfg.n_layers, k)
    plan.step_s = plan.compute_s + plan.comm["overlap"]["exposed"]
    plan.step_s_serial = plan.compute_s + plan.comm["total"]
    plan.mfu = compute.mfu(cfg, global_batch, seq, plan.step_s, mesh.size, hw.flops)
    budget = hw.memory_bytes * USABLE
    if plan.mem_bytes > budget:
        plan.reason = f"needs {account.fmt_bytes(plan.mem_bytes)} per device > {account.fmt_bytes(budget)} budget"
        return plan
    plan.ok = True
    return plan


def _short(reason: str, width: int = 160) -> str:
    """A rejection in one table row: a long message loses its trailing advice clauses (the planner
    tries the other meshes itself), never a word cut in half."""
    while len(reason) > width and "; " in reason:
        reason = reason.rsplit("; ", 1)[0]
    return reason if len(reason) <= width else reason[:width].rsplit(" ", 1)[0] + " ..."


_STAGE_MODELS: dict = {}


def _stage_view(md, sizes: dict):
    """One pipeline stage seen alone: a model of n_layers / stage layers (the embedding and head
    included, as every stage stores them) on the mesh without `stage`. Its state bytes, activations
    and per-layer collectives (FSDP gathers, tensor-parallel sums: per local layer and micro-batch)
    are one device's of the pipeline; the pipeline's own traffic is added apart."""
    cfg = dataclasses.replace(md.cfg, n_layers=md.cfg.n_layers // sizes.get("stage", 1))
    key = repr(cfg)
    if key not in _STAGE_MODELS:
        _STAGE_MODELS[key] = model_def(cfg)
    return _STAGE_MODELS[key], PlanMesh({**sizes, "stage": 1})


def search(model_cfg, devices: int, global_batch: int, seq: int, hw, hosts: int = 1, rule_names=None,
           policies=POLICIES, max_microbatches: int = 8) -> tuple[list[Plan], list[Plan]]:
    """(ranked plans that fit, rejected plans with reasons)."""
    if global_batch < 1 or seq < 1:
        raise ValueError(f"global batch {global_batch} and sequence length {seq} must be >= 1")
    md = model_def(model_cfg)
    names = rule_names or [n for n in shipped_rules()]
    good, bad = [], []
    for name in names:
        rules = load_rules(name)
        for sizes in candidate_meshes(rules, devices):
            for remat, k in itertools.product(policies, [m for m in (1, 2, 4, 8, 16) if m <= max_microbatches]):
                p = evaluate(md, rules, sizes, global_batch, seq, remat, k, hw, hosts)
                (good if p.ok else bad).append(p)
    # Ties in overlapped time (compute-bound plans) go to the one with less communication: it has
    # more slack when the overlap is imperfect; then to the smaller memory.
    good.sort(key=lambda p: (p.step_s, p.step_s_serial, p.mem_bytes))
    return good, bad


def write_rule_file(plan: Plan, out_dir: Path, rank: int) -> Path:
    """The plan's rule file: the shipped one with its mesh replaced and the estimate in the header."""
    src = Path(load_rules(plan.rules).path).read_text()
    mesh_line = "mesh: {" + ", ".join(f"{a}: {s}" for a, s in plan.mesh.items()) + "}"
    body = re.sub(r"^mesh:.*$", mesh_line + "     # chosen by scripts/plan.py", src, count=1, flags=re.M)
    head = (f"# plan {rank}: {plan.rules} on {plan.mesh_string}, remat={plan.remat}, microbatches={plan.microbatches}\n"
            f"# estimated: {account.fmt_bytes(plan.mem_bytes)} per device, step {plan.step_s * 1e3:.1f} ms "
            f"(no overlap {plan.step_s_serial * 1e3:.1f} ms), MFU {plan.mfu:.0%}\n"
            f"# train: python scripts/train.py --rules {out_dir}/plan_{rank}_{plan.rules}.yaml --mesh {plan.mesh_string} "
            f"model.remat={plan.remat} data.microbatches={plan.microbatches}\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"plan_{rank}_{plan.rules}.yaml"
    path.write_text(head + body)
    return path


def best_per_rules(plans: list[Plan]) -> dict[str, Plan]:
    out: dict[str, Plan] = {}
    for p in plans:
        if p.rules not in out or (p.step_s, p.mem_bytes) < (out[p.rules].step_s, out[p.rules].mem_bytes):
            out[p.rules] = p
    return out


def memory_parts(plan: Plan) -> dict[str, float]:
    """The plan's bytes per device in parts that add up to mem_bytes: the gradients are among the peak
    phase's temporaries (its gradient buffers, memory.plan_memory), not a part of their own."""
    m = plan.memory
    return {"params": m["state"]["params"], "Adam mu+nu": m["state"]["optimizer"],
            "activations (peak phase)": m["activations"]["total"],
            "temporaries (peak phase, gradients in them)": m["temporaries"]["total"]}


def plot(plans: list[Plan], path: Path, title: str = "") -> Path:
    """Memory per device (stacked) and estimated step time of each strategy's best plan."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    best = list(best_per_rules(plans).values())
    best.sort(key=lambda p: p.mem_bytes)
    labels = [f"{p.rules}\n{p.mesh_string}\n{p.remat}, k={p.microbatches}" for p in best]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(best) * 2), 5))
    bottom = [0.0] * len(best)
    for name in memory_parts(best[0]):
        vals = [memory_parts(p)[name] / 2 ** 30 for p in best]
        ax1.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("GiB per device")
    ax1.legend(fontsize=8)
    ax1.set_title("memory per device (estimate)")
    ax2.bar(labels, [p.step_s_serial * 1e3 for p in best], label="no overlap", color="0.7")
    ax2.bar(labels, [p.step_s * 1e3 for p in best], label="with overlap")
    ax2.set_ylabel("ms per step")
    ax2.legend(fontsize=8)
    ax2.set_title("estimated step time")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def explain(plan: Plan, model_cfg, hw) -> str:
    """The arithmetic behind one plan, line by line."""
    m, f = plan.memory, plan.flops
    lc = m["local"]
    fb = account.fmt_bytes
    lines = [f"plan: {plan.rules} on {plan.mesh_string} ({format_sizes(plan.mesh)}), remat={plan.remat}, "
             f"microbatches={plan.microbatches}, hardware {hw.name}",
             f"per device and micro-batch: b={lc.b} rows, s={lc.s} (attention {lc.s_attn}), heads {lc.h}/{lc.kvh}, "
             f"mlp {lc.f}, vocab {lc.v}",
             "memory (meshlab stores fp32 params = master, fp32 grads, fp32 Adam mu/nu):"]
    for k, v in m["state"].items():
        lines.append(f"  {k:<12} {fb(v):>12}")
    tb = m["textbook"]
    lines.append(f"  textbook 16 B/param at ZeRO-{memory.zero_stage(load_rules(plan.rules))}: params {fb(tb['params'])}, "
                 f"grads {fb(tb['grads'])}, optimizer {fb(tb['optimizer'])} = {fb(tb['total'])}")
    lines.append(f"  activations: {m['activations']['detail']}")
    lines.append(f"  activations saved per layer            {fb(m['activations']['saved per layer']):>12}")
    parts = ("saved (all layers)", "backward working set", "loss head")
    if m["activations"]["forward working set"]:   # ring attention's last layer forward
        parts += ("forward working set",)
    for k in parts:
        lines.append(f"  activations {k:<21} {fb(m['activations'][k]):>12}")
    phases = ", ".join(f"{k} {fb(v)}" for k, v in m["phases"].items())
    lines.append(f"  peak phase: {m['peak phase']} (phases: {phases}); beside its activations:")
    for k, v in m["temporaries"].items():
        lines.append(f"  temporaries {k:<21} {fb(v):>12}")
    lines.append(f"  total {fb(plan.mem_bytes)} vs budget {fb(hw.memory_bytes * USABLE)} ({USABLE:.0%} of {fb(hw.memory_bytes)})")
    kv = memory.kv_cache_bytes(model_cfg, lc.b * plan.microbatches, lc.s_attn * lc.t if lc.sp else lc.s_attn,
                               lc.t, np.dtype(model_cfg.dtype).itemsize)
    lines.append(f"  serving instead: KV cache for {lc.b * plan.microbatches} sequences x {lc.s_attn} tokens "
                 f"{fb(kv)} per device beside {fb(m['state']['params'] // 2)} of bf16 weights")
    lines.append(f"compute: {f['total'] / 1e12:.2f} TFLOP per step = S*H^2 {f['S*H^2 (projections, MLP, head)'] / 1e12:.2f} "
                 f"+ S^2*H {f['S^2*H (attention)'] / 1e12:.2f} + remat {f['remat recompute'] / 1e12:.2f}; attention "
                 f"dominates above S = {compute.crossover_seq(model_cfg):.0f} (textbook 3.5H = "
                 f"{compute.textbook_crossover(model_cfg.d_model):.0f}); at {hw.efficiency:.0%} of "
                 f"{hw.flops / 1e12:.0f} TFLOP/s: {plan.compute_s * 1e3:.2f} ms")
    lines.append("communication (alpha-beta, per step):")
    for c, t in plan.comm["rows"]:
        lines.append(f"  {c.kind:<18} over {'x'.join(c.axes):<12} {fb(c.nbytes):>10} x {c.count:<4} "
                     f"{t * 1e3:8.3f} ms  {'overlappable' if c.overlappable else 'exposed':<12} {c.what}")
    if plan.mesh.get("stage", 1) > 1:
        lines += pipeline_plan.stage_table(model_cfg, load_rules(plan.rules), PlanMesh(plan.mesh), lc.s_attn)
        lines.append(pipeline_plan.bubble_line(load_rules(plan.rules), PlanMesh(plan.mesh), plan.microbatches,
                                               model_cfg.n_layers))
    lines.append(f"step: no overlap {plan.compute_s * 1e3:.2f} + {plan.comm['total'] * 1e3:.2f} = "
                 f"{plan.step_s_serial * 1e3:.2f} ms; with overlap {plan.compute_s * 1e3:.2f} + exposed "
                 f"{plan.comm['overlap']['exposed'] * 1e3:.2f} = {plan.step_s * 1e3:.2f} ms (per layer: "
                 f"{plan.comm['overlap']['per_layer_comm'] * 1e3:.3f} ms of collectives behind "
                 f"{plan.comm['overlap']['layer_compute'] * 1e3:.3f} ms of compute); "
                 f"MFU {plan.mfu:.1%}")
    return "\n".join(lines)
