"""The profile reader on a synthetic Perfetto trace: kernels on GPU stream tracks are summed per
step, HLO-level tracks are not double-counted, host events are ignored, classes are assigned."""
import gzip
import json

import pytest

from meshlab.bench.profile_summary import format_summary, kernel_class, summarize


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
