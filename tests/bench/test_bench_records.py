"""What the benchmark scripts leave behind: the project's diary rows from a GPU run only, files outside the working
tree, rates that are never negative, and error cells that say why."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlab.bench import collectives, diary
from meshlab.bench.serve import sweep_row, tpot_between
from tests.helpers import script_module

ROOT = Path(__file__).resolve().parents[2]


def test_the_diary_takes_gpu_runs_and_a_named_file_any(tmp_path, capsys, monkeypatch):
    f = tmp_path / "diary.md"
    f.write_text("# Benchmarks\n")
    monkeypatch.setattr(diary, "DIARY", f)                   # the project's diary, here
    assert not diary.append("| cpu row |\n", backend="cpu", path=diary.DIARY)
    assert "only a GPU run is recorded" in capsys.readouterr().err
    assert diary.append("| gpu row |\n", backend="gpu", path=diary.DIARY)
    assert f.read_text() == "# Benchmarks\n| gpu row |\n"
    mine = tmp_path / "mine.md"                                  # a file the user names (--docs) takes a CPU run
    assert diary.append("| cpu row |\n", backend="cpu", path=mine) and mine.read_text() == "| cpu row |\n"


def test_collectives_on_cpu_leave_the_diary_alone(tmp_path, monkeypatch):
    f = tmp_path / "diary.md"
    f.write_text("# Benchmarks\n")
    monkeypatch.setattr(diary, "DIARY", f)
    a = argparse.Namespace(out=str(tmp_path / "p.json"), markdown=str(f))
    collectives.report([], {"platform": "cpu", "device": "8x cpu", "jax": "0", "axes": {}}, a)
    assert f.read_text() == "# Benchmarks\n" and (tmp_path / "p.json").is_file()


def test_out_dir_is_never_the_working_directory_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert diary.out_dir("x").resolve() != Path.cwd().resolve()
    assert diary.out_dir("x", tmp_path / "given") == tmp_path / "given" and (tmp_path / "given").is_dir()
    monkeypatch.setenv("OUT", str(tmp_path / "env"))
    assert diary.out_dir("x") == tmp_path / "env"


def test_bench_train_on_a_cpu_stops_at_once():
    before = diary.DIARY.read_bytes()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--model", "tiny", "--seq", "64",
                        "--steps", "3", "--batch", "4", "--no-peer", "--no-torch-gemm", "--peak-tflops", "1"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode != 0 and "times training on one GPU; JAX's backend here is cpu" in r.stderr
    assert diary.DIARY.read_bytes() == before


def test_a_timing_difference_that_is_not_positive_is_no_rate():
    assert tpot_between(1.0, 1.5, 50) == pytest.approx(0.01)
    row = sweep_row(4, 64, "", t_short=0.010, t_long=0.009, tokens=96, roof=1000.0)
    assert row["value"] != row["value"] and row["tpot_ms"] != row["tpot_ms"]        # NaN, not -107547 tok/s
    assert row["note"].startswith("not measurable: 96 more tokens took -1.00 ms")
    ok = sweep_row(4, 64, "", t_short=0.010, t_long=0.106, tokens=96, roof=1000.0)
    assert ok["value"] == pytest.approx(4000.0) and ok["note"] == "TPOT 1.00 ms; 400% of the roofline 1000 tok/s"


@pytest.fixture(scope="module")
def bench_attention():
    return script_module("bench_attention")


def test_attention_cells_keep_cpu_rates_and_say_why_an_impl_failed(bench_attention, tmp_path):
    m = bench_attention
    assert [m.tflops_text(v) for v in (None, 312.4, 7.25, 0.00123)] == ["-", "312", "7.2", "0.00123"]
    assert "not on cpu" in m.unavailable("cudnn", "cpu") and "Hopper" in m.unavailable("ours_mgpu", "cpu")
    assert m.unavailable("cudnn", "gpu") is None and m.unavailable("xla", "cpu") is None
    try:
        raise AssertionError          # a bare assert in a kernel's checks: no message
    except AssertionError as e:
        assert m.describe(e).startswith("AssertionError: no message, raised at test_bench_records.py:")
    rows = [dict(impl="xla", S=256, D=64, causal=True, fwd_tflops=0.0021, fwdbwd_tflops=0.0034),
            dict(impl="cudnn", S=256, D=64, causal=True, error=m.unavailable("cudnn", "cpu"))]
    m.write_md(rows, tmp_path / "rows.md", "cpu")
    text = (tmp_path / "rows.md").read_text()
    assert "| 0.0021 / 0.0034 | ERR / ERR |" in text and "ERR cudnn: cuDNN attention needs an NVIDIA GPU" in text


def test_the_decode_roofline_counts_one_row_of_an_untied_embedding():
    """A tied table is the LM head and is read whole each step; an untied one only at each row's token,
    so its bytes past those rows are not in the roofline's denominator; a mixture of experts' routed
    experts count as many as the rows are expected to touch."""
    import dataclasses

    import numpy as np

    from meshlab.bench.decode import weights_read_per_step
    from models.llama import LlamaConfig
    from models.moe import MoeConfig
    v, d = 512, 64
    layer = {"w": np.zeros((d, 4 * d), np.float32)}                                    # 64 KiB
    tied = {"embed": np.zeros((v, d), np.float32), "layers": layer}
    untied = dict(tied, lm_head=np.zeros((d, v), np.float32))
    cfg = LlamaConfig(vocab_size=v, d_model=d)
    assert weights_read_per_step(tied, cfg) == (v * d + 4 * d * d) * 4
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
    assert weights_read_per_step(untied, cfg, batch=1) == (v * d + 4 * d * d + d) * 4
    assert weights_read_per_step(untied, cfg, batch=8) == (v * d + 4 * d * d + 8 * d) * 4
    # a mixture of experts (8, top 2): a step of b rows reads 8 (1 - (3/4)^b) of the routed experts,
    # the router and the shared expert whole
    e, f = 8, 32
    moe = {"embed": np.zeros((v, d), np.float32),
           "layers": {"moe": {"router": np.zeros((2, d, e), np.float32),
                              "w_gate": np.zeros((2, e, d, f), np.float32), "w_up": np.zeros((2, e, d, f), np.float32),
                              "w_down": np.zeros((2, e, f, d), np.float32),
                              "shared": {"w_gate": np.zeros((2, d, f), np.float32)}}}}
    cfg = MoeConfig(vocab_size=v, d_model=d, n_experts=e, top_k=2, expert_mlp_dim=f)
    dense = (v * d + 2 * d * e + 2 * d * f) * 4
    expert = 2 * 3 * d * f * 4                                                          # one expert in both layers
    assert weights_read_per_step(moe, cfg, batch=1) == dense + 2 * expert
    assert weights_read_per_step(moe, cfg, batch=4) == int(dense + e * (1 - 0.75 ** 4) * expert)
    # serving's kernels layers hold the experts as [n, k] matrices in place of their own: the same bytes as
    # the split layers' (q|k|v and wo rearranged), the routed ones read as touched
    import models
    from meshlab.infer.loading import random_params
    from meshlab.infer.programs import serving_params
    from models import model_def
    md = model_def(models.preset("moe_tiny"))
    params = random_params(md.cfg)
    split, kernels = (serving_params(md, params, layers) for layers in ("split", "kernels"))
    assert "experts_down_t" in kernels["layers"][0][1]["decode"] and "w_down" not in kernels["layers"][0][0]["moe"]
    for b in (1, 4):
        assert weights_read_per_step(kernels, md.cfg, b) == weights_read_per_step(split, md.cfg, b)


def test_decode_rows_route_each_token_to_distinct_experts():
    # gmm_rows's routing: rows // top_k tokens, each to top_k distinct experts (batch 1: two experts, one row each)
    import numpy as np

    from meshlab.bench.expert_rows import route_rows
    rng = np.random.default_rng(0)
    one = route_rows(rng, 2, 8, 2)
    assert one.sum() == 2 and one.max() == 1 and one.shape == (8,)
    many = route_rows(rng, 64, 8, 2)
    assert many.sum() == 64 and many.max() <= 32
