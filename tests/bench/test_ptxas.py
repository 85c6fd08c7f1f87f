"""meshlab.bench.ptxas: reading Mosaic GPU's ptxas reports (the benchmarks' register and spill columns)."""
import os

import pytest

from meshlab.bench import ptxas

SPILLED = """ptxas warning : Registers are spilled to local memory in function 'mgpu_flash_dkv_mosaic_gpu_kernel', 220 bytes spill stores, 240 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mgpu_flash_dkv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mgpu_flash_dkv_mosaic_gpu_kernel
    216 bytes stack frame, 220 bytes spill stores, 240 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 216 bytes cumulative stack size, 1 bytes smem
"""
CLEAN = """ptxas info    : Compiling entry function 'mgpu_flash_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mgpu_flash_fwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""


def test_parse_reads_registers_and_spills():
    r = ptxas.parse(SPILLED, "mgpu_flash_dkv_12.ptxas")
    assert (r.kernel, r.index, r.registers, r.spill_stores, r.spill_loads, r.stack_bytes) == \
        ("mgpu_flash_dkv", 12, 168, 220, 240, 216)
    c = ptxas.parse(CLEAN, "mgpu_flash_fwd_0.ptxas")
    assert (c.kernel, c.index, c.spill_stores, c.spill_loads) == ("mgpu_flash_fwd", 0, 0, 0)


def test_bad_report_or_name_is_one_clear_error():
    with pytest.raises(ValueError, match="no 'Used N registers' line"):
        ptxas.parse("ptxas fatal : Unresolved extern function", "mgpu_flash_dq_1.ptxas")
    with pytest.raises(ValueError, match="not a Mosaic GPU ptxas report name"):
        ptxas.parse(CLEAN, "kernel.ptx")


def test_enable_sets_the_dump_env_and_clears_old_reports(tmp_path, monkeypatch):
    for key in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO"):
        monkeypatch.delenv(key, raising=False)
    d = tmp_path / "dump"
    d.mkdir()
    (d / "mgpu_flash_dq_3.ptxas").write_text(CLEAN)   # an earlier process's
    (d / "notes.txt").write_text("kept")
    assert ptxas.enable(d) == d
    assert os.environ["MOSAIC_GPU_DUMP_PTXAS"] == "1" and os.environ["MOSAIC_GPU_DUMP_TO"] == str(d)
    assert not list(d.glob("*.ptxas")) and (d / "notes.txt").exists()


def test_tracker_returns_each_report_once_in_compile_order(tmp_path):
    t = ptxas.Tracker(tmp_path)
    assert t.new() == []
    (tmp_path / "mgpu_flash_dkv_10.ptxas").write_text(SPILLED)
    (tmp_path / "mgpu_flash_fwd_9.ptxas").write_text(CLEAN)
    first = t.new()
    assert [(r.kernel, r.index) for r in first] == [("mgpu_flash_fwd", 9), ("mgpu_flash_dkv", 10)]
    (tmp_path / "mgpu_flash_dq_11.ptxas").write_text(CLEAN)
    assert [r.index for r in t.new()] == [11]
    assert t.new() == []
    table = ptxas.markdown(ptxas.read(tmp_path))
    assert table.count("\n") == 5 and "| mgpu_flash_dkv | 10 | 168 | 220 | 240 | 216 |" in table
