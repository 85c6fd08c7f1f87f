"""scripts/bench_collectives.py mechanics on 8 simulated CPU devices: every op (the source's table,
ppermute, the hand-written rings) equals the library collective over each mesh axis; the alpha/BW
fit, the profile the planner reads, and the append-only markdown. Times are never asserted."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from meshlab.plan import hardware

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_collectives.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_collectives", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_collective_equals_the_library_on_each_axis(bench):
    rows = bench.run("data=2,tensor=4", [8192], check_only=True)   # raises on any mismatch
    assert {(r["axis"], r["p"]) for r in rows} == {("data", 2), ("tensor", 4)}
    assert {r["op"] for r in rows} == set(bench.OPS)
    checked = {r["op"] for r in rows if r["checked"]}
    assert {"broadcast", "reduce", "scatter", "gather", "ring all-gather", "ring all-reduce"} <= checked


def test_timed_run_fit_profile_and_markdown(bench, tmp_path):
    rows = bench.run("data=8", [4096, 65536], reps=1, ops=("ppermute", "all-reduce", "ring all-reduce"))
    assert all(r["time_s"] > 0 and r["busbw_GBps"] > 0 for r in rows)
    prof = {"device": "8x cpu", "jax": "test", "axes": bench.fit(rows)}
    assert prof["axes"]["data"]["p"] == 8 and prof["axes"]["data"]["bw_Bps"] > 0
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(prof))
    hw = hardware.load_profile(path)
    assert hw.source == "measured" and hw.link("data", crosses_hosts=True) == hardware.Link(
        prof["axes"]["data"]["alpha_s"], prof["axes"]["data"]["bw_Bps"])
    md = tmp_path / "docs" / "benchmarks.md"
    bench.append_markdown(rows, prof, md)
    first = md.read_text()
    assert first.startswith("# Benchmarks") and "## Collectives" in first and "fit (ppermute)" in first
    bench.append_markdown(rows, prof, md)          # appends under the same heading, keeps what was there
    second = md.read_text()
    assert second.startswith(first) and second.count("## Collectives") == 1


def test_single_device_axis_is_not_a_link(bench, tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"device": "1x H200", "axes": {"data": {"alpha_s": 1e-5, "bw_Bps": 1e12, "p": 1}}}))
    hw = hardware.load_profile(path)
    assert hw.axes == {} and hw.link("data", False) == hardware.HARDWARE["h200"].intra


def test_bad_sizes(bench, capsys):
    assert bench.main(["--max-bytes", "lots"]) == 2
    assert "4KiB" in capsys.readouterr().err
