"""scripts/bench_scaling.py and scripts/bench_scaling_torch.py planning logic (no training here: the
CPU run of bench_scaling is in its docstring, the torch peers need torch and run on the device)."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

import models

SCRIPTS = Path(__file__).parents[2] / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bs():
    return _load("bench_scaling")


def test_overrides_are_typed_and_selected(bs):
    overs = bs.parse_over(["attention=cudnn,remat=none,fused_norm=1", "llama3_8b:remat=full,per_device_batch=2",
                           "tp/x2:loss_impl=dense", "seq65536:remat=save_dots"])
    cfg = models.preset("llama3_8b")
    rest = {}
    for sel, kv in overs:
        if bs.selected(sel, "llama3_8b", "fsdp", 2, 4096):
            rest.update(bs.apply_over(cfg, kv))
    assert (cfg.attention, cfg.remat, cfg.fused_norm, cfg.loss_impl) == ("cudnn", "full", True, "dense")
    assert rest == {"per_device_batch": "2"}
    assert bs.selected("tp/x2", "llama3_1b", "tp", 2, 4096) and not bs.selected("tp/x2", "llama3_1b", "tp", 4, 4096)
    assert bs.selected("seq65536", "llama3_1b", "cp_ring", 2, 65536)
    off = models.preset("llama3_1b")
    bs.apply_over(off, bs.parse_over([bs.FUSED])[0][1])
    assert not (off.fused_swiglu or off.fused_norm) and off.loss_impl == "dense"


def test_run_list(bs):
    a = argparse.Namespace(runs="llama3_1b:dp:1,llama3_1b:cp_ring:2:32768", seq=4096, models="", rules="", gpus="",
                           cp_seqs="")
    assert bs.plan_runs(a) == [("llama3_1b", "dp", 1, 4096), ("llama3_1b", "cp_ring", 2, 32768)]
    a = argparse.Namespace(runs="", seq=4096, models="llama3_1b,llama3_8b", rules="dp,fsdp", gpus="1,2", cp_seqs="32768")
    runs = bs.plan_runs(a)
    assert runs[0] == ("llama3_1b", "dp", 1, 4096) and ("llama3_1b", "fsdp", 1, 4096) not in runs   # one baseline
    assert not any(m == "llama3_8b" and n == 1 for m, _, n, _ in runs)
    assert runs[-1] == ("llama3_1b", "cp_ring", 2, 32768)


def test_rule_files_that_are_one_program_on_two_devices(bs):
    """fsdp_tp with an fsdp axis of size 1 is tp: measured once, reported twice."""
    import jax
    from meshlab import rules as R
    from meshlab.mesh import make_mesh
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    sig = {}
    for name in ("dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp", "fsdp_tp_sp", "fsdp_cp", "cp_ring"):
        rules = R.load_rules(name)
        sig.setdefault(bs.signature(rules, make_mesh(rules.mesh, jax.devices()[:2])), []).append(name)
    assert sorted(sig.values(), key=len)[-1] == ["tp", "fsdp_tp"]
    assert all(len(v) == 1 for v in sig.values() if v != ["tp", "fsdp_tp"])


def test_a_mesh_the_model_cannot_split_on_is_not_run_not_failed(bs, capsys, monkeypatch):
    """tiny (2 kv heads) under tp over 4 devices: the rule file refuses the split before anything
    compiles; the row says why, as a run not made, not as a failure."""
    monkeypatch.delenv("OUT", raising=False)
    bs.main(["--models", "tiny", "--rules", "tp", "--gpus", "4", "--dtype", "float32"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| tiny tp x4"))
    assert "| not run: rule `kv_heads: ['tensor']` splits dimension 2" in row and "does not divide 2" in row
    assert "FAILED" not in out


def test_torch_peer_phases():
    bt = _load("bench_scaling_torch")
    assert bt._bytes("1GiB") == 2**30 and bt._bytes("64MiB") == 2**26
    phases = bt.plan_phases([2, 1], ["ddp", "fsdp2"], ngpu=2, concurrent=True, collectives=True)
    assert phases[0] == [("x2", 2, [0, 1], ["collectives", "ddp", "fsdp2"])]
    assert phases[1] == [("x1-ddp", 1, [0], ["ddp"]), ("x1-fsdp2", 1, [1], ["fsdp2"])]   # one GPU each, at once
    one = bt.plan_phases([1, 4], ["ddp", "fsdp2"], ngpu=2, concurrent=False, collectives=True)
    assert one[0] == [("x1", 1, [0], ["ddp", "fsdp2"])] and one[1] == [("x4", 4, [], [])]   # 4: reported as not run


def test_torch_float8_peer_needs_torchao():
    """--float8 converts through torchao; without it one message says so (this CPU venv has neither torch
    nor torchao: the conversion itself runs on the GPU machine)."""
    import importlib.util
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao installed: the missing-package message is not reachable")
    bt = _load("bench_scaling_torch")
    with pytest.raises(SystemExit, match="--float8 needs torchao"):
        bt.float8_linears(None)


def test_bench_tokens_random_and_text():
    """The harness's two batches: ids spread over the vocabulary, or byte text's skew (train.py's corpus)."""
    import numpy as np

    from meshlab.bench.train import sample_tokens
    rand = sample_tokens("random", 128256, (4, 4097))
    text = sample_tokens("text", 128256, (4, 4097))
    assert rand.shape == text.shape == (4, 4097) and rand.dtype == text.dtype == np.int32
    assert np.bincount(rand.ravel()).max() <= 4                 # no id repeats much
    counts = np.bincount(text.ravel(), minlength=256)
    assert text.max() <= 256 and counts.max() > 1000            # bytes and EOD; one of them (space) > 1000 times
    with pytest.raises(ValueError, match="tokens='bytes' must be random or text"):
        sample_tokens("bytes", 10, (1, 2))


def test_fp8_bench_torch_peers_rows():
    """bench_fp8.py --torch-peer: the shape read without starting JAX's backend, both peers' commands,
    a failed peer reported as such, and the ratios against ours."""
    import subprocess
    import sys
    fp8 = _load("bench_fp8")
    from meshlab.bench.train import config_shape
    assert config_shape("llama3_1b", ["data.global_batch=2"]) == ("llama3_1b", 2, 4096)
    probe = ("from meshlab.bench.train import config_shape; config_shape('llama3_1b'); "
             "from jax._src import xla_bridge; print(bool(xla_bridge._backends))")
    started = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             cwd=SCRIPTS.parent).stdout.strip()
    assert started == "False"                                       # load_config(resolve=False): no backend
    cmds = []

    def runner(cmd, timeout):
        cmds.append(cmd)
        if "--float8" in cmd:
            raise TimeoutError("peer hung")
        return 'log line\n{"tokens_per_s_per_gpu": 60000.0, "step_ms": 273.1}\n'
    peers = fp8.torch_peers("llama3_1b", 2, 4096, runner=runner)
    assert [c[-1] for c in cmds] == ["4096", "--float8"] and "--batch" in cmds[0]
    assert peers["bfloat16"]["tokens_per_s_per_gpu"] == 60000.0 and "TimeoutError" in peers["float8"]["error"]
    text = fp8.report_peers(peers, {"bfloat16": {"tokens_per_s": 63000.0}, "float8": {"tokens_per_s": 72000.0}})
    assert "| bfloat16 | 60,000 | 1.050 |" in text and "| float8 (torchao, tensorwise) | failed: TimeoutError" in text


def test_step_runner_times_again_from_its_kept_state():
    """bench_train.py --rounds: a variant's compiled step and state stay, each round continues training."""
    import jax
    import numpy as np

    from meshlab import rules as R
    from meshlab.bench.train import StepRunner
    from meshlab.mesh import make_mesh
    cfg = models.preset("tiny")
    cfg.attention, cfg.n_layers = "xla", 1
    runner = StepRunner(cfg, R.load_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]), 2, 32, "text")
    first = runner.loss
    times = [runner.time(2), runner.time(2)]
    assert all(t > 0 for t in times) and np.isfinite(runner.loss) and runner.loss < first   # five steps on one batch
    runner.close()
    assert runner.state is None


def test_vs_torch_rounds_alternate_and_void_a_slow_peer(tmp_path):
    """bench_vs_torch.py: peer then ours each round; ours read from train.py's summary row (a stale one
    removed first); a round whose peer is under the floor, or whose run failed, does not count."""
    import json
    vt = _load("bench_vs_torch")
    args = vt.parse(["--config", "llama3_1b", "--rounds", "3", "--peer-floor", "61000", "--run-dir",
                     str(tmp_path / "run"), "optim.lr=1e-4"])
    assert vt.ours_command(args)[-2:] == ["checkpoint.at_end=false", "optim.lr=1e-4"]
    peers, ours, calls = iter([62000.0, 60000.0, 61500.0]), iter([65100.0, 63000.0, None]), []

    def runner(cmd, timeout):
        if cmd[1].endswith("bench_scaling_torch.py"):
            calls.append("peer")
            assert "--float8" not in cmd and cmd[-4:] == ["--batch", "4", "--seq", "4096"]
            return f'warming\n{{"tokens_per_s_per_gpu": {next(peers)}}}\n'
        calls.append("ours")
        assert not (tmp_path / "run").exists()                              # the last round's rows removed
        rate, run = next(ours), tmp_path / "run"
        run.mkdir()
        rows = [{"step": 10, "loss": 3.0}] + ([{"event": "summary", "tokens_per_s": rate}] if rate else [])
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return ""
    rounds = vt.measure(args, ("llama3_1b", 4, 4096), runner=runner)
    assert calls == ["peer", "ours"] * 3
    assert [r["valid"] for r in rounds] == [True, False, False]             # slow peer; failed run
    assert rounds[0]["ratio"] == 65100.0 / 62000.0 and rounds[2]["ours"] is None
    text = vt.report(args, ("llama3_1b", 4, 4096), rounds)
    assert "| 3 | 61,500 | failed | failed | no" in text and "Median ratio of the rounds that count: 1.050 (1 of 3)" in text
