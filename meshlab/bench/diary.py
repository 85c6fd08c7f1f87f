"""Where the benchmark scripts put what they measure: dated rows in docs/archive/benchmarks-diary.md,
from a GPU run only (a CPU or interpret-mode run checks a script's mechanics; its rates are no record;
a file the user names takes any run's),
and their other files under $OUT or a temporary directory, never the working directory by default."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DIARY = Path(__file__).resolve().parents[2] / "docs" / "archive" / "benchmarks-diary.md"


def records(backend: str | None = None, path: str | os.PathLike | None = DIARY) -> bool:
    """Whether a run on `backend` ("gpu", "cpu", ...; default JAX's, which starts JAX) writes its rows to
    `path`: the project's diary takes GPU runs only; a file the user names (a script's --docs) takes any."""
    if path is not None and Path(path).resolve() != DIARY.resolve():
        return True
    if backend is None:
        import jax
        backend = jax.default_backend()
    return backend == "gpu"


def append(text: str, *, backend: str | None = None, path: str | os.PathLike = DIARY) -> bool:
    """Append `text` to `path` when `records(backend, path)`; else say on stderr that it was left
    alone. True when appended."""
    if not records(backend, path):
        print(f"not appended to {path}: only a GPU run is recorded", file=sys.stderr, flush=True)
        return False
    with open(path, "a") as f:
        f.write(text)
    return True


def out_dir(name: str, given: str | os.PathLike | None = None) -> Path:
    """The directory a script writes its files to, created: `given` (its --out), else $OUT, else
    <tmp>/meshlab_<name>."""
    d = Path(given or os.environ.get("OUT") or Path(tempfile.gettempdir()) / f"meshlab_{name}")
    d.mkdir(parents=True, exist_ok=True)
    return d
