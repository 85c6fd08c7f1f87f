"""Overlap read from a compiled program's schedule: which collectives run asynchronously and what
compute the scheduler put between each start and its done.

The optimized HLO text (`compiled.as_text()`) of a scheduled module lists every computation's
instructions in execution order. XLA:GPU splits a collective into `<kind>-start` and `<kind>-done`
(or `async-start` / `async-done` around a wrapped op, `send` / `recv` and their dones); what sits
between the two runs while the transfer is in flight. A synchronous collective (XLA:CPU writes only
those) hides behind nothing. A done whose start is not in its computation (a collective that the
pipelining passes moved one layer-loop iteration ahead) is counted as `across`: it overlaps the rest
of an iteration. Read line by line (JAX-NOTES: no regex over the whole text).
"""
from __future__ import annotations

import dataclasses
import re

from meshlab.plan.hlo import KINDS, Instr, computations  # noqa: F401 (Instr: part of this module's reading)

_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# What counts as compute between a start and its done: kernels (fusions, library calls such as
# cuBLAS/cuDNN GEMMs and attention) and control flow that runs them. Layout ops (bitcast, tuple,
# get-tuple-element, parameter, constant, copy-start/done) do not hide a transfer.
COMPUTE = {"fusion", "custom-call", "dot", "convolution", "while", "call", "conditional", "reduce", "sort", "scatter",
           "gather", "select-and-scatter", "reduce-window"}
SENDRECV = {"send": "send", "recv": "recv"}


@dataclasses.dataclass
class Pair:
    kind: str
    start: str
    done: str
    computation: str
    compute_between: int     # compute instructions scheduled between start and done


def _kind(ins: Instr, comps) -> str:
    """The collective an async start stands for."""
    op = ins.opcode
    if op in SENDRECV:
        return op
    if op != "async-start":
        return op[: -len("-start")]
    m = _CALLS.search(ins.line)
    for inner in comps.get(m.group(1), []) if m else []:
        if inner.opcode in KINDS:
            return inner.opcode
    return "async"


def _is_start(op: str) -> bool:
    return (op.endswith("-start") and not op.startswith("copy")) or op in SENDRECV


def _is_done(op: str) -> bool:
    return (op.endswith("-done") and not op.startswith("copy")) or op in ("send-done", "recv-done")


def read(text: str) -> tuple[dict, list[Pair]]:
    """({kind: {sync, starts, dones, overlapped, exposed, across}}, the matched pairs)."""
    comps = computations(text)
    summary: dict[str, dict] = {}
    pairs: list[Pair] = []
    row = lambda k: summary.setdefault(k, dict(sync=0, starts=0, dones=0, overlapped=0, exposed=0, across=0))  # noqa: E731
    # The bodies of async-start's wrapped ops: their collective is counted at the start, not again.
    wrapped = {m.group(1) for instrs in comps.values() for ins in instrs if ins.opcode == "async-start"
               for m in [_CALLS.search(ins.line)] if m}
    for cname, instrs in comps.items():
        if cname in wrapped:
            continue
        starts = {}
        for i, ins in enumerate(instrs):
            if ins.opcode in KINDS:
                row(ins.opcode)["sync"] += 1
            elif _is_start(ins.opcode):
                kind = _kind(ins, comps)
                starts[ins.name] = (i, kind)
                row(kind)["starts"] += 1
            elif _is_done(ins.opcode):
                src = next((o for o in ins.operands if o in starts), None)
                if src is None:   # started in another computation: a pipelined (loop-carried) collective
                    kind = ins.opcode[: -len("-done")]
                    row(kind)["dones"] += 1
                    row(kind)["across"] += 1
                    continue
                j, kind = starts[src]
                between = sum(1 for x in instrs[j + 1:i] if x.opcode in COMPUTE)
                pairs.append(Pair(kind, src, ins.name, cname, between))
                r = row(kind)
                r["dones"] += 1
                r["overlapped" if between else "exposed"] += 1
    return summary, pairs


def format_summary(summary: dict) -> str:
    """One line: `kind: N async (overlapped/exposed/across), M sync` per kind found."""
    parts = []
    for kind, r in sorted(summary.items()):
        s = []
        if r["starts"] or r["dones"]:
            s.append(f"{r['starts']}/{r['dones']} start/done ({r['overlapped']} with compute between, "
                     f"{r['exposed']} without, {r['across']} across loop iterations)")
        if r["sync"]:
            s.append(f"{r['sync']} sync")
        parts.append(f"{kind} " + " + ".join(s))
    return "; ".join(parts) if parts else "no collectives"
