"""The profile reader (meshlab.profile_summary) on a synthetic Perfetto trace: kernels on GPU stream tracks are summed per
step, HLO-level tracks are not double-counted, host events are ignored, classes are assigned."""
import gzip
import json

import pytest

from meshlab.profile_summary import format_summary, kernel_class, summarize


def _trace(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return tmp_path


def _meta(pid, tid, pname, tname):
    return [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": pname}},
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": tname}}]


def test_kernels_summed_per_step_and_classed(tmp_path):
    ev = _meta(1, 10, "/device:GPU:0", "Stream #14(Compute)") + _meta(1, 11, "/device:GPU:0", "XLA Ops")
    ev += _meta(2, 20, "/host:CPU", "python")
    for _ in range(2):   # two traced steps
        ev += [{"ph": "X", "pid": 1, "tid": 10, "ts": 0, "dur": 3000.0, "name": "sm90_xmma_gemm_bf16bf16_bf16f32"},
               {"ph": "X", "pid": 1, "tid": 10, "ts": 0, "dur": 1000.0, "name": "cudnn_generated_fort_native_sdpa"},
               {"ph": "X", "pid": 1, "tid": 10, "ts": 0, "dur": 500.0, "name": "loop_multiply_fusion"},
               {"ph": "X", "pid": 1, "tid": 11, "ts": 0, "dur": 4500.0, "name": "fusion.12"},   # HLO track
               {"ph": "X", "pid": 2, "tid": 20, "ts": 0, "dur": 9e6, "name": "PjitFunction(step)"}]
    s = summarize(_trace(tmp_path, ev), steps=2)
    assert s["busy_ms_per_step"] == pytest.approx(4.5)
    classes = {c: t for c, t, _ in s["classes"]}
    assert classes == pytest.approx({"gemm": 3.0, "attention": 1.0, "reduce/fusion": 0.5})
    assert s["kernels"][0][:3] == ("sm90_xmma_gemm_bf16bf16_bf16f32", pytest.approx(3.0), 1)
    assert "| gemm | 3.00 | 66.7% |" in format_summary(s, "x", step_ms=9.0)


def test_trace_without_gpu_events_is_a_clear_error(tmp_path):
    ev = _meta(2, 20, "/host:CPU", "python") + [{"ph": "X", "pid": 2, "tid": 20, "ts": 0, "dur": 5.0, "name": "x"}]
    with pytest.raises(ValueError, match="no GPU kernel events"):
        summarize(_trace(tmp_path, ev), steps=1)
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
        summarize(tmp_path / "nothing", steps=1)


def test_collectives_before_gemm_names():
    assert kernel_class("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collective"
    assert kernel_class("triton_swiglu_fwd") == "pallas/triton"


GPU_HLO = """HloModule jit_step

%fused_convert.3 (p0: bf16[16,4]) -> f32[16,4] {
  %p0 = bf16[16,4]{1,0} parameter(0)
  ROOT %convert.7 = f32[16,4]{1,0} convert(%p0)
}

ENTRY %main (a: bf16[16,4], b: bf16[4,8]) -> f32[16,4] {
  %a = bf16[16,4]{1,0} parameter(0)
  %b = bf16[4,8]{1,0} parameter(1)
  %loop_convert_fusion.31 = f32[16,4]{1,0} fusion(%a), kind=kLoop, calls=%fused_convert.3
  %custom-call.2 = (bf16[16,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
  ROOT %r = f32[16,4]{1,0} copy(%loop_convert_fusion.31)
}
"""


def test_kernels_named_by_their_hlo_fusion():
    """Kernel rows gain the fusion's output shape and root op: XLA:GPU names a fusion's kernel after the
    instruction with '.' as '_'; a custom call reads as its target."""
    from meshlab.profile_summary import hlo_kernels
    names = hlo_kernels(GPU_HLO)
    assert names["loop_convert_fusion_31"] == "f32[16,4] convert"
    assert names["custom-call_2"].endswith("__cublas$gemm")
    s = {"busy_ms_per_step": 1.0, "classes": [("reduce/fusion", 1.0, 1.0)],
         "kernels": [("loop_convert_fusion_31", 1.0, 1, 1.0), ("nvjet_sm90_tst", 0.5, 1, 0.5)]}
    table = format_summary(s, kernels_hlo=names)
    assert "| `loop_convert_fusion_31` | 1.00 | 1 | 100.0% | f32[16,4] convert |" in table
    assert "| `nvjet_sm90_tst` | 0.50 | 1 | 50.0% |  |" in table


def test_hlo_kernels_reads_a_compiled_program():
    """On a real optimized module (CPU here): every fusion instruction is found with its output shape."""
    import jax
    import jax.numpy as jnp

    from meshlab.profile_summary import hlo_kernels
    text = jax.jit(lambda x, w: jnp.tanh(x @ w) * 2 + 1).lower(jnp.ones((8, 16)), jnp.ones((16, 32))).compile().as_text()
    names = hlo_kernels(text)
    fusions = [line for line in text.splitlines() if " fusion(" in line]
    assert fusions and len([k for k in names if "fusion" in k]) == len(fusions)
    assert any(v.startswith("f32[8,32]") for v in names.values())


def test_train_profile_window_writes_the_kernel_table(tmp_path, capsys):
    """train.py's profile window (profile.start_step=...) ends with kernels.md beside its trace on a
    GPU, each kernel named by its HLO fusion; a trace without device kernels gets a note, no file."""
    from types import SimpleNamespace
    from meshlab.profile_summary import ProfileWindow
    hlo = ("%fused_mul (p: f32[8]) -> f32[8] {\n  ROOT %m = f32[8]{0} multiply(%p, %p)\n}\n\n"
           "ENTRY %main {\n  %loop_multiply_fusion = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_mul\n}\n")
    window = ProfileWindow(SimpleNamespace(start_step=3, num_steps=2, dir=""), tmp_path, hlo_text=lambda: hlo)
    window.dir = _trace(tmp_path, _meta(2, 20, "/host:CPU", "python"))
    window.write_kernel_table()
    assert "no kernel table" in capsys.readouterr().out and not (window.dir / "kernels.md").exists()

    ev = _meta(1, 10, "/device:GPU:0", "Stream #14(Compute)")
    ev += [{"ph": "X", "pid": 1, "tid": 10, "ts": 0, "dur": 800.0, "name": "loop_multiply_fusion"}] * 2
    window.dir, window.traced = _trace(tmp_path / "gpu", ev), 2
    window.write_kernel_table()
    table = (window.dir / "kernels.md").read_text()
    assert "| `loop_multiply_fusion` | 0.80 | 1 | 100.0% | f32[8] multiply |" in table, table
