"""Execute the notebooks top to bottom, as CI does: python notebooks/run.py [NAME ...] [--out DIR]

Each notebook runs in a fresh kernel with notebooks/ as its working directory. A cell that raises
(an assertion included) fails the run with the cell's traceback. The executed copies are written
only with --out (the files in git stay without outputs; tests/test_notebooks.py checks that).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET_S = 120   # each notebook's target on 2 CPU cores; a slower one is reported, not failed


def notebooks(names=()) -> list[Path]:
    found = sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return found
    picked = [p for p in found if any(p.stem == n or p.stem.startswith(n) for n in names)]
    missing = [n for n in names if not any(p.stem == n or p.stem.startswith(n) for p in found)]
    if missing:
        raise SystemExit(f"no notebook named {', '.join(missing)}; have: {', '.join(p.stem for p in found)}")
    return picked


def run(path: Path, out: Path | None, timeout: int) -> float:
    import nbformat                      # the `notebooks` extra; listing notebooks (the tests) needs none of it
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    dt = time.perf_counter() - t0
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out / path.name)
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="notebook names or prefixes (default: all), e.g. 01 03_flash")
    ap.add_argument("--out", type=Path, help="write the executed notebooks (with outputs) here")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    a = ap.parse_args(argv)
    try:
        from nbclient.exceptions import CellExecutionError
    except ImportError as e:     # run directly, without `make notebooks` (which installs the extra first)
        raise SystemExit(f"notebooks/run.py needs the notebooks extra ({e.name} is missing): "
                         "pip install -e '.[notebooks]', or run `make notebooks`") from None
    failed, total = [], 0.0
    for path in notebooks(a.names):
        try:
            dt = run(path, a.out, a.timeout)
        except CellExecutionError as e:
            print(f"FAILED {path.name}\n{e}", flush=True)
            failed.append(path.name)
            continue
        total += dt
        slow = f"  (over the {BUDGET_S} s target)" if dt > BUDGET_S else ""
        print(f"ok     {path.name:<28} {dt:6.1f} s{slow}", flush=True)
    print(f"{len(failed)} failed, {total:.0f} s in all" if failed else f"all notebooks ran, {total:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
