"""The notebooks as files (CI executes them in their own step, `make notebooks`, never inside pytest):
committed without outputs, each asserting what it shows, importing only public names, and set up
for 8 simulated devices before JAX starts. Plus the public helper a notebook draws from."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXPECTED = {"01_mesh_and_rules", "02_train_and_compare", "03_flash_attention", "04_planner", "05_serving",
            "06_context_parallel", "07_pipeline", "08_moe_routing"}
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _code(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_every_notebook_is_listed_and_found_by_the_runner():
    import importlib.util
    spec = importlib.util.spec_from_file_location("notebooks_run", NOTEBOOKS / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    found = {p.stem for p in run.notebooks()}
    assert EXPECTED <= found, f"missing notebooks: {EXPECTED - found}"
    assert found == {p.stem for p in PATHS}


def test_the_runner_without_the_notebooks_extra_says_how_to_install_it(monkeypatch):
    """notebooks/run.py run directly (not through `make notebooks`) was a ModuleNotFoundError traceback."""
    import builtins
    import importlib.util
    spec = importlib.util.spec_from_file_location("notebooks_run", NOTEBOOKS / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    real_import = builtins.__import__

    def no_nbclient(name, *args, **kwargs):
        if name.startswith("nbclient"):
            raise ModuleNotFoundError(f"No module named {name!r}", name="nbclient")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nbclient)
    with pytest.raises(SystemExit, match=r"needs the notebooks extra \(nbclient is missing\): "
                                         r"pip install -e '\.\[notebooks\]', or run `make notebooks`"):
        run.main(["03"])

@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} carry outputs; strip them (Jupyter: Edit > Clear outputs of all "
                       "cells, or `jupyter nbconvert --clear-output --inplace`) before committing")


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_asserts_what_it_shows_with_public_names_only(path):
    code = "\n".join(_code(path))
    assert re.search(r"^\s*(assert |np\.testing\.assert_)", code, re.M), f"{path.name} asserts nothing"
    private = re.findall(r"^\s*from\s+[\w.]+\s+import\s+.*\b(_\w+)", code, re.M)
    private += re.findall(r"\b(?:meshlab|models|pallas_kernels)(?:\.\w+)*\.(_[a-z]\w*)", code)
    assert not private, f"{path.name} uses private names {private}: add a public function to the library instead"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_devices_are_set_before_jax_starts(path):
    first = _code(path)[0]
    if "set_cpu_devices" in "\n".join(_code(path)):
        assert "set_cpu_devices(8)" in first, f"{path.name}: the first code cell must set the 8 simulated devices"
        assert first.index("set_cpu_devices(8)") < first.find("import jax\n") or "import jax\n" not in first
    else:   # a notebook that needs no devices must still keep off an accelerator
        assert "JAX_PLATFORMS" in first


def test_forward_tile_plan_follows_the_causal_diagonal():
    """The plan 03_flash_attention draws: square causal tiles are skipped above the diagonal, masked on it
    and full below; queries at the end of longer keys move the diagonal right; no mask skips nothing."""
    from pallas_kernels.flash_attention import (TILE_FULL, TILE_MASKED, TILE_SKIPPED, BlockSizes,
                                                forward_tile_plan)
    bs = BlockSizes(block_q=64, block_k=64)
    sq = forward_tile_plan(256, 256, block_sizes=bs)
    expect = np.where(np.eye(4, dtype=bool), TILE_MASKED, np.where(np.tri(4, k=-1, dtype=bool), TILE_FULL,
                                                                      TILE_SKIPPED))
    np.testing.assert_array_equal(sq, expect)
    prefill = forward_tile_plan(128, 256, block_sizes=bs)        # queries are positions 128..255
    np.testing.assert_array_equal(prefill, [[2, 2, 1, 0], [2, 2, 2, 1]])
    assert (forward_tile_plan(128, 256, causal=False, block_sizes=bs) == TILE_FULL).all()
    ragged = forward_tile_plan(200, 200, block_sizes=bs)         # padded last tile: masked, not full
    assert ragged[3, 3] == TILE_MASKED and (np.diag(ragged) == TILE_MASKED).all()
