"""scripts/diag_aot_topology.py (run on the GPU machine): its arguments, and the schedule reader it
reports with (meshlab/bench/hlo_schedule.py) on a CPU-compiled program and on GPU-style async HLO."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlab import compat
from meshlab.bench import hlo_schedule


def _script():
    spec = importlib.util.spec_from_file_location("diag_aot", Path(__file__).parents[2] / "scripts" / "diag_aot_topology.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments():
    mod = _script()
    a = mod.parse_args([])
    assert a.gpus == 2 and a.case_list == list(mod.CASES) and not a.cpu and a.over == {}
    assert mod.parse_case("llama3_1b:cp_ring:32768") == ("llama3_1b", "cp_ring", 32768)
    assert mod.parse_case("tiny:dp") == ("tiny", "dp", mod.DEFAULT_SEQ)
    a = mod.parse_args(["--cpu", "--gpus", "4", "--cases", "tiny:zero2", "--model-over", "attention=xla,remat=full"])
    assert a.cpu and a.gpus == 4 and a.case_list == ["tiny:zero2"] and a.over == {"attention": "xla", "remat": "full"}
    with pytest.raises(SystemExit, match="is not MODEL:RULES"):
        mod.parse_args(["--cases", "tiny"])
    with pytest.raises(SystemExit, match="SEQ 'long' is not a whole number"):
        mod.parse_args(["--cases", "tiny:dp:long"])
    with pytest.raises(SystemExit, match="at least 2"):
        mod.parse_args(["--gpus", "1"])


def test_reader_on_a_cpu_compiled_program():
    """XLA:CPU writes synchronous collectives only: found, counted, none async."""
    mesh = compat.make_mesh(np.array(jax.devices()[:4]), ("x",))

    def f(a, w):
        moved = jax.lax.ppermute(a, "x", [(i, (i + 1) % 4) for i in range(4)])
        return moved + a @ w, jax.lax.all_gather(a, "x", tiled=True).sum()
    sf = jax.jit(compat.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P()), axis_names={"x"}))
    text = sf.lower(jnp.ones((16, 8)), jnp.ones((8, 8))).compile().as_text()
    summary, pairs = hlo_schedule.read(text)
    assert summary["collective-permute"]["sync"] == 1 and summary["all-gather"]["sync"] == 1
    assert not pairs and all(r["starts"] == r["dones"] == 0 for r in summary.values())
    assert "collective-permute 1 sync" in hlo_schedule.format_summary(summary)


GPU_STYLE = """HloModule step, is_scheduled=true

%rs_body (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%p), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

%loop_body (t: (f32[4], f32[8])) -> (f32[4], f32[8]) {
  %t = (f32[4]{0}, f32[8]{0}) parameter(0)
  %carried = f32[8]{0} get-tuple-element(%t), index=1
  %ag-done = f32[8]{0} all-gather-done(%carried)
  %fusion.9 = f32[4]{0} fusion(%ag-done), kind=kLoop, calls=%fused
  ROOT %out = (f32[4]{0}, f32[8]{0}) tuple(%fusion.9, %ag-done)
}

ENTRY %main (a: f32[4], b: f32[8]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %ag-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%a), replica_groups={{0,1}}, dimensions={0}
  %gemm = f32[8]{0} custom-call(%b), custom_call_target="__cublas$gemm"
  %ag-done.1 = f32[8]{0} all-gather-done(%ag-start)
  %cp-start = (f32[4]{0}, f32[4]{0}) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %bc = f32[4]{0} bitcast(%a)
  %cp-done = f32[4]{0} collective-permute-done(%cp-start)
  %rs-start = ((f32[8]{0}), f32[4]{0}) async-start(%gemm), calls=%rs_body
  %f2 = f32[4]{0} fusion(%cp-done, %bc), kind=kLoop, calls=%fused
  ROOT %rs-done = f32[4]{0} async-done(%rs-start)
}
"""


def test_reader_pairs_starts_and_dones():
    """A GEMM between the all-gather's start and done: overlapped; only a bitcast between the permute's:
    exposed; async-start names its wrapped reduce-scatter; a done fed by the loop carry: across."""
    summary, pairs = hlo_schedule.read(GPU_STYLE)
    by = {p.kind: p for p in pairs}
    assert by["all-gather"].compute_between == 1 and by["collective-permute"].compute_between == 0
    assert by["reduce-scatter"].compute_between == 1 and by["reduce-scatter"].start == "rs-start"
    assert summary["all-gather"] == dict(sync=0, starts=1, dones=2, overlapped=1, exposed=0, across=1)
    assert summary["collective-permute"]["exposed"] == 1
    assert summary["reduce-scatter"]["sync"] == 0   # the wrapped op, inside its async computation, not twice
