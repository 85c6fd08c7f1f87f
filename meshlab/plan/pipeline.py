"""The planner's account of a pipeline over `stage`: the schedule's bubble, the activations a stage
holds, the point-to-point bytes, and which layers (and the embedding/head) sit on which stage.

Everything comes from the schedule table itself (meshlab/parallel/pipeline/schedules.py), the
same one the executor runs: the bubble is its lockstep time (each tick as long as its costliest
op, F = 1, B = 2, BI = W = 1), the stash its peak of micro-batches in flight, the traffic two
collective-permutes of one micro-batch's residual stream [b, s, d] per tick.
"""
from __future__ import annotations

import copy

import numpy as np

from meshlab.parallel.pipeline import layout, schedules
from meshlab.plan import account, compute, hlo
from meshlab.plan.comm import Comm
from meshlab.plan.memory import local_sizes


def pipeline_of(rules, mesh) -> dict | None:
    """The rule file's {schedule, virtual} when the mesh has stage > 1."""
    return rules.strategies.get("pipeline") if mesh.shape["stage"] > 1 else None


def check_model(cfg, rules) -> None:
    """The train step cuts a model into stages only where it runs layer by layer with nothing beside
    the activations crossing stages (meshlab/train/step.py, stage_fns): a mixture of experts' router
    losses do not, so training refuses it on stage > 1 and the planner must not rank it there."""
    import models
    if hasattr(models.model_class(cfg), "hidden_and_aux"):
        raise schedules.ScheduleError(f"{rules.name}: model {cfg.name!r} does not run as a pipeline (its router "
                                      "losses do not cross stages); use a mesh with stage=1, for a mixture of "
                                      "experts ep, fsdp_ep or fsdp_tp_ep")


def schedule(rules, mesh, microbatches: int, n_layers: int) -> schedules.Schedule:
    pipe = rules.strategies.get("pipeline")
    if pipe is None:
        raise schedules.ScheduleError(f"{rules.name}: stage={mesh.shape['stage']} but no strategies.pipeline")
    layout.check_layers(n_layers, mesh.shape["stage"], pipe["virtual"])
    return schedules.build(pipe["schedule"], mesh.shape["stage"], microbatches, pipe["virtual"])


def p2p_bytes(cfg, rules, mesh, global_batch: int, seq: int, sched: schedules.Schedule) -> Comm:
    """Per tick one [b, s, d] activation forward and one cotangent back, on every stage, every tick."""
    lc = local_sizes(cfg, rules, mesh, global_batch, seq, sched.microbatches)
    x = lc.b * lc.s * cfg.d_model * np.dtype(cfg.dtype).itemsize
    c = Comm("collective-permute", ("stage",), x, 2 * sched.ticks if sched.stages > 1 else 0,
             "pipeline activations on + cotangents back, every tick", False)
    c.group = sched.stages
    return c


def collectives(md, rules, mesh, global_batch: int, seq: int, sched: schedules.Schedule) -> list[Comm]:
    """The pipeline's own traffic: the per-tick point-to-point exchange, and once per step the
    all-reduce over `stage` of the gradients of everything outside the layer stack."""
    out = [p2p_bytes(md.cfg, rules, mesh, global_batch, seq, sched)]
    rest = sum(r.bytes_per_device for r in account.param_table(md, rules, mesh, "params")
               if not (r.names and r.names[0] == "layers"))
    out.append(Comm("all-reduce", ("stage",), rest, 1, "embedding/norm/head grads summed over stage", True))
    for c in out:
        c.group = mesh.shape["stage"]
    return [c for c in out if c.count > 0]


def relative_bubble(sched: schedules.Schedule) -> float:
    """Lockstep time over the useful time of one stage, minus one (compute.compute_time's factor)."""
    busy = sum(schedules.COST[int(op)] for op in sched.table[:, 0, 0])
    return schedules.bubble(sched)["time"] / max(busy, 1e-9) - 1.0


def activation_memory(md, rules, mesh, global_batch: int, seq: int, sched: schedules.Schedule, mem: dict) -> dict:
    """`mem` (memory.plan_memory, which holds all layers' residuals of one micro-batch) with the
    stage's own: its chunk's layers times the micro-batches in flight (the stash slots), plus the
    inboxes and, for the zero-bubble table, the per-layer cotangents kept from BI to W."""
    cfg = md.cfg
    lc = local_sizes(cfg, rules, mesh, global_batch, seq, sched.microbatches)
    per_layer = mem["activations"]["saved per layer"]
    chunk = cfg.n_layers // (sched.stages * sched.virtual)
    x = lc.b * lc.s * cfg.d_model * np.dtype(cfg.dtype).itemsize
    stash = sched.slots["res"] * chunk * per_layer
    inbox = (sched.slots["fin"] + sched.slots["bin"] + 2) * x + sched.slots["gch"] * chunk * x
    delta = stash + inbox - mem["activations"]["saved (all layers)"]
    out = copy.deepcopy(mem)
    out["activations"].update({"saved (all layers)": stash + inbox, "pipeline stash": stash, "pipeline inboxes": inbox,
                               "in flight": sched.slots["res"]})
    out["phases"] = {k: v + (delta if k != "update" else 0) for k, v in mem["phases"].items()}
    peak = max(out["phases"].values())
    out["peak phase"] = max(out["phases"], key=out["phases"].get)
    out["total"] = mem["total"] - mem["estimate_temp"] + peak
    out["estimate_temp"] = peak
    return out


def stage_table(cfg, rules, mesh, seq: int) -> list[str]:
    """Which layers sit on which stage, and the FLOPs each stage does per token (forward), the
    first with the embedding lookup, the last with the final norm and the LM head."""
    pipe = rules.strategies.get("pipeline") or {"schedule": "1f1b", "virtual": 1}
    p, v = mesh.shape["stage"], pipe["virtual"]
    per = compute.layer_flops_per_token(cfg, seq)
    layer = sum(per.values())
    head = 2 * cfg.d_model * cfg.padded_vocab
    lines = [f"pipeline: {pipe['schedule']} over {p} stages x {v} virtual"
             + (" (stage s runs chunks s, p+s, ..; the state stores the layers in that chunk order, "
                "checkpoints record it)" if v > 1 else "")]
    loads = []
    for s, chunks in enumerate(layout.stage_map(cfg.n_layers, p, v)):
        flops = layer * sum(len(ls) for _, ls in chunks) + (head if s == p - 1 else 0)
        loads.append(flops)
        extra = ("embedding lookup (a gather: ~0 FLOPs)" if s == 0 else "") + \
                ((", " if s == 0 else "") + f"final norm + LM head ({head / layer:.1f} layers' FLOPs)" if s == p - 1 else "")
        spans = ", ".join(f"chunk {k}: layers {ls[0]}-{ls[-1]}" for k, ls in chunks)
        lines.append(f"  stage {s}: {spans}{'; ' + extra if extra else ''}; {flops / 1e9:.2f} GFLOP/token fwd")
    mean = sum(loads) / len(loads)
    lines.append(f"  imbalance: the heaviest stage does {max(loads) / mean:.2f}x the mean; in lockstep the ticks in which "
                 f"it runs its extra work wait for it (at most {1 - mean / max(loads):.1%} of the step idle on top of "
                 "the schedule's bubble)")
    return lines


def bubble_line(rules, mesh, microbatches: int, n_layers: int) -> str:
    """The schedule's bubble three ways: the textbook formula, the table's idle op ticks, lockstep time."""
    sched = schedule(rules, mesh, microbatches, n_layers)
    b = schedules.bubble(sched)
    p, m, v = sched.stages, sched.microbatches, sched.virtual
    theory = schedules.theory_bubble(p, m, v, sched.name)
    return (f"  bubble ({sched.name}, p={p}, M={m}, v={v}): textbook {theory:.1%}; this table {b['idle']:.1%} of op "
            f"ticks idle over {b['ticks']} ticks; {b['lockstep']:.1%} of lockstep time (a tick lasts its costliest "
            f"op: F=1, B=2, BI=W=1), which the step time above includes; {sched.slots['res']} micro-batches in flight")


def loop_copies(hlo_text: str, min_bytes: int) -> list[tuple[str, str]]:
    """(computation, result shape) of each copy of at least `min_bytes` in compiled HLO outside the
    entry computation and fusions, i.e. inside a loop or a branch: what the executor must not do per
    tick (its stash, inboxes and gradient accumulators stay in place; executor.py). Fusion-internal
    copies are layout changes of values being computed, not buffers moved."""
    comp, out = None, []
    for line in hlo_text.splitlines():
        if (m := hlo.COMPUTATION.match(line)):
            comp = "ENTRY" if line.lstrip().startswith("ENTRY") else m.group(1)
        elif " copy(" in line and comp not in (None, "ENTRY") and not comp.startswith(("fused", "wrapped")):
            shape = line.split("=", 1)[1].split(" copy(")[0].strip()
            if hlo.shape_bytes(shape) >= min_bytes:
                out.append((comp, shape))
    return out
