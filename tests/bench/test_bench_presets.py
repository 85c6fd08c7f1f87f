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
    assert "--preset: unknown model 'llama9'; known: tiny, llama3_1b" in out.stderr
    assert list(tmp_path.iterdir()) == []              # no job ran, nothing written
