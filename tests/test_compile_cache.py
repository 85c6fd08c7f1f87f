"""The training entry point's persistent compile cache: on by default under $XDG_CACHE_HOME, a rerun of
the same run loads its programs instead of compiling them (no new entries, the same losses), a cache set
before the run is kept, an empty setting turns it off, an unusable directory turns it off with a line."""
import os
import re
import subprocess
import sys

import jax
import pytest

from meshlab import compile_cache
from tests.helpers import SMALL
from tests.train.test_checkpoint import ROOT, subprocess_env

pytestmark = pytest.mark.cheap_codegen


@pytest.fixture
def no_cache_set():
    """jax's cache directory unset for the test (the suite's own cache put back after it)."""
    names = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size", "jax_persistent_cache_min_compile_time_secs")
    before = [getattr(jax.config, n) for n in names]
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_compilation_cache_max_size", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)       # jax's default
    try:
        yield
    finally:
        for n, v in zip(names, before):
            jax.config.update(n, v)


def test_enable_keeps_a_cache_set_before(tmp_path):
    current = jax.config.jax_compilation_cache_dir
    if not current:
        pytest.skip("the suite runs without a compile cache (MESHLAB_TEST_COMPILE_CACHE=off)")
    where, line = compile_cache.enable(str(tmp_path / "other"))
    assert where == current and "set before this run" in line and not (tmp_path / "other").exists()


def test_enable_sets_off_and_refuses_an_unusable_directory(tmp_path, no_cache_set):
    assert compile_cache.enable("") == (None, "compile cache: off (compile_cache is empty)")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    where, line = compile_cache.enable(str(blocker / "cache"))
    assert where is None and "cannot be created" in line and jax.config.jax_compilation_cache_dir is None
    where, line = compile_cache.enable(str(tmp_path / "c"))
    assert where == str(tmp_path / "c") and jax.config.jax_compilation_cache_dir == where
    bounded = compile_cache.MAX_BYTES if compile_cache._has_filelock() else -1     # jax bounds it only with filelock
    assert jax.config.jax_compilation_cache_max_size == bounded
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0    # every program kept, not only slow ones


def test_a_users_minimum_compile_time_is_kept(tmp_path, no_cache_set, monkeypatch):
    monkeypatch.setenv(compile_cache.MIN_COMPILE_ENV, "1.0")
    compile_cache.enable(str(tmp_path / "c"))
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


def test_without_filelock_the_cache_stays_unbounded(tmp_path, no_cache_set, monkeypatch):
    monkeypatch.setitem(sys.modules, "filelock", None)       # `import filelock` raises ImportError
    where, _ = compile_cache.enable(str(tmp_path / "c"))
    assert where == str(tmp_path / "c") and jax.config.jax_compilation_cache_max_size == -1


def test_config_key_turns_it_off_or_moves_it(tmp_path, no_cache_set):
    from meshlab.train.config import load_config
    off = load_config("default", ["compile_cache="])           # as typed on the command line
    assert compile_cache.enable_for_run(off) is None and off.auto_notes[-1].startswith("compile cache: off")
    moved = load_config("default", [f"compile_cache={tmp_path / 'mine'}"])
    assert compile_cache.enable_for_run(moved) == str(tmp_path / "mine")
    assert moved.auto_notes[-1].startswith(f"compile cache: {tmp_path / 'mine'}")


def test_default_dir_follows_xdg_cache_home(monkeypatch, tmp_path, no_cache_set):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == str(tmp_path / "meshlab" / "jax")
    where, line = compile_cache.enable("auto", setting="--compile-cache")       # "auto" is that directory
    assert where == compile_cache.default_dir() and line.endswith("(--compile-cache=DIR moves it; "
                                                                  "--compile-cache= turns it off)")


def _train(cwd, run, env):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), "--rules", "dp", "--steps", "2",
                          "--run-dir", str(run), *SMALL, "data.max_bytes=200000", "checkpoint.at_end=false"],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_rerun_loads_the_step_from_the_default_cache(tmp_path):
    # JAX_LOG_COMPILES: jax logs each persistent-cache hit (a warning, on stderr)
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_LOG_COMPILES="1")
    env.pop("JAX_COMPILATION_CACHE_DIR")          # as a user's shell has it: the default applies
    cache = tmp_path / "xdg" / "meshlab" / "jax"
    hit = "Persistent compilation cache hit for 'jit_step'"
    first = _train(tmp_path, tmp_path / "run1", env)
    assert f"compile cache: {cache}" in first.stdout and hit not in first.stderr
    assert any(e.startswith("jit_step") for e in os.listdir(cache))
    second = _train(tmp_path, tmp_path / "run2", env)
    assert hit in second.stderr, second.stderr[-3000:]      # the step loaded, not compiled again
    losses = [re.search(r"loss (\S+) -> (\S+) over", out.stdout).groups() for out in (first, second)]
    assert losses[0] == losses[1]
