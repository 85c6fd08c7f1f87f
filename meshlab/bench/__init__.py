"""The benchmark harness: timing, peers, profiles and the measurements scripts/bench_*.py run.

Above the engines (it drives train, infer and plan), below the scripts; nothing in the library
imports it (tests/test_floors.py checks). A new benchmark's logic goes here, its command line in
scripts/bench_<area>.py, its measured rows in docs/archive/ and its verdict in docs/benchmarks.md.
"""
