"""The decode and serving benchmarks measure another model shape with --preset; a name that is no
preset stops the call with one error naming the known ones, before any job runs or writes."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, job", [("bench_decode.py", "engine"), ("bench_serve.py", "offline")])
def test_an_unknown_preset_stops_the_call_before_any_job(tmp_path, script, job):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--preset", "llama9", "--jobs", job],
                         capture_output=True, text=True, env={"OUT": str(tmp_path), "PATH": ""}, cwd=tmp_path)
    assert out.returncode == 2
    assert "argument --preset: unknown model 'llama9'; known: tiny, llama3_1b" in out.stderr
    assert list(tmp_path.iterdir()) == []              # no job ran, nothing written


def _bench_serve():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_serve_script", ROOT / "scripts" / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_serve_workload_ranges_grow_max_len_and_tag_the_rows():
    mod = _bench_serve()
    parse = lambda *argv: mod.parser().parse_args(list(argv))  # noqa: E731
    args = parse("--prompts", "128,2048", "--outputs", "64,512")
    _, _, wl, ek = mod.shape(args)
    assert (wl["prompt"], wl["output"]) == ((128, 2048), (64, 512))
    assert ek["max_len"] == 2560 and ek["max_len"] % ek["page_size"] == 0       # the longest request fits
    assert mod.run_tag(args) == " [prompts 128-2048, outputs 64-512]"
    default = parse()
    assert mod.shape(default)[3]["max_len"] == 1536 and mod.run_tag(default) == ""
    assert mod.shape(parse("--outputs", "64,1500"))[3]["max_len"] == 2528          # 1024 + 1500 in pages of 16
    budget = parse("--max-step-tokens", "4224", "--preset", "llama3_8b")
    assert mod.shape(budget)[3]["max_step_tokens"] == 4224 and "max_step_tokens" not in mod.shape(default)[3]
    assert mod.run_tag(budget) == " [llama3_8b, max_step_tokens 4224]"
    assert mod.run_tag(parse("--quick", "--preset", "llama3_8b")) == ""             # the CPU mechanics run
    stored = parse("--quantize", "fp8", "--kv-cache-dtype", "fp8")
    assert mod.shape(stored)[3]["quantize"] == "fp8" and "quantize" not in mod.shape(default)[3]
    assert mod.run_tag(stored) == " [kv cache fp8, weights fp8]"


@pytest.mark.parametrize("value", ["9,3", "0,5", "128", "a,b"])
def test_a_bad_workload_range_stops_the_call_before_any_job(tmp_path, value):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serve.py"), f"--prompts={value}",
                          "--jobs", "offline"], capture_output=True, text=True,
                         env={"OUT": str(tmp_path), "PATH": ""}, cwd=tmp_path)
    assert out.returncode == 2 and "argument --prompts:" in out.stderr
    assert list(tmp_path.iterdir()) == []
