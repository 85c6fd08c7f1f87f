"""The documents stay a reference, not a diary: the benchmark page is short, work-log words and dates
stay in docs/archive/ (and git log), and CI lints before it tests."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK_LOG = re.compile(r"\b(session|issue) #?\d+", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# Library code and shipped files: a date there is a measurement's history (the benchmark page holds it).
UNDATED = ("meshlab/", "models/", "pallas_kernels/", "sharding_rules/")
DATED_OK = ("meshlab/bench/",)          # the bench wing writes dated rows


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def test_benchmark_page_is_at_most_150_lines():
    n = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert n <= 150, f"docs/benchmarks.md has {n} lines; move superseded rows to docs/archive/"


def test_no_work_log_words_outside_the_archive():
    hits = []
    for p in _tracked():
        if p.startswith("docs/archive/") or p in ("tests/test_docs_hygiene.py", "tests/kernels/test_kernel_hygiene.py"):
            continue
        if not p.endswith((".py", ".md", ".yaml", ".sh", ".ipynb", ".toml", "Makefile")):
            continue
        for i, line in enumerate((ROOT / p).read_text(errors="replace").splitlines(), 1):
            if WORK_LOG.search(line):
                hits.append(f"{p}:{i}: {line.strip()[:100]}")
    assert not hits, "work-log words (say what the code does; history belongs in git log):\n" + "\n".join(hits)


def test_library_code_carries_no_dates():
    hits = []
    for p in _tracked():
        if not p.startswith(UNDATED) or p.startswith(DATED_OK) or not p.endswith((".py", ".yaml")):
            continue
        for i, line in enumerate((ROOT / p).read_text().splitlines(), 1):
            if DATE.search(line):
                hits.append(f"{p}:{i}: {line.strip()[:100]}")
    assert not hits, "dated measurements in library code (link docs/benchmarks.md's anchor instead):\n" + "\n".join(hits)


def test_ci_lints_then_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make lint" in ci and "make test" in ci and ci.index("make lint") < ci.index("make test")
