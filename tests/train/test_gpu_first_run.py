"""A first run on a GPU, checked on CPU: shipped GPU configs, config validation at load, remat=auto
from the planner, the out-of-memory check before anything is written (given a small device memory),
MFU against the datasheet peak, and the steps / resume errors."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from meshlab.plan import memory
from meshlab.train import fit, loop
from meshlab.checkpoint import Checkpointer
from meshlab.train.config import ConfigError, load_config
from meshlab.peak import datasheet_tflops, mfu, peak_flops
from tests.helpers import persistent_compile_cache, small_config

# Compiling dominates (steps compiled to be read for their memory, a few short dp runs): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen

def _dp(tmp_path, extra=(), steps=3):
    """The small model, data parallel over the 8 simulated devices."""
    return small_config("dp", steps=steps, tmp_path=tmp_path, extra=list(extra))


# The out-of-memory and the MFU tests compile one and the same step (remat pinned, same length):
# the second takes it from JAX's persistent cache (a cold compile of it is ~20 s on 2 cores).
STEP = ["model.remat=save_dots_attn"]
STEPS = 11


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    with persistent_compile_cache(tmp_path_factory.mktemp("jax-cache")):
        yield


# -- config load ------------------------------------------------------------------------------
def test_shipped_gpu_configs_hold_the_measured_settings():
    c = load_config("llama3_1b", [])
    m, d = c.model, c.data
    assert (m.name, m.dtype, m.attention, m.remat, m.loss_impl, m.scan_layers) == (
        "llama3_1b", "bfloat16", "xla", "none", "onepass", False)   # attention: auto on CPU
    assert (d.seq_len, d.global_batch, c.rules, c.optim.lr) == (4096, 4, "dp", 3e-4)
    assert load_config("llama3_3b", []).rules == "dp" and load_config("llama3_8b", []).rules == "fsdp"


def test_attention_typo_fails_at_load_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"model.attention='palas' .* did you mean 'pallas'"):
        load_config("default", ["model.attention=palas"])
    with pytest.raises(ConfigError, match=r"did you mean 'save_dots_attn'"):
        load_config("default", ["model.remat=save_dot_attn"])
    from scripts.train import main
    with pytest.raises(SystemExit, match="did you mean 'pallas'"):
        main(["--run-dir", str(tmp_path / "run"), "model.attention=palas"])
    assert not (tmp_path / "run").exists(), "a config error must stop the run before its directory exists"


@pytest.mark.parametrize("steps", ["-5", "0"])
def test_steps_below_one_is_one_clear_error(steps, tmp_path):
    from scripts.train import main
    with pytest.raises(SystemExit, match=f"steps={steps}: a run trains at least one step"):
        main(["--steps", steps, "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_resume_past_steps_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"--resume 40 is past steps=20.*greater than 40"):
        load_config("default", ["steps=20", "checkpoint.resume=40"])
    # A run directory whose latest checkpoint is step 40, resumed with --steps 20: refused before the
    # restore and before anything is written.
    ck = Checkpointer(tmp_path / "checkpoints", async_save=False)
    ck.save(40, {"w": jax.numpy.ones(4)}, {"step": 40})
    ck.close()
    before = sorted(p.name for p in tmp_path.iterdir())
    cfg = _dp(tmp_path, ["checkpoint.resume=latest"], steps=20)
    with pytest.raises(ValueError, match=r"latest checkpoint in .* is step 40 and steps=20: nothing to train.*"
                                         r"N > 40"):
        loop.train(cfg, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# -- remat=auto, loss_impl=auto ------------------------------------------------------------------
def test_auto_choices_without_a_memory_figure_keep_cpu_numerics():
    cfg = load_config("default", [])
    assert (cfg.model.attention, cfg.model.remat, cfg.model.loss_impl) == ("xla", "none", "dense")
    assert any("remat=none" in n for n in cfg.auto_notes)


def test_remat_auto_takes_the_fastest_policy_the_planner_fits():
    """Budget between two policies' planned bytes: auto skips the faster one that does not fit."""
    base = small_config("dp")
    rules, mesh = fit._planner_inputs(base)
    d = base.data
    planned = {p: fit.planned_bytes(dataclasses.replace(base.model, remat=p), rules, mesh, d.global_batch,
                                    d.seq_len, d.microbatches) for p in fit.REMAT_SPEED_ORDER}
    first, *rest = fit.REMAT_SPEED_ORDER
    expect = next(p for p in rest if planned[p] < planned[first])   # the next one that is smaller
    limit = (planned[first] + planned[expect]) / 2 / fit._usable(1.0)   # budget = USABLE * limit
    cfg = small_config("dp", extra=["model.remat=auto", f"device_memory_gib={limit / 2 ** 30}"])
    faster = [p for p in fit.REMAT_SPEED_ORDER[:fit.REMAT_SPEED_ORDER.index(expect)]]
    assert all(planned[p] > fit._usable(limit) for p in faster)
    assert cfg.model.remat == expect
    assert any(n.startswith(f"remat={expect}: ") and " of " in n for n in cfg.auto_notes), cfg.auto_notes


# -- out of memory before it happens ---------------------------------------------------------------
def test_compiled_step_over_the_device_memory_stops_with_one_message(tmp_path):
    cfg = _dp(tmp_path / "run")
    tr = loop.build_trainer(cfg)
    state = memory.state_memory(tr.md, tr.rules, tr.mesh)["total"]
    # Above the model state (so the compile runs), below the compiled step (its temporaries, the batch).
    cfg = _dp(tmp_path / "run", STEP + [f"device_memory_gib={1.05 * state / 2 ** 30}"], steps=STEPS)
    with pytest.raises(fit.OutOfMemoryError) as e:
        loop.train(cfg, progress=False)
    text = str(e.value)
    assert "the compiled step needs" in text.lower() and "device_memory_gib" in text
    assert "Changes that fit" in text or "No remat policy" in text
    assert "more devices: --rules fsdp on" in text and "Nothing was written" in text
    assert not (tmp_path / "run").exists()


def test_state_alone_over_the_memory_needs_no_compile(tmp_path, monkeypatch):
    cfg = _dp(tmp_path / "run", ["device_memory_gib=0.000001"])
    monkeypatch.setattr(loop, "device_batch", lambda *a: pytest.fail("compiled although the state cannot fit"))
    with pytest.raises(fit.OutOfMemoryError, match=r"model state alone .* needs"):
        loop.train(cfg, progress=False)
    assert not (tmp_path / "run").exists()


def test_xla_resource_exhausted_while_compiling_is_the_same_message(tmp_path, monkeypatch):
    real = loop.build_trainer

    class Exhausted:
        def lower(self, *a):
            raise RuntimeError("NOT_FOUND: Failed to get configs ... RESOURCE_EXHAUSTED: Out of memory while trying "
                               "to allocate 64.02GiB with allocator GPU_0_bfc [tf-allocator-allocation-error='']")

    def build(*a, **k):
        tr = real(*a, **k)
        tr.step_fn = Exhausted()
        return tr
    monkeypatch.setattr(loop, "build_trainer", build)
    with pytest.raises(fit.OutOfMemoryError) as e:
        loop.train(_dp(tmp_path / "run", ["device_memory_gib=80"]), progress=False)
    text = str(e.value)
    assert "XLA ran out of device memory while compiling the step (one allocation of 64.02GiB)" in text
    assert "allocator" not in text and "NOT_FOUND" not in text and not (tmp_path / "run").exists()


def test_an_out_of_memory_first_step_reported_at_its_metrics_is_the_same_message(tmp_path, monkeypatch):
    """XLA:CPU runs a step asynchronously: an allocation that fails surfaces where the loop first reads the
    step's metrics (one step late), not at the dispatch. Both give the first step's message."""
    real = jax.device_get

    def device_get(x):
        if isinstance(x, dict) and "loss" in x:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3607155220152 bytes.")
        return real(x)
    monkeypatch.setattr(loop.jax, "device_get", device_get)
    with pytest.raises(fit.OutOfMemoryError) as e:
        loop.train(_dp(tmp_path / "run", STEP + ["device_memory_gib=4", "checkpoint.at_end=false"], steps=STEPS),
                   progress=False)
    text = str(e.value)
    assert "XLA ran out of device memory while running the first step" in text and "RESOURCE" not in text
    assert "Written so far" in text and not any((tmp_path / "run" / "checkpoints").iterdir())


def test_llama3_8b_on_one_device_names_the_devices_it_needs(monkeypatch):
    monkeypatch.setattr(fit.jax, "device_count", lambda: 1)   # the planner sees one H200-sized device
    cfg = load_config("llama3_8b", ["device_memory_gib=139"])
    text = fit.oom_message(cfg, 139 * 2 ** 30, "device_memory_gib", compiled=200 * 2 ** 30)
    assert "rules fsdp on 1 device(s)" in text and "No remat policy" in text
    assert "more devices: --rules fsdp on 2 (ZeRO-3)" in text, text


# -- MFU -------------------------------------------------------------------------------------
def test_tiny_flops_per_token_by_hand():
    cfg = load_config("default", []).model
    # per layer: q 64x64 + k, v 64x32 each + o 64x64 = 12,288; SwiGLU 3 x 64x192 = 36,864; 4 layers;
    # the LM head 64 x 384 (vocab 257 padded to a multiple of 128) counted as a matmul (tied).
    n = 4 * (4096 + 2048 + 2048 + 4096 + 36864) + 64 * 384
    assert cfg.matmul_param_count() == n == 221_184
    assert cfg.train_flops_per_token(128) == 6 * n + 6 * 4 * 128 * (4 * 16) == 1_523_712


def test_datasheet_peaks_by_device_kind():
    assert datasheet_tflops("NVIDIA H200") == datasheet_tflops("NVIDIA H100 80GB HBM3") == 989
    assert datasheet_tflops("NVIDIA GH200 480GB") == 989 and datasheet_tflops("NVIDIA H100 PCIe") == 756
    assert datasheet_tflops("NVIDIA A100-SXM4-80GB") == 312 and datasheet_tflops("TPU v5e") is None
    peak, why = peak_flops(jax.devices()[0])
    assert peak is None and "--peak-tflops" in why
    assert peak_flops(jax.devices()[0], 2.5)[0] == 2.5e12
    assert mfu(1000.0, 1e9, None, 1) is None


def test_printed_mfu_is_tokens_flops_over_peak_and_devices_unclamped(tmp_path, capsys):
    """A short run with a memory figure (the compiled step runs the steps) and a tiny stated peak:
    every row's MFU is tokens/s x FLOPs/token / (peak x devices), > 100% and not clamped."""
    cfg = _dp(tmp_path / "run", STEP + ["device_memory_gib=4", "peak_tflops=0.00001", "checkpoint.at_end=false"],
              steps=STEPS)
    out = loop.train(cfg, progress=True)
    assert isinstance(out["trainer"].step_fn, loop._FirstCallFallback) and out["trainer"].step_fn.fn is not \
        out["trainer"].step_fn.jitted, "the precompiled step should run the steps"
    flops = cfg.model.train_flops_per_token(cfg.data.seq_len)
    for r in out["rows"]:
        assert r["mfu"] == r["tokens_per_s"] * flops / (1e7 * 8)
    assert max(r["mfu"] for r in out["rows"]) > 1.0   # no clamp: a tiny peak gives > 100%
    printed = capsys.readouterr().out
    assert "peak = 1e-05 TFLOP/s per device (peak_tflops) x 8 devices" in printed
    assert "memory: compiled step" in printed and "MFU = tokens/s x (6N + 6*L*S*d) / peak" in printed
    steady = out["steady"]
    assert steady["from_step"] == 10 and steady["to_step"] == 11
    assert steady["tokens_per_s"] == pytest.approx(float(np.median([r["tokens_per_s"] for r in out["rows"]
                                                                    if r["step"] >= 10])))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] == "summary" and rows[-1]["mfu"] == steady["mfu"]
    assert not any((tmp_path / "run" / "checkpoints").iterdir()), "checkpoint.at_end=false saves nothing"
