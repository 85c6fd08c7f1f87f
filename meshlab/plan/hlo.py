"""Collectives read from compiled HLO text: kind, bytes, and whether they sit inside a loop.

Matched line by line (a regex over the whole text can run for minutes: JAX-NOTES). The
result shape before the op name gives the bytes; tuple results (combined collectives) add up.
A collective whose replica groups hold one device each (`{{0},{1},..}`, `[8,1]<=[8]`) moves
nothing and is left out: XLA on CPU keeps such no-op all-reduces, e.g. the transpose of a
shard_map over mesh axes of size 1.
"""
from __future__ import annotations

import dataclasses
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
                "s64": 8, "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")
_CALLS = re.compile(r"(?:to_apply|calls|body|condition|branch_computations)=\{?%?([\w.\-]+)")
_GROUPS = re.compile(r"replica_groups=(\{[{}\d,\s]*\}|\[\d+,(\d+)\]<=)")


def _single_device_groups(line: str) -> bool:
    m = _GROUPS.search(line)
    if not m:
        return False
    if m.group(2) is not None:             # iota form [groups, size]<=[...]
        return m.group(2) == "1"
    groups = re.findall(r"\{([\d,\s]*)\}", m.group(1)[1:-1])   # `{}`: one group of every device
    return bool(groups) and all(g.strip() and "," not in g for g in groups)


@dataclasses.dataclass
class Collective:
    kind: str
    bytes: int
    computation: str
    in_loop: bool
    line: str


def shape_bytes(text: str) -> int:
    """Bytes of the array shapes in `text` (`bf16[2,3]`, or a tuple of them); unknown dtypes are 0."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def collectives(hlo_text: str) -> list[Collective]:
    comp = None
    found = []
    loop_bodies: set[str] = set()
    calls: dict[str, set[str]] = {}
    for line in hlo_text.splitlines():
        m = COMPUTATION.match(line)
        if m:
            comp = m.group(1)
            continue
        w = _WHILE.search(line)
        if w:
            loop_bodies.add(w.group(1))
        for callee in _CALLS.findall(line):
            calls.setdefault(comp, set()).add(callee)
        op = _OP.search(line)
        if op and "-done" not in line and not _single_device_groups(line):
            found.append((op.group(2), shape_bytes(op.group(1)), comp, line.strip()))
    # Anything reachable from a loop body runs inside the loop.
    inside = set()
    stack = list(loop_bodies)
    while stack:
        c = stack.pop()
        if c in inside:
            continue
        inside.add(c)
        stack.extend(calls.get(c, ()))
    return [Collective(k, b, c, c in inside, l) for k, b, c, l in found]


def summarize(colls: list[Collective]) -> dict[str, int]:
    out = {k: 0 for k in KINDS}
    for c in colls:
        out[c.kind] += c.bytes
    return out


@dataclasses.dataclass
class Gemm:
    name: str
    kind: str           # "cublas" (a cuBLAS / cuBLASLt custom call) or "triton" (a Triton GEMM fusion)
    fp8: bool           # both operands of the GEMM are float8
    line: str


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_NAME = re.compile(r"%?([\w.\-]+)")


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    operands: list
    line: str
    shape: str = ""     # the result's type text, e.g. `f8e4m3fn[2048,1024]{1,0}`


def computations(text: str) -> dict[str, list[Instr]]:
    """computation name -> its instructions in schedule order."""
    out: dict[str, list[Instr]] = {}
    cur = None
    for line in text.splitlines():
        m = COMPUTATION.match(line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            args = m.group(4).split(")", 1)[0]
            cur.append(Instr(m.group(1), m.group(3), _NAME.findall(args), line, m.group(2)))
    return out


def gemms(hlo_text: str) -> list[Gemm]:
    """Every GEMM of a compiled GPU program. A cuBLASLt FP8 GEMM is its own custom-call target; a Triton
    GEMM fusion is FP8 when its fused dot reads two float8 values (XLA may feed it FP8 operands that it
    concatenates or bitcasts inside, e.g. gate and up merged into one GEMM). The optimized HLO prints a
    caller's operands without types, so the fused computation's own instructions give them."""
    fp8_dot = {}                               # fused computation -> its dot reads two float8 values
    for name, instrs in computations(hlo_text).items():
        types = {i.name: i.shape for i in instrs}
        dots = [i for i in instrs if i.opcode == "dot"]
        if dots:
            fp8_dot[name] = all(types.get(o, "").startswith("f8") for o in dots[0].operands[:2])
    found = []
    for line in hlo_text.splitlines():
        if " = " not in line:
            continue
        name = line.split("=", 1)[0].strip().removeprefix("ROOT").strip().lstrip("%")
        if 'custom_call_target="__cublas$' in line:
            found.append(Gemm(name, "cublas", 'custom_call_target="__cublas$lt$matmul$f8"' in line, line.strip()))
        elif "kind=kCustom" in line and ("gemm_fusion" in line or "__triton_gemm" in line):
            callee = (_CALLS.search(line) or [None, None])[1]
            found.append(Gemm(name, "triton", fp8_dot.get(callee, False), line.strip()))
    return found
