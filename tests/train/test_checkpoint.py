"""Checkpoints: exact resume, resharding restore onto another rule file and mesh, missing /
partial / corrupt checkpoints, and the NaN policy (never a poisoned checkpoint)."""
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlab.train import loop
from meshlab.checkpoint import Checkpointer, CheckpointError, read_meta
from meshlab.train.metrics import read_metrics
from tests.helpers import persistent_compile_cache, small_config

ROOT = Path(__file__).resolve().parents[2]
# Compiled programs are shared between the train() calls of these tests and their subprocesses
# through JAX's persistent cache: a cold small train step costs ~30 s on 2 cores, a cached one ~1 s.
# The run's own cache (tests/conftest.py), so that this machine's runs are as cold as CI's first one
# (a directory kept across runs made later runs here hit programs CI compiles).
_RUN_CACHE = os.environ.get("MESHLAB_TEST_COMPILE_CACHE") or "off"
CACHE_DIR = Path(_RUN_CACHE if _RUN_CACHE != "off" else tempfile.mkdtemp(prefix="meshlab-test-jax-cache-"))
if _RUN_CACHE == "off":
    atexit.register(shutil.rmtree, CACHE_DIR, ignore_errors=True)
# One xdist worker runs the whole file: the uninterrupted fsdp run of `uninterrupted` is trained once, not once per worker
# (make test: --dist loadgroup).
# Compiling dominates (tiny fsdp/tp steps, 4 steps each): cheap_codegen, in its subprocesses too.
pytestmark = [pytest.mark.xdist_group("checkpoint"), pytest.mark.cheap_codegen]


@pytest.fixture(scope="module", autouse=True)
def compile_cache():
    with persistent_compile_cache(CACHE_DIR):
        yield


def subprocess_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(CACHE_DIR),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    # each subprocess sets its own device count; the compile flags are the tests' (tests/conftest.py), so
    # its programs and the test process's share cache entries
    env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))   # jax's file lock, as the test workers'
    if not os.environ.get("MESHLAB_TEST_GPU"):   # the cheap_codegen of these modules (tests/helpers.py)
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
    env.update(extra)
    return env


def cfg(tmp, rules="fsdp", mesh=None, steps=4, extra=()):
    return small_config(rules, mesh=mesh, steps=steps, extra=["checkpoint.every=2", *extra], tmp_path=tmp)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """fsdp on 8 devices, 4 steps, checkpoints at 2 and 4; the save at step 2 slowed down by a known
    second (test_a_save_is_off_the_step_clock)."""
    run = tmp_path_factory.mktemp("full")
    real_save = Checkpointer.save

    def slow_save(self, step, *a, **k):
        if step == 2:
            time.sleep(1.0)
        return real_save(self, step, *a, **k)

    Checkpointer.save = slow_save
    try:
        out = loop.train(cfg(run), progress=False)
    finally:
        Checkpointer.save = real_save
    return run, out["losses"]


def test_resume_is_exact(uninterrupted, tmp_path):
    run, losses = uninterrupted
    assert Checkpointer(run / "checkpoints").steps() == [2, 4]
    meta = read_meta(run / "checkpoints", 2)
    assert meta["step"] == 2 and meta["data"]["next_step"] == 2 and "rules: fsdp" in meta["config"]
    # Resume in a copy of the run directory from step 2: same rules, same steps -> same losses.
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    out = loop.train(cfg(copy, extra=["checkpoint.resume=2"]), progress=False)
    assert out["losses"] == losses[2:], "losses after a resume must equal the uninterrupted run's, bit for bit"
    rows = read_metrics(copy)
    assert any(r.get("event") == "resume" and r["step"] == 2 for r in rows)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 3, 4]   # appended, never rewritten


def test_a_save_is_off_the_step_clock(uninterrupted):
    """A checkpoint save blocks the loop (the state's finiteness, its copy to the host): its time is
    its own row, never the next step's step_ms and tokens/s."""
    run, _ = uninterrupted
    rows = read_metrics(run)
    saves = {r["step"]: r["save_ms"] for r in rows if r.get("event") == "checkpoint"}
    assert sorted(saves) == [2, 4] and saves[2] >= 1000, saves
    step3 = next(r for r in rows if r.get("step") == 3 and "loss" in r)
    assert step3["step_ms"] < 1000, "the save at step 2 is not step 3's time"


def test_resume_as_another_model_touches_nothing(uninterrupted, tmp_path):
    """A resume whose model overrides change a parameter's shape is refused, naming the leaf; the run's
    checkpoints stay where they are (not moved aside as damaged) and its config.yaml keeps its settings."""
    run, _ = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = (copy / "config.yaml").read_text()
    for resume in ("latest", "4"):
        with pytest.raises(CheckpointError, match=r"another model's state .*embed: stored \(\d+, 32\), this run "
                                                  r"\(\d+, 64\)"):
            loop.train(cfg(copy, extra=[f"checkpoint.resume={resume}", "model.d_model=64"]), progress=False)
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["2", "4"]
    assert (copy / "config.yaml").read_text() == before


def test_a_resume_that_changes_the_schedule_says_so(uninterrupted, tmp_path, capsys):
    """Extending a finished run (more steps) is allowed and warned of: the learning-rate schedule is
    the longer run's from the resumed step on. Settings outside the schedule (optim.b2) are not named."""
    from meshlab.train.config import schedule_changes, to_yaml
    run, _ = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    out = loop.train(cfg(copy, steps=5, extra=["checkpoint.resume=latest"]), progress=False)
    assert len(out["losses"]) == 1                                              # step 5 after step 4
    assert "the learning-rate schedule changed since the checkpoint (steps: 4 -> 5)" in capsys.readouterr().err
    saved = to_yaml(cfg(tmp_path))
    assert schedule_changes(saved, cfg(tmp_path, extra=["optim.b2=0.9"])) == ""
    assert schedule_changes(saved, cfg(tmp_path, steps=6, extra=["optim.lr=3e-2"])) == "steps: 4 -> 6, optim.lr: 0.01 -> 0.03"
    assert schedule_changes(None, cfg(tmp_path, steps=6)) == ""


def test_restore_onto_other_rules_and_mesh(uninterrupted, tmp_path):
    """Saved with fsdp on 8 devices, restored with tp on 4 devices (data=2,tensor=2): resharded
    on load by orbax from abstract targets with the new shardings."""
    run, losses = uninterrupted
    ckdir = tmp_path / "ck"           # a copy: the resume from 2 sets the fixture's step 4 aside
    shutil.copytree(run / "checkpoints", ckdir)
    c = cfg(tmp_path, rules="tp", mesh="data=2,tensor=2", extra=["checkpoint.resume=2", f"checkpoint.dir={ckdir}"])
    out = loop.train(c, devices=jax.devices()[:4], progress=False)
    assert out["trainer"].mesh.devices.size == 4
    np.testing.assert_allclose(out["losses"], losses[2:], rtol=1e-5)
    spec = out["trainer"].shardings["params"]
    assert any("tensor" in str(s.spec) for s in jax.tree.leaves(spec))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in .* to resume from"):
        loop.train(cfg(tmp_path, extra=["checkpoint.resume=latest"]), progress=False)
    with pytest.raises(CheckpointError, match="no complete checkpoint for step 7"):
        Checkpointer(tmp_path / "x").restore({}, step=7)


def _damage(step_dir: Path):
    """Overwrite the middle of every array data file with garbage (same sizes)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.stat().st_size > 64
             and "metadata" not in p.name]
    assert files
    for p in files:
        data = bytearray(p.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 32] = os.urandom(min(32, len(data) - mid))
        p.write_bytes(bytes(data))


def test_corrupt_latest_falls_back_and_is_kept(uninterrupted, tmp_path):
    run, losses = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    _damage(copy / "checkpoints" / "4")
    out = loop.train(cfg(copy, extra=["checkpoint.resume=latest"]), progress=False)
    assert out["losses"] == losses[2:]                        # resumed from step 2
    aside = [p.name for p in (copy / "checkpoints").iterdir() if p.name.startswith("corrupt-step-4")]
    assert aside, "the damaged step is moved aside, not deleted"
    assert Checkpointer(copy / "checkpoints").steps() == [2, 4]   # a good step 4 written again
    # Asking for the damaged step by number is an error, not a silent fallback.
    _damage(copy / "checkpoints" / "4")
    with pytest.raises(CheckpointError, match="step 4 .* cannot be restored"):
        loop.train(cfg(copy, extra=["checkpoint.resume=4"]), progress=False)


def test_step_without_commit_marker_is_partial(uninterrupted, tmp_path):
    run, _ = uninterrupted
    ckdir = tmp_path / "ck"
    shutil.copytree(run / "checkpoints", ckdir)
    os.remove(ckdir / "4" / "commit_success.txt")
    assert Checkpointer(ckdir).steps() == [2]
    assert any(p.name.startswith("partial-step-4") for p in ckdir.iterdir())


KILL_DURING_SAVE = """
import os, signal, sys, time
import jax, jax.numpy as jnp
from meshlab.checkpoint import Checkpointer
ck = Checkpointer(sys.argv[1])
ck.save(1, {"w": jnp.ones((256, 1024)), "step": jnp.int32(1)}, {"n": 1}, wait=True)
big = {"w": jax.random.normal(jax.random.key(0), (32, 1024, 1024)), "step": jnp.int32(2)}
ck.save(2, big, {"n": 2})          # async: returns while the bytes are being written
# orbax may create its temporary step directory from its background thread: kill once it exists,
# so the kill lands mid-save however loaded the machine is (not before the save began, nor after)
d, t0 = ck.directory, time.monotonic()
while not any(".orbax-checkpoint-tmp" in q.name for q in d.iterdir()) and time.monotonic() - t0 < 30:
    time.sleep(0.0005)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_save_killed_half_way(tmp_path):
    ckdir = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(ckdir)], env=subprocess_env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert any(".orbax-checkpoint-tmp" in q.name for q in ckdir.iterdir()), "the kill came after the save"
    ck = Checkpointer(ckdir)
    assert ck.steps() == [1]
    abstract = {"w": jax.ShapeDtypeStruct((256, 1024), np.float32, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0])), "step": jax.ShapeDtypeStruct((), np.int32, sharding=jax.sharding.SingleDeviceSharding(
            jax.devices()[0]))}
    state, meta = ck.restore(abstract)
    assert meta["step"] == 1 and float(state["w"].sum()) == 256 * 1024


def _poison_at(step_to_poison, nan_params=False):
    """Wrap the train step: at `step_to_poison` report a NaN loss (and, if asked, NaN params)."""
    import jax.numpy as jnp
    real_build = loop.build_trainer

    def build(*a, **k):
        tr = real_build(*a, **k)
        step_fn = tr.step_fn

        def poisoned(state, batch):
            state, metrics = step_fn(state, batch)
            if int(state["step"]) == step_to_poison:
                if nan_params:
                    state = dict(state, params=jax.tree.map(lambda x: x * jnp.nan, state["params"]))
                else:
                    metrics = dict(metrics, loss=metrics["loss"] * jnp.nan, finite=jnp.bool_(False))
            return state, metrics
        tr.step_fn = poisoned
        return tr
    return build


def test_nan_stops_naming_the_step_and_saves_nothing_poisoned(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "build_trainer", _poison_at(3))
    with pytest.raises(FloatingPointError, match="at step 3"):
        loop.train(cfg(tmp_path), progress=False)
    assert Checkpointer(tmp_path / "checkpoints").steps() == [2]


def test_nan_skip_policy_continues(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "build_trainer", _poison_at(3))
    out = loop.train(cfg(tmp_path, extra=["on_nonfinite=skip"]), progress=False)
    assert len(out["losses"]) == 4
    assert [r["step"] for r in out["rows"] if r.get("skipped")] == [3]


def test_poisoned_state_is_never_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "build_trainer", _poison_at(4, nan_params=True))
    with pytest.raises(CheckpointError, match="refusing to save step 4"):
        loop.train(cfg(tmp_path), progress=False)
    assert Checkpointer(tmp_path / "checkpoints").steps() == [2]


def test_fingerprint_check_takes_reordered_sums_and_rejects_a_changed_value():
    """Summing a leaf in another order (another mesh) moves its sums by a rounding error of its terms,
    a fraction of its sum of |x|: accepted even where the signed sum is near zero. A changed value, a
    NaN or another leaf count is a mismatch, named by leaf index."""
    from meshlab.checkpoint import fingerprint, fingerprint_mismatches
    # params.layers.attn.wk of a pp_dp run saved on data=4,stage=2 and restored on data=2,stage=4
    want = [[3.32295895e-04, 1.31003998e+02], [12.5, 40.0]]
    have = [[3.30179930e-04, 1.31004013e+02], [12.5, 40.0]]
    assert not np.allclose(have, want, rtol=1e-4, atol=1e-6)       # the rounding is real: a test of the signed sum fails it
    assert fingerprint_mismatches(have, want) == []
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    changed, poisoned = x.copy(), x.copy()
    changed[17] += 10.0
    poisoned[3] = np.nan

    def fp(*leaves):
        return np.asarray(fingerprint(list(leaves)), np.float64)
    assert fingerprint_mismatches(fp(x, x[::-1].copy()), fp(x, x)) == []
    assert fingerprint_mismatches(fp(x, changed), fp(x, x)) == [1]
    assert fingerprint_mismatches(fp(poisoned, x), fp(x, x)) == [0]
    assert fingerprint_mismatches(fp(x), fp(x, x)) == [0, 1]


def test_restore_onto_another_mesh_accepts_a_near_zero_sum_and_rejects_a_flipped_bit(tmp_path, monkeypatch):
    """A leaf of mean ~0 saved sharded over 8 devices restores onto one device and onto a 2x4 mesh (its
    sum, added in another order, lands outside 1e-4 of itself). A step whose stored values differ from
    its fingerprint (one exponent bit flipped) is refused by number, naming the leaf and only the other
    steps, and is moved aside by a resume of the latest."""
    import meshlab.checkpoint as checkpoint
    from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
    x = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    x -= np.float32(x.astype(np.float64).mean())                   # signed sum ~1e-4, sum |x| ~1.3e4
    saved = {"w": jax.device_put(x, NamedSharding(jax.make_mesh((8,), ("a",)), P("a"))), "step": np.int32(1)}
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, saved, {})
    one = SingleDeviceSharding(jax.devices()[0])
    mesh24 = jax.make_mesh((2, 4), ("a", "b"))
    targets = {"one device": (one, one), "2x4": (NamedSharding(mesh24, P("b", "a")), NamedSharding(mesh24, P()))}
    stored = np.asarray(read_meta(tmp_path / "ck", 1)["fingerprint"])
    on_one = np.asarray(checkpoint.fingerprint(jax.device_put(saved, one)), np.float64)
    assert not np.allclose(on_one, stored, rtol=1e-4, atol=1e-6), "the test needs a sum that moves with the order"
    for name, (sharding, replicated) in targets.items():
        abstract = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                    "step": jax.ShapeDtypeStruct((), np.int32, sharding=replicated)}
        state, meta = ck.restore(abstract, step=1)
        np.testing.assert_array_equal(np.asarray(state["w"]), x, err_msg=name)
        assert state["w"].sharding == sharding and meta["step"] == 1

    flipped = x.copy()
    flipped.view(np.int32)[3, 5] ^= 1 << 30                           # one exponent bit of one value
    real = checkpoint.fingerprint
    monkeypatch.setattr(checkpoint, "fingerprint", lambda state: real(dict(saved, step=np.int32(2))) if state is damaged
                        else real(state))
    damaged = {"w": jax.device_put(flipped, NamedSharding(jax.make_mesh((8,), ("a",)), P("a"))), "step": np.int32(2)}
    ck.save(2, damaged, {})
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"step 2 .* cannot be restored: .*fingerprint .*\(leaf w\)\. Resume from "
                                              r"another step \(\[1\]\)") as err:
        ck.restore(abstract, step=2)
    assert "[1, 2]" not in str(err.value)
    state, meta = ck.restore(abstract)                                # the latest: falls back to step 1
    assert meta["step"] == 1 and ck.steps() == [1]
    assert any(p.name.startswith("corrupt-step-2") for p in (tmp_path / "ck").iterdir())
    ck.close()


def test_resume_from_an_earlier_step_sets_the_later_ones_aside(uninterrupted, tmp_path, capsys):
    """Resumed from step 2 of a run with checkpoints 2 and 4 (another learning rate): step 4 of the old run
    moves to a sibling checkpoint directory (said on stderr), so the new run's step 4 is saved and a later
    resume takes the new run's state. A resume refused after the restore (nothing to train) moves nothing."""
    run, losses = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    old_meta = read_meta(copy / "checkpoints", 4)
    with pytest.raises(ValueError, match="nothing to train"):
        loop.train(cfg(copy, extra=["checkpoint.resume=4"]), progress=False)
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith("checkpoints")) == ["checkpoints"]

    out = loop.train(cfg(copy, extra=["checkpoint.resume=2", "optim.lr=3e-2"]), progress=False)
    assert out["losses"][1] != losses[3]                                      # another run from step 3 on
    err = capsys.readouterr().err
    aside = [p for p in copy.iterdir() if p.name.startswith("checkpoints.after-step-2-")]
    assert len(aside) == 1 and f"later steps [4] are the run this resume branches away from; moved to {aside[0]}" in err
    assert "already saved" not in err
    assert Checkpointer(aside[0]).steps() == [4] and read_meta(aside[0], 4) == old_meta   # kept as it was
    assert Checkpointer(copy / "checkpoints").steps() == [2, 4]
    assert "lr: 0.03" in read_meta(copy / "checkpoints", 4)["config"] and "lr: 0.03" in (copy / "config.yaml").read_text()
    assert "lr: 0.03" not in old_meta["config"]


def _tree(root: Path) -> dict:
    """Every path under `root` with the SHA-256 of its bytes (None for a directory)."""
    import hashlib
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("resume", [None, "latest"])
def test_a_run_whose_step_cannot_be_built_leaves_the_run_dir_as_it_was(uninterrupted, tmp_path, resume):
    """A rule file that refuses the model at trace time (ulysses: 4 heads over 8 context shards) stops a fresh
    run or a resume before anything in the run directory is written or moved: no checkpoints set aside, no
    config.yaml rewritten, no start row."""
    run, _ = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = _tree(copy)
    extra = [f"checkpoint.resume={resume}"] if resume else []
    with pytest.raises(ValueError, match=r"ulysses attention needs .* heads \(4\) divisible by the context size \(8\)"):
        loop.train(cfg(copy, rules="cp_ulysses", mesh="data=1,context=8", steps=6, extra=extra), progress=False)
    assert _tree(copy) == before
