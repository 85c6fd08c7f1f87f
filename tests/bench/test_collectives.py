"""scripts/bench_collectives.py mechanics on 8 simulated CPU devices: every op (the source's table,
ppermute, the hand-written rings) equals the library collective over each mesh axis; the alpha/BW
fit, the profile the planner reads, and the append-only markdown. Times are never asserted.
The logic is meshlab.bench.collectives / collectives_variants; the script is loaded for its
command line (main), which the variants' child processes go through too."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from meshlab.bench import collectives as bench
from meshlab.bench import collectives_variants as variants
from meshlab.plan import hardware

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_collectives.py"


@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("bench_collectives", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_collective_equals_the_library_on_each_axis():
    rows = bench.run("data=2,tensor=4", [8192], check_only=True)   # raises on any mismatch
    assert {(r["axis"], r["p"]) for r in rows} == {("data", 2), ("tensor", 4)}
    assert {r["op"] for r in rows} == set(bench.OPS)
    checked = {r["op"] for r in rows if r["checked"]}
    assert {"broadcast", "reduce", "scatter", "gather", "ring all-gather", "ring all-reduce"} <= checked


def test_timed_run_fit_profile_and_markdown(tmp_path):
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


def test_single_device_axis_is_not_a_link(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"device": "1x H200", "axes": {"data": {"alpha_s": 1e-5, "bw_Bps": 1e12, "p": 1}}}))
    hw = hardware.load_profile(path)
    assert hw.axes == {} and hw.link("data", False) == hardware.HARDWARE["h200"].intra


def test_bad_sizes(cli, capsys):
    assert cli.main(["--max-bytes", "lots"]) == 2
    assert "4KiB" in capsys.readouterr().err


def test_fit_uses_the_planners_formulas():
    """Synthetic times from the planner's ring model come back as the alpha and BW that made them."""
    from meshlab.plan.comm import collective_time
    alpha, bw, p = 7e-6, 300e9, 2
    rows = []
    for op, kind in (("all-reduce", "all-reduce"), ("all-gather", "all-gather"), ("reduce-scatter", "reduce-scatter")):
        for n in (2**20, 2**24, 2**28, 2**30):
            full = n * p if op == "all-gather" else n   # the planner's n: all-gather output, reduce-scatter input
            t = collective_time(kind, full, p, alpha, bw, "ring")
            rows.append({"axis": "data", "p": p, "op": op, "bytes": n, "time_s": t})
    got = bench.fit(rows)["data"]
    assert got["fitted_on"].startswith("all-reduce")
    assert got["alpha_s"] == pytest.approx(alpha, rel=1e-6) and got["bw_Bps"] == pytest.approx(bw, rel=1e-6)
    assert set(got["per_op"]) == {"all-reduce", "all-gather", "reduce-scatter"}


def test_variants_each_in_a_process_and_a_bad_flag_is_a_row(cli, tmp_path):
    """Sweep in a child, then variants: one that runs (one process per device, gloo) and one whose XLA
    flag does not exist (XLA aborts that process: an error row, the rest goes on)."""
    out, md = tmp_path / "prof.json", tmp_path / "bench.md"
    rc = cli.main(["--cpu-devices", "2", "--min-bytes", "64KiB", "--max-bytes", "64KiB", "--ops", "all-reduce,ppermute",
                     "--variants", "multiprocess,bad@XLA_FLAGS=--xla_no_such_flag_here=1", "--variant-sizes", "64KiB",
                     "--out", str(out), "--markdown", str(md), "--variant-timeout-s", "120", "--variants-budget-s", "300"])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert {r["op"] for r in prof["rows"]} == {"all-reduce", "ppermute"} and prof["device"] == "2x cpu"
    ok = [v for v in prof["variants"] if v["variant"] == "multiprocess" and "error" not in v]
    assert {v["mode"] for v in ok} == set(variants.MODES) and all(v["busbw_GBps"] > 0 for v in ok)
    bad = [v for v in prof["variants"] if v["variant"].startswith("bad@")]
    assert len(bad) == 1 and "error" in bad[0]
    assert "variant multiprocess" in md.read_text()


def test_profile_copies_the_link_to_axes_on_the_same_devices(tmp_path):
    rows = [{"axis": "data", "p": 2, "op": "all-reduce", "bytes": n, "time_s": 1e-5 + n / 3e11, "algbw_GBps": 1.0,
             "busbw_GBps": 1.0} for n in (2**20, 2**30)]
    prof = bench.profile(rows, {"device": "2x test", "jax": "t"}, "fsdp,tensor")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    hw = hardware.load_profile(path)
    assert hw.link("tensor", False) == hw.link("fsdp", True) == hw.link("data", False) != hardware.HARDWARE["h200"].intra
    bench.append_markdown(rows, prof, tmp_path / "b.md")
    assert (tmp_path / "b.md").read_text().count("fit (all-reduce)") == 1
