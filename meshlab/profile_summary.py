"""Where a step's device time goes, read from the profiler's Perfetto trace (no TensorBoard or
xprof needed, so it runs on a bare GPU image and in notebooks).

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes `perfetto_trace.json.gz`; its GPU
processes hold one track per CUDA stream with every kernel as a complete ('X') event. We sum the
kernel time per name and per class (GEMM, attention, collectives, Pallas/Triton, other fusions),
per traced step, which is what decides the next optimisation: e.g. GEMMs at 60% of the step and
their TFLOP/s, or elementwise fusions taking more time than they should. `ProfileWindow` traces a
window of a training run's steps and writes that table beside the trace.
"""
from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

import jax

# Ordered: the first pattern that matches a kernel's (lower-cased) name decides its class.
CLASSES = (
    ("collective", ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "all_to_all")),
    ("attention", ("fmha", "flash", "cudnn", "sdpa", "attention", "mha")),
    ("gemm", ("gemm", "xmma", "cutlass", "cublas", "sm90_", "sm80_", "wgmma", "matmul", "dot")),
    ("pallas/triton", ("triton", "pallas", "swiglu", "rms_norm", "cross_entropy", "rope")),
    ("copy", ("memcpy", "memset", "copy", "transpose")),
    ("reduce/fusion", ("reduce", "fusion", "loop_", "input_", "scatter", "gather", "convert")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def _short(name: str, width: int = 90) -> str:
    """Template arguments and long numeric suffixes collapsed, so instances of one kernel group."""
    name = re.sub(r"<.*>", "<...>", name)
    name = re.sub(r"\.\d+$", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def find_trace(log_dir: str | Path) -> Path:
    found = sorted(Path(log_dir).rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}; trace with "
                                "jax.profiler.trace(dir, create_perfetto_trace=True)")
    return found[-1]


def device_kernels(trace: dict | list) -> tuple[list[tuple[str, float]], dict]:
    """(kernel name, duration us) of every event on a GPU stream track, and event counts per GPU
    track (to see what a trace holds when the track names change between versions)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e.get("tid"))] = e["args"]["name"]
    gpu_pids = {pid for pid, n in pname.items() if "gpu" in n.lower() or "/device:" in n.lower()}
    tracks: dict = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            tracks[tname.get((e["pid"], e.get("tid")), "?")].append((e["name"], float(e.get("dur", 0.0))))
    # Only the stream tracks carry kernels; 'XLA Ops' / 'XLA Modules' tracks repeat the same time
    # at the HLO level and would double-count. Without stream tracks, fall back to 'XLA Ops'.
    streams = [t for t in tracks if "stream" in t.lower()] or [t for t in tracks if "xla ops" in t.lower()]
    return [k for t in streams for k in tracks[t]], {t: len(v) for t, v in tracks.items()}


def summarize(log_dir: str | Path, steps: int, top: int = 25) -> dict:
    """Per-step device time (ms) by class and by kernel from a trace of `steps` steps."""
    trace = json.load(gzip.open(find_trace(log_dir)))
    kernels, tracks = device_kernels(trace)
    if not kernels:
        raise ValueError(f"the trace under {log_dir} has no GPU kernel events (a CPU run, or profiling "
                         f"failed); GPU tracks seen: {tracks}")
    by_name, by_class = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for name, dur in kernels:
        short = _short(name)
        by_name[short] += dur
        counts[short] += 1
        by_class[kernel_class(name)] += dur
    total = sum(by_class.values())
    ms = 1e-3 / steps
    return {
        "busy_ms_per_step": total * ms,
        "tracks": tracks,
        "classes": [(c, t * ms, t / total) for c, t in by_class.most_common()],
        "kernels": [(n, t * ms, counts[n] / steps, t / total) for n, t in by_name.most_common(top)],
    }


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) (fusion|custom-call)\(.*?(?:calls=%?([\w.\-]+)"
                    r"|custom_call_target=\"([^\"]+)\")")


def hlo_kernels(hlo_text: str) -> dict[str, str]:
    """Kernel name -> "output shape, what it computes" for each fusion and custom call of an optimized
    HLO module (`compiled.as_text()`): XLA:GPU names a fusion's kernel after the instruction, with
    '.' as '_'. What it computes is the fused computation's root op, or the custom call's target;
    cuBLAS GEMMs keep cuBLAS's own kernel names and are not matched."""
    roots, current = {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
        elif current and line.lstrip().startswith("ROOT "):
            op = re.search(r"= \S+ ([\w\-]+)\(", line) or re.search(r"= \(.*?\) ([\w\-]+)\(", line)
            roots.setdefault(current, op.group(1) if op else "")
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            name, shape, _, called, target = m.groups()
            shape = re.sub(r"\{[^}]*\}", "", shape)          # layouts dropped
            out[name.replace(".", "_")] = f"{shape[:100]} {roots.get(called, '') if called else target}".strip()
    return out


def format_summary(summary: dict, label: str = "", step_ms: float | None = None,
                   kernels_hlo: dict[str, str] | None = None) -> str:
    """Markdown tables; with `kernels_hlo` (hlo_kernels of the traced program) each kernel row also
    says which HLO fusion it is: its output shape and root op."""
    lines = [f"#### Device time per step{f' - {label}' if label else ''}",
             f"GPU busy {summary['busy_ms_per_step']:.1f} ms/step" +
             (f" of {step_ms:.1f} ms wall ({summary['busy_ms_per_step'] / step_ms:.0%} busy)" if step_ms else ""),
             "", "| class | ms/step | share |", "|---|---|---|"]
    lines += [f"| {c} | {t:.2f} | {s:.1%} |" for c, t, s in summary["classes"]]
    if kernels_hlo is None:
        lines += ["", "| kernel | ms/step | calls/step | share |", "|---|---|---|---|"]
        lines += [f"| `{n}` | {t:.2f} | {k:.0f} | {s:.1%} |" for n, t, k, s in summary["kernels"]]
    else:
        lines += ["", "| kernel | ms/step | calls/step | share | HLO: output, root |", "|---|---|---|---|---|"]
        lines += [f"| `{n}` | {t:.2f} | {k:.0f} | {s:.1%} | {kernels_hlo.get(n.replace('.', '_'), '')} |"
                  for n, t, k, s in summary["kernels"]]
    return "\n".join(lines) + "\n"


class ProfileWindow:
    """A jax.profiler trace of steps [start_step, start_step + num_steps) into RUN_DIR/profile, with a
    Perfetto copy, and on a GPU the window's device time per step by kernel (kernels.md beside it;
    meshlab.profile_summary): where the step goes, without TensorBoard."""

    def __init__(self, pcfg, run_dir: Path, hlo_text=None):
        self.start, self.stop_at = pcfg.start_step, pcfg.start_step + pcfg.num_steps
        self.dir = Path(pcfg.dir or run_dir / "profile")
        self.active, self.traced, self.hlo_text = False, 0, hlo_text

    def before(self, i: int, state=None) -> None:
        if self.start >= 0 and i == self.start:
            # The steps before the window finish first: else the trace would catch the tail of the
            # one still running and count it as the window's (one sync, once a run).
            jax.block_until_ready(state)
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.active = True

    def after(self, i: int, state) -> None:
        if self.active:
            self.traced += 1
            if i + 1 >= self.stop_at:
                jax.block_until_ready(state)   # the trace must hold the device work of the window
                self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            if jax.process_index() == 0:
                print(f"meshlab: profile written to {self.dir}", flush=True)
                self.write_kernel_table()

    def write_kernel_table(self) -> None:
        try:
            summary = summarize(self.dir, steps=max(self.traced, 1))
        except (FileNotFoundError, ValueError) as e:   # a CPU run has no device kernels to count
            print(f"meshlab: no kernel table ({str(e)[:160]})", flush=True)
            return
        text = self.hlo_text() if self.hlo_text else None
        names = hlo_kernels(text) if text else None
        (self.dir / "kernels.md").write_text(format_summary(summary, f"{self.traced} traced steps",
                                                            kernels_hlo=names))
        print(f"meshlab: device time per step by kernel: {self.dir / 'kernels.md'}", flush=True)
