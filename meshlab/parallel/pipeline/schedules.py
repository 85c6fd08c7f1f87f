"""Pipeline schedules as data: which op, micro-batch and chunk every stage runs at every tick.

A schedule is an int32 table [ticks, stages, NCOL], built and checked on the host, that the one
executor (`executor.py`) walks in lockstep: every stage runs one op per tick, then every stage
takes part in the same two point-to-point exchanges (activations one stage on, cotangents one
stage back). A new schedule is a new table; nothing in the executor changes.

Ops: F (forward of one chunk for one micro-batch; on the last chunk also the loss head and its
gradient), B (the whole backward of a chunk: input and weight gradients), BI (input gradient only)
and W (the deferred weight gradient, from BI's stashed per-layer cotangents). Chunks: with `virtual`
= v chunks per stage, stage s holds chunks c*p + s of the p*v virtual stages (interleaved order).

Lockstep costs: a tick lasts as long as its slowest op. GPipe's ticks are uniform (all stages do F,
then all do B); 1F1B mixes F and B in most ticks (neighbouring stages are one op apart), so a
tick costs a B (~2 F) and the stages running an F wait half of it; splitting B into BI + W (zero
bubble) makes every op about one F, which is what evens the ticks. `bubble()` reports both the
idle fraction of the table and the time-weighted one with these costs.

Columns per (tick, stage): op, micro-batch, chunk, the residual slot (F writes, B/BI/W read), the
forward-inbox slot F reads, the backward-inbox slot B/BI/W read (F on the last chunk writes the
loss head's cotangent there), the gradient-chain slot (BI writes, W reads), and where the values
received at the end of the tick go (forward inbox, backward inbox; the trash slot when nothing
arrives). Slots are allocated per stage by interval colouring, so the stash holds the peak number
of micro-batches in flight: p for 1F1B whatever M, M for GPipe.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from meshlab.rules import RulesError

IDLE, F, B, BI, W = 0, 1, 2, 3, 4
OP_NAMES = {IDLE: ".", F: "F", B: "B", BI: "I", W: "W"}
COST = {IDLE: 0.0, F: 1.0, B: 2.0, BI: 1.0, W: 1.0}   # in forwards of one chunk (backward ~ 2 forward)
COLS = ("op", "mb", "chunk", "res", "fin", "bin", "gch", "recv_f", "recv_b")
NCOL = len(COLS)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


class ScheduleError(RulesError):
    """A schedule that cannot be built for these stages / micro-batches, or a table that fails its check."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    virtual: int
    microbatches: int
    table: np.ndarray          # int32 [ticks, stages, NCOL]
    slots: dict                # {"res", "fin", "bin", "gch"}: slots per stage (the trash slot not counted)

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    def padded(self, ticks: int, slots: dict) -> "Schedule":
        """The same schedule in a larger shape (idle ticks appended, more slots): schedules of one
        shape share one compiled executor, the table being an input."""
        if ticks < self.ticks or any(slots[k] < self.slots[k] for k in self.slots):
            raise ScheduleError(f"cannot pad {self.name} ({self.ticks} ticks, slots {self.slots}) down to "
                                f"{ticks} ticks, slots {slots}")
        t = self.table.copy()
        for col, key in (("recv_f", "fin"), ("recv_b", "bin")):   # trash moves to the new last slot
            c = COLS.index(col)
            t[..., c] = np.where(t[..., c] == self.slots[key], slots[key], t[..., c])
        extra = np.zeros((ticks - self.ticks, self.stages, NCOL), np.int32)
        extra[..., COLS.index("recv_f")] = slots["fin"]
        extra[..., COLS.index("recv_b")] = slots["bin"]
        return dataclasses.replace(self, table=np.concatenate([t, extra]), slots=dict(slots))

    def render(self) -> str:
        """One row per stage: F3 = forward of micro-batch 3 (chunk letter when virtual > 1)."""
        rows = []
        for s in range(self.stages):
            cells = []
            for t in range(self.ticks):
                op, mb, ch = self.table[t, s, :3]
                cell = OP_NAMES[int(op)] + ("" if op == IDLE else str(mb))
                cells.append(cell + ("abcdefgh"[ch] if self.virtual > 1 and op != IDLE else ""))
            rows.append(f"stage {s}: " + " ".join(f"{c:>4}" for c in cells))
        return "\n".join(rows)


# -- per-stage op orders ------------------------------------------------------------------------
def _gpipe(p, v, m):
    fwd = [(F, c, i) for c in range(v) for i in range(m)]
    bwd = [(B, c, i) for c in reversed(range(v)) for i in range(m)]
    return [fwd + bwd for _ in range(p)]


def _one_f_one_b(p, v, m):
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [(F, 0, i) for i in range(warm)]
        for i in range(m - warm):
            order += [(F, 0, warm + i), (B, 0, i)]
        order += [(B, 0, i) for i in range(m - warm, m)]
        out.append(order)
    return out


def _interleaved(p, v, m):
    """Megatron's interleaved 1F1B: micro-batches in groups of p, each group through every chunk."""
    def ident(k, backward):
        group, r = divmod(k, p * v)
        chunk = r // p
        return (v - 1 - chunk if backward else chunk), group * p + r % p
    total = m * v
    out = []
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        order = [(F, *ident(k, False)) for k in range(warm)]
        for i in range(total - warm):
            order += [(F, *ident(warm + i, False)), (B, *ident(i, True))]
        order += [(B, *ident(k, True)) for k in range(total - warm, total)]
        out.append(order)
    return out


# -- dependencies and the lockstep simulation -----------------------------------------------------
def _prev(s, c, p):
    """The virtual stage feeding chunk c of stage s (None: it embeds)."""
    return (s - 1, c) if s > 0 else ((p - 1, c - 1) if c > 0 else None)


def _next(s, c, p, v):
    return (s + 1, c) if s < p - 1 else ((0, c + 1) if c < v - 1 else None)


def _ready(op, s, c, i, done, t, p, v) -> bool:
    """Is (op, chunk c, micro-batch i) on stage s runnable at tick t (inputs produced before t)?"""
    def before(key):
        return key in done and done[key] < t
    if op == F:
        src = _prev(s, c, p)
        return src is None or before((F, *src, i))
    if op in (B, BI):
        if not before((F, s, c, i)):
            return False
        dst = _next(s, c, p, v)
        return dst is None or before((B, *dst, i)) or before((BI, *dst, i))
    if op == W:
        return before((BI, s, c, i))
    return True


def _simulate_orders(orders, p, v) -> dict:
    """Each stage runs its next op as soon as its inputs have arrived. {(op, s, c, i): tick}."""
    done: dict = {}
    pos = [0] * p
    t = 0
    total = sum(len(o) for o in orders)
    while len(done) < total:
        ran = []
        for s in range(p):
            if pos[s] < len(orders[s]):
                op, c, i = orders[s][pos[s]]
                if _ready(op, s, c, i, done, t, p, v):
                    ran.append((op, s, c, i))
                    pos[s] += 1
        for key in ran:
            done[key] = t
        t += 1
        if t > 4 * total + 4 * p:
            raise ScheduleError("schedule deadlocks: an op waits for an input that never comes")
    return done


def _simulate_zero_bubble(p, m) -> dict:
    """ZB-H1-like, chosen per tick: an input gradient first (it unblocks the stage before), then a
    forward while fewer than p micro-batches hold residuals (1F1B's peak, the first stage's), then a
    deferred weight gradient; the W passes fill what would be 1F1B's bubbles. (Limiting stage s to
    p - s, as 1F1B's warm-up does, forces W passes early and doubled the bubble; p + 1 reaches
    (p-1)/(3m+p-1) at one more micro-batch of memory.)"""
    done: dict = {}
    nf, nbi, nw = [0] * p, [0] * p, [0] * p
    t = 0
    while len(done) < 3 * p * m:
        ran = []
        for s in range(p):
            if nbi[s] < m and _ready(BI, s, 0, nbi[s], done, t, p, 1):
                ran.append((BI, s, 0, nbi[s]))
                nbi[s] += 1
            elif nf[s] < m and nf[s] - nw[s] < p and _ready(F, s, 0, nf[s], done, t, p, 1):
                ran.append((F, s, 0, nf[s]))
                nf[s] += 1
            elif nw[s] < nbi[s] and _ready(W, s, 0, nw[s], done, t, p, 1):
                ran.append((W, s, 0, nw[s]))
                nw[s] += 1
        for key in ran:
            done[key] = t
        t += 1
        if t > 8 * p * m + 8 * p:
            raise ScheduleError("zero-bubble schedule deadlocks")
    return done


# -- slots and the table ------------------------------------------------------------------------
def _colour(intervals: Iterable[tuple[int, int, object]]) -> tuple[dict, int]:
    """Interval colouring: (start, end, key) -> slot; a slot read at tick e is free for a write at e."""
    free_at: list[int] = []
    out = {}
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for k, f in enumerate(free_at):
            if f <= start:
                free_at[k] = end
                out[key] = k
                break
        else:
            out[key] = len(free_at)
            free_at.append(end)
    return out, len(free_at)


def _table(done: dict, p: int, v: int, m: int) -> tuple[np.ndarray, dict]:
    ticks = max(done.values()) + 1
    last_bwd = {}
    for (op, s, c, i), t in done.items():
        if op in (B, W):
            last_bwd[(s, c, i)] = t
    slots = {}
    per_stage = {k: [] for k in ("res", "fin", "bin", "gch")}
    for s in range(p):
        res, fin, bin_, gch = [], [], [], []
        for c in range(v):
            for i in range(m):
                tf = done[(F, s, c, i)]
                res.append((tf, last_bwd[(s, c, i)], (c, i)))
                src = _prev(s, c, p)
                if src is not None:
                    fin.append((done[(F, *src, i)], tf, (c, i)))
                dst = _next(s, c, p, v)
                first_b = done.get((B, s, c, i), done.get((BI, s, c, i)))
                arrive = tf if dst is None else done.get((B, *dst, i), done.get((BI, *dst, i)))
                bin_.append((arrive, last_bwd[(s, c, i)], (c, i)))
                if (W, s, c, i) in done:
                    gch.append((first_b, done[(W, s, c, i)], (c, i)))
        for name, iv in (("res", res), ("fin", fin), ("bin", bin_), ("gch", gch)):
            colours, n = _colour(iv)
            per_stage[name].append(colours)
            slots[name] = max(slots.get(name, 0), n)
    table = np.zeros((ticks, p, NCOL), np.int32)
    table[..., COLS.index("recv_f")] = slots["fin"]     # the trash slot
    table[..., COLS.index("recv_b")] = slots["bin"]
    col = {c: COLS.index(c) for c in COLS}
    for (op, s, c, i), t in done.items():
        row = table[t, s]
        row[col["op"]], row[col["mb"]], row[col["chunk"]] = op, i, c
        row[col["res"]] = per_stage["res"][s][(c, i)]
        row[col["bin"]] = per_stage["bin"][s][(c, i)]
        if op == F and _prev(s, c, p) is not None:
            row[col["fin"]] = per_stage["fin"][s][(c, i)]
        if (c, i) in per_stage["gch"][s]:
            row[col["gch"]] = per_stage["gch"][s][(c, i)]
        # What this op sends arrives at the end of this tick at its neighbour.
        if op == F and (dst := _next(s, c, p, v)) is not None:
            table[t, dst[0], col["recv_f"]] = per_stage["fin"][dst[0]][(dst[1], i)]
        if op in (B, BI) and (src := _prev(s, c, p)) is not None:
            table[t, src[0], col["recv_b"]] = per_stage["bin"][src[0]][(src[1], i)]
    return table, slots


def build(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The table of a named schedule; `check`ed before it is returned."""
    p, m, v = stages, microbatches, virtual
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"stages ({p}), micro-batches ({m}) and virtual stages ({v}) must be >= 1")
    if name == "interleaved":
        if v < 2:
            raise ScheduleError("schedule `interleaved` needs virtual >= 2 (virtual: 1 is plain 1f1b)")
        if m % p:
            raise ScheduleError(f"interleaved 1F1B sends micro-batches through the chunks in groups of the "
                                f"{p} stages: data.microbatches={m} must be a multiple of {p}")
        done = _simulate_orders(_interleaved(p, v, m), p, v)
    elif name in ("1f1b", "zb") and v != 1:
        raise ScheduleError(f"schedule {name!r} takes virtual: 1; for virtual stages use `interleaved` or `gpipe`")
    elif name == "gpipe":
        done = _simulate_orders(_gpipe(p, v, m), p, v)
    elif name == "1f1b":
        done = _simulate_orders(_one_f_one_b(p, v, m), p, v)
    else:
        done = _simulate_zero_bubble(p, m)
    table, slots = _table(done, p, v, m)
    sched = Schedule(name, p, v, m, table, slots)
    check(sched)
    return sched


def check(sched: Schedule) -> None:
    """Replay the table: every op's input has arrived, every (stage, chunk, micro-batch) runs its
    forward and its whole backward exactly once, and no slot is overwritten while still needed."""
    p, v, m, tab = sched.stages, sched.virtual, sched.microbatches, sched.table
    col = {c: COLS.index(c) for c in COLS}
    done: dict = {}
    owner = {k: {} for k in ("res", "fin", "bin", "gch")}     # (stage, slot) -> (chunk, mb) holding it

    def claim(kind, s, slot, who, t):
        if slot >= sched.slots[kind]:
            raise ScheduleError(f"tick {t} stage {s}: {kind} slot {slot} out of range")
        held = owner[kind].get((s, slot))
        if held is not None and held != who:
            raise ScheduleError(f"tick {t} stage {s}: {kind} slot {slot} overwritten while {held} still needs it")
        owner[kind][(s, slot)] = who

    def need(kind, s, slot, who, t):
        if owner[kind].get((s, slot)) != who:
            raise ScheduleError(f"tick {t} stage {s}: {kind} slot {slot} does not hold chunk/micro-batch {who}")

    for t in range(sched.ticks):
        for s in range(p):
            op, i, c = (int(x) for x in tab[t, s, :3])
            if op == IDLE:
                continue
            if not 0 <= i < m or not 0 <= c < v:
                raise ScheduleError(f"tick {t} stage {s}: micro-batch {i} / chunk {c} out of range")
            if (op, s, c, i) in done:
                raise ScheduleError(f"tick {t} stage {s}: {OP_NAMES[op]}{i} chunk {c} runs twice")
            if not _ready(op, s, c, i, done, t, p, v):
                raise ScheduleError(f"tick {t} stage {s}: {OP_NAMES[op]}{i} chunk {c} runs before its input exists")
            who = (c, i)
            if op == F:
                if _prev(s, c, p) is not None:
                    need("fin", s, tab[t, s, col["fin"]], who, t)
                    del owner["fin"][(s, tab[t, s, col["fin"]])]
                claim("res", s, tab[t, s, col["res"]], who, t)
                if _next(s, c, p, v) is None:
                    claim("bin", s, tab[t, s, col["bin"]], who, t)
            else:
                need("res", s, tab[t, s, col["res"]], who, t)
                need("bin", s, tab[t, s, col["bin"]], who, t)
                if op == BI:
                    claim("gch", s, tab[t, s, col["gch"]], who, t)
                if op == W:
                    need("gch", s, tab[t, s, col["gch"]], who, t)
                if op in (B, W):    # the micro-batch's backward on this chunk is complete: free its slots
                    for kind in ("res", "bin") + (("gch",) if op == W else ()):
                        del owner[kind][(s, tab[t, s, col[kind]])]
            done[(op, s, c, i)] = t
        for s in range(p):   # what arrives at the end of tick t
            for kind, colname, sender_op in (("fin", "recv_f", (F,)), ("bin", "recv_b", (B, BI))):
                slot = int(tab[t, s, col[colname]])
                if slot == sched.slots[kind]:
                    continue
                src = (s - 1) % p if kind == "fin" else (s + 1) % p
                sop, si, sc = (int(x) for x in tab[t, src, :3])
                if sop not in sender_op:
                    raise ScheduleError(f"tick {t} stage {s}: expects a {kind} value from stage {src}, which sends none")
                c = sc + (1 if kind == "fin" and src == p - 1 else 0) - (1 if kind == "bin" and src == 0 else 0)
                claim(kind, s, slot, (c, si), t)
    want = {(op, s, c, i) for s in range(p) for c in range(v) for i in range(m)
            for op in ((F, BI, W) if sched.name == "zb" else (F, B))}
    if set(done) != want:
        missing = sorted(want - set(done))[:3]
        raise ScheduleError(f"schedule {sched.name} misses ops, e.g. {missing} as (op, stage, chunk, mb)")


# -- what the planner reads ---------------------------------------------------------------------
def bubble(sched: Schedule) -> dict:
    """Idle fraction of the table (op ticks) and of lockstep time (each tick as long as its costliest op)."""
    ops = sched.table[..., 0]
    busy_ticks = float((ops != IDLE).sum())
    cost = np.vectorize(COST.get)(ops)
    tick_len = cost.max(axis=1)
    return {"ticks": sched.ticks, "idle": 1.0 - busy_ticks / ops.size,
            "lockstep": 1.0 - float(cost.sum()) / (sched.stages * float(tick_len.sum())),
            "time": float(tick_len.sum())}


def theory_bubble(stages: int, microbatches: int, virtual: int = 1, schedule: str = "") -> float:
    """The textbook fraction of idle time: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved,
    (p-1)/(3m+p-1) for zero bubble (the weight-gradient passes fill 1F1B's idle ticks)."""
    if schedule == "zb":
        return (stages - 1) / (3 * microbatches + stages - 1)
    return (stages - 1) / (virtual * microbatches + stages - 1)


def peak_in_flight(sched: Schedule) -> int:
    """Most micro-batches whose residuals one stage holds at once (the stash size, in micro-batch chunks)."""
    return sched.slots["res"]
