"""Will the run fit the device? `remat=auto` / `loss_impl=auto` resolved from the planner's memory
estimate, and the out-of-memory check before the first step.

The order of work in `loop.train`: the config's `auto` choices are made at load (`resolve_auto`,
no compile), the step is compiled against abstract arrays and its memory analysis compared with
the device's memory (`check_compiled`) before the run directory, the checkpoints or the state
exist; a program that does not fit stops with one message (`OutOfMemoryError`) that names the
numbers and the changes the planner says would fit. An XLA RESOURCE_EXHAUSTED raised while
compiling or autotuning is turned into the same message (`from_xla_error`).
"""
from __future__ import annotations

import dataclasses
import re

import jax

# Speed order of the remat policies for `remat=auto`: llama3_1b, batch 4 x 4096, one H200
# (docs/benchmarks.md, Training): save_dots_attn 58.6-60.1k tokens/s (cuDNN; 42.6 GiB),
# save_dots_no_batch 58.8k (41.6 GiB), none 52.9k (88.4 GiB: saving every elementwise output costs
# more HBM traffic than recomputing it), full 52.3k (31.1 GiB). auto takes the first that fits.
REMAT_SPEED_ORDER = ("save_dots_attn", "save_dots_no_batch", "none", "full")
# With unrolled layers (`model.scan_layers=false`) nothing is stacked, so saving every output is the
# fastest when it fits: llama3_1b none 61.8k tokens/s (43.1 GiB), save_dots_attn 60.9k (39.0 GiB),
# the scan's save_dots_attn 60.2k (36.2 GiB), one H200 call. Unrolled, the policies save less than the
# planner counts (XLA may hoist recomputation): the compiled-memory check before the first step decides.
REMAT_SPEED_ORDER_UNROLLED = ("none", "save_dots_attn", "save_dots_no_batch", "full")
GIB = 2 ** 30


class FitError(ValueError):
    """The fit check cannot be set up (bad rules or mesh for the device count)."""


class OutOfMemoryError(RuntimeError):
    """The step does not fit the device; the message says by how much and what would fit."""


def device_memory(cfg, device=None) -> tuple[int | None, str]:
    """(bytes per device the run may use, where that figure comes from); None when unknown (CPU)."""
    if cfg.device_memory_gib:
        return int(cfg.device_memory_gib * GIB), "device_memory_gib"
    from meshlab.mesh import allocator_limit
    device = device or jax.devices()[0]
    limit = allocator_limit(device)
    if limit:
        return limit, f"{device.device_kind} allocator limit"
    return None, f"{device.platform} devices report no memory size"


def _planner_inputs(cfg):
    from meshlab.mesh import MeshError, resolve_sizes
    from meshlab.plan.search import PlanMesh
    from meshlab.rules import RulesError, load_rules
    try:
        rules = load_rules(cfg.rules)
        sizes = resolve_sizes(cfg.mesh or rules.mesh, jax.device_count())
    except (RulesError, MeshError, FileNotFoundError) as e:
        raise FitError(str(e)) from None
    return rules, PlanMesh(sizes)


def planned_bytes(model_cfg, rules, mesh, global_batch: int, seq: int, microbatches: int) -> int:
    """The planner's per-device total (state + the step's peak), meshlab/plan/memory.py; no compile."""
    from meshlab.plan import memory
    from models import model_def
    md = model_def(model_cfg)
    return int(memory.plan_memory(md, rules, mesh, global_batch, seq, microbatches, model_cfg.remat,
                                  _attention(model_cfg))["total"])


def _attention(model_cfg) -> str:
    from pallas_kernels.attention import resolve
    return resolve(model_cfg.attention) if model_cfg.attention == "auto" else model_cfg.attention


def resolve_auto(cfg) -> list[str]:
    """Replace `model.loss_impl=auto` and `model.remat=auto` in `cfg` by concrete choices; returns the
    startup lines that say what was chosen and why (also kept as `cfg.auto_notes`).
    loss_impl: onepass on GPU (1.004-1.010x dense's step rate, 6.4 GiB less at llama3_1b), dense
    elsewhere (the CPU tests' reference numerics). remat: without a device memory figure (CPU), none;
    else the first of REMAT_SPEED_ORDER whose planned bytes fit, or the smallest when none does
    (the check before the first step then stops the run with the numbers)."""
    notes, m = [], cfg.model
    from pallas_kernels.attention import auto_order, available
    if m.attention != "auto" and not available(m.attention):   # else a traceback from inside the first step's trace
        raise FitError(f"model.attention={m.attention} is not available on {jax.default_backend()}; use "
                       "model.attention=xla (or auto: the fastest this machine has)")
    if m.attention == "auto" and auto_order() == ("xla",):
        m.attention = "xla"   # all that auto can be here (CPU): the planner and config.yaml name what runs
    if m.loss_impl == "auto":
        m.loss_impl = "onepass" if jax.default_backend() == "gpu" else "dense"
        notes.append(f"loss_impl={m.loss_impl} (auto on {jax.default_backend()})")
    if m.remat == "auto":
        limit, source = device_memory(cfg)
        if limit is None:
            m.remat = "none"
            notes.append(f"remat=none (auto: {source}, nothing recomputed)")
        else:
            rules, mesh = _planner_inputs(cfg)
            budget = _usable(limit)
            est = {}
            for policy in (REMAT_SPEED_ORDER if m.scan_layers else REMAT_SPEED_ORDER_UNROLLED):
                est[policy] = planned_bytes(dataclasses.replace(m, remat=policy), rules, mesh,
                                            cfg.data.global_batch, cfg.data.seq_len, cfg.data.microbatches)
                if est[policy] <= budget:
                    break
            fits = [p for p in est if est[p] <= budget]
            m.remat = fits[0] if fits else min(est, key=est.get)
            notes.append(f"remat={m.remat}: {_gib(est[m.remat])} of {_gib(limit)} planned (auto: the fastest "
                         f"that fits; {source})" if fits else
                         f"remat={m.remat}: {_gib(est[m.remat])} planned, more than the {_gib(budget)} usable of "
                         f"{_gib(limit)} under every policy (auto: the smallest)")
    cfg.auto_notes = notes
    return notes


def _usable(limit: int) -> float:
    from meshlab.plan.search import USABLE
    return limit * USABLE


def check_state(cfg, md, rules, mesh, limit: int, source: str) -> None:
    """The model state alone (exact: the train step's own specs) past the limit: no need to compile."""
    from meshlab.plan import memory
    state = memory.state_memory(md, rules, mesh)["total"]
    if state > limit:
        raise OutOfMemoryError(oom_message(cfg, limit, source, state=state))


def compiled_bytes(compiled) -> int:
    """Per-device bytes of a compiled program: arguments + outputs - donated aliases + temporaries."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def check_compiled(cfg, compiled, limit: int, source: str) -> str:
    """The startup line when the compiled step fits `limit`; OutOfMemoryError when it does not."""
    need = compiled_bytes(compiled)
    if need > limit:
        raise OutOfMemoryError(oom_message(cfg, limit, source, compiled=need))
    return (f"memory: compiled step {_gib(need)} of {_gib(limit)} per device ({source}); "
            f"remat={cfg.model.remat}, loss_impl={cfg.model.loss_impl}")


def is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def from_xla_error(cfg, e: BaseException, limit: int | None, source: str, when: str,
                   written: str = "") -> OutOfMemoryError:
    """The one message for an XLA out-of-memory error raised `when` (compiling, the first step);
    `written`: what the run had already written by then (default: nothing)."""
    asked = re.search(r"allocate ([\d.]+\s*[KMGT]i?B)", str(e))
    what = f"XLA ran out of device memory while {when}" + (f" (one allocation of {asked.group(1)})" if asked else "")
    if limit is None:
        limit, source = device_memory(cfg)
    return OutOfMemoryError(oom_message(cfg, limit, source, xla=what, written=written))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def oom_message(cfg, limit: int | None, source: str, compiled: int | None = None, xla: str = "",
                written: str = "", state: int | None = None) -> str:
    rules, mesh = _planner_inputs(cfg)
    d, m = cfg.data, cfg.model
    planned = planned_bytes(m, rules, mesh, d.global_batch, d.seq_len, d.microbatches)
    have = f"{_gib(limit)} ({source})" if limit else "the device's memory"
    head = (f"out of memory: {m.name}, rules {rules.name} on {mesh.size} device(s), batch {d.global_batch} x "
            f"{d.seq_len}, remat={m.remat}, loss_impl={m.loss_impl}, microbatches={d.microbatches}, "
            f"dtype={m.dtype}.\n")
    if state is not None:
        head += (f"The model state alone (fp32 params, gradients, Adam mu and nu) needs "
                 f"{_gib(state)} per device, more than {have}; the whole step is planned at {_gib(planned)}.\n")
    elif compiled is not None:
        head += (f"The compiled step needs {_gib(compiled)} per device, more than {have} "
                 f"(planner estimate {_gib(planned)}).\n")
    else:
        head += f"{xla}; the planner estimates {_gib(planned)} per device, of {have}.\n"
    return (head + "\n".join(suggestions(cfg, rules, mesh, limit)) + "\n"
            + (written or "Nothing was written: no run directory, checkpoint or state was touched."))


def suggestions(cfg, rules, mesh, limit: int | None) -> list[str]:
    """Changes that fit by the planner's estimate: one setting at a time, then together, then more
    devices under the fsdp rule file."""
    d, m = cfg.data, cfg.model
    budget = _usable(limit) if limit else float("inf")

    def plan(mc, micro):
        try:
            rules.check_batch(d.global_batch, mesh, micro)
        except ValueError:
            return None
        return planned_bytes(mc, rules, mesh, d.global_batch, d.seq_len, micro)
    options = [(f"model.remat={p}", dataclasses.replace(m, remat=p), d.microbatches)
               for p in REMAT_SPEED_ORDER if p != m.remat]
    if m.loss_impl != "onepass":
        options.append(("model.loss_impl=onepass", dataclasses.replace(m, loss_impl="onepass"), d.microbatches))
    options += [(f"data.microbatches={k}", m, k) for k in (2, 4, 8) if k > d.microbatches]
    fits = [(label, b) for label, mc, k in options if (b := plan(mc, k)) is not None and b <= budget]
    if not fits:   # together: the smallest policy, onepass and the fewest micro-batches that fit
        small = dataclasses.replace(m, remat="full", loss_impl="onepass")
        for k in sorted({d.microbatches, 2, 4, 8}):
            if (b := plan(small, k)) is not None and b <= budget:
                fits.append((f"model.remat=full model.loss_impl=onepass data.microbatches={k}", b))
                break
    if limit is None:    # nothing to fit against: each change with what it needs
        lines = ["Changes and the memory each needs (planner estimates per device; this device reports no size):"]
    elif fits:
        lines = ["Changes that fit (planner estimates per device; the planner is within ~15% of the compiler):"]
    else:
        lines = ["No remat policy, loss implementation or micro-batch count fits on this mesh (planner)."]
    lines += [f"  {label}: {_gib(b)}" for label, b in fits[:6]]
    lines += _more_devices(cfg, budget, mesh.size)
    lines.append(f"  or a smaller data.global_batch or data.seq_len; `python scripts/plan.py --model {m.name} "
                 f"--devices N --seq {d.seq_len}` ranks every rule file and mesh")
    return lines


def _more_devices(cfg, budget: float, devices: int) -> list[str]:
    """The fewest devices, more than `devices`, on which the fsdp rule file (ZeRO-3: the 16 bytes
    per parameter split over fsdp) fits with the fastest remat policy that fits there."""
    from meshlab.plan.search import PlanMesh
    from meshlab.rules import load_rules
    d = cfg.data
    rules = load_rules("fsdp")
    for n in (2, 4, 8, 16, 32, 64):
        if n <= devices or d.global_batch % n:
            continue
        for policy in REMAT_SPEED_ORDER:
            b = planned_bytes(dataclasses.replace(cfg.model, remat=policy), rules, PlanMesh({"fsdp": n}),
                              d.global_batch, d.seq_len, d.microbatches)
            if b <= budget:
                return [f"  more devices: --rules fsdp on {n} (ZeRO-3), model.remat={policy}: {_gib(b)} per device "
                        f"(this run sees {jax.device_count()})"]
    return []
