"""Registers and spills of the Mosaic GPU kernels a process compiles, from ptxas' own report.

Why: a kernel that spills past its register budget loses time in every loop trip, and no timing
says so. The dK/dV FlashAttention kernel once spilled 220 bytes per thread; fixing that made it
1-9% faster per change (docs/benchmarks.md#attention). With MOSAIC_GPU_DUMP_TO set, Mosaic GPU writes
`<kernel>_<n>.ptxas` for each kernel it compiles, beside its PTX, every MLIR pass and (where
nvdisasm is found) its SASS: several MB per kernel, so point it at a scratch directory, not at a
device call's $OUT. jaxlib reads the variables at each compile: `enable` takes effect from the
next Mosaic kernel compiled.

Reading a report: "Used N registers" is the launch count (65536 / threads per block, rounded
down to 8: 168 for 3 warpgroups). Code after `setmaxnreg.inc` is allocated at the raised count,
and what does not fit there shows as spill stores and loads. So compare the spill bytes, not N.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

_NAME = re.compile(r"^(?P<kernel>.+)_(?P<index>\d+)\.ptxas$")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclasses.dataclass(frozen=True)
class PtxasReport:
    kernel: str          # the name given to plgpu.kernel, e.g. mgpu_flash_dkv
    index: int           # Mosaic's compile counter in this process
    registers: int       # per thread at launch (see the module docstring)
    spill_stores: int    # bytes per thread
    spill_loads: int
    stack_bytes: int


def enable(dump_dir: str | os.PathLike) -> Path:
    """Ask Mosaic GPU to write ptxas reports into dump_dir (created) from the next compile on. The
    reports of an earlier process there are removed first: Mosaic numbers its kernels from 0 in
    each process, so old files would read as this process's. A kernel taken from a compilation
    cache is not compiled, so it writes no report."""
    path = Path(dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.ptxas"):
        old.unlink()
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(path)
    return path


def parse(text: str, name: str) -> PtxasReport:
    """One report; name is its file name (`<kernel>_<n>.ptxas`)."""
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a Mosaic GPU ptxas report name (<kernel>_<n>.ptxas)")
    used = _USED.search(text)
    if not used:
        raise ValueError(f"{name}: no 'Used N registers' line; is it the output of ptxas -v?")
    spill = _SPILL.search(text)
    stack, stores, loads = (int(x) for x in spill.groups()) if spill else (0, 0, 0)
    return PtxasReport(m["kernel"], int(m["index"]), int(used.group(1)), stores, loads, stack)


def read(dump_dir: str | os.PathLike) -> list[PtxasReport]:
    """Every report in dump_dir, in compile order."""
    return sorted((parse(f.read_text(), f.name) for f in Path(dump_dir).glob("*.ptxas")), key=lambda r: r.index)


class Tracker:
    """The reports written since the last call: which kernels a benchmark row compiled."""

    def __init__(self, dump_dir: str | os.PathLike):
        self.dir, self.seen = Path(dump_dir), set()

    def new(self) -> list[PtxasReport]:
        reports = [r for r in read(self.dir) if r.index not in self.seen]   # Mosaic's counter is per process
        self.seen.update(r.index for r in reports)
        return reports


def markdown(reports: list[PtxasReport]) -> str:
    lines = ["| kernel | compile # | registers at launch | spill stores B | spill loads B | stack B |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.kernel} | {r.index} | {r.registers} | {r.spill_stores} | {r.spill_loads} | {r.stack_bytes} |"
              for r in reports]
    return "\n".join(lines) + "\n"
