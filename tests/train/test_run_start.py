"""The start of a run: a run directory that cannot be one is refused before any work, with one line;
a pipeline with fewer micro-batches than stages is warned of; the "resume with:" command printed
after a stopped run resumes it, however the run was started."""
import importlib.util
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest

from meshlab.mesh import make_mesh
from meshlab.rules import load_rules
from meshlab.train import loop, resume
from tests.helpers import small_config
from tests.train.test_checkpoint import ROOT, subprocess_env

_spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
train_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_script)


def _not_built(*a, **k):
    raise AssertionError("the trainer was built before the run directory was checked")


def test_a_run_dir_that_is_a_file_is_refused_before_any_work(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("kept")
    monkeypatch.setattr(loop, "build_trainer", _not_built)
    with pytest.raises(ValueError, match=rf"run_dir {afile} is a file, not a directory; pass a directory \(--run-dir DIR"):
        loop.train(small_config(tmp_path=afile), progress=False)
    with pytest.raises(ValueError, match=rf"run_dir {afile}/sub cannot be created: {afile} is a file, not a directory"):
        loop.train(small_config(tmp_path=afile / "sub"), progress=False)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"checkpoint.dir {afile}/ck cannot be created: {afile} is a file.*"
                                         r"\(checkpoint.dir=DIR\)"):
        loop.train(small_config(tmp_path=run, extra=[f"checkpoint.dir={afile}/ck"]), progress=False)
    assert afile.read_text() == "kept" and not run.exists()


def test_a_run_dir_that_is_a_file_is_one_line_from_the_script(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("kept")
    p = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), "--rules", "dp", "--cpu-devices", "8",
                        "--run-dir", str(afile)], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [f"error: run_dir {afile} is a file, not a directory; pass a directory "
                                             "(--run-dir DIR; a missing one is created)"]


@pytest.mark.parametrize("value,message", [("0", "0 must be >= 1 (simulated CPU devices"), ("-1", "-1 must be >= 1 (simulated"),
                                           ("eight", "invalid int value: 'eight'")])
def test_cpu_devices_below_one_is_a_usage_error(value, message, capsys):
    """0 ran on one device as if the flag were absent; a negative count was a traceback from JAX's backend."""
    with pytest.raises(SystemExit) as e:
        train_script.parse(["--cpu-devices", value])
    assert e.value.code == 2
    assert f"error: argument --cpu-devices: {message}" in capsys.readouterr().err
    assert train_script.parse(["--cpu-devices", "8"]).cpu_devices == 8

@pytest.mark.parametrize("started", [
    ["--resume", "10"], ["--resume=10"], ["--resu", "10"], ["--resume"], ["--resume", "latest"],
    ["checkpoint.resume=10"], ["--resume", "optim.lr=1e-2"], ["--resume", "--mesh", "data=8"],
])
def test_the_printed_resume_command_resumes_the_latest(started):
    """Whatever resume the run was started with is dropped from the printed command (a STEP left behind
    was read as an override), the rest is kept as it was, and --resume (the latest) is added."""
    argv = ["--rules", "dp", *started, "--steps", "20", "optim.b2=0.9"]
    command = train_script.resume_command(["scripts/train.py", *argv])
    assert command[0] == "scripts/train.py" and command[-1] == "--resume" and "10" not in command
    again, first = vars(train_script.parse(command[1:])), vars(train_script.parse(argv))
    assert again["resume"] == "latest"
    assert sorted(again["overrides"]) == sorted(o for o in first["overrides"] if not o.startswith("checkpoint.resume="))
    assert {k: v for k, v in again.items() if k not in ("resume", "overrides")} == \
           {k: v for k, v in first.items() if k not in ("resume", "overrides")}


def test_a_stopped_run_prints_a_command_that_runs(tmp_path, monkeypatch, capsys):
    """main() of a run started with --resume 4 that stops on a signal prints a command; main() of that
    command loads its config and resumes the latest checkpoint (the STEP once left in it was an error)."""
    import meshlab.compile_cache
    import meshlab.train.loop
    seen = []

    def stopped(cfg):
        seen.append(cfg.checkpoint.resume)
        return {"interrupted": 6, "checkpoint_dir": str(tmp_path / "checkpoints")}
    monkeypatch.setattr(meshlab.train.loop, "train", stopped)
    monkeypatch.setattr(meshlab.compile_cache, "enable_for_run", lambda cfg: None)
    train_script.main(["--rules", "dp", "--steps", "8", "--resume", "4", "--run-dir", str(tmp_path), "optim.lr=1e-2"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resume with: "))
    python, script, *args = shlex.split(line[len("resume with: "):])
    assert python == "python" and script == "scripts/train.py"
    assert args == ["--rules", "dp", "--steps", "8", "--run-dir", str(tmp_path), "optim.lr=1e-2", "--resume"]
    train_script.main(args)
    assert seen == ["4", "latest"]


def _bubble(rules: str, mesh: str | None, extra=()):
    cfg = small_config(rules, mesh=mesh, extra=list(extra))
    r = load_rules(rules)
    return loop.pipeline_bubble_warning(SimpleNamespace(cfg=cfg, rules=r, mesh=make_mesh(cfg.mesh or r.mesh)))


def test_pipeline_with_fewer_micro_batches_than_stages_is_warned_of():
    """The line names the bubble fraction ((p-1)/(M+p-1)) and a data.microbatches the global batch divides
    into: 4 x stages where it can (the rule files' advice), else the largest of 2p, p, else 4 x stages
    with the global batch that needs."""
    assert _bubble("pp_dp", None) == (
        "meshlab: warning: rules pp_dp run a 2-stage pipeline with data.microbatches=1: about 50% of each step is "
        "the pipeline's bubble (stages idle); set data.microbatches=4 (4 x stages=8 needs a larger data.global_batch)")
    line = _bubble("pp_dp", "data=2,stage=4", ["data.global_batch=64", "data.microbatches=2"])
    assert "4-stage pipeline with data.microbatches=2: about 60% of each step" in line   # 3 / (2 + 3)
    assert line.endswith("set data.microbatches=16 (the rule file advises >= 4 x stages)")
    assert _bubble("pp_dp", None, ["data.global_batch=4"]).endswith(   # one row per data rank: no M > 1 divides
        "set data.microbatches=8 (the rule file advises >= 4 x stages) with data.global_batch a multiple of 32")
    assert _bubble("pp_dp", None, ["data.microbatches=2"]) is None      # M >= p
    assert _bubble("dp", None) is None                                  # no pipeline


def test_train_prints_the_pipeline_warning_once_on_stderr(tmp_path, monkeypatch, capsys):
    class Started(Exception):
        pass

    def start(*a, **k):
        raise Started
    monkeypatch.setattr(loop, "check_memory", lambda tr: None)   # the step's trace is not what is tested here
    monkeypatch.setattr(resume, "start_state", start)
    for microbatches, lines in ((1, 1), (2, 0)):
        with pytest.raises(Started):
            loop.train(small_config("pp_dp", extra=[f"data.microbatches={microbatches}"]), progress=False, write=False)
        err = capsys.readouterr().err
        assert len([x for x in err.splitlines() if "pipeline's bubble" in x]) == lines, err


def test_fp8_on_a_mixture_of_experts_says_the_experts_stay_in_the_compute_dtype():
    import dataclasses

    import models
    moe, dense = models.preset("moe_tiny"), models.preset("tiny")
    assert loop.fp8_experts_warning(moe) is None and loop.fp8_experts_warning(dataclasses.replace(dense, matmul_dtype="float8")) is None
    line = loop.fp8_experts_warning(dataclasses.replace(moe, matmul_dtype="float8"))
    assert f"routed experts' GEMMs stay {moe.dtype}" in line and line.startswith("meshlab: warning:")
