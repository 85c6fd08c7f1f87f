"""jax's persistent XLA compile cache for the entry scripts: training runs (`compile_cache` in the run
config) and the serving scripts (`--compile-cache`).

A step compiles once per process: llama3_1b's unrolled layers take about a minute on an H200 host,
llama3_3b's several; a server compiles each of its batch buckets before it listens. Every later run of
the same program (a resume, a restart after preemption, the next experiment that changes only the data,
the seed or the run directory, a server started again) loads it from here instead: jax's persistent
cache, keyed on the program's HLO, the compile options, the devices and the jax version, so a change to
the model, the rules or the code is a new entry, never a stale one. Autotuning results live in the
cached executable. An empty setting compiles afresh every time.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax

MAX_BYTES = 16 << 30   # past this, jax evicts the least recently used entries
MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"   # a user's own threshold is kept


def default_dir() -> str:
    """$XDG_CACHE_HOME/meshlab/jax, else ~/.cache/meshlab/jax."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "meshlab" / "jax")


def enable_for_run(cfg) -> str | None:
    """`enable` with the run config's `compile_cache`; its startup line joins the run's others
    (cfg.auto_notes). The entry scripts call it; library calls of `train` leave jax's cache as the
    caller set it."""
    where, line = enable(cfg.compile_cache or "")
    cfg.auto_notes = [*getattr(cfg, "auto_notes", []), line]
    return where


def enable(path: str, setting: str = "compile_cache") -> tuple[str | None, str]:
    """Point jax's persistent compile cache at `path` (`~` expanded; "auto": `default_dir()`), keeping every
    program however fast it compiled, unless a cache is set already (JAX_COMPILATION_CACHE_DIR, or
    jax.config by the caller): that one is kept, with its settings. Returns
    (directory in use or None, the startup line saying so, naming `setting`: the config key or flag the
    caller's user sets it with). A directory that cannot be created turns the cache off with a line
    naming why; the run goes on."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current, f"compile cache: {current} (set before this run)"
    if not path:
        return None, f"compile cache: off ({setting} is empty)"
    target = Path(default_dir() if path == "auto" else path).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return None, f"compile cache: off ({target} cannot be created: {e.strerror}; set {setting}=DIR)"
    jax.config.update("jax_compilation_cache_dir", str(target))
    if MIN_COMPILE_ENV not in os.environ:
        # jax keeps only programs that took >= 1 s to compile. A server's buckets on a CPU take less each
        # (the tiny model's 19: 15 s together), and a read costs milliseconds: with every program kept,
        # serve.py started again is listening in 6.0 s instead of 17.7 (the tiny model, 2 CPU cores).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if jax.config.jax_compilation_cache_max_size < 0 and _has_filelock():   # jax's default: unbounded
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return str(target), f"compile cache: {target} ({setting}=DIR moves it; {setting}= turns it off)"


def _has_filelock() -> bool:
    """jax bounds its cache only with the filelock package (without it, setting a size fails at the
    first compile), so without it the cache stays unbounded."""
    try:
        import filelock  # noqa: F401
    except ImportError:
        return False
    return True
