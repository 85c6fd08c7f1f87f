"""The benchmark harness: timing, peers, profiles and the measurements scripts/bench_*.py run.

Above the engines (it drives train, infer and plan), below the scripts; nothing in the library
imports it (tests/test_floors.py checks). A new benchmark's logic goes here, its command line in
scripts/bench_<area>.py, its measured rows in docs/archive/ and its verdict in docs/benchmarks.md.
"""

DEFAULT_PRESET = "llama3_1b"   # the model shape every benchmark row measures unless --preset names another


def preset_arg(name: str) -> str:
    """An argparse type: `name` if it is a model preset, else the error naming the known ones (before
    any job runs; importing models starts no backend, so the GPU stays free for a torch peer)."""
    import argparse

    import models
    try:
        models.preset(name)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None
    return name
